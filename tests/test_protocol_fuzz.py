"""Fuzzing the wire protocol with hypothesis.

In process: `protocol.unpack`, `protocol.parse_frames` and `protocol.validate_generate` get
arbitrary bytes, msgpack-shaped bytes, deep nesting and structured random bodies (the right
and wrong keys, random value types, nested values, huge ints, NaN/inf): the only exception
allowed out is `ProtocolError` with a code in ERROR_CODES, and a request that validates is
normalised into something in range that packs and that the worker can serve (its
`SamplingParams` accept it and its `Sampler` draws tokens with it). Plus 20000 cheap
byte-level mutations of valid and corpus bodies.
The default suite runs a bounded, derandomized pass; `-m slow` runs a long random one.

Live: random messages through a raw DEALER to one real `colibri serve` (2 workers): each
gets exactly one final answer -- the error code the in-process validation predicts when it
rejects the message, else a valid answer -- then a health probe must be the next reply; at
the end no process was restarted and the error counters match the errors received.
"""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from server_harness import Server
from test_bad_requests import Raw, count_error, error_counters_grew_as_received, snapshot

from colibri_server.model.sampler import Sampler, SamplingParams
from colibri_server.wire import protocol as P

VOCAB = 512
_rng = np.random.default_rng(0)
LOGITS = [(_rng.standard_normal(VOCAB) * 4).astype(np.float32),               # typical logits
          np.where(np.arange(VOCAB) % 7 == 0, 3.0, -1e4).astype(np.float32)]  # ties at the top
HISTORY = np.array([0, 5, 7, 511], dtype=np.int64)
LIMITS = P.Limits(vocab_size=VOCAB)         # the server's defaults, and the test model's vocabulary
U64, I64_MIN = (1 << 64) - 1, -(1 << 63)
NAMES = ["type", "id", "prompt", "stop", "stop_token_ids", "stream", "deadline_ms", "text", "ids",
         "add_special_tokens", *P.SAMPLING_FIELDS, *P.REQUEST_TYPES]
HC = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
FAST = dict(derandomize=True, database=None, deadline=None, suppress_health_check=HC,
            phases=[Phase.explicit, Phase.generate])     # bounded: no shrinking (the regressions below are minimal)
LONG = dict(derandomize=False, database=None, deadline=None, suppress_health_check=HC, max_examples=3000)

# ---------------------------------------------------------------------------- strategies

SPECIAL_INTS = [0, 1, -1, 2, VOCAB - 1, VOCAB, 4096, 4097, 8192, 8193, 86_400_000, 86_400_001,
                (1 << 31) - 1, 1 << 31, (1 << 63) - 1, 1 << 63, U64, I64_MIN]
SPECIAL_FLOATS = [0.0, -0.0, 1.0, 0.5, 1e-45, 5e-324, 1e-300, 99.999, 100.0, math.nextafter(100.0, 200.0),
                  math.nextafter(1.0, 2.0), 1e300, 1.7976931348623157e308, -1e-300, math.nan, math.inf, -math.inf]

wire_ints = st.one_of(st.sampled_from(SPECIAL_INTS), st.integers(I64_MIN, U64))      # what msgpack can carry
any_ints = st.one_of(wire_ints, st.integers(), st.sampled_from([1 << 64, -(1 << 63) - 1, 10 ** 400, -10 ** 400]))
floats = st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats())
texts = st.one_of(st.sampled_from(NAMES + ["", "x" * 64, "x" * 65, "\x00", "\ufffd", "\U0001F600"]),
                  st.text(max_size=12))
keys = st.one_of(texts, st.binary(max_size=8))


def leaves(ints=wire_ints):
    return st.one_of(st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=12))


def values(ints=wire_ints):
    """Any msgpack value: nested lists and maps (recursive, so slow to draw: used sparingly)."""
    return st.recursive(leaves(ints), lambda ch: st.one_of(st.lists(ch, max_size=6),
                                                           st.dictionaries(keys, ch, max_size=5)), max_leaves=8)


