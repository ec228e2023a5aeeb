"""colibri wire protocol, version 1. No pickle anywhere: msgpack maps with size limits.

Clients speak to the router's frontend socket (ZeroMQ ROUTER) from a DEALER socket.
Every message is exactly two frames:

    frame 0: b"COLI/1"              protocol magic + version
    frame 1: msgpack map            the body (limits: MAX_BODY bytes; strings, arrays,
                                    maps and nesting bounded at unpack time)

Each body has "type" and "id" (the client's request id: a str of 1..64 chars or an int;
the router keys requests by (connection, id), so ids need only be unique per connection).

Requests (client -> server)
    generate   prompt: str | [int]   text, or token ids
               (or prompt_embeds: bytes  the prompt's input embeddings instead: little-endian float32,
                T x hidden_size, row-major; T is len / (4 x hidden_size))
               max_tokens: int = 16, temperature: float = 0, top_k: int = 0, top_p: float = 1,
               min_p: float = 0, repetition_penalty: float = 1, seed: int | None,
               stop: [str] = [], stop_token_ids: [int] = [], ignore_eos: bool = false,
               presence_penalty: float = 0, frequency_penalty: float = 0  (OpenAI's, in [-2, 2]),
               logit_bias: [[id, bias], ...] = []  (bias in [-100, 100], at most 1024 ids),
               n: int = 1  (completions sampled from one prefill of the prompt, 1..16 and at most a
                            worker's slots: it holds n slots),
               logprobs: int | None  (0..20: each sampled token's log-probability and that many top
                                      alternatives, from the model's raw logits),
               prompt_logprobs: int | None  (0..20: the same for every prompt token after the first),
               grammar: {type: "json_schema" | "regex" | "lark", value: str} | None  (constrained
                        decoding: the output stays inside it and ends when it is complete; a
                        JSON schema is given as JSON text; see model/grammar.py),
               request_id: str | None  (1..64 of A-Z a-z 0-9 . _ : / -: names the request in the
                                        router's and the worker's log lines and comes back in done;
                                        generated when absent),
               stream: bool = true   (false: one "done" carrying all text and ids),
               deadline_ms: int | None  (the whole request, from arrival at the router)
    tokenize   text: str, add_special_tokens: bool = true
               (special-token text such as "</s>" in `text` stays text: user content never
               becomes control tokens.  A chat template's rendering sends instead
               segments: [[str, bool], ...], where true marks the template's own text, whose
               special tokens are parsed, and false user content)
    detokenize ids: [int]
    cancel     (the id of a request in flight; answered by that request's end)
    health     -
    stats      -

Responses (server -> client), each with the id of its request
    token      text: str, ids: [int], index: int (the position of this token in the completion),
               choice: int (n > 1 only: which completion), logprobs: [entry] (one per id, when asked):
               entry = [token text, logprob, [[id, token text, logprob], ...top alternatives]],
               prompt_logprobs: [entry] (on the request's first token, when asked: see done)
               (stream=true only; text may be "" while it is held back for a stop string or an
               incomplete UTF-8 character: the held text comes in a later token)
    done       finish_reason: "stop" | "length" | "cancelled", text: str, ids: [int]: the WHOLE
               completion again (the concatenation of the tokens' text and ids when streaming),
               usage: {prompt_tokens, completion_tokens},
               timings: {queued_s, prefill_s, decode_s, total_s}, worker_pid: int, generation: int,
               attempts: int (dispatches: > 1 when a worker died before streaming and it was retried),
               request_id: str (the request's, given or generated),
               logprobs: [entry] (when asked; of the first completion), prompt_logprobs: [entry] (when
               asked: one per prompt token, the first with logprob null), choices: [{index, text, ids, finish_reason, logprobs}] (n > 1: every
               completion; the top-level text/ids/finish_reason are choice 0's, usage counts all)
    result     the answer, its fields directly in the body: tokenize {ids}, detokenize {text},
               health {status: "ok"|"starting"|"draining", workers_ready, generation, queue},
               stats {generation, model, model_bytes, queue, in_flight, workers: [...], counters, ...}
    error      code: str (ERROR_CODES), message: str. id is null when the request's id could not
               be read (an undecodable body): it concerns the last request that connection sent.

Every generate ends in exactly one "done" or one "error"; nothing ends in silence. A cancel
ends its request with "error" code "cancelled" if it was still queued, or with "done" and
finish_reason "cancelled" (with the tokens made so far) if a worker had started it.

Frame size: a body over the server's max_body is answered with "too_large"; a message over
4 x max_body (at least 16 MiB) is dropped by ZeroMQ with the connection (it is never read).
"""
from __future__ import annotations

