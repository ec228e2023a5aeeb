"""Kernels linked by reference: one machine-code copy of a large kernel, however many kernels call it.

Numba links a called kernel into its caller by copying: the callee's LLVM module, and everything the
callee linked in turn, goes into the caller's module, which LLVM optimizes and compiles again, whole. A
chain of calls compiles the innermost kernel once per link of the chain. The block kinds' product
(kernels/blocks_gemm.gemm_rows: its tiles, row dots and few-row kernels, ~33 functions) sits under ~18
libraries in a decode token (each overload on the way, each parallel region and its wrappers): 6-7 s of
LLVM each, most of the token's compile.

`by_reference(kernel)` marks a kernel whose compiled signatures are linked by reference: a library that
calls one links nothing of it; the call stays a call of the kernel's symbol, which the JIT resolves to the
one copy the kernel's own library holds. What is lost is inlining across the call, which a kernel this
large never gets anyway. Mark only kernels whose body dwarfs a call.

A cached caller's machine code names that symbol, so loading it needs the kernel loaded first, and under
the name the caller was compiled against (Numba names a function with a counter of the process that
compiled it). Every library whose module calls a kernel by reference carries, in Numba's `reload_init`
(callables that run before a cached library is loaded, and pass from a library to those that link it), a
`_Load` of the kernel's signature: it compiles or loads the signature, and when its symbol has another
name than the caller's (the kernel compiled again in another process) registers the caller's name at its
address. A missing symbol kills the process when the JIT resolves it (a segfault, not an exception): no
cached caller loads before its kernels. Numba judges a cache entry stale by its own source file only, so a
caller's entry can outlive an edit of the kernel's file (where the cache directory is not keyed on every
kernel source: a user's NUMBA_CACHE_DIR): a `_Load` that cannot give the caller the kernel it was compiled
against (another return type, a signature that no longer compiles) makes the caller's entry a cache miss,
and Numba compiles the caller again.

`install()` runs once, at import of colibri_server.model.kernels, before any kernel module is imported;
the kernels name themselves with `by_reference`. Owns only Numba's linking of the kernels it is given.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

_KERNELS: list = []          # the dispatchers linked by reference
_LOADS: dict = {}            # symbol -> the _Load that provides it, for every signature linked or loaded here


def by_reference(kernel):
    """Link `kernel` (an @njit dispatcher defined at a module's top level: a cached caller finds it by its
    module and name) by reference from now on; returns it (usable as a decorator)."""
    f = kernel.py_func
    if "<locals>" in f.__qualname__ or f.__module__ == "__main__":
        raise ValueError(f"{f.__module__}.{f.__qualname__}: a kernel linked by reference must be a module's own name")
    _KERNELS.append(kernel)
    return kernel


class _Stale(Exception):
    """A cached caller was compiled against another form of a kernel it calls by reference."""


@dataclasses.dataclass(frozen=True)
class _Load:
    """Before a cached library that calls `symbol` loads: the kernel `module.name` compiled or loaded for `args`,
    returning `restype`, its entry point reachable under `symbol`; else _Stale. Picklable (Numba saves it with
    the caller's cache entry)."""
    module: str
    name: str
    args: tuple
    restype: object
    symbol: str

    def __call__(self):
        import llvmlite.binding as ll
        try:
            kernel = getattr(importlib.import_module(self.module), self.name)
            kernel.compile(self.args)
            cres = kernel.overloads[self.args]
        except Exception as e:
            raise _Stale(f"{self.module}.{self.name}{self.args}: {e}") from e
        if cres.signature.return_type != self.restype:
            raise _Stale(f"{self.module}.{self.name}{self.args} returns {cres.signature.return_type}, "
                         f"not {self.restype}")
        _LOADS.setdefault(self.symbol, self)
        if cres.fndesc.mangled_name != self.symbol:
            ll.add_symbol(self.symbol, cres.library.get_pointer_to_function(cres.fndesc.mangled_name))


def _load_of(library):
    """The _Load of a by-reference kernel's signature whose code `library` is, or None."""
    for kernel in _KERNELS:
        for args, cres in list(kernel.overloads.items()):
            if cres.library is library:
                return _Load(kernel.py_func.__module__, kernel.py_func.__qualname__, tuple(args),
                             cres.signature.return_type, cres.fndesc.mangled_name)
    return None


def install() -> bool:
    """Link the marked kernels by reference (see the module's doc). Returns False when this Numba's code
    library has not the expected form (kernels are then linked by copy, as Numba does)."""
    try:
        from numba.core.caching import Cache
        from numba.core.codegen import CPUCodeLibrary
        add, finalize, load = CPUCodeLibrary.add_linking_library, CPUCodeLibrary.finalize, Cache.load_overload
    except (ImportError, AttributeError):
        return False
    if getattr(add, "_colibri_by_reference", False):
        return True

    @functools.wraps(load)
    def load_overload(self, sig, target_context):
        try:
            return load(self, sig, target_context)
        except _Stale:              # raised before the caller's code was loaded: compile it again instead
            return None

    @functools.wraps(add)
    def add_linking_library(self, library):
        ref = _load_of(library)
        if ref is None:
            return add(self, library)
        library._ensure_finalized()
        _LOADS.setdefault(ref.symbol, ref)       # finalize() below puts it in this library's reload_init (a cached
        # kernel's own entry carries what its load needs: a parallel one's threads)

    @functools.wraps(finalize)
    def finalize_(self):
        finalize(self)
        # every kernel this library's code calls by reference, directly or through a library it linked (one
        # loaded from the cache carries no reload_init of its own: its module's declarations say what it calls)
        for fn in self._final_module.functions:
            if fn.is_declaration:
                load = _LOADS.get(fn.name)
                if load is not None:
                    self._reload_init.add(load)

    add_linking_library._colibri_by_reference = True
    CPUCodeLibrary.add_linking_library = add_linking_library
    CPUCodeLibrary.finalize = finalize_
    Cache.load_overload = load_overload
    return True
