"""Which of a model's bytes stay in memory when the file is larger than its budget (`weights_memory`).

A .colibri file keeps every expert's matrices as contiguous slices of its layer's stacks (format.py),
so an expert is a handful of byte ranges of the one MAP_SHARED mapping. Under a budget:

- the always-resident part (everything that is not an expert: attention, norms, routers, shared
  experts, the head) is locked (mlock) at start; the token embeddings (unless the head shares them)
  are read a row at a time on demand;
- experts are ranked by a decayed count of how often they were routed (a table in shared memory that
  the workers add their routes to; a lost increment when two add at once costs nothing that matters);
  the top ones, as many as fit in the rest of the budget, are locked; the others are unlocked and
  zapped from the master's page tables (their cached pages are the first the kernel reclaims: the
  only weights it can), and advised MADV_RANDOM so that a miss does not read its neighbours;
- locked bytes never exceed the budget. Pages of an unlocked expert that a worker reads on a miss sit
  in the page cache as the kernel's to reclaim: under memory pressure they are the only weights it can
  take (a cgroup's limit included).

Residency (the master's, one per mapped file; a one-process user such as a benchmark calls rerank()
itself) chooses and locks; ReadAhead (each worker's, the forward pass's hook) asks for an expert's bytes
(a reader thread faults them in, prefetch.py: the reads overlap compute) when layer l routes to an expert
that is not locked: a decode token's few at once, a step of several rows a part of n experts ahead of the
part running (stream(): moe() runs them n at a time, n the worker's threads), so a layer's reads held in
the page cache at once are two parts, not every expert its rows chose; it predicts layer l+1's probable
experts (its router applied to layer l's output: bench/routing_stats.py measured 70% of its choices in the predicted top-k, 86% in top-k+1 on
bench-mixtral) as soon as layer l is done and scores the guess, asking for them too only with
expert_readahead = predicted (ReadAhead.ahead: measured slower on a disk that is the bottleneck); it
counts what it found resident, what its prediction had asked for, and the bytes it found missing
(mincore) when a layer needed them: the stalls.

Legend: L layers, E experts per layer.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import resource

import numpy as np

from .format import PIECE, is_expert_stack
from .prefetch import Prefetcher

__all__ = ["Residency", "ReadAhead", "expert_ranges", "resolve_budget", "in_flight_bytes", "available_memory",
           "memory_headroom", "BudgetTooSmall", "STAT_NAMES"]

PAGE = mmap.PAGESIZE
# What is locked and counted against the budget, in whole pieces of the file of this size: the page cache holds a
# file read on a 2 MiB mapping in folios up to 2 MiB, and mlock pins only a folio wholly inside a locked range,
# while reclaim cannot take one that a locked range covers in part (the unmap gives up on it): a lock that ends
# inside a folio pins that folio unaccounted. bench-mixtral f16's expert slices are 4 MiB at 1.55 MiB into a
# piece: an expert pinned 18 MiB for the 12 its locks counted, and a 50% memory limit thrashed or OOM-killed
# the process once the locked experts changed often. The writer puts experts on these pieces (format.PIECE).
CHUNK = PIECE
MADV_RANDOM = getattr(mmap, "MADV_RANDOM", 1)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
# what ReadAhead counts, in the shared stats row (one int64 each)
STAT_NAMES = ("routes", "resident", "predicted", "missed", "missing_bytes", "requested_bytes",
              "predictions", "prediction_hits", "ceiling")      # ceiling: the master's (Residency.follow)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = _libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class BudgetTooSmall(ValueError):
    """weights_memory below the part of the model that must always be resident."""


def _pages(off: int, n: int) -> tuple[int, int]:
    """(start, length) of the whole pages covering [off, off + n)."""
    a = off // PAGE * PAGE
    return a, -(-(off + n) // PAGE) * PAGE - a


def expert_ranges(cf, cfg) -> tuple[list, list, list]:
    """(experts, always, demand): experts[l][e] the page-rounded (offset, length) ranges of layer l's
    expert e in every per-expert stack of the file (w1, w3, w2, their scales and biases: a tensor whose
    leading dimension is E and whose name says `_exps`); demand: the token embeddings when the head does
    not share them (a token reads one row of them: read on demand, never locked); always: the rest,
    [0, file size) less the others' pages. A dense layer has [] for every expert."""
    E = cfg.num_experts
    experts = [[[] for _ in range(E)] for _ in range(cfg.num_layers)]
    covered, demand = [], []
    for r in cf.record_list:
        if r.name == "token_embd" and not cfg.tie_word_embeddings and r.size > 4 * PAGE:
            a, n = _pages(r.offset, r.size)
            demand.append((a + PAGE, n - 2 * PAGE))
            covered.append(demand[-1])
            continue
        if not is_expert_stack(r.name, r.shape, E) or r.size % E:
            continue
        layer, each = int(r.name.split(".")[1]), r.size // E
        for e in range(E):
            a, n = _pages(r.offset + e * each, each)
            experts[layer][e].append((a, n))
        a = -(-r.offset // PAGE) * PAGE                 # the stack's whole pages; a page it shares with a
        covered.append((a, max(0, (r.offset + r.size) // PAGE * PAGE - a)))     # neighbour is always's
    size = cf.header["file_size"]
    always, pos = [], 0
    for a, n in sorted(covered):
        if a > pos:
            always.append((pos, a - pos))
        pos = max(pos, a + n)
    if pos < size:
        always.append(_pages(pos, size - pos))
    return experts, always, demand


def resolve_budget(setting: int, file_size: int, available: int, in_flight: int = 0, processes: int = 0) -> int:
    """weights_memory's bytes: the setting when > 0; else the whole file when it fits in `available`;
    else 90% of `available` less `in_flight` (the bytes of the experts being read at once, which the
    kernel cannot reclaim while their reads are under way: 2 * top_k + 1 of the largest), `processes`
    (what processes that start after the budget is chosen take: a server's kernels, router and
    workers) and 32 MiB for the processes' own growth (a worker's KV pool comes out of the rest: with
    kv_cache_memory set, set weights_memory too). 0 when nothing is left: nothing is locked then."""
    if setting > 0:
        return int(setting)
    return file_size if file_size <= available else \
        max(0, int(available * 0.9) - in_flight - processes - (32 << 20))


def in_flight_bytes(cf, cfg) -> int:
    """The bytes of 2 * top_k + 1 of the model's largest experts (resolve_budget's in_flight)."""
    experts, _, _ = expert_ranges(cf, cfg)
    biggest = max((sum(n for _, n in r) for row in experts for r in row), default=0)
    return (2 * max(1, cfg.top_k) + 1) * biggest


def _cgroup_limits():
    """(limit, usage, memory.stat, v2) of each memory cgroup this process is in that has a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        if ctrl == "":
            d, files = f"/sys/fs/cgroup{path}", ("memory.max", "memory.current")
        elif "memory" in ctrl.split(","):
            d, files = f"/sys/fs/cgroup/memory{path}", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        try:
            with open(f"{d}/{files[0]}") as f:
                lim = f.read().strip()
            with open(f"{d}/{files[1]}") as f:
                used = int(f.read())
            with open(f"{d}/memory.stat") as f:
                stat = {k: int(v) for k, v in (ln.split() for ln in f if ln.strip())}
        except (OSError, ValueError):
            continue
        if lim != "max" and int(lim) < (1 << 60):
            yield int(lim), used, stat, ctrl == ""


def available_memory() -> int:
    """Bytes this process may still use: the system's available memory, or less in a memory cgroup
    (v2 memory.max, v1 memory.limit_in_bytes, less what the group uses but cannot give back: its usage
    less its inactive file pages)."""
    import psutil
    avail = psutil.virtual_memory().available
    for lim, used, stat, v2 in _cgroup_limits():
        avail = min(avail, max(0, lim - used + stat.get("inactive_file" if v2 else "total_inactive_file", 0)))
    return avail


def memory_headroom() -> int:
    """Bytes the server's processes can still take before the kernel must kill one: the system's available
    memory (it counts the page cache the kernel can reclaim, not locked pages), or less in a memory cgroup:
    its limit less what it holds that no reclaim gives back (its usage less its file pages on the LRU lists:
    anonymous memory, locked pages and the kernel's own). Where available_memory asks what a new budget may
    take, this asks whether the processes' growth since has eaten into what the budget left them."""
    import psutil
    room = psutil.virtual_memory().available
    for lim, used, stat, v2 in _cgroup_limits():
        files = ("active_file", "inactive_file") if v2 else ("total_active_file", "total_inactive_file")
        room = min(room, max(0, lim - (used - sum(stat.get(k, 0) for k in files))))
    return room


class _Shared:
    """The tables the master makes before it forks and its workers write: counts (L,E) int64 routes,
    resident (L,E) uint8 (1: locked), stats (len(STAT_NAMES),) int64. One anonymous MAP_SHARED mapping."""

    def __init__(self, L: int, E: int):
        n = L * E
        self.mm = mmap.mmap(-1, n * 8 + n + len(STAT_NAMES) * 8 + 64, flags=mmap.MAP_SHARED)
        buf = np.frombuffer(self.mm, np.uint8)
        self.counts = buf[:n * 8].view(np.int64).reshape(L, E)
        self.stats = buf[n * 8:n * 8 + len(STAT_NAMES) * 8].view(np.int64)
        self.resident = buf[n * 8 + len(STAT_NAMES) * 8:][:n].reshape(L, E)


# The half-life of an expert's route count, in tokens through the model (rows of the steps, summed over the
# workers). A sequence's routes move from token to token (bench/residency_policy.py: bench-mixtral f16, four
# greedy sequences of 96 tokens, 13 of its 64 experts locked, re-ranked every 4 tokens): the share of a decode
# token's expert uses found locked was 0.65-0.72 with a half-life of 4 tokens, 0.63-0.69 with 8, 0.49-0.62
# without decay, 0.58-0.68 for the best fixed set known in hindsight. The four as one step's rows: 0.28-0.30
# whatever the half-life, 0.61 newcomers a step against 0.19 without decay.
HALF_LIFE_TOKENS = 4.0


class Residency:
    """The master's: lock the always-resident part and the experts that fit in the budget, by decayed
    route counts. cf: the open ColibriFile (its mapping), cfg its ModelConfig, budget in bytes. A budget
    below the always-resident part raises BudgetTooSmall, unless partial (a budget the server chose
    itself): then as much of that part as fits is locked, no expert, and the rest is read on demand.
    always_bytes is what the budget counts of that part (shrink)."""

    def __init__(self, cf, cfg, budget: int, half_life: float = HALF_LIFE_TOKENS, partial: bool = False,
                 chunk: int = CHUNK):
        self.cf, self.budget, self.half_life, self.chunk = cf, int(budget), half_life, int(chunk)
        self.experts, self.always, self.demand = expert_ranges(cf, cfg)
        L, E = cfg.num_layers, max(1, cfg.num_experts)
        self.expert_bytes = np.array([[sum(n for _, n in self.experts[l][e]) if E else 0 for e in range(E)]
                                      for l in range(L)], np.int64)                      # (L,E)
        # the routes one token adds to the counts: top_k in each layer that has experts
        self.routes_per_token = max(1, int(cfg.top_k) * int((self.expert_bytes.sum(axis=1) > 0).sum()))
        self.size = int(cf.header["file_size"])
        self.refs = np.zeros(-(-self.size // self.chunk), np.int32)   # (pieces,) locks held on each piece
        self.expert_chunks = [[_chunks(r, self.chunk) for r in row] for row in self.experts]
        # stacks whose experts could lie on whole pieces but do not (a converter before format.PIECE): each of
        # their locked experts holds pieces of its neighbours beyond its own bytes
        self.misplaced = [r.name for r in cf.record_list if is_expert_stack(r.name, r.shape, cfg.num_experts)
                          and r.size % (self.chunk * cfg.num_experts) == 0 and r.offset % self.chunk]
        self.shared = _Shared(L, E)
        self.score = np.zeros((L, E), np.float64)                                       # (L,E) decayed routes
        self._seen = np.zeros((L, E), np.int64)
        self.locked_bytes = 0
        self.swaps = 0
        self._base = cf._buf.ctypes.data
        self.partial = partial
        self.shrink(self.budget)

    def shrink(self, budget: int) -> None:
        """Set the budget to `budget` bytes (at most the one given; before start(): nothing is locked yet)
        and choose what of the always-resident part is locked: all of it, or, partial, as much as fits in
        file order. Raises BudgetTooSmall as the constructor says."""
        assert self.locked_bytes == 0, "shrink() before start()"
        self.budget = min(self.budget, max(0, int(budget)))
        # the always part is locked and counted in whole pieces, as the experts are (an expert that shares a
        # piece with it costs nothing more). The reference writer puts it before the expert stacks in one run
        # (format.PIECE): its pieces add under 2 MiB to it; in a file written with a stack after each layer
        # they added 50 MiB to bench-mixtral f16's 153.
        self.always_chunks = _chunks(self.always, self.chunk)
        self.whole_always_bytes = self._bytes(self.always_chunks)
        self.always_bytes = self.whole_always_bytes
        if self.always_bytes > self.budget and self.partial:
            self.always_chunks = self.always_chunks[:self.budget // self.chunk]      # in file order, what fits
            self.always_bytes = self._bytes(self.always_chunks)
        if self.always_bytes > self.budget:
            raise BudgetTooSmall(f"weights_memory {self.budget / 2**20:.0f} MiB is below the part of "
                                 f"{os.path.basename(self.cf.path)} always kept resident "
                                 f"({self.always_bytes / 2**20:.0f} MiB: attention, norms, routers, head)")
        self.ceiling = self.budget              # what may be locked now: follow() lowers it while memory is short
        self.shared.stats[STAT_NAMES.index("ceiling")] = self.ceiling

    @property
    def active(self) -> bool:
        return True

    def start(self) -> None:
        """Lock the always-resident part; release every expert (they are locked by rerank as they are
        routed); advise MADV_RANDOM on them. Raises OSError with its reason where locking fails."""
        _room_to_lock(self.budget)
        mm = self.cf._mm
        for l, row in enumerate(self.experts):
            for e, ranges in enumerate(row):
                for a, n in ranges:
                    mm.madvise(MADV_RANDOM, a, n)
        for a, n in self.demand:
            mm.madvise(MADV_RANDOM, a, n)
        self._lock(self.always_chunks)
        self.locked_bytes = self.always_bytes

    def _bytes(self, chunks) -> int:
        """The file's bytes in these pieces (the last one may be short)."""
        n = int(chunks.size) * self.chunk
        if chunks.size and chunks[-1] == self.refs.size - 1:
            n -= self.refs.size * self.chunk - self.size
        return n

    def _cost(self, chunks, held) -> int:
        """Bytes locking `chunks` adds where `held` (a bool per piece) are locked already."""
        return self._bytes(chunks[~held[chunks]])

    def _lock(self, chunks) -> None:
        """Lock the pieces not locked yet; count a lock of each (locked_bytes: the pieces held)."""
        for c in chunks[self.refs[chunks] == 0]:
            a = int(c) * self.chunk
            n = min(self.chunk, self.size - a)
            if _libc.mlock(ctypes.c_void_p(self._base + a), n) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"mlock of {n / 2**20:.1f} MiB of {self.cf.path}: {os.strerror(e)}")
            self.locked_bytes += n
        self.refs[chunks] += 1

    def _release(self, chunks) -> None:
        """Drop a lock of each piece; the pieces no lock holds any more are unlocked and the master's
        page-table entries of them dropped: their pages stay in the page cache as the kernel's to reclaim
        first (dropping them outright, POSIX_FADV_DONTNEED, threw away pages a limit still had room for:
        75% limit 21.7 tok/s against the kernel LRU's 24.3)."""
        self.refs[chunks] -= 1
        mm = self.cf._mm
        for c in chunks[self.refs[chunks] == 0]:
            a = int(c) * self.chunk
            n = min(self.chunk, self.size - a)
            _libc.munlock(ctypes.c_void_p(self._base + a), n)
            mm.madvise(MADV_DONTNEED, a, n)
            self.locked_bytes -= n

    def rerank(self, max_swaps: int = 16, uncached: int = 1) -> int:
        """Fold the routes counted since the last call into the decayed scores (each score halves every
        half_life tokens that went through the model: the decay follows the work done, not the clock, so an
        idle server keeps its ranking) and lock the experts that rank highest within the budget (the
        ceiling), unlocking those that fell out. At most max_swaps newcomers are locked per call, the best
        first, so the caller never waits long; uncached: how many of them may have pages missing from the page
        cache (mlock reads those from disk, in the caller, beside the workers' own reads; a newcomer a worker
        used just now is usually cached). An incumbent that fell out keeps its place until a newcomer can take
        it: unlocking first and locking what the limits allowed had left 2 of 13 places empty at the end of a
        batch-1 decode at 50% of bench-mixtral f16 (allowing no uncached newcomer at all, 3 of 13).
        Returns how many were locked."""
        res = self.shared.resident
        counts = self.shared.counts.copy()
        new, self._seen = counts - self._seen, counts
        tokens = max(0, int(new.sum())) / self.routes_per_token          # through the model since the last call
        self.score = self.score * 0.5 ** (tokens / self.half_life) + new
        # the incumbents keep their place against a newcomer up to 25% ahead (no churn on noise)
        eff = self.score * np.where(res > 0, 1.25, 1.0)
        order = [divmod(int(f), res.shape[1]) for f in np.argsort(-eff, axis=None, kind="stable")]
        base = np.zeros(self.refs.size, np.bool_)
        base[self.always_chunks] = True
        room, held = self.ceiling - self.always_bytes, base.copy()     # ceiling <= budget (shrink, follow)
        want = np.zeros(res.shape, np.bool_)              # the ranking's choice within the room
        for l, e in order:
            ch = self.expert_chunks[l][e]
            if eff[l, e] <= 0 or ch.size == 0:
                break
            b = self._cost(ch, held)
            if b <= room:
                want[l, e], room, held[ch] = True, room - b, True
        can = res > 0                                     # what may be locked after this call: the incumbents
        for l, e in order:                                # and the newcomers the limits let in now
            if want[l, e] and not res[l, e]:
                if max_swaps <= 0:
                    break
                if self._missing(l, e):
                    if uncached <= 0:
                        continue
                    uncached -= 1
                can[l, e], max_swaps = True, max_swaps - 1
        keep = np.zeros(res.shape, np.bool_)              # the best of those within the room
        room, held = self.ceiling - self.always_bytes, base
        for l, e in order:
            ch = self.expert_chunks[l][e]
            if can[l, e] and ch.size and (want[l, e] or res[l, e]):
                b = self._cost(ch, held)
                if b <= room:
                    keep[l, e], room, held[ch] = True, room - b, True
        # each newcomer, best first, takes the place of the weakest that fell out: that one is unlocked just
        # before it is locked (the budget holds at every moment, and one expert at a time is between the two)
        out = [(l, e) for l, e in reversed(order) if res[l, e] and not keep[l, e]]
        added = 0
        for l, e in order:
            if keep[l, e] and not res[l, e]:
                ch = self.expert_chunks[l][e]
                while out and self.locked_bytes + self._cost(ch, self.refs > 0) > self.ceiling:
                    self._unlock(*out.pop(0))
                if self.locked_bytes + self._cost(ch, self.refs > 0) > self.ceiling:
                    continue
                self._lock(ch)
                res[l, e] = 1
                added += 1
        for l, e in out:
            self._unlock(l, e)
        self.swaps += added
        return added

    def _unlock(self, l: int, e: int) -> None:
        self.shared.resident[l, e] = 0
        self._release(self.expert_chunks[l][e])

    def follow(self, headroom: int, floor: int) -> int:
        """Keep the processes out of the OOM killer's way: the budget is chosen before they grow (KV blocks
        filled, buffers, a reload's second generation) and a weights_memory set by hand may not fit at all.
        Locking a page takes it from what `headroom` (memory_headroom) counts, so what may be locked now is
        what is locked plus the headroom beyond `floor`: below it, the ceiling on locked bytes drops by the
        shortfall and the next rerank unlocks the least routed experts at once (their pages then the
        kernel's to reclaim); above it, the ceiling rises by half the excess a turn (the headroom is
        measured again after the locks), never above the budget. The always-resident part stays locked.
        Returns the ceiling."""
        room = int(headroom) - int(floor)
        want = self.locked_bytes + (room if room < 0 else room // 2)
        self.ceiling = min(self.budget, max(self.always_bytes, want))
        self.shared.stats[STAT_NAMES.index("ceiling")] = self.ceiling
        return self.ceiling

    def _missing(self, l: int, e: int) -> int:
        """Pages of expert (l, e) not in the page cache (mincore: the file's cache, mapped here or not)."""
        miss = 0
        for a, n in self.experts[l][e]:
            v = np.zeros(n // PAGE, np.uint8)
            if _libc.mincore(ctypes.c_void_p(self._base + a), n, v.ctypes.data) == 0:
                miss += int(np.count_nonzero((v & 1) == 0))
        return miss

    def figures(self) -> dict:
        """What status and /metrics show: the budget, bytes locked, experts resident, the workers' counts."""
        st = dict(zip(STAT_NAMES, (int(v) for v in self.shared.stats)))
        return {"weights_memory": self.budget, "locked_bytes": self.locked_bytes, "always_bytes": self.always_bytes,
                "experts_resident": int(self.shared.resident.sum()), "swaps": self.swaps, **st}

    def reader(self, cfg, predict: bool = False, spread: int = 0) -> "ReadAhead":
        return ReadAhead(self, cfg, predict, spread)


def _chunks(ranges, chunk: int) -> np.ndarray:
    """(n,) int64 ascending: the pieces of the file `chunk` bytes long that byte ranges [(offset, length)] touch."""
    out = [np.arange(a // chunk, -(-(a + n) // chunk)) for a, n in ranges if n > 0]
    return np.unique(np.concatenate(out)) if out else np.zeros(0, np.int64)


def _room_to_lock(budget: int) -> None:
    """Raise RLIMIT_MEMLOCK to the budget where it is lower (its hard limit allows, or root); a one-line
    OSError naming the limit otherwise."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= budget:
        return
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
                           if os.geteuid() == 0 else (min(budget, hard) if hard != resource.RLIM_INFINITY
                                                      else budget, hard))
    except (ValueError, OSError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < budget and os.geteuid() != 0:
        raise OSError(f"weights_memory {budget / 2**20:.0f} MiB is locked in memory but RLIMIT_MEMLOCK is "
                      f"{soft / 2**20:.0f} MiB (raise LimitMEMLOCK= in the unit, or ulimit -l)")


class ReadAhead:
    """A worker's hook in the forward pass (batch.forward_batch): route(l, layer, h) before layer l's
    experts run, ahead(l, x) after layer l's output is in x. Counts into the shared stats row."""

    def __init__(self, residency: Residency, cfg, predict: bool = False, spread: int = 0):
        self.r = residency
        self.cfg = cfg
        self.mm = residency.cf._mm
        self.base = residency._base
        self.stats = residency.shared.stats
        self.counts = residency.shared.counts
        self.resident = residency.shared.resident
        self.asked = np.zeros(self.resident.shape, np.bool_)    # (L,E) requested by a prediction, this step
        self._vec = np.zeros(max(1, int(residency.expert_bytes.max()) // PAGE + 8), np.uint8)
        self.predict = predict           # read the next layer's probable experts ahead (expert_readahead = predicted)
        self.spread = spread             # its top_k + spread are the probable ones (-1: no prediction, none scored)
        self.layer, self.streamed = 0, set()     # the layer route() saw last, its experts asked for since
        # the reads asked for: faulted in by a thread of the worker's on a mapping advised 2 MiB pages (a folio
        # a fault, mapped whole); otherwise asked of the kernel's readahead (WILLNEED) from it
        self.reader = Prefetcher(populate=bool(getattr(residency.cf, "hugepages", False)))

    def figures(self) -> dict:
        """The budget and what every worker counted (shared): what a heartbeat reports."""
        r = self.r
        st = dict(zip(STAT_NAMES, (int(v) for v in self.stats)))
        held = np.zeros(r.refs.size, np.bool_)
        held[r.always_chunks] = True
        experts = [r.expert_chunks[l][e] for l, e in zip(*np.nonzero(self.resident))]
        more = r._cost(np.unique(np.concatenate(experts)), held) if experts else 0
        return {"weights_memory": r.budget, "locked_bytes": r.always_bytes + more,
                "experts_resident": int(self.resident.sum()), "experts": int(self.resident.size), **st}

    def _fetch(self, l: int, e: int, ask: bool = True) -> int:
        """Ask for the bytes of expert (l, e) that are not in the page cache (mincore: a few us for an
        expert whose pages are mapped; madvise(WILLNEED) on cached pages costs ~400 us per 12 MiB, so only
        the missing runs are asked for, gaps under 256 KiB merged); returns how many bytes were missing
        (ask False: only counts them)."""
        miss = 0
        for a, n in self.r.experts[l][e]:
            v = self._vec[:n // PAGE]
            if _libc.mincore(ctypes.c_void_p(self.base + a), n, v.ctypes.data) != 0:
                continue
            gone = np.flatnonzero((v & 1) == 0)                                      # (pages missing,)
            if gone.size == 0:
                continue
            miss += gone.size * PAGE
            if not ask:
                continue
            cut = np.flatnonzero(np.diff(gone) > 64) + 1
            for run in np.split(gone, cut):
                self.reader.ask(self.base + a + int(run[0]) * PAGE, (int(run[-1]) - int(run[0]) + 1) * PAGE)
        if ask:
            self.stats[5] += miss
        return miss

    def route(self, l: int, layer, h) -> None:
        """h (N,D): layer l's normed rows, before its experts: count what is missing of the chosen experts
        that are not locked (the router's top-k, as moe() will choose them; an expert found with bytes
        missing is a stall: the layer waits for them) and, for one row, ask for it at once; more rows
        run their experts through stream(), which asks a few ahead of the ones running."""
        A = layer.top_k
        logits = h @ layer.gate.T                                                   # (N,E)
        if layer.gate_b is not None:
            logits += layer.gate_b
        if layer.corr_bias is not None and layer.corr_bias.size:
            logits = logits + layer.corr_bias
        chosen = np.unique(np.argpartition(-logits, A - 1, axis=1)[:, :A])          # (<= N*A,)
        self.stats[0] += chosen.size
        self.layer, self.streamed = l, set()
        one = h.shape[0] == 1
        for e in chosen:
            e = int(e)
            if self.resident[l, e]:
                self.stats[1] += 1
                continue
            if self.predict and self.asked[l, e]:
                self.stats[2] += 1
            m = self._fetch(l, e, ask=one)
            if one:
                self.streamed.add(e)
            if m:
                self.stats[3] += 1
                self.stats[4] += m
        if l > 0:
            self.asked[l - 1] = False

    def stream(self, active, n):
        """moe()'s experts of the layer route() saw last (active (k,), ascending), n at a time: before a part
        runs, what is missing of the next part's experts that are not locked is asked for, so one part is
        read while another runs. Asking for a layer's every chosen expert at once held them all in the page
        cache together (8 rows chose 6-8 of bench-mixtral's 8 experts a layer, 78-104 MiB in f16); a budget
        that left less room than that read them twice: at 50% of the file, 8 clients, a budget of 200 MiB
        read 103 MiB from the disk a token against 80 at the default 145."""
        l = self.layer
        for i in range(0, len(active), n):
            for e in active[i:i + 2 * n] if i == 0 else active[i + n:i + 2 * n]:
                e = int(e)
                if not self.resident[l, e] and e not in self.streamed:
                    self.streamed.add(e)
                    self._fetch(l, e)
            yield active[i:i + n]

    def predicted(self, l: int, idx) -> None:
        """idx (N,A): layer l's actual choices: count them (shared table) and score layer l's prediction."""
        self.counts[l] += np.bincount(idx.ravel(), minlength=self.counts.shape[1])
        if self.asked[l].any() or l > 0:
            got = self.asked[l][idx]
            self.stats[6] += idx.size
            self.stats[7] += int(got.sum())

    def ahead(self, l: int, x, layers) -> None:
        """x (N,D) layer l's output: layer l+1's router on it names its probable experts (scored in predicted()
        against the real choice: the hit rate shown), and with `predict` they are asked for now when not locked.
        Off by default, measured: asked here, a right guess gains layer l+1's attention time on its read, while a
        wrong one (a third) puts a whole expert's read before the needed ones on a disk that is already the
        bottleneck, and takes page cache from them. bench/memory_limit.py, bench-mixtral f16, one thread, a
        1.9 GB/s disk, tok/s asked / not: 26.8 / 30.5 at a 75% limit, 9.1-9.4 / 13.2-13.6 at 50%, 3.9 / 4.9 at
        25%; asked only after a layer that found its experts in memory: 27.1 at 75%, 10.6 at 50%."""
        if self.spread < 0 or l + 1 >= len(layers) or layers[l + 1].gate is None:
            return
        nxt = layers[l + 1]
        w = nxt.ffn_norm
        hn = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + self.cfg.rms_norm_eps) * w      # (N,D)
        if nxt.ffn_norm_b is not None:
            hn = hn + nxt.ffn_norm_b
        logits = hn @ nxt.gate.T                                                    # (N,E)
        k = min(logits.shape[1], nxt.top_k + self.spread)
        self.asked[l + 1] = False
        for e in np.unique(np.argpartition(-logits, k - 1, axis=1)[:, :k]):
            e = int(e)
            self.asked[l + 1, e] = True
            if self.predict and not self.resident[l + 1, e]:
                self._fetch(l + 1, e)