def shallow(ints=wire_ints):
    """A value of any type, nested at most once (cheap to draw)."""
    leaf = leaves(ints)
    return st.one_of(leaf, st.lists(leaf, max_size=3), st.dictionaries(keys, leaf, max_size=2))


def fields(ints=wire_ints):
    """Per-field strategies: values near the valid range, and anything at all."""
    v = shallow(ints)
    small = st.integers(-3, 10)
    num = st.one_of(floats, small, st.integers(95, 105), v)
    return {
        "type": st.one_of(st.sampled_from(P.REQUEST_TYPES), st.just("generate"), texts, v),
        "id": st.one_of(st.text(min_size=1, max_size=64), ints, v),
        "prompt": st.one_of(st.lists(st.integers(-2, VOCAB + 2), max_size=8), st.text(max_size=24),
                            st.lists(st.integers(0, VOCAB - 1), min_size=250, max_size=260),
                            values(ints)),
        "max_tokens": st.one_of(st.integers(-2, 6), st.sampled_from([4096, 4097, U64, I64_MIN]), v),
        "temperature": num, "top_p": num, "min_p": num, "repetition_penalty": num,
        "top_k": st.one_of(small, st.integers(0, 1 << 20), v),
        "seed": st.one_of(st.none(), small, st.sampled_from([(1 << 63) - 1, 1 << 63, U64]), v),
        "ignore_eos": st.one_of(st.booleans(), v), "stream": st.one_of(st.booleans(), v),
        "stop": st.one_of(st.lists(st.text(max_size=4), max_size=20), st.text(max_size=4), v),
        "stop_token_ids": st.one_of(st.lists(st.integers(-2, VOCAB + 2), max_size=70), v),
        "deadline_ms": st.one_of(st.none(), st.integers(-2, 3), st.sampled_from([10_000, 86_400_001]), v),
        "text": st.one_of(st.text(max_size=24), v),
        "ids": st.one_of(st.lists(st.integers(-2, VOCAB + 2), max_size=8), v),
        "add_special_tokens": st.one_of(st.booleans(), v),
    }


def random_bodies(ints=wire_ints):
    """Maps with some of the known keys (right or wrong values) plus a few random keys."""
    known = st.fixed_dictionaries({}, optional=fields(ints))
    extra = st.dictionaries(keys, st.one_of(shallow(ints), values(ints)), max_size=3)
    return st.tuples(known, extra, st.booleans()).map(lambda t: {**t[1], **t[0]} if t[2] else {**t[0], **t[1]})


tiny = st.sampled_from([5e-324, 1e-320, 1e-300, 1e-45, 1e-39, 1e-30, 1e-8])
GOOD = {   # valid values (cheap to serve: at most 4 tokens), including the edges of each range
    "prompt": st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), st.text(min_size=1, max_size=16)),
    "max_tokens": st.integers(1, 4),
    "temperature": st.one_of(st.just(0.0), tiny, st.floats(0, 100)),
    "top_k": st.one_of(st.integers(0, VOCAB + 1), st.just(U64)),
    "top_p": st.one_of(tiny, st.floats(0, 1, exclude_min=True)),
    "min_p": st.one_of(tiny, st.floats(0, 1)),
    "repetition_penalty": st.one_of(tiny, st.floats(0, 100, exclude_min=True)),
    "seed": st.one_of(st.none(), st.integers(0, (1 << 63) - 1)),
    "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, VOCAB + 8), st.just(U64)), max_size=4),
    "deadline_ms": st.one_of(st.none(), st.integers(5000, 86_400_000)),
    "text": st.text(max_size=16), "ids": st.lists(st.integers(0, VOCAB - 1), max_size=8),
    "add_special_tokens": st.booleans(),
}
REQUIRED = {"generate": ["prompt"], "tokenize": ["text"], "detokenize": ["ids"]}
OPTIONAL = {"generate": sorted(set(GOOD) - {"prompt", "text", "ids", "add_special_tokens"}),
            "tokenize": ["add_special_tokens"]}