import math
import re

import msgpack

from ..sampling_fields import SAMPLING_FIELDS

MAGIC = b"COLI/1"
MAX_BODY = 1 << 20              # bytes of one body frame
MAX_STR = 1 << 20
MAX_ARRAY = 1 << 17
MAX_MAP = 64
MAX_ID_LEN = 64

# stable error codes: clients switch on these, never on messages
ERROR_CODES = {
    "bad_request":        "the message is malformed or a field is invalid",
    "unsupported_version": "the protocol magic/version frame is not COLI/1",
    "unknown_type":       "the request type is not one of the known ones",
    "too_large":          "a frame, prompt, max_tokens or stop list exceeds the server's limit",
    "overloaded":         "the queue is full: retry later",
    "deadline_exceeded":  "the request's deadline passed",
    "cancelled":          "cancelled before it started",
    "worker_lost":        "the worker died after streaming tokens; the request cannot be retried",
    "numerical_fault":    "the forward pass gave non-finite logits (corrupted weights or an overflow)",
    "shutting_down":      "the server is stopping: it takes no new requests, and a stop cut this one",
    "starting":           "the server is loading its model (and compiling kernels): retry shortly",
    "duplicate_id":       "a request with this id is already in flight on this connection",
    "not_found":          "cancel of an id that is not in flight",
    "unauthorized":       "the client's CURVE key is no longer allowed (removed from curve_allowed_keys)",
    "internal":           "a server bug; the message says more",
}
REQUEST_TYPES = ("generate", "tokenize", "detokenize", "cancel", "health", "stats")
MAX_N = 16


MAX_LOGIT_BIAS = 1024
GRAMMAR_KINDS = ("json_schema", "regex", "lark")     # model/grammar.py's KINDS
MAX_GRAMMAR = 256 << 10
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/-]{1,64}")


