"""numba_wrappers: a kernel compiled in a colibri process has no C wrapper; the CPython wrapper of a kernel of
many arguments is left unoptimised, a small kernel's is optimised, and the kernels themselves are optimised as
before and give the same results."""
from __future__ import annotations

import re

import numba
import numpy as np

from colibri_server.model import (
    kernels,  # noqa: F401  (installs the wrappers' compile, as in every colibri process)
    numba_wrappers,
)


@numba.njit
def _total(xs, w):              # a tuple of arrays, the argument kind of the decode token
    s = 0.0
    for x in xs:
        for i in range(x.shape[0]):
            s += w * x[i]
    return s


def _compiled(kernel, *args):
    """kernel(*args) -> (result, attributes of the CPython wrapper, of the kernel's own function, names of every
    function the signature's module defines)"""
    got = kernel(*args)
    cres = kernel.overloads[tuple(numba.typeof(a) for a in args)]
    ir = cres.library.get_llvm_str()
    groups = dict(re.findall(r"^attributes #(\d+) = \{(.*)\}", ir, re.M))
    fns = {}
    for line in ir.splitlines():
        m = re.match(r'define .*?@"?([\w.$]+)"?\(', line)
        if m:
            fns[m.group(1)] = {a for g in re.findall(r"#(\d+)", line.rsplit(")", 1)[-1]) for a in groups[g].split()}
    return got, fns[cres.fndesc.llvm_cpython_wrapper_name], fns[cres.fndesc.mangled_name], set(fns)


def test_no_c_wrapper_and_only_a_many_argument_kernels_python_wrapper_unoptimised():
    rng = np.random.default_rng(0)
    few = (rng.standard_normal(5).astype(np.float32), rng.standard_normal(3).astype(np.float32))
    many = tuple(rng.standard_normal(4).astype(np.float32) for _ in range(40))
    for xs in (few, many):
        got, wrapper, body, names = _compiled(_total, xs, 2.0)
        assert np.isclose(got, 2.0 * sum(float(x.astype(np.float64).sum()) for x in xs), rtol=1e-6)
        assert not any(n.startswith("cfunc.") for n in names), names
        assert "optnone" not in body
        assert ("optnone" in wrapper) == (xs is many), (len(xs), wrapper)


def test_a_kernel_or_cfunc_that_asks_for_a_c_wrapper_keeps_it_and_install_is_idempotent():
    assert numba_wrappers.install() and numba_wrappers.install()
    asks = numba.njit(no_cfunc_wrapper=False)(_total.py_func)
    *_, names = _compiled(asks, (np.ones(3, np.float32),), 2.0)
    assert any(n.startswith("cfunc.") for n in names), names

    @numba.cfunc("float64(float64)")
    def twice(x):
        return 2.0 * x
    assert twice.ctypes(1.5) == 3.0