_DELETE = object()


def _edited(t):
    body, edits = t
    body = dict(body)
    for k, v in edits:
        if v is _DELETE:
            body.pop(k, None)
        else:
            body[k] = v
    return body


def near_valid_bodies(ints=wire_ints):
    """A valid request of a random type, then 0..2 edits: a field set to a wrong value or
    deleted, or an unknown field added."""
    f = fields(ints)
    valid = st.sampled_from(P.REQUEST_TYPES).flatmap(lambda t: st.fixed_dictionaries(
        {"type": st.just(t), "id": st.one_of(st.text(min_size=1, max_size=64), st.integers(I64_MIN, U64)),
         **{n: GOOD[n] for n in REQUIRED.get(t, [])}},
        optional={n: GOOD[n] for n in OPTIONAL.get(t, [])}))
    field_edit = st.sampled_from(sorted(f)).flatmap(
        lambda n: st.tuples(st.just(n), st.one_of(f[n], st.just(_DELETE))))
    edit = st.one_of(field_edit, st.tuples(keys, shallow(ints)))
    return st.tuples(valid, st.lists(edit, max_size=2)).map(_edited)


def bodies(ints=wire_ints):
    return st.one_of(near_valid_bodies(ints), near_valid_bodies(ints), random_bodies(ints))


def _nest(t):
    depth, level = t
    return b"\x82\xa4type\xa8generate\xa6prompt" + level * depth + b"\x00"


FRAGMENTS = [b"\xa4type", b"\xa2id", b"\xa6prompt", b"\xa8generate", b"\xa6health", b"\xc0", b"\xc2", b"\xc3",
             b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00", b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xdc\xff\xff",
             b"\xdd\xff\xff\xff\xff", b"\xde\x00\x41", b"\xdf\xff\xff\xff\xff", b"\xd9\x05", b"\xda\xff\xff",
             b"\xc4\x03", b"\xd4\x01\x00", b"\xd6\xff\x00\x00\x00\x01", b"\xc1", b"\xa2\xff\xfe", b"\xa3\xed\xa0\x80"]
msgpackish = st.lists(st.one_of(st.integers(0x80, 0x9f).map(lambda b: bytes([b])), st.sampled_from(FRAGMENTS),
                                st.binary(max_size=4)), max_size=30).map(b"".join)
deep = st.tuples(st.integers(1, 3000), st.sampled_from([b"\x91", b"\x81\xa1a", b"\xdc\x00\x01"])).map(_nest)
packed = bodies().map(P.pack)
body_bytes = st.one_of(packed, st.binary(max_size=256), msgpackish, deep)
frame_lists = st.one_of(
    body_bytes.map(lambda b: [P.MAGIC, b]),
    st.lists(st.one_of(st.just(P.MAGIC), st.sampled_from([b"", b"COLI/2", b"coli/1", P.MAGIC + b"\x00"]), body_bytes),
             min_size=1, max_size=4))          # ZeroMQ cannot send a message of no frames


# ---------------------------------------------------------------------------- checks

def _only_protocol_errors(fn, *args):
    try:
        return fn(*args)
    except P.ProtocolError as e:
        assert e.code in P.ERROR_CODES and isinstance(e.message, str)
        return e


