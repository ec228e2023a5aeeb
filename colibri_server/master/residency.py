"""The master's side of a weights budget (model/residency.py is the mechanism): decide the budget when a
model is opened, lock its always-resident part before the workers fork, re-rank the locked experts from
the workers' shared route counts as the main loop turns, release the least routed when the processes' own
memory grows into the room the budget left them (and take the room back when it returns), and keep the
popular set beside the model so a restart locks the right experts first.

The master starts no thread: a re-rank is a few syscalls (mlock faults a newly chosen expert in from
disk: at most MAX_SWAPS experts per turn, so a turn stays short).
"""
from __future__ import annotations

import json
import logging
import os
import time

import numpy as np

log = logging.getLogger("colibri.master")

RERANK_EVERY = 0.25         # seconds between two re-ranks of one model (and checks of the memory left): a few
                            # tokens of a batch-1 decode under a tight limit (the ranking's half-life is 4 tokens)
WARN_EVERY = 60.0           # seconds between two warnings that memory held the budget down
HELD_WARN_AFTER = 10.0      # seconds the ceiling may stay below the budget (its rise included) before a warning
MAX_SWAPS = 8               # experts newly locked per re-rank
UNCACHED_SWAPS = 1          # of which read from disk by the lock (the others a worker used just now)
SAVE_EVERY = 60.0           # seconds between two saves of the popular set


# What the server's processes still take once the budget is chosen (the model is opened before its
# kernels load and before the workers fork): locked pages cannot be reclaimed, so a budget that takes
# this room ends in an OOM kill as they grow. Measured (bench/memory_breakdown.py --serve): the
# master's kernels ~50 MiB, the router ~25 MiB of its own, a worker ~16 MiB of its own after the fork
# plus the KV blocks it fills.
KERNELS_ROOM = 64 << 20
PROCESS_ROOM = 32 << 20
FLOOR_SLACK = 32 << 20      # kept free beside the experts the workers read at once (floor_for)


def processes_room(s) -> int:
    """The bytes resolve_budget leaves for the kernels, the router and s.workers workers."""
    return KERNELS_ROOM + (1 + max(1, getattr(s, "workers", 1) or 1)) * PROCESS_ROOM


