"""Constrained decoding in the engine (model/grammar.py, llguidance): 50 JSON schemas on the bundled
model and on a random test model always give output that validates (jsonschema), in one batch; regex
and Lark grammars hold; a grammar that does not compile is a bad request naming it."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from schema_corpus import schemas

from colibri_server.bundled import BUNDLED_MODEL
from colibri_server.model import Model
from colibri_server.model.serving import BatchEngine


def _run(eng, reqs):
    """reqs: {rid: (prompt, params)}, all added before the first step: {(rid, choice): (text, finish_reason)}."""
    for rid, (p, kw) in reqs.items():
        eng.add(rid, p, **kw)
    text, fr = {}, {}
    while eng.has_work():
        for rid, ev in eng.step():
            text[(rid, ev.choice)] = text.get((rid, ev.choice), "") + ev.text
            if ev.finish_reason:
                fr[(rid, ev.choice)] = ev.finish_reason
    return {k: (text[k], fr[k]) for k in text}


@pytest.fixture(scope="module", params=["bundled", "mixtral"])
def model(request, built):
    return Model.open(BUNDLED_MODEL if request.param == "bundled" else built("mixtral").colibri("f32"))


def test_fifty_json_schemas_always_validate(model):
    S = schemas()
    eng = BatchEngine(model, max_seqs=len(S), max_batch_tokens=64)
    got = _run(eng, {i: ("Answer in JSON:", dict(max_tokens=200, grammar=("json_schema", json.dumps(s))))
                     for i, s in enumerate(S)})
    for i, s in enumerate(S):
        text, fr = got[(i, 0)]
        assert fr == "stop", (i, text)
        jsonschema.validate(json.loads(text), s)
    # the same requests without the grammar: the model does not write such JSON by itself
    free = _run(BatchEngine(model, max_seqs=8, max_batch_tokens=64), {i: ("Answer in JSON:", dict(max_tokens=40))
                                                                     for i in range(8)})
    assert not any(t.startswith("{") for t, _ in free.values())


def test_regex_lark_and_sampled_choices_hold(model):
    reqs = {"re": ("Date:", dict(max_tokens=30, grammar=("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))),
            "lark": ("Pick:", dict(max_tokens=30, grammar=("lark", 'start: "yes" | "no" | "maybe"'))),
            "n": ("Say:", dict(max_tokens=60, n=3, temperature=1.0, seed=2,
                               grammar=("json_schema", json.dumps({"type": "array", "items": {"type": "integer",
                                        "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}))))}
    got = _run(BatchEngine(model, max_seqs=8, max_batch_tokens=32), reqs)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", got[("re", 0)][0]) and got[("re", 0)][1] == "stop"
    assert got[("lark", 0)][0] in ("yes", "no", "maybe")
    for c in range(3):
        arr = json.loads(got[("n", c)][0])
        assert isinstance(arr, list) and 1 <= len(arr) <= 4 and all(0 <= x <= 9 for x in arr)


@pytest.mark.parametrize("spec,words", [(("json_schema", "{not json"), "not JSON"),
                                        (("lark", "start: nothing_here"), "does not compile"),
                                        (("regex", "(unclosed"), "does not compile"),
                                        (("yaml", "a: 1"), "kind must be one of")])
def test_a_grammar_that_does_not_compile_is_a_bad_request_naming_it(model, spec, words):
    eng = BatchEngine(model, max_seqs=2, max_batch_tokens=8)
    with pytest.raises(ValueError, match=r"^grammar: .*" + words):
        eng.add("x", "hi", grammar=spec)
    assert not eng.has_work()


UNSATISFIABLE = {"$defs": {"n": {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]}},
                 "$ref": "#/$defs/n"}


def test_a_grammar_with_no_way_on_ends_its_request_with_an_error_not_stop(model):
    """Issue 38 item 3: an object that must contain itself admits no complete output. Its request
    ends with a GrammarDeadEnd naming the grammar (never output marked stop that fails the schema),
    and a request beside it in the batch finishes valid."""
    eng = BatchEngine(model, max_seqs=2, max_batch_tokens=64)
    eng.add("bad", "Answer in JSON:", max_tokens=40, grammar=("json_schema", json.dumps(UNSATISFIABLE)))
    eng.add("good", "Answer in JSON:", max_tokens=40, grammar=("json_schema", '{"type": "object", "properties": '
                                                                               '{"x": {"type": "boolean"}}, "required": ["x"]}'))
    events, faults = [], []
    while eng.has_work():
        events += eng.step()
        faults += eng.faults
    assert [rid for rid, _ in faults] == ["bad"], (faults, [ev for rid, ev in events if rid == "bad"])
    from colibri_server.model.grammar import GrammarDeadEnd
    assert isinstance(faults[0][1], GrammarDeadEnd) and str(faults[0][1]).startswith("grammar: ")
    assert "\n" not in str(faults[0][1])
    assert not [ev for rid, ev in events if rid == "bad" and ev.finish_reason is not None]
    good = "".join(ev.text for rid, ev in events if rid == "good")
    assert [ev.finish_reason for rid, ev in events if rid == "good"][-1] == "stop"
    assert isinstance(json.loads(good)["x"], bool)