def check_normalised(req: dict, limits=LIMITS) -> None:
    """A validated generate is in range, packs, and is accepted by the worker's SamplingParams."""
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)
    p = req["prompt"]
    assert (isinstance(p, str) and p) or (isinstance(p, list) and 0 < len(p) <= limits.max_prompt_tokens and
                                          all(is_int(t) and 0 <= t < VOCAB for t in p)), p
    assert is_int(req["max_tokens"]) and 1 <= req["max_tokens"] <= limits.max_tokens
    for name, lo, hi in [("temperature", 0, 100), ("top_p", 0, 1), ("min_p", 0, 1), ("repetition_penalty", 0, 100)]:
        assert type(req[name]) is float and math.isfinite(req[name]) and lo <= req[name] <= hi, (name, req[name])
    assert is_int(req["top_k"]) and req["top_k"] >= 0
    assert req["seed"] is None or (is_int(req["seed"]) and 0 <= req["seed"] < (1 << 63))
    assert type(req["ignore_eos"]) is bool and type(req["stream"]) is bool
    assert isinstance(req["stop"], list) and len(req["stop"]) <= limits.max_stop
    assert all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_len for s in req["stop"])
    assert isinstance(req["stop_token_ids"], list) and len(req["stop_token_ids"]) <= 4 * limits.max_stop
    assert all(is_int(t) and t >= 0 for t in req["stop_token_ids"])
    assert req["deadline_ms"] is None or (is_int(req["deadline_ms"]) and 1 <= req["deadline_ms"] <= 86_400_000)
    P.unpack(P.pack({"rid": 1, "request": req}), max_body=64 << 20)     # what the router sends the worker
    # what the worker does with it: SamplingParams, then a Sampler drawing tokens
    params = SamplingParams(**{k: req[k] for k in P.SAMPLING_FIELDS}, stop=tuple(req["stop"]),
                            stop_token_ids=tuple(req["stop_token_ids"]))
    sampler = Sampler(params, VOCAB)
    for row in LOGITS:
        t = sampler.sample(row, HISTORY)
        assert 0 <= t < VOCAB


def check_wire_body(data: bytes, max_body=P.MAX_BODY):
    """What the router does with one body frame: parse, then validate a generate."""
    r = _only_protocol_errors(P.parse_frames, [P.MAGIC, data], max_body)
    if isinstance(r, P.ProtocolError):
        return r
    assert isinstance(r, dict) and r["type"] in P.REQUEST_TYPES
    P.check_id(r["id"])
    if r["type"] == "generate":
        req = _only_protocol_errors(P.validate_generate, r, LIMITS)
        if isinstance(req, P.ProtocolError):
            return req
        check_normalised(req)
    return r


def check_unpack(data: bytes, max_body=P.MAX_BODY):
    r = _only_protocol_errors(P.unpack, data, max_body)
    assert isinstance(r, (dict, P.ProtocolError))
    if isinstance(r, P.ProtocolError):
        assert r.code in ("bad_request", "too_large")
    else:
        assert len(data) <= max_body


def check_frames(parts, max_body=P.MAX_BODY):
    r = _only_protocol_errors(P.parse_frames, parts, max_body)
    if isinstance(r, dict):
        assert len(parts) == 2 and parts[0] == P.MAGIC and r["type"] in P.REQUEST_TYPES
        P.check_id(r["id"])


def check_direct(body: dict):
    """validate_generate on a Python dict that did not go through msgpack (ints of any size)."""
    body = {**body, "type": "generate", "id": 1}
    r = _only_protocol_errors(P.validate_generate, body, LIMITS)
    if isinstance(r, dict):
        check_normalised(r)


MAX_BODIES = st.sampled_from([P.MAX_BODY, 16, 100, 1024])


# ---------------------------------------------------------------------------- in process: bounded

@settings(max_examples=300, **FAST)
@given(body_bytes, MAX_BODIES)
def test_unpack_raises_only_protocol_errors(data, max_body):
    check_unpack(data, max_body)


@settings(max_examples=200, **FAST)
@given(frame_lists, MAX_BODIES)
def test_parse_frames_raises_only_protocol_errors(parts, max_body):
    check_frames(parts, max_body)


