"""The router's control requests (tokenize, detokenize, health, stats): answered in its loop from what
it holds (the generation's tokenizer, the workers' last heartbeats, the memory sampler's cache), never
from a worker. A mixin of router.Router, kept apart so router.py holds the data path.

Owns: the answers to control requests and the stats document. Never: queues, dispatches or cancels.
"""
from __future__ import annotations

import os
import time

from ..wire import protocol as P


class ControlRequests:
    def on_tokenize(self, client, cid, body):
        segments = P.tokenize_segments(body)
        self._check_text("".join(t for t, _ in segments), "text")
        if self.tokenizer is None:
            raise P.ProtocolError("bad_request", "this model has no tokenizer")
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise P.ProtocolError("bad_request", "field 'add_special_tokens' must be a boolean")
        # user text never yields control tokens; only segments marked as template text are parsed
        self.reply(client, {"type": "result", "id": cid, "ids": self.tokenizer.encode_segments(segments, add)})

    def on_detokenize(self, client, cid, body):
        ids = body.get("ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise P.ProtocolError("bad_request", "field 'ids' must be a list of token ids")
        most = self.limits.max_prompt_tokens + self.limits.max_tokens
        if len(ids) > most:
            raise P.ProtocolError("too_large", f"{len(ids)} ids to detokenize exceed max_prompt_tokens + "
                                               f"max_tokens = {most}")
        bad = [t for t in ids if not 0 <= t < (self.vocab_size or 0)]
        if bad:
            raise P.ProtocolError("bad_request", f"token id {bad[0]} is outside the vocabulary")
        if self.tokenizer is None:
            raise P.ProtocolError("bad_request", "this model has no tokenizer")
        self.reply(client, {"type": "result", "id": cid, "text": self.tokenizer.decode(ids)})

    def on_health(self, client, cid, body):
        ready = sum(1 for w in self.workers.values() if w.state == "ready" and self.serves(w, self.generation))
        status = "draining" if self.draining else ("ok" if ready else "starting")
        self.reply(client, {"type": "result", "id": cid, "status": status, "workers_ready": ready,
                            "generation": self.generation, "queue": len(self.queue)})

    def on_stats(self, client, cid, body):
        self.reply(client, {"type": "result", "id": cid, **self.stats()})

    def _sample_memory(self):
        self.memory.refresh([w.pid for w in self.workers.values() if not w.remote] + [self.ppid, os.getpid()],
                            os.path.realpath(self.model_path))

    def stats(self) -> dict:
        """Live scheduling figures; memory figures from the sampler's cache (memory_age_s old),
        which this call only asks to refresh: reading smaps here would stall the loop."""
        self._sample_memory()
        mem = self.memory.get
        workers = []
        for w in sorted(self.workers.values(), key=lambda w: w.wid or 0):
            m = mem(w.pid) if not w.remote else {}      # another machine's process: its memory is not ours to read
            workers.append({"pid": w.pid, "wid": w.wid, "generation": w.generation, "state": w.state,
                            "host": w.host, "remote": w.remote, "identity": w.identity,
                            "cores": w.cores, "slots": w.slots, "running": len(w.running), "served": w.served,
                            "uptime_s": round(time.monotonic() - w.t_start, 1), "engine": w.engine, **m})
        master = mem(self.ppid)
        me = {k: v for k, v in mem(os.getpid()).items() if not k.startswith("model_")}
        try:
            size = os.stat(self.model_path).st_size
        except OSError:
            size = 0
        return {"generation": self.generation, "starting": self.generation not in self.gens,
                "model": self.model_path, "model_bytes": size,
                "queue": len(self.queue), "in_flight": sum(len(w.running) for w in self.workers.values()),
                "workers": workers, "counters": dict(self.counters), "draining": self.draining,
                "expert_counts": self.experts.total(self.generation, self.workers.values()),
                "router": {"pid": os.getpid(), **me},
                "generations": sorted(self.gens), "last_reload": self.last_reload,
                "master": {"pid": self.ppid, "model_rss": master["model_rss"], "model_pss": master["model_pss"]},
                "memory_age_s": self.memory.age(), "uptime_s": round(time.monotonic() - self.t_start, 1)}
