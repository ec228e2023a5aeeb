"""The entry points Numba builds around every compiled kernel, made cheap to compile.

Besides a kernel's own function, Numba gives each compiled signature two wrappers: a CPython one (unbox the
Python arguments, call the kernel, box its result) and a C one (`cfunc.`, the address a kernel passed as a
first-class function value is called through). Both are generated per argument, then optimised and compiled
to machine code like kernel code. For a kernel of many arguments they are most of its compile: the fused
decode token takes 62 (~150 arrays in nested tuples), its two wrappers are 5,800 of its module's 15,000 IR
lines, and a kernel with those arguments and an empty body takes ~4 s to compile.

`install()`, once, before any kernel compiles:
- no C wrapper for a kernel whose options do not ask for one (Numba's `@cfunc` sets its own; colibri never
  passes a kernel as a function value);
- a CPython wrapper of at least BIG_WRAPPER instructions (the many-argument entry points: the decode token,
  its per-layer parts) compiled without LLVM's optimisation (`optnone`, `noinline`): it runs once per call
  from Python, a few conversions per argument, and calls the kernel, which is optimised as before. A small
  wrapper (~250-500 instructions: a kernel of a few arrays, called per layer from Python) stays optimised.

Owns only how Numba compiles those wrappers: a kernel's own code, its bits, is never changed.
"""
from __future__ import annotations

import functools

BIG_WRAPPER = 1000          # instructions of a CPython wrapper from which it is not optimised


def _instructions(fn) -> int:
    return sum(len(block.instructions) for block in fn.blocks)


def install() -> bool:
    """Compile the wrappers as above from now on (every Numba compile of this process). Returns False when this
    Numba has not the expected form (the wrappers are then compiled as Numba does)."""
    try:
        from numba.core.codegen import CPUCodeLibrary
        from numba.core.cpu import CPUContext, CPUTargetOptions
        finalize, add, wrap = CPUTargetOptions.finalize, CPUCodeLibrary.add_ir_module, CPUContext.create_cpython_wrapper
    except (ImportError, AttributeError):
        return False
    if getattr(finalize, "_colibri_wrappers", False):
        return True

    @functools.wraps(finalize)
    def finalize_(self, flags, options):
        finalize(self, flags, options)
        if not flags.is_set("no_cfunc_wrapper"):
            flags.no_cfunc_wrapper = True

    @functools.wraps(wrap)
    def create_cpython_wrapper(self, library, fndesc, *args, **kwargs):
        library._colibri_cpython_wrapper = fndesc.llvm_cpython_wrapper_name     # the name add_ir_module sees next
        try:
            return wrap(self, library, fndesc, *args, **kwargs)
        finally:
            library._colibri_cpython_wrapper = None

    @functools.wraps(add)
    def add_ir_module(self, ir_module):
        name = getattr(self, "_colibri_cpython_wrapper", None)
        if name is not None:
            for fn in ir_module.functions:
                if fn.name == name and not fn.is_declaration and _instructions(fn) >= BIG_WRAPPER:
                    fn.attributes.add("noinline")       # optnone requires it
                    fn.attributes.add("optnone")
        return add(self, ir_module)

    finalize_._colibri_wrappers = True
    CPUTargetOptions.finalize = finalize_
    CPUContext.create_cpython_wrapper = create_cpython_wrapper
    CPUCodeLibrary.add_ir_module = add_ir_module
    return True