@settings(max_examples=200, **FAST)
@given(bodies())
def test_validate_generate_on_decoded_bodies(body):
    """Bodies as the router sees them (packed, then decoded), generate or not."""
    check_wire_body(P.pack(body))
    check_wire_body(P.pack({**body, "type": "generate", "id": "fz"}))


@settings(max_examples=120, **FAST)
@given(bodies(any_ints))
def test_validate_generate_on_python_values(body):
    check_direct(body)


def _seed_bodies():
    """Valid bodies of every type, and the small body frames of the bad-request corpus."""
    from test_bad_requests import CASE_FILES, build_frame, load_case
    seeds = [P.pack(b) for b in (
        {"type": "generate", "id": "g", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.7, "top_k": 40,
         "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1, "seed": 7, "stop": ["\n", "ab"],
         "stop_token_ids": [2], "ignore_eos": False, "stream": True, "deadline_ms": 5000},
        {"type": "generate", "id": 9, "prompt": "hello", "stream": False},
        {"type": "tokenize", "id": "t", "text": "héllo", "add_special_tokens": False},
        {"type": "detokenize", "id": "d", "ids": [1, 2, 3]}, {"type": "cancel", "id": "c"},
        {"type": "health", "id": "h"}, {"type": "stats", "id": 0})]
    for path in CASE_FILES:
        frames = load_case(path)["frames"]
        if len(frames) == 2 and not any(k in str(frames[1]) for k in ("count", "depth")):
            seeds.append(build_frame(frames[1]))
    return seeds


def test_mutated_bodies_raise_only_protocol_errors():
    """Cheap volume: 20000 deterministic byte-level mutations of valid and corpus bodies."""
    import random
    rnd, seeds = random.Random(1234), _seed_bodies()
    interesting = [b"\x00", b"\xc0", b"\xc1", b"\xc3", b"\xff", b"\x7f", b"\x80", b"\x90", b"\xa0", b"\xcb",
                   b"\xd9", b"\xdc", b"\xde", b"\xdf", b"\xdd"]
    for _ in range(20000):
        data = bytearray(rnd.choice(seeds))
        for _ in range(rnd.randint(1, 4)):
            op, i = rnd.randrange(5), rnd.randrange(len(data) + 1)
            if op == 0 and data:
                data[min(i, len(data) - 1)] = rnd.randrange(256)
            elif op == 1:
                data[i:i] = rnd.choice(interesting)
            elif op == 2:
                del data[i:i + rnd.randint(1, 8)]
            elif op == 3:
                data = data[:i]
            else:
                other = rnd.choice(seeds)
                j = rnd.randrange(len(other) + 1)
                data = data[:i] + other[j:j + rnd.randint(1, 16)] + data[i:]
        check_wire_body(bytes(data))


# ---------------------------------------------------------------------------- in process: long (-m slow)

@pytest.mark.slow
@settings(**LONG)
@given(body_bytes, MAX_BODIES)
def test_unpack_long(data, max_body):
    check_unpack(data, max_body)


@pytest.mark.slow
@settings(**LONG)
@given(frame_lists, MAX_BODIES)
def test_parse_frames_long(parts, max_body):
    check_frames(parts, max_body)


@pytest.mark.slow
@settings(**LONG)
@given(bodies())
def test_validate_generate_on_decoded_bodies_long(body):
    check_wire_body(P.pack(body))
    check_wire_body(P.pack({**body, "type": "generate", "id": "fz"}))


@pytest.mark.slow
@settings(**LONG)
@given(bodies(any_ints))
def test_validate_generate_on_python_values_long(body):
    check_direct(body)


# ---------------------------------------------------------------------------- regressions found by the fuzz

