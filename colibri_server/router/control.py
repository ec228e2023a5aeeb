"""The router's control requests (tokenize, detokenize, health, stats): answered in its loop from what
it holds (the generation's tokenizer, the workers' last heartbeats, the memory sampler's cache), never
from a worker. The Router builds one ControlRequests with the containers it keeps and asks it for each
answer's body; the data path (queue, dispatch, ledger) stays in loop.py.

Owns: the answers to control requests and the stats document. Never: queues, dispatches or cancels.
"""
from __future__ import annotations

import os
import time

from ..wire import protocol as P
from .recent import RecentWindow
from .records import ControlRate, check_text


class ControlRequests:
    """The answers to control requests. `workers`, `gens`, `queue` and `counters` are the router's own
    containers (read here, never rebound there); `experts` its ExpertCounts, `serves(w, g)` whether
    worker w runs generation g (RemoteHosts.serves). `memory` (a MemorySampler unless given) reads
    smaps figures on a thread, never in the loop."""

    def __init__(self, *, workers: dict, gens: dict, queue, counters, experts, serves, t_start: float, memory=None):
        self.workers, self.gens, self.queue, self.counters = workers, gens, queue, counters
        self.experts, self.serves, self.t_start = experts, serves, t_start
        if memory is None:
            from ..host.memory import MemorySampler
            memory = MemorySampler()
        self.memory = memory
        self.rate = ControlRate()          # control_rate's token bucket per client
        self.recent = RecentWindow()       # the workers' figures over the last half minute (recent.py)

    def admit(self, client, t: str, rate: float):
        """control_rate: a client pipelining thousands of stats or tokenizes gets 'overloaded'
        answers instead of taking the loop's time from everyone's generates."""
        if not self.rate.take(client, rate):
            self.counters["rate_limited"] += 1
            raise P.ProtocolError("overloaded", f"more than {rate:g} control requests ({t}) a second from this "
                                                f"client (control_rate): slow down")

    def tick(self, now: float):
        """From the router's tick: forget idle clients' buckets, sample the workers' figures."""
        self.rate.prune(now, self.t_start)
        self.recent.sample(now, self.workers.values())

    def tokenize(self, body, gen) -> dict:
        """gen: the serving generation (Gen)."""
        segments = P.tokenize_segments(body)
        check_text("".join(t for t, _ in segments), "text", gen.limits)
        if gen.tokenizer is None:
            raise P.ProtocolError("bad_request", "this model has no tokenizer")
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise P.ProtocolError("bad_request", "field 'add_special_tokens' must be a boolean")
        # user text never yields control tokens; only segments marked as template text are parsed
        return {"ids": gen.tokenizer.encode_segments(segments, add)}

    def detokenize(self, body, gen) -> dict:
        ids = body.get("ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise P.ProtocolError("bad_request", "field 'ids' must be a list of token ids")
        most = gen.limits.max_prompt_tokens + gen.limits.max_tokens
        if len(ids) > most:
            raise P.ProtocolError("too_large", f"{len(ids)} ids to detokenize exceed max_prompt_tokens + "
                                               f"max_tokens = {most}")
        bad = [t for t in ids if not 0 <= t < (gen.vocab_size or 0)]
        if bad:
            raise P.ProtocolError("bad_request", f"token id {bad[0]} is outside the vocabulary")
        if gen.tokenizer is None:
            raise P.ProtocolError("bad_request", "this model has no tokenizer")
        return {"text": gen.tokenizer.decode(ids)}

    def health(self, generation: int, draining: bool) -> dict:
        ready = sum(1 for w in self.workers.values() if w.state == "ready" and self.serves(w, generation))
        gen = self.gens.get(generation)
        faulty = gen.faulty if gen is not None else None
        status = "draining" if draining else "faulty" if faulty else ("ok" if ready else "starting")
        out = {"status": status, "workers_ready": ready, "generation": generation, "queue": len(self.queue)}
        return {**out, "reason": faulty} if faulty and not draining else out

    def sample_memory(self, model_path: str, master_pid: int):
        self.memory.refresh([w.pid for w in self.workers.values() if not w.remote] + [master_pid, os.getpid()],
                            os.path.realpath(model_path))

    def stats(self, *, generation: int, model_path: str, draining: bool, last_reload, master_pid: int) -> dict:
        """Live scheduling figures; memory figures from the sampler's cache (memory_age_s old),
        which this call only asks to refresh: reading smaps here would stall the loop."""
        self.sample_memory(model_path, master_pid)
        mem = self.memory.get
        workers = []
        for w in sorted(self.workers.values(), key=lambda w: w.wid or 0):
            m = mem(w.pid) if not w.remote else {}      # another machine's process: its memory is not ours to read
            workers.append({"pid": w.pid, "wid": w.wid, "generation": w.generation, "state": w.state,
                            "host": w.host, "remote": w.remote, "identity": w.identity,
                            "cores": w.cores, "slots": w.slots, "running": len(w.running), "served": w.served,
                            "uptime_s": round(time.monotonic() - w.t_start, 1), "engine": w.engine, **m})
        master = mem(master_pid)
        me = {k: v for k, v in mem(os.getpid()).items() if not k.startswith("model_")}
        try:
            size = os.stat(model_path).st_size
        except OSError:
            size = 0
        gen = self.gens.get(generation)
        return {"generation": generation, "starting": gen is None,
                "model": model_path, "model_bytes": size, "context": gen.context if gen is not None else None,
                "queue": len(self.queue), "in_flight": sum(len(w.running) for w in self.workers.values()),
                "workers": workers, "counters": dict(self.counters), "draining": draining,
                "expert_counts": self.experts.total(generation, self.workers.values()),
                "recent": self.recent.figures(time.monotonic(), generation, self.workers.values()),
                "router": {"pid": os.getpid(), **me},
                "generations": sorted(self.gens), "last_reload": last_reload,
                "master": {"pid": master_pid, "model_rss": master["model_rss"], "model_pss": master["model_pss"]},
                "memory_age_s": self.memory.age(), "uptime_s": round(time.monotonic() - self.t_start, 1)}
