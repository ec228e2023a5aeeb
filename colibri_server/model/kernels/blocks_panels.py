"""The tiles' weight panels (kernels/blocks_gemm): 16 weight rows of a block-kind matrix laid out so that the
32-bit lanes of a zmm register are the rows.

A panel's values are a transpose: dword q of each of the 16 rows' blocks goes to the 16 lanes of vector q. Done a
dword at a time (16 x 32 scalar loads and stores a Q4_K block) the layout cost ~0.15 ms a 2048 x 1024 matrix, more
than a few activation rows' products through the panel, so the small-row kernels (kernels/blocks_small) ran up to 4
rows. Here the values move 64 bytes at a time: 16 rows' 64 bytes loaded as 16 vectors and transposed in registers
(_transpose: 4 rounds of 2-source shuffles, each swapping one bit of the row index with one of the lane index), a
Q4_K block's values in two such transposes, and the block headers (d, dmin, the packed scales and mins) transposed
the same way and unpacked on the 16 rows as lanes.
The values are the GGUF's: Q4_0's and Q8_0's bytes moved (Q8_0's + 128), the k-quants' unpacked to one byte a value
(Q4_K / Q5_K nibbles split, Q5_K's fifth bit and Q6_K's high two bits merged in) once per panel rather than in every
pass of the micro-kernel over it: one thread, 1024 x 2048 Q6_K at 32 rows 0.78 -> 0.60 ms. The micro-kernels
read the same integers either way, so the products keep their bits.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .prefetch import prefetch_ahead

R = 16                     # weight rows per tile (the 16 i32 lanes of a zmm register)

_i8, _i32 = ir.IntType(8), ir.IntType(32)
_idx = ir.IntType(64)
_v16 = ir.VectorType(_i32, R)


def _transpose(builder, rows):
    """len(rows) (16, 8 or 4) <16 x i32> vectors (row r, lane q) -> as many vectors, bits 0..log2(len)-1 of the row
    and of the lane swapped (16: row q, lane r): round k swaps bit k of the row with bit k of the lane, for rows i and
    j = i | 2^k one shuffle each."""
    n = len(rows)
    for k in range(n.bit_length() - 1):
        s = 1 << k
        new = list(rows)
        for i in range(n):
            if i & s:
                continue
            j = i | s
            mi = [q if not q & s else R + (q ^ s) for q in range(R)]
            mj = [q ^ s if not q & s else R + q for q in range(R)]
            new[i] = builder.shuffle_vector(rows[i], rows[j], ir.Constant(ir.VectorType(_i32, R), mi))
            new[j] = builder.shuffle_vector(rows[i], rows[j], ir.Constant(ir.VectorType(_i32, R), mj))
        rows = new
    return rows


def f16_lanes(b, v):
    """The low 16 bits of each of 16 i32 lanes as IEEE half -> <16 x float>, exact (fpext, as kernels/base's f16 to
    f32)."""
    h = b.bitcast(b.trunc(v, ir.VectorType(ir.IntType(16), R)), ir.VectorType(ir.HalfType(), R))
    return b.fpext(h, ir.VectorType(ir.FloatType(), R))


class _Tile:
    """IR over a tile's arguments (raw, r0, ...): the 16 rows' 64 bytes at a byte offset, transposed, and 16-lane
    stores into the panel arrays."""

    def __init__(self, context, builder, sig, args):
        self.context, self.b, self.sig, self.args = context, builder, sig, args
        a = context.make_array(sig.args[0])(context, builder, args[0])
        self.stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]
        self.base = builder.bitcast(a.data, _i8.as_pointer())
        self.r0 = self.idx(1)

    def idx(self, k):
        return self.context.cast(self.b, self.args[k], self.sig.args[k], types.intp)

    def cols(self, off):
        """dword q of rows r0..r0+R's bytes off..off+64 (off: i64) as 16 vectors, lane r the row."""
        b = self.b
        start = b.add(b.mul(self.r0, self.stride), off)
        ptrs = [b.gep(self.base, [b.add(start, b.mul(self.stride, ir.Constant(_idx, r)))]) for r in range(R)]
        rows = [b.load(b.bitcast(p, _v16.as_pointer()), align=1) for p in ptrs]
        # the next tile's same bytes into L2, a tile's products ahead of their layout (past the matrix: no fault)
        prefetch_ahead(b, ptrs, b.mul(self.stride, ir.Constant(_idx, R)), ahead=0)
        return _transpose(b, rows)

    def cols32(self, off, nd):
        """The nd (8 or 4) dwords of rows r0..r0+R's bytes off..off+4nd (no byte beyond: a matrix's last block) as nd
        vectors, lane r the row: row r + nd*h loaded into lanes nd*h.. of vector r, then log2(nd) transpose rounds."""
        b = self.b
        vt = ir.VectorType(_i32, nd)
        start = b.add(b.mul(self.r0, self.stride), off)
        ptrs = [b.gep(self.base, [b.add(start, b.mul(self.stride, ir.Constant(_idx, r)))]) for r in range(R)]
        part = [b.load(b.bitcast(p, vt.as_pointer()), align=1) for p in ptrs]
        prefetch_ahead(b, ptrs, b.mul(self.stride, ir.Constant(_idx, R)), ahead=0)
        rows = []
        for r in range(nd):
            group = [part[r + nd * h] for h in range(R // nd)]
            while len(group) > 1:           # concatenate pairwise: <nd> x 16/nd -> <16>
                w = group[0].type.count
                group = [b.shuffle_vector(group[i], group[i + 1], ir.Constant(ir.VectorType(_i32, 2 * w), list(range(2 * w))))
                         for i in range(0, len(group), 2)]
            rows.append(group[0])
        return _transpose(b, rows)

    def f16_at(self, off):
        """The f16 at byte off of each of rows r0..r0+R -> <16 x float> (exact)."""
        b = self.b
        start = b.add(b.mul(self.r0, self.stride), off)
        v = ir.Constant(_v16, None)
        for r in range(R):
            p = b.bitcast(b.gep(self.base, [b.add(start, b.mul(self.stride, ir.Constant(_idx, r)))]),
                          ir.IntType(16).as_pointer())
            v = b.insert_element(v, b.zext(b.load(p, align=1), _i32), ir.Constant(_i32, r))
        return self.f16(v)

    def store(self, k, at, v):
        """v (16 lanes) to array argument k at element at (i64)."""
        b = self.b
        p = b.bitcast(self.context.make_array(self.sig.args[k])(self.context, b, self.args[k]).data,
                      v.type.element.as_pointer())
        b.store(v, b.bitcast(b.gep(p, [at]), v.type.as_pointer()), align=4)

    def store_k_header(self, blk, h, sc):
        """A Q4_K / Q5_K block's header as 4 16-lane dwords h (d | dmin, the 12 packed scale bytes) of block blk ->
        argument sc (SC) the 8 scales, sc + 1 (MN) the mins' 4 pairs, sc + 2 / sc + 3 (DD / DM) d and dmin."""
        b = self.b
        self.store(sc + 2, b.mul(blk, self.c(R)), self.f16(h[0]))
        self.store(sc + 3, b.mul(blk, self.c(R)), self.f16(b.lshr(h[0], self.k(16))))
        for j in range(8):
            self.store(sc, b.mul(b.add(b.mul(blk, self.c(8)), self.c(j)), self.c(R)), k_scale(b, h[1:4], j, self.k))
        for p in range(4):
            self.store(sc + 1, b.mul(b.add(b.mul(blk, self.c(4)), self.c(p)), self.c(R)), k_min_pair(b, h[1:4], p, self.k))

    def store_k_values(self, blk, q, arg, qh=None):
        """A Q4_K / Q5_K block's 32 dwords of nibbles q (dword 8c + g, 16 rows as lanes) of block blk -> argument arg
        (P): dword g of sub-block j at (64 blk + 8j + g) * R, a byte a value (qh: Q5_K's fifth bits' 8 dwords)."""
        b = self.b
        for c in range(4):
            for h in range(2):
                for g in range(8):
                    v = b.and_(b.lshr(q[8 * c + g], self.k(4 * h)), self.k(0x0F0F0F0F))
                    if qh is not None:
                        hb = b.and_(b.lshr(qh[g], self.k(2 * c + h)), self.k(0x01010101))
                        v = b.or_(v, b.shl(hb, self.k(4)))
                    self.store(arg, b.mul(b.add(b.mul(blk, self.c(64)), self.c(16 * c + 8 * h + g)), self.c(R)), v)

    def store_q6_header(self, blk, h, d, sc):
        """A Q6_K block's 16 int8 scales as 4 16-lane dwords h and its d (<16 x float>) of block blk -> argument sc
        (SC) the scales, sc + 1 (SP) their i16 pairs, sc + 2 (DD) d."""
        b = self.b
        self.store(sc + 2, b.mul(blk, self.c(R)), d)
        s = [q6_scale(b, h, g, self.k) for g in range(16)]
        for g in range(16):
            self.store(sc, b.mul(b.add(b.mul(blk, self.c(16)), self.c(g)), self.c(R)), s[g])
        for p in range(8):
            self.store(sc + 1, b.mul(b.add(b.mul(blk, self.c(8)), self.c(p)), self.c(R)),
                       b.or_(b.and_(s[2 * p], self.k(0xFFFF)), b.shl(s[2 * p + 1], self.k(16))))

    def store_q6_values(self, blk, ql, qh, arg):
        """A Q6_K block's 32 dwords of ql and 16 of qh (16 rows as lanes) of block blk -> argument arg (P): dword g of
        values 128h + 32c.. at (64 blk + 32h + 8c + g) * R, a 6-bit unsigned byte a value (q6_value)."""
        b = self.b
        for h in range(2):
            for c in range(4):
                for g in range(8):
                    self.store(arg, b.mul(b.add(b.mul(blk, self.c(64)), self.c(32 * h + 8 * c + g)), self.c(R)),
                               q6_value(b, ql, qh, h, c, g, self.k))

    def c(self, v):
        return ir.Constant(_idx, v)

    def k(self, v):
        return ir.Constant(_v16, [v] * R)

    def f16(self, v):
        return f16_lanes(self.b, v)


def _scale_byte(bb, h, i, k):
    """Byte i of a Q4_K / Q5_K block's 12 packed scale bytes, held as 3 16-lane dwords h (lane r: row r)."""
    return bb.and_(bb.lshr(h[i // 4], k(8 * (i % 4))), k(255))


def k_scale(bb, h, j, k):
    """Sub-block j's 6-bit scale of a Q4_K / Q5_K block whose 12 packed scale bytes are 3 16-lane dwords h (lane r:
    row r) -> an i32 vector: blocks._k_scale_min on 16 rows as lanes (k(v): v splat)."""
    if j < 4:
        return bb.and_(_scale_byte(bb, h, j, k), k(63))
    return bb.or_(bb.and_(_scale_byte(bb, h, j + 4, k), k(15)),
                  bb.and_(bb.lshr(_scale_byte(bb, h, j - 4, k), k(2)), k(48)))


def k_min_pair(bb, h, p, k):
    """The 6-bit mins of sub-blocks 2p and 2p+1 (h as k_scale's) -> min 2p | min 2p+1 << 16 in each lane."""
    def mn(j):
        if j < 4:
            return bb.and_(_scale_byte(bb, h, j + 4, k), k(63))
        return bb.or_(bb.lshr(_scale_byte(bb, h, j + 4, k), k(4)),
                      bb.and_(bb.lshr(_scale_byte(bb, h, j, k), k(2)), k(48)))
    return bb.or_(mn(2 * p), bb.shl(mn(2 * p + 1), k(16)))


def q6_scale(bb, h, g, k):
    """Group g's int8 scale of a Q6_K block whose 16 scale bytes are 4 16-lane dwords h, sign-extended to i32."""
    return bb.ashr(bb.shl(h[g // 4], k(24 - 8 * (g % 4))), k(24))


def q6_value(bb, ql, qh, h, c, g, k):
    """Dword g of a Q6_K block's values 128h + 32c.. as 6-bit unsigned bytes (the low 4 bits from ql's dword
    16h + 8(c % 2) + g, the high 2 from qh's dword 8h + g), from its 32 ql and 16 qh dwords (16 rows as lanes)."""
    low = bb.and_(bb.lshr(ql[16 * h + 8 * (c % 2) + g], k(4 * (c // 2))), k(0x0F0F0F0F))
    high = bb.and_(bb.lshr(qh[8 * h + g], k(2 * c)), k(0x03030303))
    return bb.or_(low, bb.shl(high, k(4)))


@intrinsic
def k_header(typingctx, raw, r0, off, b, SC, MN, DD, DM):
    """A Q4_K / Q5_K block's 16 header bytes at off (d, dmin, the 12 packed 6-bit scales and mins) of rows r0..r0+R
    -> SC[(8b + j)*R + r] = sub-block j's scale, MN[(4b + p)*R + r] = mins 2p | 2p+1 << 16, DD/DM[b*R + r] = d, dmin:
    blocks._k_scale_min on 16 rows as lanes."""
    sig = types.void(raw, r0, off, b, SC, MN, DD, DM)

    def codegen(context, builder, signature, args):
        t = _Tile(context, builder, signature, args)
        t.store_k_header(t.idx(3), t.cols32(t.idx(2), 4), 4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def q6_header(typingctx, raw, r0, off, b, SC, SP, DD):
    """A Q6_K block's scales (16 int8 at off + 192) and d (f16 at off + 208) of rows r0..r0+R -> SC[(16b + g)*R + r]
    = group g's scale, SP[(8b + p)*R + r] = scales 2p | 2p+1 << 16 (i16), DD[b*R + r] = d."""
    sig = types.void(raw, r0, off, b, SC, SP, DD)

    def codegen(context, builder, signature, args):
        t = _Tile(context, builder, signature, args)
        bb = builder
        o = t.idx(2)
        h = t.cols32(bb.add(o, t.c(192)), 4)             # bytes 192..207: the scales
        dw = t.cols32(bb.add(o, t.c(194)), 4)[3]         # bytes 206..209: d in the high half
        t.store_q6_header(t.idx(3), h, t.f16(bb.lshr(dw, t.k(16))), 4)
        return context.get_dummy_value()
    return sig, codegen


def _mk_k_values(five):
    def impl(typingctx, raw, r0, off, b, P):
        """A Q4_K / Q5_K block's 256 values (off: the block's first byte) of rows r0..r0+R, unpacked to bytes:
        P[(64b + 8j + g)*R + r] = dword g of sub-block j's 32 values (the nibble, plus 16 for Q5_K's fifth bit)."""
        sig = types.void(raw, r0, off, b, P)

        def codegen(context, builder, signature, args):
            t = _Tile(context, builder, signature, args)
            bb = builder
            o, blk = t.idx(2), t.idx(3)
            qs = 48 if five else 16
            q = t.cols(bb.add(o, t.c(qs))) + t.cols(bb.add(o, t.c(qs + 64)))      # dword 8c + g of the 128 bytes
            qh = t.cols(bb.add(o, t.c(16)))[:8] if five else None                   # the fifth bits' 8 dwords
            t.store_k_values(blk, q, 4, qh)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


q4_k_values, q5_k_values = _mk_k_values(False), _mk_k_values(True)


@intrinsic
def q6_values(typingctx, raw, r0, off, b, P):
    """A Q6_K block's 256 values (off: the block's first byte) of rows r0..r0+R as their 6-bit unsigned bytes:
    P[(64b + 32h + 8c + g)*R + r] = dword g of the values 128h + 32c.. (low 4 bits from ql, high 2 from qh)."""
    sig = types.void(raw, r0, off, b, P)

    def codegen(context, builder, signature, args):
        t = _Tile(context, builder, signature, args)
        o = t.idx(2)
        ql = t.cols(o) + t.cols(builder.add(o, t.c(64)))     # dword q of ql's 128 bytes
        qh = t.cols(builder.add(o, t.c(128)))                # dword q of qh's 64
        t.store_q6_values(t.idx(3), ql, qh, 4)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True)
def prep_q45_k(raw, r0, nb, five, P, SC, MN, DD, DM):
    # rows r0..r0+R of a Q4_K (Q5_K: five) matrix -> P[(64b + 8j + g)*R + r] = dword g of sub-block j's 32 values as
    # bytes (nibbles split once here, not in every pass of the micro-kernel; Q5_K's fifth bit added), SC[(8b + j)*R + r]
    # = sub-block j's 6-bit scale, MN[(4b + p)*R + r] = mins 2p | 2p+1 << 16, DD/DM[b*R + r] = d, dmin
    size = 176 if five else 144
    for b in range(nb):
        o = b * size
        if five:
            q5_k_values(raw, r0, o, b, P)
        else:
            q4_k_values(raw, r0, o, b, P)
        k_header(raw, r0, o, b, SC, MN, DD, DM)


@intrinsic
def x16_block(typingctx, raw, r0, b, P, SC, MN, DD, DM):
    """Block b of the Q4_K_X16 tile at row r0 (vector q at dword (36b + q) * R of the tile: blocks.to_x16) -> the same
    P, SC, MN, DD, DM as prep_q45_k's for the Q4_K rows it holds, with no transpose: the tile's vectors are already
    the rows as lanes."""
    sig = types.void(raw, r0, b, P, SC, MN, DD, DM)

    def codegen(context, builder, signature, args):
        t = _Tile(context, builder, signature, args)
        bb = builder
        blk = t.idx(2)
        tile = bb.bitcast(bb.gep(t.base, [bb.mul(t.r0, t.stride)]), _v16.as_pointer())
        ptrs = [bb.gep(tile, [bb.add(bb.mul(blk, t.c(36)), t.c(q))]) for q in range(36)]
        h = [bb.load(p, align=4) for p in ptrs]
        # the next tile's same bytes into L2, as prep_q45_k asks for them
        prefetch_ahead(bb, ptrs, bb.mul(t.stride, ir.Constant(_idx, R)), ahead=0)
        t.store_k_header(blk, h[:4], 4)
        t.store_k_values(blk, h[4:], 3)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True)
def prep_x16(raw, r0, nb, P, SC, MN, DD, DM):
    # the Q4_K_X16 tile at row r0 -> prep_q45_k's panel of its rows (blocks_gemm.X16_PANEL_MIN_ROWS)
    for b in range(nb):
        x16_block(raw, r0, b, P, SC, MN, DD, DM)


Q6_WORDS = 52             # a Q6_K block's 208 bytes before its d, as dwords


def q6x_ptr(builder, base, blk, q):
    """Byte pointer of vector q of block blk of a Q6_K_X16 tile (base: its first byte, i8*; blocks.to_x16): vector q
    (dword q of the 16 rows: ql 0..31, qh 32..47, the scales 48..51) at byte 3360 blk + 64q, the rows' 16 d (f16) at
    q = Q6_WORDS."""
    bb = builder
    return bb.gep(base, [bb.add(bb.mul(blk, ir.Constant(_idx, R * 210)), ir.Constant(_idx, 64 * q))])


def q6x_d(builder, p):
    """The 16 rows' d at byte pointer p (q6x_ptr's q = Q6_WORDS) -> <16 x float> (exact)."""
    bb = builder
    h = bb.load(bb.bitcast(p, ir.VectorType(ir.IntType(16), R).as_pointer()), align=2)
    return bb.fpext(bb.bitcast(h, ir.VectorType(ir.HalfType(), R)), ir.VectorType(ir.FloatType(), R))


@intrinsic
def x16_q6_block(typingctx, raw, r0, b, P, SC, SP, DD):
    """Block b of the Q6_K_X16 tile at row r0 -> the same P, SC, SP, DD as prep_q6_k's for the Q6_K rows it holds,
    with no transpose."""
    sig = types.void(raw, r0, b, P, SC, SP, DD)

    def codegen(context, builder, signature, args):
        t = _Tile(context, builder, signature, args)
        bb = builder
        blk = t.idx(2)
        base = bb.gep(t.base, [bb.mul(t.r0, t.stride)])
        ptrs = [q6x_ptr(bb, base, blk, q) for q in range(Q6_WORDS)]
        h = [bb.load(bb.bitcast(p, _v16.as_pointer()), align=4) for p in ptrs]
        ql, qh, sc, d = h[:32], h[32:48], h[48:], q6x_d(bb, q6x_ptr(bb, base, blk, Q6_WORDS))
        prefetch_ahead(bb, ptrs, bb.mul(t.stride, ir.Constant(_idx, R)), ahead=0)
        t.store_q6_header(blk, sc, d, 4)
        t.store_q6_values(blk, ql, qh, 3)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True)
def prep_x16_q6(raw, r0, nb, P, SC, SP, DD):
    # the Q6_K_X16 tile at row r0 -> prep_q6_k's panel of its rows
    for b in range(nb):
        x16_q6_block(raw, r0, b, P, SC, SP, DD)


@njit(cache=True, inline="always")
def q6_panel(tmp, nb):
    # prep_q6_k's arrays for nb blocks in a tile's f32 scratch tmp: P, SC, SP (i32 views), DD, and the rest of tmp
    w = tmp.view(np.int32)
    return w[:nb * 1024], w[nb * 1024:nb * 1280], w[nb * 1280:nb * 1408], tmp[nb * 1408:nb * 1424], tmp[nb * 1424:]


@njit(cache=True)
def prep_q6_k(raw, r0, nb, P, SC, SP, DD):
    # rows r0..r0+R of a Q6_K matrix -> P[(64b + 32h + 8c + g)*R + r] = dword g of values 128h + 32c.. as 6-bit bytes,
    # SC[(16b + g)*R + r] = group g's int8 scale, SP[(8b + p)*R + r] = scales 2p | 2p+1 << 16 (i16), DD[b*R + r] = d
    for b in range(nb):
        o = b * 210
        q6_values(raw, r0, o, b, P)
        q6_header(raw, r0, o, b, SC, SP, DD)


FLIP = -0x7F7F7F80         # 0x80808080: Q8_0's int8 values + 128 as u8 (vpdpbusd's unsigned side)


def _mk_b32_block(nibbles):
    def impl(typingctx, raw, r0, off, b, P, DD):
        """A Q8_0 (Q4_0: nibbles) block at byte off of rows r0..r0+R -> P[(nd*b + g)*R + r] = dword g of its nd = 8
        value dwords, each byte + 128 (Q4_0: nd = 4 dwords of nibbles, as they are), DD[b*R + r] = d."""
        sig = types.void(raw, r0, off, b, P, DD)

        def codegen(context, builder, signature, args):
            t = _Tile(context, builder, signature, args)
            bb = builder
            nd = 4 if nibbles else 8
            o, blk = t.idx(2), t.idx(3)
            cols = t.cols32(bb.add(o, t.c(2)), nd)
            for g in range(nd):
                v = cols[g] if nibbles else bb.xor(cols[g], t.k(FLIP))
                t.store(4, bb.mul(bb.add(bb.mul(blk, t.c(nd)), t.c(g)), t.c(R)), v)
            t.store(5, bb.mul(blk, t.c(R)), t.f16_at(o))
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(impl)


q8_0_block, q4_0_block = _mk_b32_block(False), _mk_b32_block(True)


@njit(cache=True)
def prep_b32(raw, r0, nb, nibbles, P, DD):
    # rows r0..r0+R of a Q8_0 (Q4_0: nibbles) matrix -> P[(w*b + g)*R + r] = dword g of block b's w = 8 value
    # dwords, each byte + 128 (Q4_0: w = 4 dwords of nibbles, as they are), DD[b*R + r] = d
    size = 18 if nibbles else 34
    for b in range(nb):
        if nibbles:
            q4_0_block(raw, r0, b * size, b, P, DD)
        else:
            q8_0_block(raw, r0, b * size, b, P, DD)