def test_unknown_fields_keyed_by_bin_and_str_are_a_bad_request():
    """Found by the fuzz: sorted() of the unknown keys raised TypeError (bytes vs str), which
    killed the router (see also tests/bad_requests/205-unknown-fields-bin-and-str-keys.json)."""
    body = P.parse_frames([P.MAGIC, P.pack({"type": "generate", "id": 1, "prompt": [1], b"k": 1, "z": 2})])
    with pytest.raises(P.ProtocolError) as e:
        P.validate_generate(body, LIMITS)
    assert e.value.code == "bad_request"


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
def test_float_field_given_a_huge_python_int_is_a_bad_request(field):
    """Found by the fuzz: float(10**400) raised OverflowError (not reachable through msgpack,
    whose ints stop at 2^64, but validate_generate is the protocol's public validator)."""
    with pytest.raises(P.ProtocolError) as e:
        P.validate_generate({"type": "generate", "id": 1, "prompt": [1], field: 10 ** 400}, LIMITS)
    assert e.value.code == "bad_request"


def test_sampler_takes_every_temperature_the_protocol_accepts():
    """In-process form of test_live_tiny_temperature_is_served."""
    for extra in ({"top_p": 0.5}, {"min_p": 0.1}, {"top_p": 0.9, "temperature": 5e-324}):
        req = P.validate_generate({"type": "generate", "id": 1, "prompt": [1], "temperature": 1e-40, **extra}, LIMITS)
        check_normalised(req)


# ---------------------------------------------------------------------------- live server

@pytest.fixture(scope="module")
def live(built, tmp_path_factory):
    s = Server(built("mixtral").colibri("f32"), tmp_path_factory.mktemp("fuzz"), workers=2, name="f")
    try:
        s.wait_ready(2)
        s.start = snapshot(s)
        s.received = collections.Counter()
        s.outcomes = collections.Counter()      # final answers by type (errors by code)
        yield s
    finally:
        s.stop()


def _readable_id(parts):
    """The id the server can read from the last frame (None if it cannot)."""
    try:
        body = P.unpack(parts[-1])
        P.check_id(body.get("id"))
        return body["id"]
    except Exception:
        return None


def exchange(server, conn, parts, timeout=5.0):
    """Send one message; check its answers against the in-process validation."""
    oracle = ""
    try:
        body = P.parse_frames(parts, P.MAX_BODY)
        want = None
        if body["type"] == "generate":
            P.validate_generate(body, LIMITS)
    except P.ProtocolError as e:
        body, want = None, e.code
    except Exception as e:      # the in-process validation itself crashed: a bug; see what the server does
        want, oracle = None, f"in-process validation raised {e!r}; "
    rid = body["id"] if body is not None else _readable_id(parts)
    conn.send(parts)
    answers = []
    while not answers or answers[-1]["type"] == "token":
        r = conn.recv(timeout)
        assert r is not None, (f"{oracle}no answer in {timeout}s to {parts!r} (answers so far {answers}); "
                               f"log tail:\n{server.logs()[-3000:]}")
        answers.append(r)
        count_error(server, r)
    extra = conn.probe()
    assert not extra, f"more than one answer to {parts!r}: {answers + extra}"
    final, tokens = answers[-1], answers[:-1]
    server.outcomes[final["type"] if final["type"] != "error" else final["code"]] += 1
    for a in answers:
        assert a["id"] == rid and type(a["id"]) is type(rid) or (a["type"] == "error" and a["id"] is None and
                                                                 body is None), (parts, a, rid)
    if want is not None:
        assert final["type"] == "error" and final["code"] == want, (parts, want, answers)
        return
    t = body["type"]
    assert final["type"] != "error" or final["code"] not in ("internal", "worker_lost", "overloaded"), \
        (oracle, parts, final)
    assert not oracle, (oracle, parts, final)
    if t == "generate":
        assert final["type"] in ("done", "error"), (parts, final)
        if final["type"] == "error":
            # the router's own checks after validation: text prompts, the context, the deadline
            assert final["code"] in ("too_large", "bad_request", "deadline_exceeded"), (parts, final)
        else:
            assert final["finish_reason"] in ("stop", "length") and all(0 <= i < VOCAB for i in final["ids"])
            assert not tokens or body.get("stream", True), (parts, answers)
            if tokens:
                assert [i for a in tokens for i in a["ids"]] == final["ids"], answers
    elif t == "cancel":
        assert final["type"] == "error" and final["code"] == "not_found", (parts, final)
    elif t in ("tokenize", "detokenize"):
        assert not tokens and (final["type"] == "result" or final["code"] == "bad_request"), (parts, final)
    else:
        assert not tokens and final["type"] == "result", (parts, final)


