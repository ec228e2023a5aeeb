"""Tiled attention over the paged KV pool: blocks of query rows against tiles of keys, an online softmax.

The rows of a serving step (kernels/paged's layout: every row carries its sequence's block table and
its absolute position) are grouped into query blocks: up to QROWS consecutive rows of one sequence
at consecutive positions. A block and one kv head make a work item; its query vectors are the block's
rows times the kv head's query heads (H/Hkv; latent attention: all H on its one kv head). Keys are
taken TILE at a time, converted once from the pool (f16 bits or f32) for every query vector of the
item, and each vector keeps a running max, sum and weighted sum of values (the online softmax of
flash attention): the full score matrix never exists, and a tile wholly after every row of the block
(causal) or before every row's window is never read.

Keys are cut at fixed absolute positions: tiles at multiples of TILE, segments at multiples of
SEGMENT. Within a segment the tiles run in order; each segment ends in its own (max, sum, weighted
sum), and the segments are merged in position order. A long sequence decoding alone splits over
the threads by segments (split-K): each segment's partial is computed on any thread, then merged
in the same order. Every element is one fixed chain of operations (attn_ir's tile kernels: one fma
chain per score and per weighted sum; the softmax and merges without fastmath), and a key a row does
not see adds exact zeros, so a row's bits depend on its own position and keys only: not on the
rows beside it, the chunking of its prompt, the blocks, the split or the threads.

A row alone in its block (a decoding sequence) on f16 pools takes row_ir's kernels instead (_segment_row):
the keys and values are widened in registers straight from the pool, every load shared by the kv head's
query heads, 16 lanes at work; each element's chain of operations is the tile kernels', so the bits are too.

Values may be narrower than keys (out's head dim below hd): latent attention passes the key pool
as the value pool too, a row's values the first out.shape[-1] dims of its key row. sinks (H,) f32:
per-head logits in every softmax's sum (GPT-OSS), or size 0. window > 0: position p sees
p - window + 1 .. p.

Legend: N rows, H heads, Hkv kv heads, g = H/Hkv, hd key dims, dv value dims, NB blocks, BS positions
per block; a query vector i of an item is (row i // gh, head h0 + i % gh).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..numba_link import by_reference
from .attn_ir import HAVE_ATTN_IR, TILE_LANES, tile_exp, tile_max, tile_scores, tile_scores8, tile_wsum
from .base import expf, to_f32
from .row_ir import HAVE_ROW_IR, row_exp, row_max, row_prefetch, row_scores, row_wsum

TILE = 64          # keys converted at once and scored against every query vector of an item
SEGMENT = 512      # positions per split-K segment (a multiple of TILE): a row's merge points
QROWS = 16         # query rows per block at most: 16 rows x 4 heads = 64 query vectors for GQA 4:1
QVECS = 64         # query vectors per block at most (latent attention's 16 heads: 4 rows), so the item's
                   # query columns and weighted sums stay near L1
SPLIT_MAX_FLOATS = 1 << 24   # partials of a split call (64 MiB); beyond it items run whole

__all__ = ["SEGMENT", "TILE", "QROWS", "tiled_attention", "tiled_attention_par", "query_blocks"]

_NEG_INF = np.float32(-np.inf)


@njit(cache=True, inline="always")
def _padl(n):
    # n rounded up to the tile kernels' lanes (8 or 16: attn_ir.TILE_LANES); 8 for up to 8
    if n <= 8:
        return 8
    return _padv(n)


@njit(cache=True, inline="always")
def _padv(n):
    # value dims rounded up to the tile kernels' lanes
    return (n + TILE_LANES - 1) // TILE_LANES * TILE_LANES


@njit(cache=True)
def _checked(q, kpool, vpool, out, tables, row_pos):
    if q.shape[1] % kpool.shape[1] != 0:
        raise ValueError("paged attention: H must be a multiple of Hkv")
    if q.shape[2] != kpool.shape[3] or out.shape[2] > vpool.shape[3]:
        raise ValueError("paged attention: head dims of q, the pools and out disagree")
    maxp = 1
    for r in range(q.shape[0]):
        maxp = max(maxp, row_pos[r] + 1)
    if (maxp + kpool.shape[2] - 1) // kpool.shape[2] > tables.shape[1]:
        raise ValueError("paged attention: a position beyond its block table")


@njit(cache=True)
def query_blocks(row_seq, row_pos, qrows):
    # (nb, 2) [first row, end row) of each query block: runs of rows of one sequence at consecutive
    # positions, cut every qrows rows
    N = row_seq.shape[0]
    out = np.empty((N, 2), np.int64)
    nb = 0
    r = 0
    while r < N:
        e = r + 1
        while e < N and e - r < qrows and row_seq[e] == row_seq[r] and row_pos[e] == row_pos[e - 1] + 1:
            e += 1
        out[nb, 0] = r
        out[nb, 1] = e
        nb += 1
        r = e
    return out[:nb]


@njit(cache=True)
def _first(p, window):
    if window > 0 and p - window + 1 > 0:
        return p - window + 1
    return 0


@njit(cache=True)
def _load_rows(pool, table, kh, k0, n, dst):
    # positions k0..k0+n-1 of kv head kh -> dst (>= n, >= d) f32, the first d = dst.shape[1] dims of each
    # (the columns beyond the pool's stay zero); a block's rows at once
    BS, hd = pool.shape[2], pool.shape[3]
    d = min(dst.shape[1], hd)
    flat = dst.shape[1] == hd
    j = 0
    while j < n:
        p = k0 + j
        o = p % BS
        cnt = min(BS - o, n - j)
        src = pool[table[p // BS], kh]
        if flat:
            s1 = src.reshape(BS * hd)[o * hd:(o + cnt) * hd]
            d1 = dst[j:j + cnt].reshape(cnt * hd)
            for e in range(cnt * hd):
                d1[e] = to_f32(s1[e])
        else:
            for r in range(cnt):
                sr = src[o + r]
                dr = dst[j + r]
                for c in range(d):
                    dr[c] = to_f32(sr[c])
        j += cnt


@njit(cache=True)
def _scores(Kt, n, Qt, St):
    # St[:n] = Kt[:n] @ Qt: attn_ir's tile kernel (8 lanes for an item of 8 query vectors or fewer: the same
    # chains), or the same chains (mul and add, not fused) without it
    if HAVE_ATTN_IR:
        if Qt.shape[1] == 8:
            tile_scores8(Kt, n, Qt, St)
        else:
            tile_scores(Kt, n, Qt, St)
        return
    d, nq = Qt.shape
    for j in range(n):
        s = St[j]
        for i in range(nq):
            s[i] = 0.0
        k = Kt[j]
        for c in range(d):
            kc = k[c]
            qc = Qt[c]
            for i in range(nq):
                s[i] += kc * qc[i]


@njit(cache=True)
def _wsum(P, n, Vt, A):
    # A += P[:n].T @ Vt[:n]
    if HAVE_ATTN_IR:
        tile_wsum(P, n, Vt, A)
        return
    nq, dv = A.shape
    for j in range(n):
        p = P[j]
        v = Vt[j]
        for i in range(nq):
            a = A[i]
            w = p[i]
            for c in range(dv):
                a[c] += w * v[c]


@njit(cache=True, error_model="numpy")
def _tile(St, n, k0, lo, hi, masked, m, l, A, tmax, ms, corr, tsum, Vt, nq):
    # one tile's scores St[:n] (keys k0..k0+n-1) into the running max m, sum l and weighted sum A of the
    # first nq query vectors (a multiple of 4; St's columns beyond them are not read): a key outside
    # [lo[i], hi[i]] weighs exactly 0
    if masked:
        for j in range(n):
            s = St[j]
            p = k0 + j
            for i in range(nq):
                if p < lo[i] or p > hi[i]:
                    s[i] = _NEG_INF
    nqp = St.shape[1]
    if HAVE_ATTN_IR:
        tile_max(St, n, tmax)
    else:
        for i in range(nqp):
            tmax[i] = _NEG_INF
        for j in range(n):
            s = St[j]
            for i in range(nqp):
                tmax[i] = max(tmax[i], s[i])
    for i in range(nqp):
        mn = max(m[i], tmax[i])
        ms[i] = mn if mn != _NEG_INF else np.float32(0.0)
        corr[i] = expf(m[i] - ms[i])
        m[i] = mn
    if HAVE_ATTN_IR:
        tile_exp(St, n, ms, tsum)
    else:
        for i in range(nqp):
            tsum[i] = 0.0
        for j in range(n):
            s = St[j]
            for i in range(nqp):
                e = expf(s[i] - ms[i])
                s[i] = e
                tsum[i] += e
    dv = A.shape[1]
    for i in range(nq):
        l[i] = l[i] * corr[i] + tsum[i]
        a = A[i]
        cr = corr[i]
        for c in range(dv):
            a[c] *= cr
    _wsum(St, n, Vt, A[:nq])


@njit(cache=True, error_model="numpy")
def _merge(M, L, A, m, l, acc):
    # (M, L, A) <- (M, L, A) then the segment (m, l, acc), per query vector; an empty segment (m = -inf)
    # leaves it as it is
    for i in range(M.shape[0]):
        if m[i] == _NEG_INF:
            continue
        if M[i] == _NEG_INF:
            M[i] = m[i]
            L[i] = l[i]
            A[i, :] = acc[i]
            continue
        mn = max(M[i], m[i])
        a = expf(M[i] - mn)
        b = expf(m[i] - mn)
        L[i] = L[i] * a + l[i] * b
        Ai = A[i]
        ai = acc[i]
        for c in range(Ai.shape[0]):
            Ai[c] = Ai[c] * a + ai[c] * b
        M[i] = mn


@njit(cache=True)
def _scratch(hd, dvp, nqp):
    # an item's buffers for up to nqp query vectors, flat: _fit cuts C-contiguous arrays for one item
    # (Qt, Kt, Vt, St, vec: m l tmax ms corr tsum of a segment and M L of the item, acc, bounds: lo hi)
    # and rs, the row path's (_segment_row): key offsets, KT, S, Q4 of up to nqp heads
    Kt = np.empty((TILE, hd), np.float32)
    Vt = np.zeros((TILE, dvp), np.float32)
    hg = (nqp + 3) // 4
    rs = (np.empty((2, TILE), np.int64), np.empty((TILE // 4, hd, 4), np.float32), np.empty((hg, TILE, 4), np.float32),
          np.empty((hg, hd, 16), np.float32))
    return (np.empty(hd * nqp, np.float32), Kt, Vt, np.empty(TILE * nqp, np.float32), np.empty(8 * nqp, np.float32),
            np.empty(nqp * dvp, np.float32), np.empty(2 * nqp, np.int64), rs)


def _row_pools(kpool, vpool):
    """True when the row path runs on these pools: both f16 bits and the row kernels compiled (row_ir)."""
    return False


@overload(_row_pools, inline="always")
def _row_pools_overload(kpool, vpool):
    ok = HAVE_ROW_IR and kpool.dtype == types.uint16 and vpool.dtype == types.uint16
    return lambda kpool, vpool: ok


@njit(cache=True)
def _row_offs(table, kh, Hkv, BS, hd, k0, k1, offs):
    # offs[j] = the element offset in a pool layer of key k0 + j's row (kv head kh), j < k1 - k0, repeated to a
    # multiple of 4; returns k1 - k0
    n = k1 - k0
    for j in range(n):
        p = k0 + j
        offs[j] = ((table[p // BS] * Hkv + kh) * BS + p % BS) * hd
    for j in range(n, (n + 3) // 4 * 4):
        offs[j] = offs[n - 1]
    return n


@njit(cache=True, error_model="numpy")
def _segment_row(kpool, vpool, table, kh, gh, s, sc):
    # _segment for one row's gh query heads on f16 pools (head dims and value columns multiples of 16): row_ir's
    # kernels read the pool's rows in place, 4 heads x 4 keys a vector; every element is the tile path's chain
    Qt, Kt, Vt, St, vec, acc, bounds, rs = sc
    offs, KT, S, Q4 = rs
    m, l, tmax, ms, corr, tsum = vec[0], vec[1], vec[2], vec[3], vec[4], vec[5]
    k0 = max(s * SEGMENT, bounds[0, 0])
    k1 = min((s + 1) * SEGMENT, bounds[1, 0] + 1)
    if k1 <= k0:
        return False
    Hkv, BS, hd = kpool.shape[1], kpool.shape[2], kpool.shape[3]
    hg = (gh + 3) // 4
    g4 = 4 * hg
    Sh, Qh = S[:hg], Q4[:hg]
    for h in range(hg):
        for c in range(hd):
            for r in range(4):
                v = Qt[c, 4 * h + r] if 4 * h + r < gh else np.float32(0.0)
                for t in range(4):
                    Qh[h, c, 4 * r + t] = v
    m[:] = _NEG_INF
    l[:] = 0.0
    A = acc[:g4]
    A[:] = 0.0
    t = k0 // TILE * TILE
    _row_offs(table, kh, Hkv, BS, hd, max(t, k0), min(t + TILE, k1), offs[0])
    cur = 0
    while t < k1:
        ks, ke = max(t, k0), min(t + TILE, k1)
        n = ke - ks
        if t + TILE < k1:           # the next tile's rows on their way while this one is computed
            nn = _row_offs(table, kh, Hkv, BS, hd, t + TILE, min(t + 2 * TILE, k1), offs[1 - cur])
            row_prefetch(kpool, offs[1 - cur], nn, 2 * hd)
            row_prefetch(vpool, offs[1 - cur], nn, 2 * acc.shape[1])
        o = offs[cur]
        cur = 1 - cur
        row_scores(kpool, o, n, KT, Qh, Sh)
        row_max(Sh, n, tmax)
        for i in range(g4):
            mn = max(m[i], tmax[i])
            ms[i] = mn if mn != _NEG_INF else np.float32(0.0)
            corr[i] = expf(m[i] - ms[i])
            m[i] = mn
        row_exp(Sh, n, ms)
        row_wsum(Sh, n, vpool, o, A, corr, tsum)
        for i in range(g4):
            l[i] = l[i] * corr[i] + tsum[i]
        t += TILE
    return True


@by_reference          # its tiles' loads, scores and softmax (~17 functions): compiled once, not into each caller
@njit(cache=True)
def _segment(kpool, vpool, table, kh, rows, gh, s, sc):
    # segment s's partial of an item's query vectors (_prepare's: rows x gh, on kv head kh of the sequence
    # whose blocks are `table`): leaves (m, l, acc) in the scratch sc; returns False when no vector of the
    # item sees a key of the segment (nothing computed). One row from f16 pools: _segment_row, the same bits
    Qt, Kt, Vt, St, vec, acc, bounds, rs = sc
    if rows == 1 and _row_pools(kpool, vpool) and kpool.shape[3] % 16 == 0 and acc.shape[1] % 16 == 0:
        return _segment_row(kpool, vpool, table, kh, gh, s, sc)
    nq = rows * gh
    lo, hi = bounds[0], bounds[1]
    m, l, tmax, ms, corr, tsum = vec[0], vec[1], vec[2], vec[3], vec[4], vec[5]
    nq4 = (nq + 3) // 4 * 4
    nqp = Qt.shape[1]
    lo_min, hi_max = lo[0], hi[nq - 1]
    for i in range(nq):
        lo_min = min(lo_min, lo[i])
        hi_max = max(hi_max, hi[i])
    k0 = max(s * SEGMENT, lo_min)
    k1 = min((s + 1) * SEGMENT, hi_max + 1)
    if k1 <= k0:
        return False
    lo_max, hi_min = lo[0], hi[0]
    for i in range(nq):
        lo_max = max(lo_max, lo[i])
        hi_min = min(hi_min, hi[i])
    for i in range(nqp):
        m[i] = _NEG_INF
        l[i] = 0.0
    acc[:] = 0.0
    t = k0 // TILE * TILE
    while t < k1:
        ks, ke = max(t, k0), min(t + TILE, k1)
        n = ke - ks
        _load_rows(kpool, table, kh, ks, n, Kt)
        _load_rows(vpool, table, kh, ks, n, Vt)
        _scores(Kt, n, Qt, St)
        masked = ks < lo_max or ke - 1 > hi_min
        _tile(St, n, ks, lo, hi, masked, m, l, acc, tmax, ms, corr, tsum, Vt, nq4)
        t += TILE
    return True


@njit(cache=True)
def _prepare(q, row_pos, r0, r1, kh, gh, h0, window, scale, sc):
    # the item's query columns Qt (hd, nqp) = scale * q of each vector (padding lanes zero) and each
    # vector's key range [lo, hi] (padding lanes: the first vector's)
    Qt, Kt, Vt, St, vec, acc, bounds, rs = sc
    nq = (r1 - r0) * gh
    hd = q.shape[2]
    for i in range(Qt.shape[1]):
        if i < nq:
            r = r0 + i // gh
            qr = q[r, h0 + i % gh]
            for c in range(hd):
                Qt[c, i] = qr[c] * np.float32(scale)
            p = row_pos[r]
        else:
            for c in range(hd):
                Qt[c, i] = 0.0
            p = row_pos[r0]
        bounds[0, i] = _first(p, window)
        bounds[1, i] = p


@njit(cache=True, error_model="numpy")
def _finish(M, L, A, sinks, r0, gh, h0, nq, out):
    # (M, L, A) -> out rows: A / (L + the sink's weight)
    dv = out.shape[2]
    for i in range(nq):
        h = h0 + i % gh
        Li = L[i]
        s = np.float32(1.0)
        if sinks.shape[0] > 0:
            mn = max(M[i], sinks[h])
            a = expf(M[i] - mn)
            Li = Li * a + expf(sinks[h] - mn)
            s = a
        inv = np.float32(1.0) / Li
        o = out[r0 + i // gh, h]
        Ai = A[i]
        for c in range(dv):
            o[c] = (Ai[c] * s) * inv


@njit(cache=True)
def _item(q, kpool, vpool, table, row_pos, r0, r1, kh, h0, gh, window, scale, sinks, out, sc, total):
    # one work item whole: every segment of its keys in order, merged, written to out
    nq = (r1 - r0) * gh
    _prepare(q, row_pos, r0, r1, kh, gh, h0, window, scale, sc)
    Qt, Kt, Vt, St, vec, acc, bounds, rs = sc
    M, L, A = vec[6], vec[7], total
    M[:] = _NEG_INF
    L[:] = 0.0
    s_first = _first(row_pos[r0], window) // SEGMENT
    s_last = row_pos[r1 - 1] // SEGMENT
    for s in range(s_first, s_last + 1):
        if _segment(kpool, vpool, table, kh, r1 - r0, gh, s, sc):
            _merge(M, L, A, vec[0], vec[1], acc)
    _finish(M, L, A, sinks, r0, gh, h0, nq, out)


@njit(cache=True)
def _qrows(g):
    # rows per query block for g query heads per kv head
    return max(1, min(QROWS, QVECS // g))


@njit(cache=True)
def _items(q, kpool, row_seq, row_pos, qrows, chunks):
    # the work items (block first row, end row, kv head, first head, heads) and each one's cost
    blocks = query_blocks(row_seq, row_pos, qrows)
    Hkv = kpool.shape[1]
    g = q.shape[1] // Hkv
    per = (g + chunks - 1) // chunks
    n = blocks.shape[0] * Hkv * chunks
    items = np.empty((n, 5), np.int64)
    cost = np.empty(n, np.int64)
    k = 0
    for b in range(blocks.shape[0]):
        r0, r1 = blocks[b, 0], blocks[b, 1]
        for kh in range(Hkv):
            for c in range(chunks):
                h0 = kh * g + c * per
                gh = min(per, kh * g + g - h0)
                if gh <= 0:
                    continue
                items[k, 0], items[k, 1], items[k, 2], items[k, 3], items[k, 4] = r0, r1, kh, h0, gh
                cost[k] = (r1 - r0) * gh * (row_pos[r1 - 1] + 1)
                k += 1
    return items[:k], cost[:k]


@njit(cache=True)
def tiled_attention(q, kpool, vpool, tables, row_seq, row_pos, window, scale, out, sinks):
    # q (N,H,hd) f32 rows of a step, kpool/vpool (NB,Hkv,BS,hd) f32 or f16 bits, tables (S,maxb) i32,
    # row_seq (N,) index into tables, row_pos (N,) absolute positions -> out (N,H,dv), dv <= hd
    _checked(q, kpool, vpool, out, tables, row_pos)
    g = q.shape[1] // kpool.shape[1]
    qrows = _qrows(g)
    items, _ = _items(q, kpool, row_seq, row_pos, qrows, 1)
    dvp = _padv(out.shape[2])
    sc = _scratch(q.shape[2], dvp, _padl(qrows * g))
    total = np.empty((_padl(qrows * g), dvp), np.float32)
    for k in range(items.shape[0]):
        r0, r1, kh, h0, gh = items[k, 0], items[k, 1], items[k, 2], items[k, 3], items[k, 4]
        _item(q, kpool, vpool, tables[row_seq[r0]], row_pos, r0, r1, kh, h0, gh, window, scale, sinks, out,
              _fit(sc, q.shape[2], (r1 - r0) * gh), total[:_padl((r1 - r0) * gh)])


@njit(cache=True)
def _fit(sc, hd, nq):
    # the scratch as C-contiguous arrays for nq query vectors (padded to the lanes): the tile kernels run over
    # exactly these lanes
    Qt, Kt, Vt, St, vec, acc, bounds, rs = sc
    n = _padl(nq)
    dvp = Vt.shape[1]
    return (Qt[:hd * n].reshape((hd, n)), Kt, Vt, St[:TILE * n].reshape((TILE, n)), vec[:8 * n].reshape((8, n)),
            acc[:n * dvp].reshape((n, dvp)), bounds[:2 * n].reshape((2, n)), rs)


@njit(cache=True)
def _assign(cost, threads):
    # items to threads, the costliest first to the least loaded (longest processing time first):
    # (threads, n) item lists, -1 padded
    order = np.argsort(-cost)
    load = np.zeros(threads, np.int64)
    lists = np.full((threads, cost.shape[0]), -1, np.int64)
    fill = np.zeros(threads, np.int64)
    for k in order:
        t = np.argmin(load)
        lists[t, fill[t]] = k
        fill[t] += 1
        load[t] += cost[k]
    return lists


@njit(cache=True, parallel=True)
def tiled_attention_par(q, kpool, vpool, tables, row_seq, row_pos, window, scale, out, sinks, threads):
    # tiled_attention on `threads` Numba threads, the same bits. Enough items (query blocks x kv heads):
    # each thread runs whole items (balanced by their cost). Few (a sequence or two decoding): the kv
    # heads' query heads split into chunks and each item's segments run on any thread (split-K), then
    # each item's partials are merged in segment order.
    _checked(q, kpool, vpool, out, tables, row_pos)
    Hkv = kpool.shape[1]
    g = q.shape[1] // Hkv
    qrows = _qrows(g)
    blocks = query_blocks(row_seq, row_pos, qrows)
    base = blocks.shape[0] * Hkv
    chunks = 1
    if base < threads:
        chunks = min(g, (threads + base - 1) // base)
    items, cost = _items(q, kpool, row_seq, row_pos, qrows, chunks)
    n = items.shape[0]
    dvp = _padv(out.shape[2])
    hd = q.shape[2]
    nqp_max = _padl(qrows * g)
    # split-K: segments of every item as units
    nseg = np.zeros(n + 1, np.int64)
    for k in range(n):
        r0, r1 = items[k, 0], items[k, 1]
        nseg[k + 1] = nseg[k] + row_pos[r1 - 1] // SEGMENT - _first(row_pos[r0], window) // SEGMENT + 1
    units = nseg[n]
    split = n < 2 * threads and units > n and units * nqp_max * (dvp + 2) <= SPLIT_MAX_FLOATS
    if not split:
        lists = _assign(cost, threads)
        for t in prange(threads):
            sc = _scratch(hd, dvp, nqp_max)
            total = np.empty((nqp_max, dvp), np.float32)
            for x in range(lists.shape[1]):
                k = lists[t, x]
                if k < 0:
                    break
                r0, r1, kh, h0, gh = items[k, 0], items[k, 1], items[k, 2], items[k, 3], items[k, 4]
                nq = (r1 - r0) * gh
                _item(q, kpool, vpool, tables[row_seq[r0]], row_pos, r0, r1, kh, h0, gh, window, scale, sinks,
                      out, _fit(sc, hd, nq), total[:_padl(nq)])
        return
    nqs = np.empty(n, np.int64)
    for k in range(n):
        nqs[k] = _padl((items[k, 1] - items[k, 0]) * items[k, 4])
    pm = np.empty((units, nqp_max), np.float32)
    pl = np.empty((units, nqp_max), np.float32)
    pa = np.empty((units, nqp_max, dvp), np.float32)
    done = np.zeros(units, np.bool_)
    per = (units + threads - 1) // threads
    for t in prange(threads):
        sc = _scratch(hd, dvp, nqp_max)
        k = 0
        for u in range(t * per, min(units, (t + 1) * per)):
            while nseg[k + 1] <= u:
                k += 1
            r0, r1, kh, h0, gh = items[k, 0], items[k, 1], items[k, 2], items[k, 3], items[k, 4]
            nq = nqs[k]
            s = _first(row_pos[r0], window) // SEGMENT + u - nseg[k]
            scf = _fit(sc, hd, (r1 - r0) * gh)
            if u == t * per or nseg[k] == u:
                _prepare(q, row_pos, r0, r1, kh, gh, h0, window, scale, scf)
            if _segment(kpool, vpool, tables[row_seq[r0]], kh, r1 - r0, gh, s, scf):
                vec, acc = scf[4], scf[5]
                pm[u, :nq] = vec[0]
                pl[u, :nq] = vec[1]
                pa[u, :nq] = acc
                done[u] = True
    for k in prange(n):
        r0, r1, kh, h0, gh = items[k, 0], items[k, 1], items[k, 2], items[k, 3], items[k, 4]
        nq = nqs[k]
        M = np.full(nq, _NEG_INF, np.float32)
        L = np.zeros(nq, np.float32)
        A = np.zeros((nq, dvp), np.float32)
        for u in range(nseg[k], nseg[k + 1]):
            if done[u]:
                _merge(M, L, A, pm[u, :nq], pl[u, :nq], pa[u, :nq])
        _finish(M, L, A, sinks, r0, gh, h0, (r1 - r0) * gh, out)
