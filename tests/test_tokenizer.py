"""Tests for colibri_server.model.tokenizer (Tokenizer, IncrementalDecoder).

The tokenizer under test is a tiny byte-level BPE trained here on inline text,
so the tests need no files and no network.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from colibri_server.model.tokenizer import IncrementalDecoder, Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Mixture-of-experts models route every token to a few experts out of many.",
    "Le café est très bon, mais l'été à Genève est déjà fini. Élève, écoute!",
    "中文分词是自然语言处理的基础任务。我们在中文文本上训练一个很小的分词器。",
    "Emoji test: 😀 😃 😄 🚀 🎉 👍🏽 — and some symbols: ∑ ∫ √ ≤ ≥ ≠ ∞ € £ ¥.",
    "def f(x):\n    return x * 2  # comment\n\nprint(f(21))\n",
    "Numbers 0123456789, punctuation !?.,;:()[]{}<>/\\|@#$%^&*-_=+~`'\"",
    "Русский текст и ελληνικά γράμματα, also عربى and हिन्दी.",
] * 8


@pytest.fixture(scope="module")
def tok_json() -> str:
    tk = HFTokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    return tk.to_str()


@pytest.fixture(scope="module")
def tok(tok_json) -> Tokenizer:
    return Tokenizer.from_json(tok_json, bos_token_id=1, eos_token_ids=[2])


TEXTS = [
    "",
    "hello world",
    "Le café est très bon",
    "中文分词",
    "🚀🎉 rockets 👍🏽",
    "🦜 parrot not in the corpus ℵ",
    "  leading and trailing spaces  \n\ttabs",
]


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def test_from_json_bytes_and_str(tok_json, tok):
    t2 = Tokenizer.from_json(tok_json.encode("utf-8"), bos_token_id=1, eos_token_ids=2)
    assert t2.encode("héllo 中文") == tok.encode("héllo 中文")
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and t2.eos_token_ids == (2,)
    assert tok.is_eos(2) and not tok.is_eos(1)
    assert 256 < tok.vocab_size <= 300
    assert tok.chat_template is None


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_bpe_merges_something(tok):
    # the trained merges are used: common words take fewer tokens than bytes
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox".encode())


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_round_trip_property(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_special_tokens(tok):
    assert tok.token_to_id("<s>") == 1 and tok.token_to_id("</s>") == 2
    assert tok.id_to_token(0) == "<unk>"
    assert tok.token_to_id("no-such-token-xyz") is None
    assert tok.id_to_token(10**6) is None and tok.id_to_token(-1) is None
    ids = [1] + tok.encode("hi") + [2]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hi</s>"
    # ids beyond the vocabulary decode to nothing; negative ids are an error
    assert tok.decode([tok.vocab_size + 5] + tok.encode("a")) == "a"
    with pytest.raises(ValueError):
        tok.decode([-1])


def test_add_bos(tok_json):
    t = Tokenizer.from_json(tok_json, bos_token_id=1, eos_token_ids=[2], add_bos=True)
    ids = t.encode("hello")
    assert ids[0] == 1 and ids[1:] == t.encode("hello", add_special_tokens=False)
    assert t.encode("<s>hello")[:2] != [1, 1]  # not doubled
    assert t.encode("hello", add_special_tokens=False)[0] != 1


@pytest.mark.parametrize(
    "data",
    [b"{not json", "", '{"a": 1}', b"\xff\xfe{}", '{"model": {"type": "BPE", "vocab": 3}}', 42],
)
def test_malformed_json(data):
    with pytest.raises(ValueError, match="invalid tokenizer JSON"):
        Tokenizer.from_json(data)


def test_bad_metadata(tok_json):
    with pytest.raises(ValueError, match="eos_token_ids"):
        Tokenizer.from_json(tok_json, eos_token_ids=[100000])
    with pytest.raises(ValueError, match="bos_token_id"):
        Tokenizer.from_json(tok_json, bos_token_id=-1)
    with pytest.raises(ValueError, match="add_bos"):
        Tokenizer.from_json(tok_json, add_bos=True)
    # a valid JSON that was tampered with is still rejected cleanly
    d = json.loads(tok_json)
    d["model"]["merges"] = 5
    with pytest.raises(ValueError, match="invalid tokenizer JSON"):
        Tokenizer.from_json(json.dumps(d))


# --------------------------------------------------------------------------
# IncrementalDecoder
# --------------------------------------------------------------------------


def _stream(tok, ids, **kw):
    dec = IncrementalDecoder(tok, **kw)
    pieces = [dec.push(i) for i in ids]
    tail = dec.flush()
    return pieces, tail


def test_incremental_multibyte_never_partial(tok):
    text = "a🦜b中文ℵ"  # 🦜 and ℵ are not in the corpus: byte tokens
    ids = tok.encode(text)
    assert len(ids) > len(text)  # some characters really span several tokens
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == text
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)
    # the parrot's 4 bytes arrive in several tokens: the token before the one
    # completing it yields nothing, the completing one yields the whole char
    idx = next(i for i, p in enumerate(pieces) if "🦜" in p)
    assert pieces[idx - 1] == "" and pieces[idx].startswith("🦜")


def test_incremental_incomplete_tail_goes_to_flush(tok):
    ids = tok.encode("x🦜")
    pieces, tail = _stream(tok, ids[:-1])  # cut inside the emoji
    assert "".join(pieces) == "x"
    assert tail == tok.decode(ids[:-1])[1:] and tail.endswith("\ufffd")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_incremental_equals_decode_random_ids(tok, data):
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size + 3), max_size=40))
    skip = data.draw(st.booleans())
    pieces, tail = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def _byte_to_char() -> dict[int, str]:
    """GPT-2 byte-level alphabet: byte value -> the char that stands for it."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(128, 255), st.integers(0, 127)), max_size=30))
def test_incremental_equals_decode_byte_garbage(tok, raw):
    # single-byte tokens: mostly invalid / truncated UTF-8 sequences
    b2c = _byte_to_char()
    ids = [tok.token_to_id(b2c[b]) for b in raw]
    assert None not in ids
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids)
    assert tok.decode(ids) == bytes(raw).decode("utf-8", errors="replace")


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_incremental_equals_decode_text(tok, text):
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == text
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text


def test_incremental_context_ids(tok):
    prompt = tok.encode("Le café")
    gen = tok.encode(" est très bon")
    dec = IncrementalDecoder(tok, context_ids=prompt[-3:])
    out = "".join(dec.push(i) for i in gen) + dec.flush()
    assert out == " est très bon"


def test_incremental_long_stream_trims(tok):
    text = "Le café est très bon, 中文 🚀. " * 30
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == text
    assert len(dec._ids) < 100  # window list is trimmed


def test_token_bytes_rebuild_text_split_over_byte_tokens(tok):
    """A character split over tokens: each token's text alone is U+FFFD, its bytes are its own, and the
    bytes of the ids, concatenated, are the text's UTF-8 (byte-level BPE, and a byte-fallback vocabulary)."""
    for text in ("ŷ", "a🙂b", "Grüße ∑"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    ids = tok.encode("ŷ", add_special_tokens=False)
    assert len(ids) == 2 and [tok.token_text(i) for i in ids] == ["\ufffd"] * 2
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "<0xC5>": 3, "<0xB7>": 4}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp = Tokenizer.from_json(hf.to_str())
    ids = sp.encode("aŷ", add_special_tokens=False)
    assert ids == [2, 3, 4] and [sp.token_text(i) for i in ids] == ["a", "\ufffd", "\ufffd"]
    assert [sp.token_bytes(i) for i in ids] == [b"a", b"\xc5", b"\xb7"]
