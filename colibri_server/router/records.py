"""What the router keeps and the small helpers of its sockets: Gen (a generation's tokenizer,
vocabulary, context and limits), Req (a request from arrival to its one answer), W (a worker and
its credits), the prefix key of a prompt (affinity to the worker holding its first KV block),
ControlRate (control_rate's token bucket per client), and the bind/chmod/id-salvage helpers.
The loop that uses them is loop.py's.
"""
from __future__ import annotations

import logging
import os

import zmq

from ..wire import protocol as P

log = logging.getLogger("colibri.router")


MAX_TEXT_BYTES_PER_TOKEN = 16   # a text prompt longer than this x max_prompt_tokens is refused untokenized


def check_text(text, what, limits):
    """The size guard of text the router would tokenize in its loop (limits: the generation's)."""
    nbytes = len(text.encode("utf-8", "surrogatepass"))
    if nbytes > MAX_TEXT_BYTES_PER_TOKEN * limits.max_prompt_tokens:
        # refuse before tokenizing: tokenizing megabytes would stall this loop for seconds
        raise P.ProtocolError("too_large", f"{what} of {nbytes} bytes cannot fit in max_prompt_tokens "
                                           f"{limits.max_prompt_tokens}")


class Gen:
    """What the router needs of one generation: its tokenizer, vocabulary and context."""
    __slots__ = ("number", "model_path", "tokenizer", "vocab_size", "hidden_size", "context", "limits", "identity",
                 "faulty")

    def __init__(self, info, settings):
        from ..model.tokenizer import Tokenizer
        self.number, self.model_path = info["generation"], info["model"]
        self.identity = info.get("identity")
        self.vocab_size, self.context = info["vocab_size"], info["context"]
        self.hidden_size = info.get("hidden_size")
        self.faulty = None          # why the model of this generation fails its requests (the master says)
        tj = info.get("tokenizer_json") or ""
        self.tokenizer = Tokenizer.from_json(tj) if tj else None
        self.set_limits(settings)

    def set_limits(self, s):
        self.limits = P.Limits(max_prompt_tokens=s.max_prompt_tokens, max_tokens=s.max_tokens, max_stop=s.max_stop,
                               max_body=s.max_body, vocab_size=self.vocab_size, hidden_size=self.hidden_size)


class Req:
    __slots__ = ("rid", "client", "cid", "request", "stream", "state", "worker", "attempts", "streamed",
                 "t_arrive", "t_dispatch", "deadline", "generation", "key", "request_id", "body")

    def __init__(self, rid, client, cid, request, now, generation):
        self.rid, self.client, self.cid, self.request = rid, client, cid, request
        if not request.get("request_id"):           # in every log line about it, the worker's too
            request["request_id"] = os.urandom(8).hex()
        self.request_id = request["request_id"]
        self.generation = generation    # tokenized and checked for it: runs only on its workers
        self.stream = request["stream"]
        self.state = "queued"           # queued | running
        self.worker = None
        self.attempts = 0
        self.streamed = False
        self.t_arrive, self.t_dispatch = now, None
        self.key = None                 # the client's CURVE key (ZAP User-Id), when CURVE is on
        self.body = None                # the client's message (checked again when its generation is gone)
        dl = request.get("deadline_ms")
        self.deadline = now + dl / 1000.0 if dl else None


def prefix_key(prompt):
    """The affinity key of a tokenized prompt: the model's key of its first KV block (None for a
    text prompt, or one too short to reuse a block)."""
    if not isinstance(prompt, list):
        return None
    from ..model.kv import first_block_key
    return first_block_key(prompt)