# valid messages the live pass always sends (the explicit phase), so the check below that the
# served paths were exercised does not hang on how many valid ones the random mix holds
_VALID = [P.frames({"type": "generate", "id": f"valid-{i}", "prompt": [3 + i, 4, 5], "max_tokens": 2,
                    "ignore_eos": True, "stream": bool(i % 2)}) for i in range(5)] + \
         [P.frames({"type": "tokenize", "id": f"tok-{i}", "text": "hello" * (i + 1)}) for i in range(5)]


def _live_pass(live, n):
    with Raw(live.addr) as conn:
        @settings(max_examples=n, **FAST)
        @given(frame_lists)
        def run(parts):
            exchange(live, conn, parts)
        for parts in _VALID:
            run = example(parts)(run)
        run()
    print("live fuzz outcomes:", dict(live.outcomes))
    assert live.outcomes["done"] >= 5 and live.outcomes["result"] >= 5, f"too few valid messages: {live.outcomes}"
    end = snapshot(live)
    assert end["router"] == live.start["router"], f"the router restarted:\n{live.logs()[-3000:]}"
    assert end["workers"] == live.start["workers"], f"workers restarted:\n{live.logs()[-3000:]}"
    error_counters_grew_as_received(live, end)
    delta = end["counters"] - live.start["counters"]
    assert not delta.get("retries") and not delta.get("worker_lost"), delta


def test_live_tiny_temperature_is_served(live):
    """Found by the fuzz: 0 < temperature < ~2.9e-39 is valid, but the sampler's float32
    1/temperature overflows to inf, every weight turns NaN, and with top_p < 1 or min_p > 0
    no candidate survives: IndexError in the worker, answered "internal"."""
    with Raw(live.addr) as c:
        for i, extra in enumerate([{"top_p": 0.5}, {"min_p": 0.1}, {"top_p": 0.9, "temperature": 5e-324}]):
            body = {"type": "generate", "id": f"tiny-{i}", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True,
                    "stream": False, "temperature": 1e-40, **extra}
            c.send(P.frames(body))
            r = c.recv(5.0)
            assert r is not None and r["id"] == body["id"], r
            count_error(live, r)
            assert r["type"] == "done" and r["finish_reason"] == "length", (body, r)


def test_live_server_answers_random_messages(live):
    _live_pass(live, 300)


@pytest.mark.slow
def test_live_server_answers_random_messages_long(live):
    live.start = snapshot(live)
    live.received.clear()
    live.outcomes.clear()
    _live_pass(live, 3000)


def test_live_unknown_bin_and_str_keys_is_answered(live):
    """Found by the fuzz (and corpus case 205): a generate with unknown fields keyed by a bin
    and by a str made validate_generate raise TypeError, which killed the router: no answer,
    every request in flight lost, workers unknown to the new router until they re-announce.
    Last in the module, as it takes the router down."""
    with Raw(live.addr) as c:
        c.send([P.MAGIC, P.pack({"type": "generate", "id": "keys", "prompt": [1, 2], b"k": 1, "z": 2})])
        r = c.recv(5.0)
        assert r is not None, f"no answer; log tail:\n{live.logs()[-2500:]}"
        assert r["type"] == "error" and r["code"] == "bad_request" and r["id"] == "keys", r
        assert not c.probe(), "more than one answer"
    assert snapshot(live)["router"] == live.start["router"], "the router restarted"