def budget_for(path: str, s) -> int:
    """The weights budget of model file `path` under settings s: weights_memory, or, at 0, the whole
    file when it fits in the memory available now (a cgroup's limit counted), else less (resolve_budget;
    the in-flight room is estimated as 5% of the file until the model is open, the processes' own as
    processes_room)."""
    from ..model.residency import available_memory, resolve_budget
    size = os.path.getsize(path)
    return resolve_budget(getattr(s, "weights_memory", 0), size, available_memory(), size // 20, processes_room(s))


def floor_for(res, workers: int) -> int:
    """The memory tend() keeps free beside the locked weights: the experts each of `workers` live workers reads
    at once (in_flight_bytes: each reads its own step's), and FLOOR_SLACK. A floor for one worker left a
    second one (TTIN, a reload's new generation beside the draining one) no room to stream its experts in:
    every process in the memory limit thrashed, down to the router's own code pages."""
    return res.in_flight * max(1, int(workers)) + FLOOR_SLACK


def popular_path(model_path: str) -> str:
    return model_path + ".popular.json"


def attach(m, s, budget: int) -> None:
    """Give Model m a Residency under `budget` bytes (below its file's size), locking nothing yet: the
    kernels compile on it (the path a budget runs) before lock() locks its pages. Raises ValueError with
    a one-line reason (the caller halts with it)."""
    from ..model.residency import Residency
    if s.mlock:
        raise ValueError(f"mlock locks the whole model ({os.path.getsize(m.path) / 2**20:.0f} MiB) but "
                         f"weights_memory is {budget / 2**20:.0f} MiB: turn one of them off")
    m.residency = Residency(m.file, m.config, budget, partial=not getattr(s, "weights_memory", 0))


def start_after_compile(m, weights_memory: int, grown: int) -> None:
    """lock()'s first half: a budget chosen from the memory available (weights_memory 0) gives up what the
    kernels' compile kept beyond KERNELS_ROOM (`grown`: the process's anonymous memory grown since the budget
    was chosen), then m's Residency starts (its always-resident part locked)."""
    res = m.residency
    over = grown - KERNELS_ROOM
    if over > 0 and not weights_memory:
        log.info("model %s: the kernels took %.0f MiB beyond the %.0f MiB left for them: weights_memory "
                 "%.0f -> %.0f MiB", m.path, over / 2**20, KERNELS_ROOM / 2**20, res.budget / 2**20,
                 max(0, res.budget - over) / 2**20)
        res.shrink(res.budget - over)
    res.start()


def lock(m, s, grown: int, headroom=None) -> None:
    """Once the kernels are compiled: lock m's always-resident part and, from a saved popular set, the
    experts it names. `grown`: the master's anonymous memory grown since the budget was chosen. A budget
    the server chose left KERNELS_ROOM for it; a cold compile keeps more (hundreds of MiB at its peak, part
    of it kept), and pages locked before it would leave it none: an OOM kill in a memory limit. So the
    locks come after it, and a budget the server chose gives up what the compile kept beyond that room.
    headroom: as tend's. Raises ValueError / OSError with a one-line reason."""
    from ..model.residency import in_flight_bytes, memory_headroom
    headroom = headroom or memory_headroom
    res = m.residency
    start_after_compile(m, getattr(s, "weights_memory", 0), grown)
    # the room the budget leaves that tend() keeps free: the experts the workers read at once, and some slack
    res.in_flight = in_flight_bytes(m.file, m.config)
    res.floor, res.next_warn, res.held_since = floor_for(res, getattr(s, "workers", 1) or 1), 0.0, None
    _load_popular(res, m.path)
    _follow(res, m.path, headroom(), time.monotonic())        # a saved set locks at once: within the room
    res.rerank(max_swaps=1 << 30, uncached=1 << 30)
    res.next_rerank, res.next_save = 0.0, time.monotonic() + SAVE_EVERY
    budget = res.budget
    if res.misplaced:
        held = sum(res._bytes(c) for row in res.expert_chunks for c in row)
        log.warning("model %s: its experts are not on whole 2 MiB pieces (%d stacks; a converter before "
                    "colibri-convert 5 wrote it), so under weights_memory they hold %.0f%% more than their bytes: "
                    "convert it again to lock more of them", m.path, len(res.misplaced),
                    100 * (held / max(1, int(res.expert_bytes.sum())) - 1))
    whole = res.whole_always_bytes
    if res.always_bytes < whole:
        log.warning("model %s: the memory left beside the server's processes (weights_memory %.0f MiB) holds "
                    "%.0f of the %.0f MiB always needed: the rest and every expert are read on demand, slowly; "
                    "give it more memory", m.path, budget / 2**20, res.always_bytes / 2**20, whole / 2**20)
    log.info("model %s: weights_memory %.0f MiB of %.0f MiB: %.0f MiB always resident, %d experts locked "
             "by route counts, the rest read on demand", m.path, budget / 2**20, m.file.header["file_size"] / 2**20,
             res.always_bytes / 2**20, int(res.shared.resident.sum()))


def _load_popular(res, model_path: str) -> None:
    try:
        with open(popular_path(model_path)) as f:
            saved = json.load(f)
        score = np.asarray(saved["score"], np.float64)
        if score.shape == res.score.shape and saved.get("identity") == res.cf.identity:
            res.score[...] = score
    except (OSError, ValueError, KeyError, TypeError):
        pass


def _save_popular(res, model_path: str) -> None:
    tmp = f"{popular_path(model_path)}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"identity": res.cf.identity, "score": np.round(res.score, 2).tolist()}, f)
        os.replace(tmp, popular_path(model_path))
    except OSError:                 # a read-only model directory: no saved set, nothing else lost
        try:
            os.unlink(tmp)
        except OSError:
            pass


def tend(gens, headroom=None, workers=None) -> None:
    """One turn of the main loop: for every live generation's model that has a residency, hold its locked
    bytes under what the memory left allows (Residency.follow: the processes grew into the room the budget
    left them) and re-rank it. headroom: a callable giving the bytes left (model/residency.memory_headroom);
    workers: the live workers of every generation (they share the memory), which sets the floor (floor_for)."""
    if headroom is None:
        from ..model.residency import memory_headroom as headroom
    now = time.monotonic()
    for g in list(gens.values()):
        res = getattr(g.model, "residency", None)
        if res is None or now < res.next_rerank:
            continue
        res.next_rerank = now + RERANK_EVERY
        if workers is not None:
            res.floor = floor_for(res, workers)
        try:
            _follow(res, g.model.path, headroom(), now)
            res.rerank(MAX_SWAPS, UNCACHED_SWAPS)
        except OSError as e:
            log.warning("weights residency of %s: %s", g.model.path, e)
        if now >= res.next_save:
            res.next_save = now + SAVE_EVERY
            _save_popular(res, g.model.path)


def next_turn(gens, now: float) -> float:
    """Seconds until tend() has a model to re-rank (the master's loop sleeps no longer); inf: no budget. Only while
    tend() turns (not while the server stops: the re-rank stays due, and the loop would not sleep at all)."""
    due = [g.model.residency.next_rerank for g in list(gens.values())
           if getattr(g.model, "residency", None) is not None]
    return max(0.0, min(due) - now) if due else float("inf")


def _follow(res, path: str, room: int, now: float) -> None:
    before = res.ceiling
    after = res.follow(room, res.floor)
    if after >= res.budget:
        if res.held_since is not None and now - res.held_since >= HELD_WARN_AFTER:
            log.info("model %s: memory is back: the weights budget is %.0f MiB again", path, res.budget / 2**20)
        res.held_since = None
        return
    if res.held_since is None:
        res.held_since = now
    short = room < res.floor and after < before          # released experts: say so at once
    if (short or now - res.held_since >= HELD_WARN_AFTER) and now >= res.next_warn:
        res.next_warn = now + WARN_EVERY
        log.warning("model %s: %.0f MiB of memory left beside the %.0f MiB the server keeps free: weights locked "
                    "held to %.0f MiB of the %.0f MiB budget (%.0f MiB locked; the least routed experts are read "
                    "from disk when used) until the room comes back", path, max(0, room - res.floor) / 2**20,
                    res.floor / 2**20, after / 2**20, res.budget / 2**20, res.locked_bytes / 2**20)
