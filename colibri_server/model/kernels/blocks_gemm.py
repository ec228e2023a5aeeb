"""The tiled product of block-kind weights with many activation rows (prefill, a serving step's rows):
X (T, n) @ W.T for Q4_K, Q5_K, Q6_K, Q4_0 and Q8_0 tiles on AVX-512 VNNI (all but Q8_0's on AVX2), every other
case through the row dots (kernels/blocks).

The row dots read a weight row once for all T rows but decode its blocks again for each of them
(nibbles, scales, one horizontal sum per block and row): a 128-token prefill ran 2-3.5x slower than the
q8 integer GEMM (kernels/gemm). Here, as llama.cpp's CPU repacking does at load (8 rows), a tile of 16
weight rows is laid out once per call in a scratch panel (kernels/blocks_panels, by register transposes) whose 32-bit lanes are the rows: dword g of a
chunk holds 4 consecutive bytes of each of the 16 rows (the GGUF's bytes, interleaved, the k-quants' values
unpacked to one byte each; the file keeps its own order), beside the rows' sub-block scales as i32 vectors and d,
dmin as f32 vectors. A micro-kernel then runs KC = 8 (the k-quants) or C32 = 2 activation rows at a time (the last
ones in one narrower pass) through the panel: for 4 weight bytes of the
16 rows, one `vpdpbusd` per activation row with its 4 bytes broadcast (4 products summed into each row's
lane, no horizontal sum); a sub-block's sums times the rows' scales (`vpmulld`), Q4_K's mins through
`vpdpwssd` on i16 pairs (Q6_K's offset of 32 the same way), and per 256-block the float step
(blocks_ir.k_update) on 16 rows at once. These are the integers and float operations of the row dots
kblock_q4_k / kblock_q5_k / kblock_q6_k, so each output equals the matvec's bit for bit, whatever T or the threads.
The output head's int16 activations (a kind id + ACTS16, kernels/blocks_wide) take blocks_wide's row dots, and
from WIDE_TILE_MIN_ROWS rows Q8_0 / Q4_0 tiles whose lanes hold two i16 values of a row (`vpdpwssd`), a Q6_K head
from blocks_head.HEAD_TILE_MIN_ROWS rows the int8 Q6_K panel against the activations' two bytes (kernels/blocks_head).
On AVX2 (no VNNI) the k-quants' and Q4_0's passes are kernels/blocks_avx2's (a panel's 8-row halves, products
added in i16 by `vpmaddubsw` + `vpaddw`, one `vpmaddwd` per sub-block); the other kernels here run with each 16-lane
vector split in two 256-bit halves by LLVM and the dot instructions built from `vpmaddubsw` and `vpmaddwd`
(blocks_tile_ir.Kernel.dpbusd / dpwssd): the same integers everywhere, so the same bits.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..numba_link import by_reference
from . import blocks_avx2 as A2
from .blocks import ACTS16, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, X16, _f16, _kround, _rows, round_rows
from .blocks_head import HEAD_TILE_MIN_ROWS, tiles_q6_kw
from .blocks_ir import _arr_ptr, k_update
from .blocks_panels import R, prep_b32, prep_q6_k, prep_q45_k, prep_x16, prep_x16_q6, q6_panel
from .blocks_row32 import b32_total, b32_update
from .blocks_small import SMALL_MAX_ROWS, small_rows
from .blocks_tile_ir import KC, Kernel, pass_width, q6_block_end, q6_block_sums, store_rows, xs_pairs
from .blocks_wide import round_rows16, rows16
from .blocks_x16 import gemm_rows_x16
from .cpu import HAVE_AVX2, HAVE_VNNI512

C = 4                      # activation rows per pass of the micro-kernel
GEMM_MIN_ROWS = 4          # fewer activation rows: the row dots (the panel costs more than it saves)
# the k-quants' panels laid out by register transposes (kernels/blocks_panels) pay from 2 rows, before the small-row
# kernels: one thread, the weights in cache, ms for 1 / 2 / 4 / 8 rows, row dots / small rows / tiles: Q4_K
# 2048x1024 0.063 / - / 0.047, 0.121 / 0.108 / 0.065, 0.238 / 0.172 / 0.074, 0.474 / 0.264 / 0.113; Q6_K 1024x2048
# 0.146 / - / 0.110, 0.282 / 0.176 / 0.147, 0.572 / 0.229 / 0.151, 1.179 / 0.386 / 0.256 (one row stays on the row
# dot: the batch-1 matvec reads the weights from memory, where a panel's extra traffic would not pay)
K_TILE_MIN_ROWS = 2
# the int16 head's Q8_0 / Q4_0 panels (two values a lane: twice the int8 panel's work to lay out) pay from 12 rows:
# bench/head.py, 32000 x 1024 Q8_0, one thread, row dots / tiles: 4 rows 5.6 / 11.4 ms, 16 rows 22.4 / 17.3
WIDE_TILE_MIN_ROWS = 12
# a Q4_K_X16 matrix (kernels/blocks_x16) takes its tiles as stored up to this many rows of X; from here a panel of each
# tile (blocks_panels.prep_x16, no transposes) through the Q4_K passes, which do not unpack the nibbles and scales again
# in each pass of KC rows. One thread, 64 matrices 2048 x 1024 (memory), against the Q4_K rows' panels: as stored
# 1.12x at 4 rows, 1.08x at 16, 1.00x at 32, 0.96x at 48, 0.93x at 128; through a panel 0.96-0.99x from 48 to 128
X16_PANEL_MIN_ROWS = 48
# and a Q6_K_X16 matrix from this many (blocks_panels.prep_x16_q6, the Q6_K passes): as stored against the Q6_K rows'
# panels, 1024 x 2048 from memory, 1.02-1.05x at 16 rows, 0.95x at 20, 0.91x at 32; through a panel 0.98-0.99x
X16_Q6_PANEL_MIN_ROWS = 20
# on AVX2 (kernels/blocks_avx2's tiles as stored: a 256-bit half at a time, 4 rows a pass, the values unpacked in
# each) a Q4_K_X16 matrix from this many, a Q6_K_X16 one from the next: one thread, 64 matrices from memory, as stored
# against through a panel (blocks_avx2's panel passes), Q4_K 2048 x 1024 1.07x at 5 rows, 1.04x at 6, 0.97x at 7,
# 0.96x at 8, 0.86x at 12, 0.85x at 16; Q6_K 1024 x 2048 0.97x at 5 and 6, 0.94x at 8, 0.85x at 16
X16_AVX2_PANEL_MIN_ROWS = 7
X16_AVX2_Q6_PANEL_MIN_ROWS = 5
HAVE_TILES = HAVE_VNNI512        # every tile kind (Q8_0's and the int16 head's too)
# the kinds whose weight bytes stay within 0..63 (Q4_K, Q5_K, Q6_K, Q4_0) also on AVX2, where Kernel.dpbusd is
# `vpmaddubsw` + `vpmaddwd` (exact below i16 saturation; Q8_0's flipped bytes reach 255 and would saturate)
TILES_SMALL_VALUES = HAVE_VNNI512 or HAVE_AVX2
# Q8_0 and Q4_0 tiles: AVX-512 VNNI's, or on AVX2 kernels/blocks_avx2's (Q8_0's through the sign trick)
B32_TILES = HAVE_VNNI512 or HAVE_AVX2


@njit(cache=True)
def scratch_words(n: int) -> int:
    """f32 words of the scratch for n columns: a tile's panel (the largest kind, the int16 head's Q8_0: 17 * 16
    words per 32 columns; Q6_K: 1424 per 256) and C * R results, or a row dequantized (kernels/blocks)."""
    return max(n, n // 32 * 272 + KC * R) + 16


_i8, _i32, _f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
_idx = ir.IntType(64)


@intrinsic
def ld32(typingctx, r, o):
    """The 4 bytes r[o:o+4] of a u8 array as one int32 (unaligned load)."""
    sig = types.int32(r, o)

    def codegen(context, builder, signature, args):
        p = builder.gep(_arr_ptr(context, builder, signature.args[0], args[0], _i8), [args[1]])
        return builder.load(builder.bitcast(p, _i32.as_pointer()), align=1)
    return sig, codegen


# ---------------------------------------------------------------------------- panels (plain Numba)

@njit(cache=True)
def _prep_b32w(raw, r0, nb, nibbles, P, DD):
    # rows r0..r0+R of a Q8_0 (Q4_0: nibbles) matrix for the int16 activations (kernels/blocks_wide) -> P[(16b + g)*R
    # + r] = block b's values 2g and 2g+1 as two i16 (Q4_0's minus 8), DD[b*R + r] = d
    size = 18 if nibbles else 34
    for r in range(R):
        row = raw[r0 + r]
        for b in range(nb):
            o = b * size
            DD[b * R + r] = _f16(row, o)
            for g in range(16):
                if nibbles:
                    k = 2 * g
                    v0 = (np.int32(row[o + 2 + k % 16]) >> (4 * (k // 16))) & 15
                    v1 = (np.int32(row[o + 2 + (k + 1) % 16]) >> (4 * ((k + 1) // 16))) & 15
                    v0, v1 = v0 - 8, v1 - 8
                else:
                    v0, v1 = np.int32(np.int8(row[o + 2 + 2 * g])), np.int32(np.int8(row[o + 3 + 2 * g]))
                P[(16 * b + g) * R + r] = (v0 & 0xFFFF) | (v1 << 16)


# ---------------------------------------------------------------------------- micro-kernels (LLVM IR)

def _mk_q45_k(nc, five):
    def impl(typingctx, P, SC, MN, DD, DM, xq, xd, xs, t0, nb, res):
        sig = types.void(P, SC, MN, DD, DM, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = Kernel(context, builder, signature, args, 5)
            b = builder
            p, sc, mn, dd, dm = (_arr_ptr(context, builder, signature.args[i], args[i], _f32 if i > 2 else _i32)
                                 for i in range(5))
            zero = ir.Constant(k.v16, None)

            def body(blk, accs):
                isum = [zero] * nc
                x0 = b.mul(blk, k.c(256))
                for c in range(4):
                    sa, sb = [zero] * nc, [zero] * nc
                    for g in range(8):
                        # sub-blocks 2c and 2c+1, unpacked in the panel (blocks_panels.prep_q45_k)
                        lo = k.vec(p, b.mul(b.add(b.mul(blk, k.c(64)), k.c(16 * c + g)), k.c(R)))
                        hi = k.vec(p, b.mul(b.add(b.mul(blk, k.c(64)), k.c(16 * c + 8 + g)), k.c(R)))
                        for t in range(nc):
                            sa[t] = k.dpbusd(sa[t], lo, k.x4(t, b.add(x0, k.c(64 * c + 4 * g))))
                            sb[t] = k.dpbusd(sb[t], hi, k.x4(t, b.add(x0, k.c(64 * c + 32 + 4 * g))))
                    s0 = k.vec(sc, b.mul(b.add(b.mul(blk, k.c(8)), k.c(2 * c)), k.c(R)))
                    s1 = k.vec(sc, b.mul(b.add(b.mul(blk, k.c(8)), k.c(2 * c + 1)), k.c(R)))
                    for t in range(nc):
                        isum[t] = b.add(isum[t], b.add(b.mul(sa[t], s0), b.mul(sb[t], s1)))
                msum = [zero] * nc
                for q in range(4):
                    m = k.vec(mn, b.mul(b.add(b.mul(blk, k.c(4)), k.c(q)), k.c(R)))
                    for t in range(nc):
                        msum[t] = k.dpwssd(msum[t], m, k.xs1(t, b.add(b.mul(blk, k.c(4)), k.c(q))))
                d = k.vec(dd, b.mul(blk, k.c(R)), k.f16)
                dmin = k.vec(dm, b.mul(blk, k.c(R)), k.f16)
                for t in range(nc):
                    xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), k.f16)
                    b.store(k_update(b, b.load(accs[t]), isum[t], d, xdb, msum[t], dmin), accs[t])
            k.block_loop(nc, body)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


def _mk_q6_k(nc):
    def impl(typingctx, P, SC, SP, DD, xq, xd, xs, t0, nb, res):
        sig = types.void(P, SC, SP, DD, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = Kernel(context, builder, signature, args, 4)
            b = builder
            p, sc, sp, dd = (_arr_ptr(context, builder, signature.args[i], args[i], _f32 if i == 3 else _i32)
                             for i in range(4))

            def body(blk, accs):
                # the 6-bit values and the scales, unpacked in the panel (blocks_panels.prep_q6_k)
                isum = q6_block_sums(
                    k, blk, nc, lambda h, c, g: k.vec(p, b.mul(b.add(b.mul(blk, k.c(64)), k.c(32 * h + 8 * c + g)), k.c(R))),
                    lambda g: k.vec(sc, b.mul(b.add(b.mul(blk, k.c(16)), k.c(g)), k.c(R))))
                q6_block_end(k, blk, accs, isum, lambda q: k.vec(sp, b.mul(b.add(b.mul(blk, k.c(8)), k.c(q)), k.c(R))),
                             k.vec(dd, b.mul(blk, k.c(R)), k.f16))
            k.block_loop(nc, body)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


def _mk_b32(nc, nibbles, wide=False):
    """The 32-block kinds' micro-kernel: int8 activations (`vpdpbusd` on 4 bytes of 16 rows), or (wide) the output
    head's int16 ones (kernels/blocks_wide: `vpdpwssd` on 2 values of 16 rows, the panel from _prep_b32w): per block
    the exact integer sum of each row, then blocks_row32.b32_update into accumulator b mod 8 and b32_total, as the
    row dots do."""
    def impl(typingctx, P, DD, xq, xd, xs, t0, nb, res):
        sig = types.void(P, DD, xq, xd, xs, t0, nb, res)

        def codegen(context, builder, signature, args):
            k = Kernel(context, builder, signature, args, 2)
            b = builder
            p = _arr_ptr(context, builder, signature.args[0], args[0], _i32)
            dd = _arr_ptr(context, builder, signature.args[1], args[1], _f32)
            zero = ir.Constant(k.v16, None)
            nw = 16 if wide else 4 if nibbles else 8
            mask = k.splat(ir.Constant(_i32, 0x0F0F0F0F))
            accs = [[cgutils.alloca_once_value(b, ir.Constant(k.f16, None)) for _ in range(8)] for _ in range(nc)]
            with cgutils.for_range(b, b.sdiv(k.nb, k.c(8))) as loop:            # 8 blocks: accumulator b mod 8
                for i in range(8):
                    blk = b.add(b.mul(loop.index, k.c(8)), k.c(i))
                    x0 = b.mul(blk, k.c(32))
                    isum = [zero] * nc
                    for g in range(nw):
                        w = k.vec(p, b.mul(b.add(b.mul(blk, k.c(nw)), k.c(g)), k.c(R)))
                        if wide:        # the int16 values 2g, 2g+1 of the block: bytes 4g.. of its 64
                            for t in range(nc):
                                isum[t] = k.dpwssd(isum[t], w, k.x4(t, b.add(b.mul(blk, k.c(64)), k.c(4 * g))))
                            continue
                        if nibbles:
                            lo, hi = b.and_(w, mask), b.and_(b.lshr(w, k.splat(ir.Constant(_i32, 4))), mask)
                        for t in range(nc):
                            if nibbles:
                                isum[t] = k.dpbusd(isum[t], lo, k.x4(t, b.add(x0, k.c(4 * g))))
                                isum[t] = k.dpbusd(isum[t], hi, k.x4(t, b.add(x0, k.c(16 + 4 * g))))
                            else:
                                isum[t] = k.dpbusd(isum[t], w, k.x4(t, b.add(x0, k.c(4 * g))))
                    d = k.vec(dd, b.mul(blk, k.c(R)), k.f16)
                    for t in range(nc):
                        if wide:
                            it = isum[t]
                        else:
                            s2 = b.gep(k.xs[t], [b.mul(blk, k.c(2))])
                            xsum = b.add(b.load(s2), b.load(b.gep(s2, [k.c(1)])))
                            corr = b.mul(xsum, ir.Constant(_i32, 8 if nibbles else 128))
                            it = b.sub(isum[t], k.splat(corr))
                        xdb = k.splat(b.load(b.gep(k.xd[t], [blk])), k.f16)
                        b.store(b32_update(b, b.load(accs[t][i]), it, d, xdb), accs[t][i])
            for t in range(nc):
                tot = b32_total(b, [b.load(a) for a in accs[t]])
                b.store(tot, b.bitcast(b.gep(k.res, [k.c(t * R)]), k.f16.as_pointer()), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


C32 = 2                    # activation rows per pass of the 32-block kinds' micro-kernel (8 accumulators each)
_q8_2, _q8_1 = _mk_b32(C32, False), _mk_b32(1, False)
_q40_2, _q40_1 = _mk_b32(C32, True), _mk_b32(1, True)
_w32_2, _w32_1 = _mk_b32(C32, False, True), _mk_b32(1, False, True)     # the int16 head's Q8_0 and Q4_0 panels
# the k-quants' last T mod C rows in one pass of as many (the panel read once for them, not once a row): one thread,
# in cache, Q6_K 1024x2048 at 2 / 3 / 6 rows the single-row passes took 0.147 / 0.178 / 0.251 ms against 0.151 at 4
_q4k_8, _q4k_4, _q4k_3, _q4k_2, _q4k_1 = (_mk_q45_k(n, False) for n in (KC, 4, 3, 2, 1))
_q5k_8, _q5k_4, _q5k_3, _q5k_2, _q5k_1 = (_mk_q45_k(n, True) for n in (KC, 4, 3, 2, 1))
_q6k_8, _q6k_4, _q6k_3, _q6k_2, _q6k_1 = (_mk_q6_k(n) for n in (KC, 4, 3, 2, 1))


# ---------------------------------------------------------------------------- tiles


@njit(cache=True, inline="always")
def _pass_q45_k(nc, five, P, SC, MN, DD, DM, Xq, Xd, Xs, XP, t0, nb, res):
    # activation rows t0..t0+nc (nc in 1..4, KC) through a Q4_K (Q5_K: five) panel: the 16-lane kernels take the
    # activation sums' packed pairs XP (xs_pairs), AVX2's (blocks_avx2) the sums Xs themselves
    if not HAVE_VNNI512:
        A2.pass_q45_k(nc, five, P, SC, MN, DD, DM, Xq, Xd, Xs, t0, nb, res)
    elif nc == KC:
        if five:
            _q5k_8(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)
        else:
            _q4k_8(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)
    elif nc == 4:
        if five:
            _q5k_4(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)
        else:
            _q4k_4(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)
    elif nc == 3:
        if five:
            _q5k_3(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)
        else:
            _q4k_3(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)
    elif nc == 2:
        if five:
            _q5k_2(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)
        else:
            _q4k_2(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)
    else:
        if five:
            _q5k_1(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)
        else:
            _q4k_1(P, SC, MN, DD, DM, Xq, Xd, XP, t0, nb, res)


@njit(cache=True, inline="always")
def _pass_q6_k(nc, P, SC, SP, DD, Xq, Xd, Xs, XP, t0, nb, res):
    # activation rows t0..t0+nc (nc in 1..4, KC) through a Q6_K panel (XP and Xs as in _pass_q45_k)
    if not HAVE_VNNI512:
        A2.pass_q6_k(nc, P, SC, SP, DD, Xq, Xd, Xs, t0, nb, res)
    elif nc == KC:
        _q6k_8(P, SC, SP, DD, Xq, Xd, XP, t0, nb, res)
    elif nc == 4:
        _q6k_4(P, SC, SP, DD, Xq, Xd, XP, t0, nb, res)
    elif nc == 3:
        _q6k_3(P, SC, SP, DD, Xq, Xd, XP, t0, nb, res)
    elif nc == 2:
        _q6k_2(P, SC, SP, DD, Xq, Xd, XP, t0, nb, res)
    else:
        _q6k_1(P, SC, SP, DD, Xq, Xd, XP, t0, nb, res)


@njit(cache=True, inline="always")
def _pass_width(T, t0):
    # the rows of the next pass from t0: KC while KC remain, then 4, then the last 1-3 in one pass (AVX2: blocks_avx2's)
    return pass_width(T, t0) if HAVE_VNNI512 else A2.pass_width(T, t0)


@njit(cache=True)
def _tiles_q45_k(raw, five, x16, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # rows i0..i0 + R*k (whole tiles) of a Q4_K (Q5_K: five; x16: Q4_K_X16, its tiles' panels laid out without
    # transposes) matrix times every row of Xq (rounded per 256: quant_acts_k)
    nb = Xq.shape[1] // 256
    T = Xq.shape[0]
    w = tmp.view(np.int32)
    P, SC, MN = w[:nb * 1024], w[nb * 1024:nb * 1152], w[nb * 1152:nb * 1216]
    DD, DM, res = tmp[nb * 1216:nb * 1232], tmp[nb * 1232:nb * 1248], tmp[nb * 1248:nb * 1248 + KC * R]
    XP = xs_pairs(Xs, 2)
    for r0 in range(i0, i1 - R + 1, R):
        if x16:
            prep_x16(raw, r0, nb, P, SC, MN, DD, DM)
        else:
            prep_q45_k(raw, r0, nb, five, P, SC, MN, DD, DM)
        t0 = 0
        while t0 < T:
            nc = _pass_width(T, t0)
            _pass_q45_k(nc, five, P, SC, MN, DD, DM, Xq, Xd, Xs, XP, t0, nb, res)
            store_rows(res, out, t0, nc, r0, alpha, accumulate)
            t0 += nc


@njit(cache=True)
def _tiles_q6_k(raw, x16, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # as _tiles_q45_k for a Q6_K (x16: Q6_K_X16) matrix
    nb = Xq.shape[1] // 256
    T = Xq.shape[0]
    P, SC, SP, DD, rest = q6_panel(tmp, nb)
    res = rest[:KC * R]
    XP = xs_pairs(Xs, 1)
    for r0 in range(i0, i1 - R + 1, R):
        if x16:
            prep_x16_q6(raw, r0, nb, P, SC, SP, DD)
        else:
            prep_q6_k(raw, r0, nb, P, SC, SP, DD)
        t0 = 0
        while t0 < T:
            nc = _pass_width(T, t0)
            _pass_q6_k(nc, P, SC, SP, DD, Xq, Xd, Xs, XP, t0, nb, res)
            store_rows(res, out, t0, nc, r0, alpha, accumulate)
            t0 += nc


@njit(cache=True)
def _tiles_b32(raw, nibbles, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # rows i0..i0 + R*k (whole tiles) of a Q8_0 (Q4_0: nibbles) matrix times every row of Xq (rounded per 32: quant_acts)
    nb = Xq.shape[1] // 32
    T = Xq.shape[0]
    nw = 4 if nibbles else 8
    P = tmp.view(np.int32)[:nb * nw * R]
    DD, res = tmp[nb * nw * R:nb * (nw + 1) * R], tmp[nb * (nw + 1) * R:nb * (nw + 1) * R + C * R]
    for r0 in range(i0, i1 - R + 1, R):
        prep_b32(raw, r0, nb, nibbles, P, DD)
        if not HAVE_VNNI512:                      # AVX2: blocks_avx2's Q4_0 and Q8_0 kernels
            t0 = 0
            while t0 < T:
                nc = min(A2.KC40 if nibbles else A2.KC80, T - t0)
                if nibbles:
                    A2.pass_q40(nc, P, DD, Xq, Xd, Xs, t0, nb, res)
                else:
                    A2.pass_q80(nc, P, DD, Xq, Xd, Xs, t0, nb, res)
                store_rows(res, out, t0, nc, r0, alpha, accumulate)
                t0 += nc
            continue
        for t0 in range(0, T - C32 + 1, C32):
            if nibbles:
                _q40_2(P, DD, Xq, Xd, Xs, t0, nb, res)
            else:
                _q8_2(P, DD, Xq, Xd, Xs, t0, nb, res)
            store_rows(res, out, t0, C32, r0, alpha, accumulate)
        for t0 in range(T // C32 * C32, T):
            if nibbles:
                _q40_1(P, DD, Xq, Xd, Xs, t0, nb, res)
            else:
                _q8_1(P, DD, Xq, Xd, Xs, t0, nb, res)
            store_rows(res, out, t0, 1, r0, alpha, accumulate)


@njit(cache=True)
def _tiles_b32w(raw, nibbles, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # _tiles_b32 for the int16 activations of the output head (kernels/blocks_wide; Xq (T, 2n) i8 holding them)
    nb = Xq.shape[1] // 64
    T = Xq.shape[0]
    P = tmp.view(np.int32)[:nb * 16 * R]
    DD, res = tmp[nb * 16 * R:nb * 17 * R], tmp[nb * 17 * R:nb * 17 * R + C * R]
    for r0 in range(i0, i1 - R + 1, R):
        _prep_b32w(raw, r0, nb, nibbles, P, DD)
        for t0 in range(0, T - C32 + 1, C32):
            _w32_2(P, DD, Xq, Xd, Xs, t0, nb, res)
            store_rows(res, out, t0, C32, r0, alpha, accumulate)
        for t0 in range(T // C32 * C32, T):
            _w32_1(P, DD, Xq, Xd, Xs, t0, nb, res)
            store_rows(res, out, t0, 1, r0, alpha, accumulate)


@by_reference          # ~33 functions of tiles and row dots: compiled once, not into each of the ~18 libraries above it
@njit(cache=True)
def gemm_rows(raw, kind, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate):
    # out[t, i] (=|+=) alpha * raw[i] . X[t] for rows i0..i1 and every t, X rounded for kind (round_rows): 2 to
    # SMALL_MAX_ROWS rows of X of an integer kind through kernels/blocks_small (each block unpacked once for all rows),
    # more (the k-quants: from K_TILE_MIN_ROWS) through whole tiles of R rows where they run (HAVE_TILES), the rest through the row
    # dots, the same bits every way; kind + ACTS16 (the output head): blocks_wide's row dots, its Q8_0/Q4_0 tiles
    # from WIDE_TILE_MIN_ROWS rows, Q6_K's (kernels/blocks_head) from HEAD_TILE_MIN_ROWS; Q4_K + X16, Q6_K + X16 (rows
    # stored as tiles): kernels/blocks_x16's tiles as stored from one row, their panels from X16_PANEL_MIN_ROWS
    # (X16_Q6_PANEL_MIN_ROWS; on AVX2 X16_AVX2_PANEL_MIN_ROWS, X16_AVX2_Q6_PANEL_MIN_ROWS).
    # tmp: >= scratch_words(n) f32
    end = i0
    T = X.shape[0]
    if kind & ACTS16:
        k = kind & (ACTS16 - 1)
        if HAVE_TILES and T >= WIDE_TILE_MIN_ROWS and (k == Q8_0 or k == Q4_0) and X.shape[1] % 256 == 0 \
                and tmp.shape[0] >= scratch_words(X.shape[1]):
            end = i0 + (i1 - i0) // R * R
            _tiles_b32w(raw, k == Q4_0, Xq, Xd, Xs, out, tmp, i0, end, alpha, accumulate)
        elif HAVE_TILES and T >= HEAD_TILE_MIN_ROWS and k == Q6_K and tmp.shape[0] >= scratch_words(X.shape[1]):
            end = i0 + (i1 - i0) // R * R
            tiles_q6_kw(raw, Xq, Xd, Xs, out, tmp, i0, end, alpha, accumulate)
        rows16(raw, kind, X, Xq, Xd, Xs, out, tmp, end, i1, alpha, accumulate)
        return
    if kind == Q4_K + X16 or kind == Q6_K + X16:
        six = kind == Q6_K + X16
        lo, hi = (i0 + R - 1) // R * R, i1 // R * R          # the whole tiles in i0..i1
        if HAVE_VNNI512:
            panel_min = X16_Q6_PANEL_MIN_ROWS if six else X16_PANEL_MIN_ROWS
        else:
            panel_min = X16_AVX2_Q6_PANEL_MIN_ROWS if six else X16_AVX2_PANEL_MIN_ROWS
        if T >= panel_min and lo < hi and TILES_SMALL_VALUES and tmp.shape[0] >= scratch_words(X.shape[1]):
            gemm_rows_x16(raw, six, X, Xq, Xd, Xs, out, tmp, i0, lo, alpha, accumulate)
            if six:
                _tiles_q6_k(raw, True, Xq, Xd, Xs, out, tmp, lo, hi, alpha, accumulate)
            else:
                _tiles_q45_k(raw, False, True, Xq, Xd, Xs, out, tmp, lo, hi, alpha, accumulate)
            gemm_rows_x16(raw, six, X, Xq, Xd, Xs, out, tmp, hi, i1, alpha, accumulate)
        else:                               # its tiles as stored (kernels/blocks_x16)
            gemm_rows_x16(raw, six, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate)
        return
    kq = kind == Q4_K or kind == Q5_K or kind == Q6_K
    big = tmp.shape[0] >= scratch_words(X.shape[1])      # room for a panel
    if 2 <= T <= SMALL_MAX_ROWS and (kq or kind == Q8_0 or kind == Q4_0) \
            and not (kq and HAVE_TILES and big and T >= K_TILE_MIN_ROWS):
        small_rows(raw, kind, X, Xq, Xd, Xs, out, tmp, i0, i1, alpha, accumulate)     # a few rows: no panel
        return
    if not big:                                           # too small a scratch for a panel: the row dots
        pass
    elif kq and TILES_SMALL_VALUES and T >= (min(GEMM_MIN_ROWS, K_TILE_MIN_ROWS) if HAVE_TILES else GEMM_MIN_ROWS):
        end = i0 + (i1 - i0) // R * R
        if kind == Q4_K or kind == Q5_K:
            _tiles_q45_k(raw, kind == Q5_K, False, Xq, Xd, Xs, out, tmp, i0, end, alpha, accumulate)
        else:
            _tiles_q6_k(raw, False, Xq, Xd, Xs, out, tmp, i0, end, alpha, accumulate)
    elif X.shape[0] >= GEMM_MIN_ROWS and B32_TILES and (kind == Q8_0 or kind == Q4_0) \
            and X.shape[1] % 256 == 0:
        end = i0 + (i1 - i0) // R * R
        _tiles_b32(raw, kind == Q4_0, Xq, Xd, Xs, out, tmp, i0, end, alpha, accumulate)
    if end < i1:
        _rows(raw, kind, X, Xq, Xd, Xs, out, tmp, end, i1, alpha, accumulate)


@njit(cache=True)
def round_acts(kind, X, Xq, Xd, Xs):
    # every row of X rounded for kind's products: int8 (kernels/blocks.round_rows), or int16 for kind + ACTS16
    if kind & ACTS16:
        round_rows16(kind, X, Xq, Xd, Xs)
    else:
        round_rows(kind, X, Xq, Xd, Xs)


@njit(cache=True)
def matmul_blocks(raw, kind, X, out, Xq, Xd, Xs, tmp, alpha, accumulate):
    # X (T, n) f32 @ W.T -> out (T, d) (=|+= alpha *); W raw (d, row bytes) of GGML type kind (+ ACTS16: the activations
    # rounded to int16, blocks_wide); scratch: Xq (T,n) i8 (T,2n for + ACTS16), Xd (T,n/32) f32, Xs (T,n/16) i32,
    # tmp (>= scratch_words(n),) f32
    round_acts(kind, X, Xq, Xd, Xs)
    # np.int64(0): a literal 0 would be a type of its own (Literal[int](0)), a second compile of gemm_rows (~50 s)
    # beside the int64 one gemm_rows_par and experts_blocks call
    gemm_rows(raw, kind, X, Xq, Xd, Xs, out, tmp, np.int64(0), raw.shape[0], alpha, accumulate)


# from this many rows of X, matmul_blocks_par rounds them on the threads too (fewer, as a decode token's one row: on the
# calling thread, no second parallel region); a 128-token prefill's q, k, v and o rows (128 x 1024, k-quants) took
# 0.18 ms each to round on one thread beside the threads' products
PAR_ROUND_MIN_ROWS = 16


@njit(cache=True, parallel=True)
def round_acts_par(kind, X, Xq, Xd, Xs, nparts):
    # round_acts with the rows of X split over nparts Numba threads (each row's rounding is its own: the same bits)
    T = X.shape[0]
    for p in prange(nparts):
        r0, r1 = p * T // nparts, (p + 1) * T // nparts
        round_acts(kind, X[r0:r1], Xq[r0:r1], Xd[r0:r1], Xs[r0:r1])


@njit(cache=True, inline="always")
def _round_par(kind, X, Xq, Xd, Xs, nt):
    # the rows of X rounded for kind as matmul_blocks_par rounds them: on nt threads from PAR_ROUND_MIN_ROWS rows
    if X.shape[0] >= PAR_ROUND_MIN_ROWS:
        round_acts_par(kind, X, Xq, Xd, Xs, nt)
    else:
        round_acts(kind, X, Xq, Xd, Xs)


@njit(cache=True, inline="always")
def _chunk_rows(raw, kind, X, Xq, Xd, Xs, out, tmp, c, nt, alpha, accumulate):
    # chunk c of nt of a threaded product: gemm_rows on its share (whole tiles) of raw's rows
    d = raw.shape[0]
    tiles = (d + R - 1) // R
    gemm_rows(raw, kind, X, Xq, Xd, Xs, out, tmp, min(d, c * tiles // nt * R), min(d, (c + 1) * tiles // nt * R),
              alpha, accumulate)


@njit(cache=True, parallel=True)
def gemm_rows_par(raw, kind, X, Xq, Xd, Xs, out, tmps, alpha, accumulate):
    # gemm_rows of X's rows (rounded) with the weight rows split over tmps.shape[0] chunks (whole tiles) run by Numba
    # threads
    nt = tmps.shape[0]
    for c in prange(nt):
        _chunk_rows(raw, kind, X, Xq, Xd, Xs, out, tmps[c], c, nt, alpha, accumulate)


@njit(cache=True)
def matmul_blocks_par(raw, kind, X, out, Xq, Xd, Xs, tmps, alpha, accumulate):
    # matmul_blocks on tmps.shape[0] Numba threads: the rows of X rounded (on the threads from PAR_ROUND_MIN_ROWS),
    # then the weight rows split over the threads (gemm_rows_par)
    _round_par(kind, X, Xq, Xd, Xs, tmps.shape[0])
    gemm_rows_par(raw, kind, X, Xq, Xd, Xs, out, tmps, alpha, accumulate)


@njit(cache=True, parallel=True)
def _gemm_rows3_par(ra, ka, rb, kb, rc, kc, X, Qa, Da, Sa, Qb, Db, Sb, Qc, Dc, Sc, oa, ob, oc, tmps):
    # three matrices' gemm_rows_par in one parallel region: chunk c takes its share of each one's rows
    nt = tmps.shape[0]
    one, no = np.float32(1.0), np.bool_(False)     # not literals: gemm_rows' one compile with matmul_blocks' types
    for c in prange(nt):
        _chunk_rows(ra, ka, X, Qa, Da, Sa, oa, tmps[c], c, nt, one, no)
        _chunk_rows(rb, kb, X, Qb, Db, Sb, ob, tmps[c], c, nt, one, no)
        _chunk_rows(rc, kc, X, Qc, Dc, Sc, oc, tmps[c], c, nt, one, no)


@njit(cache=True)
def matmul3_blocks_par(ra, ka, rb, kb, rc, kc, X, oa, ob, oc, Xq, Xd, Xs, tmps):
    # X (T, n) @ ra.T -> oa, @ rb.T -> ob, @ rc.T -> oc (q, k and v: block kinds without ACTS16) in one parallel region
    # of tmps.shape[0] chunks, where three matmul_blocks_par calls take three: X rounded once per rounding the kinds
    # take (Xq, Xd, Xs (>= 3T, ...): rows 0..T for ka, T..2T and 2T..3T for the others when theirs differs), each
    # product the rows of its own call (the same bits); the rows rounded as matmul_blocks_par rounds them (_round_par)
    T, nt = X.shape[0], tmps.shape[0]
    Qa, Da, Sa = Xq[:T], Xd[:T], Xs[:T]
    _round_par(ka, X, Qa, Da, Sa, nt)
    Qb, Db, Sb = Qa, Da, Sa
    if _kround(kb) != _kround(ka):
        Qb, Db, Sb = Xq[T:2 * T], Xd[T:2 * T], Xs[T:2 * T]
        _round_par(kb, X, Qb, Db, Sb, nt)
    Qc, Dc, Sc = Qb, Db, Sb
    if _kround(kc) == _kround(ka):
        Qc, Dc, Sc = Qa, Da, Sa
    elif _kround(kc) != _kround(kb):
        Qc, Dc, Sc = Xq[2 * T:3 * T], Xd[2 * T:3 * T], Xs[2 * T:3 * T]
        _round_par(kc, X, Qc, Dc, Sc, nt)
    _gemm_rows3_par(ra, ka, rb, kb, rc, kc, X, Qa, Da, Sa, Qb, Db, Sb, Qc, Dc, Sc, oa, ob, oc, tmps)
