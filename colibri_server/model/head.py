"""The output head of a serving step (and of a greedy decode token): its logits, and for the rows that only take their
argmax, the int16 head's argmax at the int8 head's speed.

exact_head (the default) multiplies a block-kind head by the hidden state rounded to int16, twice the integer
dots of llama.cpp's int8 rounding: on bench-mixtral Q4_K_M's 32000 x 1024 Q6_K head, 16 rows took 3.9-4.1 ms on
two threads against 2.2-2.5 ms at int8, a sixth of a 16-row serving step. A row whose token is the argmax of its
raw logits, and which nothing else reads (greedy, no log-probabilities, grammar, logit bias or penalties:
Sequence.argmax_only), gets the int8 head's logits with the few near the top recomputed at int16
(kernels/head_argmax): its token is the int16 head's, bit for bit; its other logits are the int8 ones, which
nothing reads. The other rows get the int16 head as before. The fused decode token (decode_step) takes the same
two steps for a greedy sequence: its head argmax_head's, then refine().
"""
from __future__ import annotations

import weakref

import numpy as np

from .blocks import KINDS, BlockTensor
from .kernels import blocks as KB
from .kernels import head_argmax as KH

__all__ = ["argmax_head", "head_logits", "refine"]

_L2: dict = {}          # id of a head's bytes (BlockTensor.raw) -> max_v |w_v|_2, dropped with the array (a reload's
                        # model is another array); the master's warm-up computes it before the workers fork


def _refined_kind(head):
    """The head's GGML id when its greedy rows take the int8 head and the refinement (a block-kind head on the int16
    rounding, of a kind with integer dots: the others take the f32 hidden state either way), else None."""
    if not isinstance(head, BlockTensor) or not head.acts16:
        return None
    k = KINDS[head.kind].ggml
    return k if k in KB.FAST else None


def _l2_max(head: BlockTensor) -> float:
    key = id(head.raw)
    if key not in _L2:
        _L2[key] = float(KH.head_l2_max(head.raw, _refined_kind(head), head.shape[-1]))
        weakref.finalize(head.raw, _L2.pop, key, None)
    return _L2[key]


def head_logits(ws, hs, head, bias, logits, argmax_rows=None):
    """logits (M,V) = hs (M,D) @ head.T (+ bias); argmax_rows (M,) bool or None: the rows that only take their
    argmax (their other logits are then the int8 head's). Returns logits."""
    if argmax_rows is None or _refined_kind(head) is None or not argmax_rows.any():
        ws.mm(hs, head, logits)
        if bias is not None:
            logits += bias
        return logits
    fast = np.flatnonzero(argmax_rows)
    rest = np.flatnonzero(~argmax_rows)
    if rest.size == 0:
        ws.mm(hs, argmax_head(head), logits)
    else:                   # the rows apart: a row's logits are its own bits whatever rows come with it
        for sel, W in ((fast, argmax_head(head)), (rest, head)):
            part = np.empty((sel.size, logits.shape[1]), np.float32)
            ws.mm(hs[sel], W, part)
            logits[sel] = part
    if bias is not None:
        logits += bias
    refine(ws, hs, head, bias, logits, fast)
    return logits


def argmax_head(head):
    """The head a row that only takes its argmax is multiplied by before refine(): the int8 twin of a head that takes
    the refinement, else None (the head as it is gives that row its logits)."""
    return head.with_acts16(False) if _refined_kind(head) is not None else None


def refine(ws, hs, head, bias, logits, rows) -> None:
    """logits[rows] (the int8 head's, argmax_head's, bias added) -> every logit near each row's top recomputed on the
    int16 head (kernels/head_argmax): the row's argmax is the int16 head's."""
    args = _refine_args(ws, hs, head, bias, logits, rows)
    if ws.threads > 1:
        KH.refine_argmax_par(*args)
    else:
        KH.refine_argmax(*args)


_NO_BIAS = np.zeros(0, np.float32)


def _refine_args(ws, hs, head, bias, logits, rows):
    """kernels/head_argmax's arguments: refine_argmax's, or on threads refine_argmax_par's (a scratch a thread)."""
    _, _, _, tmps = ws.block_acts(1, hs.shape[1], True)
    return (head.raw, _refined_kind(head), hs, logits, rows, bias if bias is not None else _NO_BIAS, _l2_max(head),
            tmps[:ws.threads] if ws.threads > 1 else tmps[0])


def compile_refine(ws, head, bias) -> None:
    """Compile refine_argmax_par for the types a threaded workspace gives it (a pre-fork master compiles, the
    forked workers run it), when the head takes it."""
    import numba
    if ws.threads < 2 or _refined_kind(head) is None:
        return
    args = _refine_args(ws, ws.gather[:1], head, bias, np.zeros((1, head.shape[0]), np.float32), np.zeros(1, np.int64))
    KH.refine_argmax_par.compile(tuple(numba.typeof(a) for a in args))