class W:
    __slots__ = ("ident", "pid", "wid", "generation", "slots", "running", "last_seen", "state", "cores",
                 "served", "t_start", "last_dispatch", "engine", "identity", "host", "remote", "sock")

    def __init__(self, ident, body, now):
        self.ident = ident
        self.pid, self.wid = body.get("pid"), body.get("wid")
        self.generation, self.slots = body.get("generation", 0), max(1, int(body.get("slots", 1)))
        self.cores = body.get("cores") or []
        self.running = {}               # rid -> the slots it holds (its n)
        self.last_seen = now
        self.state = "ready"            # ready | draining | unresponsive
        self.served = 0
        self.t_start = now
        self.last_dispatch = 0.0
        self.engine = {}                # the worker's batch engine figures, from its last heartbeat
        self.identity = body.get("identity")    # its model file's identity (ColibriFile.identity)
        self.host = body.get("host")            # its master: hostname:pid
        self.remote = False             # on the tcp backend (a worker host's), not forked by our master
        self.sock = None                # the backend socket it is on (None: the local one)

    @property
    def free(self):
        return self.slots - sum(self.running.values()) if self.state == "ready" else 0


class ControlRate:
    """Token bucket per client for control requests: `rate` a second, bursts of twice that."""

    def __init__(self):
        self.buckets = {}                  # client -> [tokens, last refill]

    def take(self, client, rate: float) -> bool:
        """Spend one token of client's bucket; False when it is empty (rate <= 0: no limit)."""
        import time
        if rate <= 0:
            return True
        now = time.monotonic()
        b = self.buckets.get(client)
        burst = max(2.0 * rate, 1.0)
        if b is None:
            b = self.buckets[client] = [burst, now]
        b[0] = min(burst, b[0] + (now - b[1]) * rate)
        b[1] = now
        if b[0] < 1.0:
            return False
        b[0] -= 1.0
        return True

    def prune(self, now: float, t_start: float) -> None:
        """Forget clients idle for a minute (checked once a minute, or when there are many)."""
        if len(self.buckets) > 4096 or (self.buckets and now - t_start > 60 and int(now) % 60 == 0):
            self.buckets = {c: b for c, b in self.buckets.items() if now - b[1] < 60}


class AttrDict(dict):
    __getattr__ = dict.__getitem__


def salvage_id(rest):
    """The id of a malformed request, when the body decodes at all (so the error can name it)."""
    try:
        body = P.unpack(rest[-1]) if rest else {}
        rid = body.get("id")
        P.check_id(rid)
        return rid
    except Exception:
        return None


def chmod_ipc(addr, mode):
    if addr.startswith("ipc://"):
        try:
            os.chmod(addr[len("ipc://"):], mode)
        except OSError as e:
            log.warning("cannot chmod %s: %s", addr, e)


class BindFailed(Exception):
    pass


def bind_message(addr, e) -> str:
    msg = f"cannot bind {addr}: {e.strerror if hasattr(e, 'strerror') else e}"
    if addr.startswith("ipc://"):
        d = os.path.dirname(addr[len("ipc://"):]) or "."
        if not os.path.isdir(d):
            msg += f" (the directory {d} does not exist: create it, or under systemd use RuntimeDirectory=)"
    elif e.errno == zmq.EADDRINUSE:
        msg += " (another process listens there: stop it or choose another bind)"
    return msg


class ExpertCounts:
    """How often each layer's router chose each expert, over the workers of a generation: the live
    workers' counts (from their heartbeats) plus those of workers that have exited, so the total only
    grows (a Prometheus counter) while the generation serves."""

    def __init__(self):
        self.retired = {}                  # generation -> (L,E) list of lists

    def retire(self, w) -> None:
        c = (w.engine or {}).get("expert_counts")
        if c:
            self.retired[w.generation] = _add(self.retired.get(w.generation), c)

    def total(self, generation, workers) -> list:
        out = self.retired.get(generation)
        for w in workers:
            c = (w.engine or {}).get("expert_counts")
            if w.generation == generation and c:
                out = _add(out, c)
        return out or []


def _add(a, b):
    if not a or len(a) != len(b) or len(a[0]) != len(b[0]):
        return [list(r) for r in b]
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
