"""What the workers did over the last WINDOW_S seconds: expert routing counts per layer, tokens per
second and rows per batched step, from the cumulative figures each worker's heartbeat carries
(BatchEngine.stats: expert_counts, tokens_out, rows_total, steps).

The router keeps, every EVERY_S seconds, a reference to each worker's last engine figures: a heartbeat
replaces a worker's `engine` dict with a new one and never changes the old, so a sample costs one dict
of references (nothing copied) and the figures of the window are computed only when `stats` asks,
as each worker's figures now minus its own at the window's start (a worker that started within the
window counts from zero; one that exited drops out).

Owns: the samples and the window's figures. Never: reads a worker or the loop's sockets.
"""
from __future__ import annotations

import collections

WINDOW_S = 30.0         # the heat map's and the rates' window
EVERY_S = 5.0           # between samples: the window spans WINDOW_S to WINDOW_S + EVERY_S once warm; a
#                         sample holds each worker's last figures alive (L x E counts: ~0.5 MB for 61 x 256)


class RecentWindow:
    def __init__(self, window: float = WINDOW_S, every: float = EVERY_S):
        self.window, self.every = float(window), float(every)
        self.samples = collections.deque()     # (t, {pid: engine dict}), oldest first

    def sample(self, now: float, workers) -> None:
        """At most every `every` seconds (the router's tick calls it); drops the samples the window has passed:
        the oldest kept is the newest one at least `window` old."""
        if self.samples and now - self.samples[-1][0] < self.every:
            return
        self.samples.append((now, {w.pid: w.engine for w in workers if w.engine}))
        while len(self.samples) > 1 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()

    def figures(self, now: float, generation: int, workers) -> dict:
        """The window's figures for the serving generation's workers: window_s (its actual span, 0 before a
        first sample), expert_counts (L,E) lists of lists, tokens (sampled), tokens_per_s, steps and
        rows_per_step (rows of the batched steps: prompt positions and decoded tokens)."""
        t0, base = self.samples[0] if self.samples else (now, {})
        span = max(0.0, now - t0)
        counts, tokens, rows, steps = None, 0, 0, 0
        for w in workers:
            e = w.engine
            if not e or w.generation != generation:
                continue
            b = base.get(w.pid) or {}
            tokens += _delta(e, b, "tokens_out")
            rows += _delta(e, b, "rows_total")
            steps += _delta(e, b, "steps")
            c = e.get("expert_counts")
            if not c:
                continue
            bc = b.get("expert_counts")
            if not bc or len(bc) != len(c) or len(bc[0]) != len(c[0]):
                bc = None
            d = [[max(0, x - y) for x, y in zip(rc, rb)] for rc, rb in zip(c, bc)] if bc else [list(r) for r in c]
            if counts is not None and (len(counts) != len(d) or len(counts[0]) != len(d[0])):
                continue        # another shape (a remote host's file mid-rollout): not this generation's map
            counts = d if counts is None else [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(counts, d)]
        return {"window_s": round(span, 1), "expert_counts": counts or [], "tokens": tokens,
                "tokens_per_s": round(tokens / span, 1) if span > 0 else 0.0, "steps": steps,
                "rows_per_step": round(rows / steps, 2) if steps else 0.0}


def _delta(now: dict, base: dict, key: str) -> int:
    a, b = now.get(key), base.get(key, 0)
    if not isinstance(a, int) or not isinstance(b, int):
        return 0
    return max(0, a - b)
