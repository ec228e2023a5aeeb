"""Constrained decoding: a request's grammar compiled against the model's tokenizer, and at each
step the tokens that keep the output inside it.

    c = Constraint.build(model, ("json_schema", '{"type": "object"}'))
    allowed = c.allowed()          # (V,) bool: the tokens the grammar accepts next (EOS once it may end)
    c.advance(token_id)            # after sampling; c.done once the grammar is complete

The engine is llguidance (Microsoft's, used by vLLM and llama.cpp): a Rust library with no
Python dependencies that computes a token mask from an Earley parser over a lexer, lazily, in
tens of microseconds per token (measured on this machine: 21 us for the mask, 8 us to unpack it,
11 us to apply it, on a 3072-token vocabulary), with JSON schema, regex and Lark grammars. The
other candidates were heavier for a CPU server: xgrammar requires torch at run time, and
outlines-core precomputes a regex's index over the whole vocabulary before the first token.

Grammar kinds (the protocol's `grammar` field):
    json_schema   a JSON schema (JSON text); output is compact JSON (no free whitespace) that
                  validates against it. `{"type": "object"}` is OpenAI's json_object.
    regex         the whole output matches the regex
    lark          a Lark grammar (llguidance's dialect, with %json{...} for embedded schemas)

Owns: the llguidance tokenizer of a model (built once per process, lazily: tens of ms for a
small vocabulary, about a second for 150k tokens), compiling a grammar, one matcher per sequence.
Never: samples, or knows about requests, workers and sockets.
"""
from __future__ import annotations

import json
import os

import numpy as np

KINDS = ("json_schema", "regex", "lark")
JSON_OPTIONS = {"whitespace_flexible": False}      # compact JSON: no runs of free whitespace to wander in


class GrammarError(ValueError):
    """A grammar that does not compile (the message names what is wrong); a ValueError, so a
    request carrying it is a bad request."""


class GrammarDeadEnd(GrammarError):
    """The output so far admits no continuation within its grammar (an unsatisfiable schema, or
    one beyond the parser's limits): the request ends with this, never with output marked
    complete that fails the grammar."""


def _llguidance():
    # llguidance computes masks on a rayon pool sized to the machine; its threads, spinning beside a
    # worker's Numba threads, made a one-sequence decode step twice as slow (bench/grammar.py: 50.1 vs
    # 25.1 ms). One thread: the mask is computed inline (0.24 ms per token at a 32000-token vocabulary)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    try:
        import llguidance
    except ImportError:             # a dependency of the package: only a broken install lacks it
        raise GrammarError("grammar: constrained decoding needs the llguidance package (pip install llguidance)") \
            from None
    return llguidance


def tokenizer_for(model):
    """The model's llguidance tokenizer, built at the first use in this process and kept on the model."""
    llt = model.__dict__.get("_llg_tokenizer")
    if llt is None:
        if not model.file.tokenizer_json:
            raise GrammarError(f"grammar: {model.path} has no tokenizer, which constrained decoding needs")
        llg = _llguidance()
        tj = model.file.tokenizer_json
        eos = list(model.config.eos_token_ids) or None
        try:
            llt = llg.LLTokenizer(tj if isinstance(tj, str) else tj.decode("utf-8"),
                                  n_vocab=model.config.vocab_size, eos_token=eos)
        except Exception as e:     # llguidance's tokenizer import refuses some exotic tokenizers
            raise GrammarError(f"grammar: the model's tokenizer cannot be used for constrained decoding: {e}") \
                from None
        model.__dict__["_llg_tokenizer"] = llt
    return llt


def grammar_text(kind: str, value: str) -> str:
    """(kind, value) -> llguidance's grammar text; raises GrammarError naming the problem."""
    llg = _llguidance()
    if kind not in KINDS:
        raise GrammarError(f"grammar: the kind must be one of {', '.join(KINDS)}, got {kind!r:.40}")
    if not isinstance(value, str) or not value:
        raise GrammarError("grammar: the value must be a non-empty string")
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(value)
            except ValueError as e:
                raise GrammarError(f"grammar: the JSON schema is not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("grammar: a JSON schema must be an object (or true)")
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(value)
        return llg.LLMatcher.grammar_from_lark(value)
    except GrammarError:
        raise
    except Exception as e:         # llguidance raises ValueError/RuntimeError with its own message
        raise GrammarError(f"grammar: the {kind} does not compile: {str(e)[:300]}") from None


def check(kind: str, value: str) -> None:
    """Raise GrammarError unless (kind, value) compiles (no tokenizer needed: the router and the gateway
    check a request's grammar before it is queued)."""
    text = grammar_text(kind, value)
    err = _llguidance().LLMatcher.validate_grammar(text)
    if err:
        raise GrammarError(f"grammar: the {kind} does not compile: {err[:300]}")


class Constraint:
    """One sequence's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self._bits = None

    @classmethod
    def build(cls, model, spec) -> "Constraint":
        kind, value = spec
        text = grammar_text(kind, value)
        llg = _llguidance()
        m = llg.LLMatcher(tokenizer_for(model), text)
        if m.is_error():
            raise GrammarError(f"grammar: the {kind} does not compile: {m.get_error()[:300]}")
        return cls(m, model.config.vocab_size)

    def allowed(self) -> np.ndarray:
        """(V,) bool view: the tokens the grammar accepts next (valid until the next call)."""
        raw = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        self._bits = np.unpackbits(raw, bitorder="little")[:self.vocab_size].view(np.bool_)
        return self._bits

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False when the grammar refuses it (never after allowed())."""
        return bool(self.matcher.consume_token(int(token)))

    @property
    def error(self):
        """The matcher's error (its parser gave up: an unsatisfiable or too ambiguous grammar), or None."""
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end may follow."""
        return bool(self.matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())