class ProtocolError(Exception):
    """A message that cannot be served; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str):
        assert code in ERROR_CODES, code
        self.code, self.message = code, message
        super().__init__(f"{code}: {message}")


# ---------------------------------------------------------------------------- encoding

def pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def unpack(data: bytes, max_body: int = MAX_BODY, max_array: int = MAX_ARRAY) -> dict:
    """Decode one body frame with hard limits; raise ProtocolError(bad_request|too_large).
    (A client reading answers passes larger limits: a tokenize answer may hold more ids
    than a request may.)"""
    if len(data) > max_body:
        raise ProtocolError("too_large", f"body of {len(data)} bytes exceeds {max_body}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=MAX_STR, max_bin_len=MAX_STR,
                              max_array_len=max_array, max_map_len=MAX_MAP, max_ext_len=0,
                              use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError,
            UnicodeDecodeError) as e:
        raise ProtocolError("bad_request", f"body is not valid msgpack ({e.__class__.__name__}: {e})") from None
    except Exception as e:  # msgpack raises a few more exotic ones (e.g. OutOfData subclasses)
        raise ProtocolError("bad_request", f"body is not valid msgpack ({e.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_request", f"body must be a map, found {type(obj).__name__}")
    return obj


def frames(body: dict) -> list:
    return [MAGIC, pack(body)]


def parse_frames(parts, max_body: int = MAX_BODY) -> dict:
    """[magic, body] -> body dict (validated envelope: type and id)."""
    if len(parts) != 2:
        raise ProtocolError("bad_request", f"expected 2 frames (magic, body), got {len(parts)}")
    if parts[0] != MAGIC:
        raise ProtocolError("unsupported_version", f"first frame {bytes(parts[0][:16])!r} is not {MAGIC!r}")
    body = unpack(parts[1], max_body)
    t = body.get("type")
    if not isinstance(t, str):
        raise ProtocolError("bad_request", "field 'type' is missing or not a string")
    if t not in REQUEST_TYPES:
        raise ProtocolError("unknown_type", f"type {t[:40]!r} is not one of {', '.join(REQUEST_TYPES)}")
    check_id(body.get("id"))
    return body


def check_id(rid):
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise ProtocolError("bad_request", "field 'id' must be a string or an integer")
    if isinstance(rid, str) and not 0 < len(rid) <= MAX_ID_LEN:
        raise ProtocolError("bad_request", f"field 'id' must have 1..{MAX_ID_LEN} characters")
    if isinstance(rid, int) and not -(1 << 63) <= rid < (1 << 64):
        raise ProtocolError("bad_request", "field 'id' is out of the 64-bit range")


# ---------------------------------------------------------------------------- validation

class Limits:
    """Server-side limits, checked at the router before a request is queued."""

    def __init__(self, max_prompt_tokens=8192, max_tokens=4096, max_stop=16, max_stop_len=256,
                 max_body=MAX_BODY, vocab_size=None, hidden_size=None):
        self.max_prompt_tokens, self.max_tokens = max_prompt_tokens, max_tokens
        self.hidden_size = hidden_size
        self.max_stop, self.max_stop_len, self.max_body = max_stop, max_stop_len, max_body
        self.vocab_size = vocab_size


def _num(body, name, typ, default):
    v = body.get(name, default)
    if v is None and default is None:
        return None
    if typ is bool:
        if not isinstance(v, bool):
            raise ProtocolError("bad_request", f"field {name!r} must be a boolean")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and not isinstance(v, int)):
        raise ProtocolError("bad_request", f"field {name!r} must be {'an integer' if typ is int else 'a number'}")
    if typ is float:
        try:
            v = float(v)
        except OverflowError:
            raise ProtocolError("bad_request", f"field {name!r} is out of range") from None
        if not math.isfinite(v):
            raise ProtocolError("bad_request", f"field {name!r} must be finite")
    return v


def validate_generate(body: dict, limits: Limits) -> dict:
    """A generate body -> normalised request dict; raises ProtocolError naming the field."""
    known = {"type", "id", "request_id", "prompt", "prompt_embeds", "stop", "stop_token_ids", "stream", "deadline_ms", "n", "logit_bias", "grammar"} | \
        set(SAMPLING_FIELDS)
    extra = sorted((k for k in body if k not in known), key=repr)     # keys may be str or bytes
    if extra:
        raise ProtocolError("bad_request", f"unknown field {extra[0]!r:.40}")
    prompt = body.get("prompt")
    embeds = body.get("prompt_embeds")
    if embeds is not None:
        if prompt is not None:
            raise ProtocolError("bad_request", "give 'prompt' or 'prompt_embeds', not both")
        row = 4 * (limits.hidden_size or 1)
        if not isinstance(embeds, bytes):
            raise ProtocolError("bad_request", "field 'prompt_embeds' must be bytes")
        if not embeds or len(embeds) % row:
            raise ProtocolError("bad_request", f"field 'prompt_embeds' must be bytes: float32 rows of hidden_size "
                                               f"{limits.hidden_size} ({row} bytes each), got {len(embeds)} bytes")
        if len(embeds) // row > limits.max_prompt_tokens:
            raise ProtocolError("too_large", f"prompt_embeds of {len(embeds) // row} rows exceeds "
                                             f"{limits.max_prompt_tokens}")
    elif isinstance(prompt, str):
        if not prompt:
            raise ProtocolError("bad_request", "field 'prompt' is empty")
    elif isinstance(prompt, list):
        if not prompt:
            raise ProtocolError("bad_request", "field 'prompt' is an empty list")
        if len(prompt) > limits.max_prompt_tokens:
            raise ProtocolError("too_large", f"prompt of {len(prompt)} tokens exceeds {limits.max_prompt_tokens}")
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ProtocolError("bad_request", f"prompt[{i}] is not an integer token id")
            if t < 0 or (limits.vocab_size is not None and t >= limits.vocab_size):
                raise ProtocolError("bad_request", f"prompt[{i}] = {t} is outside the vocabulary "
                                                   f"0..{(limits.vocab_size or 1) - 1}")
    else:
        raise ProtocolError("bad_request", "field 'prompt' must be a string or a list of token ids")
    req = {"prompt": prompt}
    if embeds is not None:
        req["prompt_embeds"], req["prompt_len"] = embeds, len(embeds) // (4 * (limits.hidden_size or 1))
    for name, f in SAMPLING_FIELDS.items():
        req[name] = _num(body, name, f.type, f.default)
        why = f.problem(req[name])
        if why:
            raise ProtocolError("bad_request", f"field {name!r} must be {why}")
    if req["max_tokens"] > limits.max_tokens:
        raise ProtocolError("too_large", f"max_tokens {req['max_tokens']} exceeds {limits.max_tokens}")
    req["n"] = _num(body, "n", int, 1)
    if not 1 <= req["n"] <= MAX_N:
        raise ProtocolError("bad_request", f"field 'n' must be in 1..{MAX_N}")
    req["logit_bias"] = _logit_bias(body.get("logit_bias", []), limits.vocab_size)
    g = body.get("grammar")
    if g is not None:
        if not isinstance(g, dict) or set(g) != {"type", "value"} or g["type"] not in GRAMMAR_KINDS \
                or not isinstance(g["value"], str) or not g["value"]:
            raise ProtocolError("bad_request", "field 'grammar' must be {type: " + " | ".join(GRAMMAR_KINDS) +
                                ", value: a non-empty string}")
        if len(g["value"]) > MAX_GRAMMAR:
            raise ProtocolError("too_large", f"grammar of {len(g['value'])} characters exceeds {MAX_GRAMMAR}")
        from ..model.grammar import GrammarError, check  # (the router's import: clients never validate)
        try:
            check(g["type"], g["value"])
        except GrammarError as e:
            raise ProtocolError("bad_request", str(e)) from None
    req["grammar"] = g
    rq = body.get("request_id")
    if rq is not None and not (isinstance(rq, str) and REQUEST_ID.fullmatch(rq)):
        raise ProtocolError("bad_request", "field 'request_id' must be 1..64 of A-Z a-z 0-9 . _ : / -")
    req["request_id"] = rq
    stop = body.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError("bad_request", "field 'stop' must be a list of non-empty strings")
    if len(stop) > limits.max_stop or any(len(s) > limits.max_stop_len for s in stop):
        raise ProtocolError("too_large", f"at most {limits.max_stop} stop strings of {limits.max_stop_len} characters")
    req["stop"] = stop
    sids = body.get("stop_token_ids", [])
    if not isinstance(sids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in sids):
        raise ProtocolError("bad_request", "field 'stop_token_ids' must be a list of token ids")
    if len(sids) > limits.max_stop * 4:
        raise ProtocolError("too_large", f"at most {limits.max_stop * 4} stop token ids")
    req["stop_token_ids"] = sids
    req["stream"] = _num(body, "stream", bool, True)
    dl = body.get("deadline_ms")
    if dl is not None and (isinstance(dl, bool) or not isinstance(dl, int) or not 0 < dl <= 86_400_000):
        raise ProtocolError("bad_request", "field 'deadline_ms' must be an integer in 1..86400000")
    req["deadline_ms"] = dl
    return req


def _logit_bias(lb, vocab_size) -> list:
    """[[id, bias], ...] checked: ids in the vocabulary and unique, biases finite in [-100, 100]."""
    if not isinstance(lb, list) or not all(isinstance(e, list) and len(e) == 2 for e in lb):
        raise ProtocolError("bad_request", "field 'logit_bias' must be a list of [token id, bias] pairs")
    if len(lb) > MAX_LOGIT_BIAS:
        raise ProtocolError("too_large", f"logit_bias of {len(lb)} ids exceeds {MAX_LOGIT_BIAS}")
    seen, out = set(), []
    for i, (t, b) in enumerate(lb):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ProtocolError("bad_request", f"logit_bias[{i}]: token id {t!r:.40} is outside the vocabulary "
                                               f"0..{(vocab_size or 1) - 1}")
        if t in seen:
            raise ProtocolError("bad_request", f"logit_bias[{i}]: token id {t} is given twice")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise ProtocolError("bad_request", f"logit_bias[{i}]: the bias of token {t} must be a number in [-100, 100]")
        seen.add(t)
        out.append([t, float(b)])
    return out


MAX_SEGMENTS = 4096


def tokenize_segments(body: dict) -> list:
    """A tokenize body -> [(text, parse_special)]: `text` (user text, never parsed for special
    tokens) or `segments` (see the module doc). Raises ProtocolError naming the field."""
    text, segs = body.get("text"), body.get("segments")
    if segs is None:
        if not isinstance(text, str):
            raise ProtocolError("bad_request", "field 'text' must be a string")
        return [(text, False)]
    if text is not None:
        raise ProtocolError("bad_request", "give either 'text' or 'segments', not both")
    if not isinstance(segs, list) or not 0 < len(segs) <= MAX_SEGMENTS or not all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], bool) for x in segs):
        raise ProtocolError("bad_request", f"field 'segments' must be a list of 1..{MAX_SEGMENTS} "
                                           "[text, is_template_text] pairs")
    return [(t, p) for t, p in segs]


def error_body(rid, code: str, message: str) -> dict:
    return {"type": "error", "id": rid, "code": code, "message": message}
