"""Per-layer arrays as one compiled type for any number of layers: a stack.

The fused decode token reads every layer's weights. A tuple of them is typed by its length
(UniTuple(array, 30)), so each layer count compiled the token anew, and indexing it at run time
compiled a switch over every element at every use: a 4-layer model's token took 15 s to compile,
a 30-layer one's 38 s, each model shape its own. A stack is three arrays instead:

    (addresses (L,) int64, shapes (L, ndim) int64, first)

`layer(S, l)` rebuilds layer l's array from its address and shape, typed as `first` (its dtype and
rank, C order); the compiled type depends on the kind of array, never on L. A stack of pairs
(quantized values and scales) or of three (q|k|v as three matrices) is a tuple of stacks, and
`layer` gives the tuple of layer l's arrays, what the kernels took from a tuple over the layers.
A 1-D integer array in such a tuple holds a number per layer (a block-kind matrix's kind: the
pair (stack of raw bytes, kinds)), and `layer` gives layer l's number.

The arrays behind the addresses must outlive the stack (the Python side that builds one keeps
them: decode_step.Stacks); every array is C-contiguous (the builder checks). A rebuilt array has
the type of the stack's first (read-only when the mapping is), so the kernels it goes to are the
specialisations forward's general path compiles: the fused token adds no second copy of them.
"""
from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.arrayobj import get_itemsize, make_array, populate_array

__all__ = ["layer", "is_stack"]


@intrinsic
def _view(typingctx, addr, shape, like):
    # the C-ordered array of `like`'s type (its dtype, rank and read-only flag) at address `addr` with `shape`
    # (a tuple): numba.carray's construction, but typed as the stack's own arrays, so every kernel the fused
    # token calls with it is the specialisation forward's general path compiled (and no second one)
    aryty = like

    def codegen(context, builder, sig, args):
        out = make_array(aryty)(context, builder)
        itemsize = cgutils.intp_t(get_itemsize(context, aryty))
        shapes = cgutils.unpack_tuple(builder, args[1])
        strides, off = [], itemsize
        for s in reversed(shapes):
            strides.append(off)
            off = builder.mul(off, s)
        strides.reverse()
        data = builder.inttoptr(args[0], context.get_data_type(aryty.dtype).as_pointer())
        populate_array(out, data=data, shape=shapes, strides=strides, itemsize=itemsize, meminfo=None)
        return out._getvalue()
    return aryty(types.int64, shape, like), codegen


def is_stack(S) -> bool:
    """Whether the Numba type S is one stack (not a tuple of stacks)."""
    return (isinstance(S, types.BaseTuple) and len(S) == 3 and isinstance(S[0], types.Array)
            and S[0].dtype == types.int64 and S[0].ndim == 1 and isinstance(S[1], types.Array)
            and S[1].ndim == 2 and isinstance(S[2], types.Array))


def layer(S, l):
    """Python stand-in (never called): layer l's array of stack S, or the tuple of them for a tuple of stacks."""
    raise NotImplementedError


@overload(layer, inline="always")
def _layer_overload(S, l):
    if is_stack(S) and S[2].layout == "C":
        nd = S[2].ndim
        if nd == 1:
            return lambda S, l: _view(S[0][l], (S[1][l, 0],), S[2])
        if nd == 2:
            return lambda S, l: _view(S[0][l], (S[1][l, 0], S[1][l, 1]), S[2])
        if nd == 3:
            return lambda S, l: _view(S[0][l], (S[1][l, 0], S[1][l, 1], S[1][l, 2]), S[2])
        if nd == 4:         # experts in panels (E, nb, d, P)
            return lambda S, l: _view(S[0][l], (S[1][l, 0], S[1][l, 1], S[1][l, 2], S[1][l, 3]), S[2])
        return None
    if isinstance(S, types.Array) and S.ndim == 1 and isinstance(S.dtype, types.Integer):
        return lambda S, l: S[l]            # a per-layer number (a block-kind matrix's GGML kind)
    if isinstance(S, types.BaseTuple) and len(S) == 2:
        return lambda S, l: (layer(S[0], l), layer(S[1], l))
    if isinstance(S, types.BaseTuple) and len(S) == 3:
        return lambda S, l: (layer(S[0], l), layer(S[1], l), layer(S[2], l))
    return None
