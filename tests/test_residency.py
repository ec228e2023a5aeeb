"""Weights under a budget (model/residency.py, master/residency.py): what is locked, what is read
ahead, and that the answers do not change, in-process and in a memory cgroup below the model's size."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from synth_model import write_model

from colibri_server.model import Model
from colibri_server.model.prefetch import Prefetcher
from colibri_server.model.residency import (
    PAGE,
    STAT_NAMES,
    BudgetTooSmall,
    ReadAhead,
    Residency,
    expert_ranges,
    in_flight_bytes,
    resolve_budget,
)
from colibri_server.model.serving import BatchEngine

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
             num_experts=8, top_k=2, moe_intermediate_size=1024)
PROMPT = [1, 5, 9, 200, 31, 77, 1000, 4]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    p = tmp_path_factory.mktemp("res") / "small.colibri"
    write_model(p, **SMALL)
    return str(p)


def _locked_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return -1


def _greedy(m, res=None, n=12, predict=False):
    eng = BatchEngine(m, max_seqs=1, max_batch_tokens=len(PROMPT) + 1, prefix_cache=False, predict_experts=predict)
    eng.add(0, PROMPT, max_tokens=n, ignore_eos=True, temperature=0.0)
    toks = []
    while eng.has_work():
        toks += [ev.token_id for _, ev in eng.step()]
        if res is not None:
            res.rerank()
    return toks, eng


def _open_with_budget(path, frac, chunk=PAGE):
    """The model at `path` under a budget of `frac` of its size, locked in pieces of `chunk` bytes (the small
    model's experts are 0.5 MiB slices: in 2 MiB pieces its always part would hold every one; None: the
    server's own pieces)."""
    m = Model.open(path, context=64, populate=False)
    res = Residency(m.file, m.config, int(m.file.header["file_size"] * frac), **({} if chunk is None else {"chunk": chunk}))
    try:
        res.start()
    except OSError as e:
        m.close()
        pytest.skip(f"cannot lock memory here: {e}")
    m.residency = res
    return m, res


def test_expert_ranges_cover_the_file_once(small):
    m = Model.open(small, context=32, populate=False)
    try:
        experts, always, demand = expert_ranges(m.file, m.config)
        size = m.file.header["file_size"]
        cover = np.zeros(-(-size // 4096), np.int32)
        for a, n in always + demand:
            cover[a // 4096:(a + n) // 4096] += 1
        assert cover.max() == 1                                   # always and demand never count twice
        emb = m.file.records["token_embd"]
        assert demand and demand[0][0] <= emb.offset + 4096 and sum(demand[0]) >= emb.offset + emb.size - 4096
        seen = np.zeros_like(cover)
        for row in experts:
            assert all(len(r) == 3 for r in row)                 # w1, w3, w2 of every expert
            for r in row:
                for a, n in r:
                    seen[a // 4096:(a + n) // 4096] += 1
        assert ((cover + (seen > 0)) >= 1).all()                  # every page is always's or an expert's
        # an expert's range is that expert's slice of its stack
        r = m.file.records["blk.1.ffn_down_exps"]
        each = r.size // m.config.num_experts
        a, n = experts[1][3][2]
        assert a <= r.offset + 3 * each and a + n >= r.offset + 4 * each and n < each + 2 * 4096
    finally:
        m.close()


def test_rerank_locks_the_most_routed_within_the_budget(small):
    m, res = _open_with_budget(small, 0.4)
    try:
        assert _locked_kib() * 1024 >= res.always_bytes - 4096
        L, E = res.shared.counts.shape
        counts = np.arange(1, L * E + 1, dtype=np.int64).reshape(L, E)    # every expert routed, all differ
        counts[:, 2] += 1000                                      # expert 2 of every layer, then 5 of layer 0
        counts[0, 5] += 500
        res.shared.counts[...] = counts
        fd = os.open(small, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)      # no expert in the page cache
        os.close(fd)
        missing = np.array([[res._missing(l, e) for e in range(E)] for l in range(L)])
        assert (missing > 0).sum() > L * E // 2
        res.rerank(max_swaps=1000, uncached=0)  # only what a worker just read
        assert (missing[res.shared.resident > 0] == 0).all()
        before = res.shared.resident.astype(bool).copy()
        ranked = np.where((missing > 0) & ~before, counts, -1)
        best = np.unravel_index(np.argmax(ranked), ranked.shape)
        res.rerank(max_swaps=1000)              # and one a call read from disk: the best ranked
        assert res.shared.resident[best]                          # (its 2 MiB folios may bring neighbours in)
        res.rerank(max_swaps=1000, uncached=1 << 30)
        resident = res.shared.resident.astype(bool)
        assert resident[:, 2].all() and resident[0, 5]
        assert res.locked_bytes <= res.budget
        assert 0 < resident.sum() < L * E                         # the budget cut the ranking
        assert counts[resident].min() > counts[~resident].max()   # experts of one size: the top ones
        assert res.budget - res.locked_bytes < res.expert_bytes.max()   # and as many as fit
        mask = np.zeros(res.refs.size, np.bool_)
        mask[res.always_chunks] = True
        held = np.unique(np.concatenate([res.expert_chunks[l][e] for l, e in zip(*np.nonzero(resident))]))
        assert res.always_bytes + res._cost(held, mask) == res.locked_bytes   # neighbours' shared pages counted once
        assert _locked_kib() * 1024 <= res.budget + 4096 * 8 * L * E
        # the routes move: the decayed scores give way, within the budget at every step
        res.shared.counts[:, 6] += 10_000
        res.rerank(max_swaps=1000, uncached=1 << 30)
        resident = res.shared.resident.astype(bool)
        assert resident[:, 6].all()
        assert res.locked_bytes <= res.budget
    finally:
        m.close()


def test_the_ranking_follows_the_tokens_not_the_clock(small):
    """The decayed counts halve every half_life tokens that went through the model (the routes counted, over
    top_k in each layer with experts): an idle server keeps its ranking however long it waits, and experts a
    sequence stopped using give way within a few tokens to ones it uses now, though those have fewer routes
    in all."""
    m = Model.open(small, context=64, populate=False)
    experts, always, _ = expert_ranges(m.file, m.config)
    each = sum(n for _, n in experts[0][0])
    frac = (sum(n for _, n in always) + 4.5 * each) / m.file.header["file_size"]
    m.close()
    m, res = _open_with_budget(small, frac)               # room for 4 experts
    try:
        L, E = res.shared.counts.shape
        assert res.routes_per_token == m.config.top_k * L
        res.shared.counts[:, 1] = 100                     # 100 tokens routed to experts 1 and 2 of every layer
        res.shared.counts[:, 2] = 100
        res.rerank(max_swaps=1000, uncached=1 << 30)
        first = res.shared.resident.astype(bool).copy()
        assert first.sum() == 4 and first[:, [1, 2]].sum() == 4
        score = res.score.copy()
        time.sleep(0.2)                                   # no token since: nothing decays, nothing moves
        res.rerank(max_swaps=1000, uncached=1 << 30)
        assert np.array_equal(res.score, score) and np.array_equal(res.shared.resident.astype(bool), first)
        fd = os.open(small, os.O_RDONLY)
        os.fdatasync(fd)                                  # (a dirty page stays)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)      # out of the page cache (where no folio is locked)
        os.close(fd)
        fresh = [(l, e) for l in range(L) for e in range(E) if e not in (1, 2) and res._missing(l, e)][:4]
        assert len(fresh) == 4
        # then 20 tokens (5 half-lives) route to four other experts: 40 routes each against the others' 100
        for l, e in fresh:
            res.shared.counts[l, e] += 40
        res.rerank(max_swaps=1000, uncached=0)            # none may be read now: the old ones keep their places
        assert np.array_equal(res.shared.resident.astype(bool), first)
        res.rerank(max_swaps=1000, uncached=1 << 30)
        now = res.shared.resident.astype(bool)
        assert np.allclose(res.score[:, 1], 100 * 0.5 ** (4 * 40 / res.routes_per_token / res.half_life))
        assert now.sum() == 4 and all(now[l, e] for l, e in fresh)
        assert res.locked_bytes <= res.budget
    finally:
        m.close()


def _locked_ranges(base: int):
    """[(offset into the mapping at `base`, length)] of this process's locked mappings (smaps), neighbours
    joined (other advice splits a locked range into several mappings)."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                a, b = (int(x, 16) for x in head[0].split("-"))
                cur = (a - base, b - a)
            elif head[0] == "VmFlags:" and "lo" in head[1:] and cur is not None:
                if out and out[-1][0] + out[-1][1] == cur[0]:
                    out[-1] = (out[-1][0], out[-1][1] + cur[1])
                else:
                    out.append(cur)
    return out


def test_locks_hold_whole_2mib_pieces_and_count_them(small):
    """A lock ending inside a 2 MiB page-cache folio pins that folio without counting it (mlock skips a large
    folio a locked range covers in part; reclaim cannot take it): so every lock starts and ends on a 2 MiB
    piece of the file, the budget counts the pieces, a piece two locked experts share stays locked until both
    are released, and what the kernel holds locked is what the budget counts."""
    MIB2 = 2 << 20                                     # the largest page-cache folio: a PMD
    m, res = _open_with_budget(small, 1.0, chunk=None)
    size = m.file.header["file_size"]
    base = m.file._buf.ctypes.data
    try:
        L, E = res.shared.counts.shape
        res.shared.counts[0, 3] = 50                     # two neighbours in one stack: a piece in common
        res.shared.counts[0, 4] = 40
        res.rerank(max_swaps=1000, uncached=1 << 30)
        assert res.shared.resident[0, 3] and res.shared.resident[0, 4]
        held = _locked_ranges(base)
        assert held and all(a % MIB2 == 0 and (n % MIB2 == 0 or a + n >= size) for a, n in held)
        pinned = lambda: sum(min(n, size - a) for a, n in _locked_ranges(base))      # noqa: E731
        assert pinned() == res.locked_bytes                  # what the kernel holds locked is what the budget counts
        assert res.locked_bytes <= res.budget
        shared_piece = set(res.expert_chunks[0][3].tolist()) & set(res.expert_chunks[0][4].tolist())
        assert shared_piece
        res._unlock(0, 4)                                 # expert 4 released: 3 keeps the piece they share
        locked = {c for a, n in _locked_ranges(base) for c in range(a // MIB2, -(-(a + n) // MIB2))}
        assert shared_piece <= locked and set(res.expert_chunks[0][3].tolist()) <= locked
        res._unlock(0, 3)
        locked = {c for a, n in _locked_ranges(base) for c in range(a // MIB2, -(-(a + n) // MIB2))}
        alone = set(res.expert_chunks[0][4].tolist()) - set(res.always_chunks.tolist()) - {
            c for l in range(L) for e in range(E) if res.shared.resident[l, e] for c in res.expert_chunks[l][e].tolist()}
        assert not (alone & locked)                       # a piece no lock holds is unlocked
        assert pinned() == res.locked_bytes
    finally:
        m.close()


def test_the_writer_puts_each_expert_on_whole_pieces(tmp_path):
    """The reference writer lays the expert stacks after every other tensor, a stack whose per-expert slice is a
    whole number of 2 MiB pieces starting on one: under a budget locked in 2 MiB pieces such an expert then costs
    exactly its own bytes (bench-mixtral f16's 12 MiB experts had cost up to 18), no two experts share a piece,
    and the always-resident part is one run beside the token embeddings (read on demand), not one per layer."""
    MIB2 = 2 << 20
    p = tmp_path / "pieces.colibri"
    write_model(p, **{**SMALL, "hidden_size": 512, "moe_intermediate_size": 2048, "num_layers": 2, "num_experts": 4})
    m = Model.open(str(p), context=64, populate=False)
    try:
        res = Residency(m.file, m.config, m.file.header["file_size"])
        L, E = res.expert_bytes.shape
        assert (res.expert_bytes == 3 * MIB2).all()                  # w1, w3, w2: 512 x 2048 f16 each
        seen = set(res.always_chunks.tolist())
        for l in range(L):
            for e in range(E):
                ch = res.expert_chunks[l][e]
                assert res._bytes(ch) == res.expert_bytes[l, e]        # costs its bytes: no piece edge
                assert not seen & set(ch.tolist())
                seen |= set(ch.tolist())
        runs = [(a, n) for a, n in res.always if n]
        assert len(runs) == 2 and runs[0][0] + runs[0][1] == res.demand[0][0]     # before and after token_embd
        assert res.demand[0][0] + res.demand[0][1] == runs[1][0]
        assert res.always_bytes - sum(n for _, n in res.always) < 2 * MIB2
        assert res.misplaced == []
    finally:
        m.close()


def test_a_file_with_its_experts_off_the_pieces_is_named_at_start(tmp_path, monkeypatch, caplog):
    """A file an older converter wrote (expert stacks between the layers, 64-byte aligned) still serves under a
    budget, but each locked expert holds its neighbours' pieces: the master says so once, naming the file and
    what converting it again gives."""
    import logging
    from types import SimpleNamespace

    import colibri_server.model.format as fmt
    from colibri_server.master import residency as MR
    p = tmp_path / "old-layout.colibri"
    with monkeypatch.context() as mp:
        mp.setattr(fmt, "PIECE", fmt.ALIGNMENT)          # the writer before the pieces: 64-byte alignment
        write_model(p, **{**SMALL, "hidden_size": 512, "moe_intermediate_size": 2048, "num_layers": 2, "num_experts": 4})
    m = Model.open(str(p), context=64, populate=False)
    try:
        size = m.file.header["file_size"]
        m.residency = res = Residency(m.file, m.config, size)
        assert res.misplaced and all("_exps" in n for n in res.misplaced)
        assert (res.expert_bytes > 3 * (2 << 20)).all()
        with caplog.at_level(logging.WARNING, logger="colibri.master"):
            try:
                MR.lock(m, SimpleNamespace(weights_memory=size), 0, headroom=lambda: 1 << 40)
            except OSError as e:
                pytest.skip(f"cannot lock memory here: {e}")
        said = [r.getMessage() for r in caplog.records if "2 MiB pieces" in r.getMessage()]
        assert len(said) == 1 and str(p) in said[0] and "convert" in said[0]
    finally:
        m.close()


def test_locked_experts_give_way_while_the_processes_memory_grows_and_come_back(small, caplog):
    """master/residency.tend each turn: with less memory left than the server keeps free (the workers' KV
    blocks and buffers grew after the budget was chosen), the least routed experts are released at once, as
    many bytes as the shortfall, the always-resident part kept; as the room returns they are locked again,
    never past the budget."""
    import logging

    from colibri_server.master import residency as MR
    m, res = _open_with_budget(small, 0.6)
    try:
        L, E = res.shared.counts.shape
        res.shared.counts[...] = np.arange(1, L * E + 1, dtype=np.int64).reshape(L, E)   # all differ
        res.rerank(max_swaps=1000, uncached=1 << 30)
        full = res.shared.resident.astype(bool)
        assert 0 < full.sum() < L * E and res.locked_bytes <= res.budget
        res.floor, res.next_warn, res.held_since = 64 << 20, 0.0, None           # as lock() sets them
        res.next_save = time.monotonic() + 1e9
        res.follow(1 << 40, res.floor)

        class Gen:
            model = m
        room = {"now": 1 << 40}
        gens = {1: Gen()}

        def turn():
            res.next_rerank = 0.0
            MR.tend(gens, headroom=lambda: room["now"])
            return res.shared.resident.astype(bool)

        assert (turn() == full).all() and res.ceiling == res.budget          # room above the floor: nothing moves
        short = 3 * int(res.expert_bytes.max()) // 2
        room["now"] = (64 << 20) - short
        before = res.locked_bytes
        with caplog.at_level(logging.WARNING, logger="colibri.master"):
            now = turn()
        assert before - res.locked_bytes >= short and res.locked_bytes <= res.ceiling < res.budget
        assert now.sum() < full.sum() and not (now & ~full).any()
        counts = res.shared.counts
        assert counts[now].min() > counts[full & ~now].max()                 # the least routed went first
        assert res.shared.stats[STAT_NAMES.index("ceiling")] == res.ceiling
        assert any("beside the 64 MiB the server keeps free" in r.message for r in caplog.records)
        assert _locked_kib() * 1024 <= res.ceiling + 4096 * 8 * L * E
        room["now"] = 0                                                      # nothing left: the experts all go
        assert not turn().any() and res.locked_bytes == res.always_bytes     # the always part stays locked
        room["now"] = 1 << 40                                                # the room is back: so are they
        for _ in range(4):
            turn()
        assert res.ceiling == res.budget and (res.shared.resident.astype(bool) == full).all()
    finally:
        m.close()


def test_each_live_worker_widens_the_room_kept_free(small):
    """The floor tend() keeps free is the experts each live worker reads at once: memory that left one worker
    room locks the same experts, and a second worker (TTIN, a reload's new generation beside the draining one)
    with the same memory left releases the least routed ones for its reads."""
    from colibri_server.master import residency as MR
    m, res = _open_with_budget(small, 0.6)
    try:
        L, E = res.shared.counts.shape
        res.shared.counts[...] = np.arange(1, L * E + 1, dtype=np.int64).reshape(L, E)
        res.rerank(max_swaps=1000, uncached=1 << 30)
        full = res.shared.resident.astype(bool)
        res.in_flight = in_flight_bytes(m.file, m.config)
        res.next_warn, res.held_since, res.next_save = 0.0, None, time.monotonic() + 1e9
        one_worker = MR.floor_for(res, 1)
        assert MR.floor_for(res, 2) - one_worker == res.in_flight > 0

        class Gen:
            model = m

        def turn(workers):
            res.next_rerank = 0.0
            MR.tend({1: Gen()}, headroom=lambda: one_worker, workers=workers)
            return res.shared.resident.astype(bool)
        assert (turn(1) == full).all() and res.floor == one_worker
        before = res.locked_bytes
        now = turn(2)
        assert res.floor == MR.floor_for(res, 2) and res.locked_bytes <= max(res.always_bytes, before - res.in_flight)
        assert now.sum() < full.sum() and res.locked_bytes >= res.always_bytes
    finally:
        m.close()


def test_a_saved_popular_set_locks_within_the_memory_left(small, tmp_path):
    """lock() locks a saved popular set at once, reading it from disk: within the memory left beyond the room
    the server keeps free (half of it, the rest as tend() measures again), not the whole budget."""
    import shutil
    from types import SimpleNamespace

    from colibri_server.master import residency as MR
    path = str(tmp_path / "m.colibri")
    shutil.copy(small, path)
    m = Model.open(path, context=64, populate=False)
    try:
        budget = int(m.file.header["file_size"] * 0.6)
        m.residency = Residency(m.file, m.config, budget, chunk=PAGE)
        L, E = m.config.num_layers, m.config.num_experts
        with open(MR.popular_path(path), "w") as f:
            json.dump({"identity": m.file.identity, "score": np.arange(1, L * E + 1).reshape(L, E).tolist()}, f)
        res, one = m.residency, int(m.residency.expert_bytes.max())
        floor = in_flight_bytes(m.file, m.config) + (32 << 20)
        try:
            MR.lock(m, SimpleNamespace(weights_memory=budget), 0, headroom=lambda: floor + 4 * one)
        except OSError as e:
            pytest.skip(f"cannot lock memory here: {e}")
        assert res.ceiling == res.always_bytes + 2 * one and res.always_bytes < res.locked_bytes <= res.ceiling
        assert res.shared.resident.sum() == 2                            # the two best of the saved set
        assert res.shared.resident[L - 1, E - 1] and res.shared.resident[L - 1, E - 2]
    finally:
        m.close()


@pytest.mark.parametrize("populate", [False, True], ids=["willneed", "populate"])
def test_a_range_beyond_the_readahead_window_is_read_whole(tmp_path, populate):
    # prefetch.Prefetcher reads a 24 MiB expert range on its own thread, whole: faulted in on a mapping advised 2 MiB
    # pages (MADV_POPULATE_READ), or asked of the readahead in chunks (one madvise(WILLNEED) reads no more than the
    # device's readahead window: 2-8 MiB on a disk of read_ahead_kb 8192); under MADV_RANDOM (an unlocked expert's
    # advice) what one call left unread would come a page at a time from the layer's faults
    import ctypes
    import mmap

    n = 24 << 20
    path = tmp_path / "expert.bin"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, n, np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, n, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        addr = np.frombuffer(mm, np.uint8).ctypes.data      # (the view is gone at once: mm can close)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        v = np.zeros(n // mmap.PAGESIZE, np.uint8)

        def cached():
            assert libc.mincore(ctypes.c_void_p(addr), n, v.ctypes.data) == 0
            return (v & 1).mean()
        os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
        if cached() > 0.5:
            pytest.skip("this file system keeps the file in memory (tmpfs): nothing to read")
        if populate:
            mm.madvise(mmap.MADV_HUGEPAGE)
        mm.madvise(mmap.MADV_RANDOM)
        reader = Prefetcher(populate=populate)
        reader.ask(addr, n)
        deadline = time.monotonic() + 120
        while not reader.idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.idle()
        last, moved = cached(), time.monotonic()
        while last < 1.0 and time.monotonic() - moved < 30:      # the reads still coming in, however slowly
            time.sleep(0.01)
            now = cached()
            if now > last:
                last, moved = now, time.monotonic()
        # readahead is best effort: a page it cannot allocate at once is left to the fault (the suite's other worker
        # busy beside it left 6 of 6144 pages unread once); one call for the whole range stops at 8-33%
        assert last >= 0.95, f"{last:.1%} of the range read: the reads stopped there"
        mm.close()
    finally:
        os.close(fd)


def test_greedy_answers_equal_under_a_budget(small):
    m = Model.open(small, context=64, populate=False)
    try:
        ref, eng = _greedy(m)
        assert eng.single is not None                             # no budget: the fused token, as before
    finally:
        m.close()
    for predict in (False, True):                                 # expert_readahead chosen (the default), predicted
        m, res = _open_with_budget(small, 0.35)
        try:
            got, eng = _greedy(m, res, predict=predict)
            assert got == ref
            f = eng.stats()["weights"]
            assert f["routes"] > 0 and 0 < f["experts_resident"] < f["experts"]
            assert f["resident"] > 0                              # the locked experts served routes
            assert f["predictions"] > 0 and f["prediction_hits"] > 0     # the next layer's guess is scored either way
            assert (f["predicted"] > 0) == predict                # and its experts read ahead only when predicted
            assert f["locked_bytes"] <= res.budget
        finally:
            m.close()


def test_a_steps_experts_are_read_a_part_ahead_of_the_ones_running(small):
    """ReadAhead.stream: with several rows, route() asks for nothing and moe()'s parts of n experts are each asked for
    one part ahead (the first two parts before the first runs), the locked ones never; with one row route() asks for
    every chosen expert at once, as before."""
    m, res = _open_with_budget(small, 0.35)
    try:
        r = res.reader(m.config)
        L0 = m.weights.layers[0]
        E = L0.gate.shape[0]
        asked = []
        r._fetch = lambda l, e, ask=True: asked.append(e) if ask else 0
        res.shared.resident[0] = 0
        res.shared.resident[0, 3] = 1                                   # one locked expert
        h = np.random.default_rng(0).standard_normal((16, L0.gate.shape[1])).astype(np.float32)
        r.route(0, L0, h)
        assert asked == []
        active = np.arange(E)
        seen = []
        for part in r.stream(active, 2):
            seen.append((list(part), list(asked)))
        assert [p for p, _ in seen] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert seen[0][1] == [0, 1, 2]                                  # parts 0 and 1, the locked 3 left out
        assert seen[1][1] == [0, 1, 2, 4, 5]
        assert seen[2][1] == [0, 1, 2, 4, 5, 6, 7] == seen[3][1]
        asked.clear()
        r.route(0, L0, h[:1])
        assert len(asked) == len(set(asked)) and 1 <= len(asked) <= L0.top_k
        assert list(r.stream(np.array(sorted(asked)), 2)) and len(asked) == len(set(asked))   # not asked twice
    finally:
        m.close()


def test_greedy_answers_of_several_sequences_equal_under_a_budget(small, monkeypatch):
    """Four sequences decoding together (their steps' experts run in parts through ReadAhead.stream) give the
    tokens they give with the whole model resident."""
    prompts = [PROMPT, PROMPT[::-1], [3, 9, 27, 81, 243], [700, 12, 5]]

    def run(m, res=None):
        eng = BatchEngine(m, max_seqs=4, max_batch_tokens=32, prefix_cache=False)
        for i, p in enumerate(prompts):
            eng.add(i, p, max_tokens=10, ignore_eos=True, temperature=0.0)
        toks = {i: [] for i in range(len(prompts))}
        while eng.has_work():
            for sid, ev in eng.step():
                toks[sid].append(ev.token_id)
            if res is not None:
                res.rerank()
        return toks, eng
    m = Model.open(small, context=64, populate=False)
    try:
        ref, _ = run(m)
    finally:
        m.close()
    parts = []
    stream = ReadAhead.stream

    def counted(self, active, n):
        for part in stream(self, active, n):
            parts.append(len(part))
            yield part
    monkeypatch.setattr(ReadAhead, "stream", counted)
    m, res = _open_with_budget(small, 0.35)
    try:
        got, eng = run(m, res)
        assert got == ref
        f = eng.stats()["weights"]
        assert f["routes"] > 0 and 0 < f["experts_resident"] < f["experts"]
        assert parts and max(parts) == 1 and len(parts) > 4 * m.config.num_layers    # one thread: an expert a part
    finally:
        m.close()


def test_budget_below_the_always_part_is_one_line(small):
    m = Model.open(small, context=32, populate=False)
    try:
        with pytest.raises(BudgetTooSmall, match=r"weights_memory 0 MiB is below the part of small.colibri"):
            Residency(m.file, m.config, 1000)
    finally:
        m.close()
    m = Model.open(small, context=32, populate=False)
    try:                                      # a budget the server chose: as much of the always part as fits
        res = Residency(m.file, m.config, 100 * 4096, partial=True, chunk=PAGE)
        assert 0 < res.always_bytes <= 100 * 4096 and res.always_chunks.size * 4096 == res.always_bytes
    finally:
        m.close()
    assert resolve_budget(0, 100, 200) == 100                     # fits: all of it
    G = 1 << 30                                                   # too large: 90% of it less the reads' room
    assert resolve_budget(0, 3 * G, 2 * G, 100 << 20) == int(2 * G * 0.9) - (100 << 20) - (32 << 20)
    assert resolve_budget(123, 300, 200) == 123
    # a server's budget leaves room for what starts after it is chosen: the kernels, router, workers
    from types import SimpleNamespace

    from colibri_server.master.residency import processes_room
    one, four = processes_room(SimpleNamespace(workers=1)), processes_room(SimpleNamespace(workers=4))
    assert (64 << 20) < one < four and four - one == 3 * (32 << 20)
    assert resolve_budget(0, 3 * G, 2 * G, 100 << 20, four) == int(2 * G * 0.9) - (100 << 20) - four - (32 << 20)
    assert resolve_budget(0, 3 * G, 200 << 20, 50 << 20, four) == 0       # nothing left: nothing locked


def test_the_master_locks_after_the_compile(small, monkeypatch):
    """open_model compiles before it locks (a cold compile's hundreds of MiB beside pages locked first
    were an OOM kill in a memory limit), and a budget the server chose gives up what the compile kept
    beyond the room it had left for the kernels."""
    from colibri_server.master import loading
    from colibri_server.master import residency as MR
    from colibri_server.master.loading import HaltServer
    from colibri_server.settings.load import defaults
    s = defaults()
    size = os.path.getsize(small)
    monkeypatch.setattr(MR, "budget_for", lambda path, s: int(size * 0.9))       # as in a limit below the file
    at_compile, kept, before = [], [], _locked_kib()

    def compile_(m, s):
        at_compile.append(_locked_kib())
        kept.append(np.ones(MR.KERNELS_ROOM + (8 << 20), np.uint8))      # what a cold compile keeps
    monkeypatch.setattr(loading, "_compile", compile_)
    from colibri_server.host import trim
    monkeypatch.setattr(trim, "trim", lambda: 0)     # the heap this process had before: not the compile's to give back
    try:
        m = loading.open_model(small, s)
    except HaltServer as e:
        pytest.skip(f"cannot lock memory here: {e}")
    try:
        res = m.residency
        assert at_compile == [before] and _locked_kib() > before         # nothing locked while it compiled
        assert res.locked_bytes >= res.always_bytes > 0
        assert int(size * 0.9) - res.budget >= 8 << 20                    # the compile's excess came off it
        assert res.locked_bytes <= res.budget
    finally:
        m.close()


# ------------------------------------------------------------------- in a memory cgroup below the model

_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from colibri_server.model import Model
from colibri_server.model.residency import Residency, available_memory, in_flight_bytes, resolve_budget
from colibri_server.model.serving import BatchEngine
m = Model.open(sys.argv[2], context=64, populate=False)
size = m.file.header["file_size"]
budget = resolve_budget(0, size, available_memory(), in_flight_bytes(m.file, m.config))
res = None
if budget < size:
    res = Residency(m.file, m.config, budget, partial=True); res.start(); m.residency = res
eng = BatchEngine(m, max_seqs=1, max_batch_tokens=16, prefix_cache=False)
eng.add(0, json.loads(sys.argv[3]), max_tokens=int(sys.argv[4]), ignore_eos=True, temperature=0.0)
toks = []
while eng.has_work():
    toks += [ev.token_id for _, ev in eng.step()]
    if res is not None:
        res.rerank()
print(json.dumps({"tokens": toks, "budget": budget, "size": size, "weights": eng.stats().get("weights")}))
"""


def _cgroup(limit):
    """A fresh v1 (or v2) memory cgroup with `limit`, or pytest.skip with the reason."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    v1 = pathlib.Path("/sys/fs/cgroup/memory")
    base, v2 = (v1, False) if v1.is_dir() else (pathlib.Path("/sys/fs/cgroup"), True)
    if v2 and "memory" not in (base / "cgroup.controllers").read_text():
        pytest.skip("cgroup v2 without the memory controller")
    d = base / f"colibri-test-{os.getpid()}"
    try:
        d.mkdir()
        (d / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup: {e}")
    return d, v2


def _run(path, n, cg=None):
    def enter():
        if cg is not None:
            with open(cg / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
    r = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), path, json.dumps(PROMPT), str(n)],
                       capture_output=True, text=True, preexec_fn=enter, timeout=600,
                       env=dict(os.environ, NUMBA_NUM_THREADS="1"))
    return r


def test_greedy_answers_equal_in_a_cgroup_below_the_model(tmp_path):
    path = str(tmp_path / "big.colibri")
    size = write_model(path, **{**SMALL, "hidden_size": 512, "moe_intermediate_size": 4096})   # ~395 MiB
    limit = 300 << 20
    assert limit < size
    ref = _run(path, 10)
    assert ref.returncode == 0, ref.stderr[-2000:]
    ref = json.loads(ref.stdout.strip().splitlines()[-1])
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)            # the run must read what it uses
    os.close(fd)
    cg, v2 = _cgroup(limit)
    try:
        got = _run(path, 10, cg)
        ooms = [ln for ln in (cg / ("memory.events" if v2 else "memory.oom_control")).read_text().splitlines()
                if ln.startswith("oom_kill ")]
        peak = int((cg / ("memory.peak" if v2 else "memory.max_usage_in_bytes")).read_text()) \
            if (cg / ("memory.peak" if v2 else "memory.max_usage_in_bytes")).exists() else 0
        hit_limit = int((cg / "memory.failcnt").read_text()) if not v2 else None
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert got.returncode == 0, f"exit {got.returncode}: {got.stderr[-2000:]}"
    assert all(ln.split()[1] == "0" for ln in ooms)
    got = json.loads(got.stdout.strip().splitlines()[-1])
    assert got["budget"] < size and got["weights"] is not None
    assert got["tokens"] == ref["tokens"]
    assert peak <= limit
    if hit_limit is not None:
        assert hit_limit > 0                                      # the limit was met: pages were reclaimed


# ------------------------------------------------------------------- the server: master, router, workers

def test_the_master_loop_wakes_for_a_rerank_only_while_it_reranks(monkeypatch):
    """Arbiter.sleep waits no longer than the next re-rank of a model with a budget (master/residency.next_turn);
    while the server stops, tend() no longer re-ranks and the re-rank stays due: the loop then sleeps its own
    turn instead of spinning through a graceful stop."""
    import types

    from colibri_server.master import arbiter
    from colibri_server.master.residency import next_turn
    waits = []
    monkeypatch.setattr(arbiter.select, "select", lambda r, w, x, timeout: waits.append(timeout) or ([], [], []))
    due = types.SimpleNamespace(model=types.SimpleNamespace(residency=types.SimpleNamespace(next_rerank=0.0)))
    me = types.SimpleNamespace(watchdog=0, gens={1: due}, stopping=True, router_pid=1, role="host", _wake_r=-1, pipe=None)
    arbiter.Arbiter.sleep(me)
    me.stopping = False
    arbiter.Arbiter.sleep(me)
    assert waits == [0.5, 0.0]                           # stopping: its own turn; turning: the re-rank is due
    assert next_turn({}, 0.0) == float("inf")             # no budget: nothing to wake for


def test_server_under_a_weights_budget(small, tmp_path):
    from server_harness import Server

    from colibri_server.commands.status import format_status
    m = Model.open(small, context=64, populate=False)
    try:
        ref, _ = _greedy(m, n=8)
        size = m.file.header["file_size"]
    finally:
        m.close()
    budget = int(size * 0.7)              # (its always part, whole 2 MiB pieces: 28 of its 53 MiB)
    s = Server(small, tmp_path, workers=2, extra=("--weights-memory", budget, "--context", 64))
    try:
        s.wait_ready(workers=2)
        with s.client() as c:
            for _ in range(3):
                got = c.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
                assert got.token_ids == ref
        # the master re-ranks from the workers' shared counts: the routed experts get locked
        def weights():
            ws = [w["engine"].get("weights") for w in s.stats()["workers"] if w.get("engine")]
            return ws[0] if ws and ws[0] and ws[0]["experts_resident"] > 0 else None
        f = s.wait_for(weights, what="experts locked by the master")
        assert f["weights_memory"] == budget and f["locked_bytes"] <= budget
        assert f["routes"] > 0 and f["predictions"] > 0
        assert "weights    budget" in format_status(s.stats())
        assert "weights_memory" in s.logs()
    finally:
        assert s.stop() == 0


def test_metrics_and_status_show_the_budget():
    from colibri_server.commands.status import format_status
    from colibri_server.http.metrics import _weights_families
    w = {"weights_memory": 300 << 20, "locked_bytes": 200 << 20, "experts_resident": 14, "experts": 64, "routes": 100,
         "resident": 60, "predicted": 20, "missed": 15, "missing_bytes": 50 << 20, "requested_bytes": 80 << 20,
         "predictions": 90, "prediction_hits": 63, "ceiling": 250 << 20}
    fams = {f.name: f.samples[0].value for f in _weights_families([{"engine": {}}, {"engine": {"weights": w}}])}
    assert fams["colibri_weights_memory_bytes"] == 300 << 20 and fams["colibri_weights_locked_bytes"] == 200 << 20
    assert fams["colibri_weights_stalls"] == 15 and fams["colibri_weights_stall_bytes"] == 50 << 20
    assert fams["colibri_weights_prediction_hits"] == 63 and fams["colibri_weights_experts_resident"] == 14
    assert fams["colibri_weights_ceiling_bytes"] == 250 << 20
    assert list(_weights_families([{"engine": {"steps": 3}}])) == []          # no budget: no family
    st = {"model": "m.colibri", "model_bytes": 1 << 30, "generation": 1, "queue": 0, "in_flight": 0, "draining": False,
          "router": {"pid": 1, "rss": 1}, "workers": [{"pid": 2, "wid": 0, "generation": 1, "state": "ready",
                                                       "cores": [0], "running": 0, "served": 1, "rss": 1, "uss": 1,
                                                       "pss": 1, "anon_private": 1, "memory_sampled": False,
                                                       "engine": {"weights": w}}]}
    line = next(ln for ln in format_status(st).splitlines() if ln.startswith("weights "))
    assert "14/64 experts" in line and "60% locked" in line and "15 stalls" in line and "70% right" in line
    assert "budget 300.0 MiB (held to 250.0 MiB: memory is short)" in line
    w["ceiling"] = w["weights_memory"]
    assert "held" not in next(ln for ln in format_status(st).splitlines() if ln.startswith("weights "))
