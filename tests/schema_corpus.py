"""50 JSON schemas for constrained decoding tests: nested objects, arrays, enums, consts, bounded
numbers and strings, optional fields, anyOf. Every string and array is bounded (maxLength / maxItems)
and every number has a range: a random-weight model writes what the grammar allows, and an unbounded
string can go on past any max_tokens."""
from __future__ import annotations

import random


def _leaf(r: random.Random, depth: int):
    k = r.choice(["str", "int", "num", "bool", "enum", "const", "null", "obj", "arr", "any"] if depth < 3
                 else ["str", "int", "bool", "enum", "null"])
    if k == "str":
        s = {"type": "string", "maxLength": r.randint(1, 12)}
        if r.random() < 0.3:
            s["minLength"] = 1
        return s
    if k == "int":
        lo = r.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 500)}
    if k == "num":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if k == "bool":
        return {"type": "boolean"}
    if k == "enum":
        return {"enum": r.sample(["red", "green", "blue", "x", "yes", "no", 1, 2, None, True], r.randint(1, 4))}
    if k == "const":
        return {"const": r.choice(["fixed", 7, False])}
    if k == "null":
        return {"type": "null"}
    if k == "obj":
        return _object(r, depth + 1)
    if k == "arr":
        lo = r.randint(0, 2)
        return {"type": "array", "items": _leaf(r, depth + 1), "minItems": lo, "maxItems": lo + r.randint(0, 2)}
    return {"anyOf": [_leaf(r, depth + 1), _leaf(r, depth + 1)]}


def _object(r: random.Random, depth: int):
    names = r.sample(["id", "name", "tags", "size", "kind", "child", "items", "ok", "value", "note"], r.randint(1, 4))
    props = {n: _leaf(r, depth) for n in names}
    req = [n for n in names if r.random() < 0.7]
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


def schemas(count: int = 50, seed: int = 19) -> list:
    r = random.Random(seed)
    out = [_object(r, 0) for _ in range(count - 2)]
    out.append({"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3})
    out.append({"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]},
                                                                "maxItems": 2}},
        "required": ["name", "roles"], "additionalProperties": False}}, "required": ["user"],
        "additionalProperties": False})
    return out
