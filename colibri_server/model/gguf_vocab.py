"""A GGUF file's tokenizer metadata, rebuilt as a Hugging Face ``tokenizer.json``.

Owns: reading the ``tokenizer.*`` keys llama.cpp writes (already decoded into python values by the
caller) and producing a :class:`GgufVocab`: a ``tokenizer.json`` text for the ``tokenizers``
library that splits, merges and decodes as llama.cpp does for the same file, plus the BOS id, the
end-of-generation ids (the eos id and the tokens llama.cpp recognises by their text), the chat
template and whether BOS is added.  Two tokenizer models are supported:

* ``gpt2``: byte-level BPE.  ``tokenizer.ggml.pre`` names the pre-tokenizer; its split regexes
  are the ones llama.cpp's ``llama-vocab.cpp`` applies, in the same order (each refines the pieces
  of the one before), then the GPT-2 byte alphabet.
* ``llama``: SentencePiece BPE.  llama.cpp merges the adjacent pair whose join has the highest
  score, so the merges are derived from ``tokenizer.ggml.scores``; spaces become U+2581, a space is
  prepended to every piece of text that starts the input or follows an added token (as llama.cpp,
  and the ``legacy`` Llama ``tokenizer.json``), unknown characters fall back to ``<0xXX>`` tokens.

Control (type 3) and unknown (2) tokens become special added tokens, user-defined ones (4) plain
added tokens, so both are matched whole in text.  ``add_bos_token``/``add_eos_token`` become a
``TemplateProcessing`` post-processor.

Never: reads files, touches weights, downloads anything, renders templates, or infers more than
llama.cpp infers from the same keys.  A model, pre-tokenizer or key it cannot honour raises
:class:`VocabError` naming the key.  Not reproduced:
llama.cpp's lossy ``clean_spaces`` on decode, and its regex engine's approximations of Unicode
classes (the regexes here run on Oniguruma with real Unicode categories).
"""
from __future__ import annotations

import json
import numbers
import re
from dataclasses import dataclass

import tokenizers

__all__ = ["VocabError", "GgufVocab", "tokenizer_from_gguf"]

_K = "tokenizer.ggml."
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


class VocabError(Exception):
    """The GGUF's tokenizer metadata cannot be turned into a tokenizer; the message names the key."""


@dataclass(frozen=True)
class GgufVocab:
    tokenizer_json: str               # for tokenizers.Tokenizer.from_str / Tokenizer.from_json
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]    # the eos id first, then every other end-of-generation token
    chat_template: str                # "" if the file has none
    add_bos: bool                     # the post-processor in tokenizer_json puts BOS first


# --- pre-tokenizers (llama-vocab.cpp, llm_tokenizer_bpe): regexes applied in turn ----------------

_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"   # contractions, ASCII case only
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_UP, _LO = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*{_C}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_LLM = (
    "[\r\n]",
    r"\s?[A-Za-z"
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    r"\s?[!-/:-~" "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK, r"\p{N}+")
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")

# pre name -> (regexes, ignore_merges, add_bos default); names grouped as llama.cpp groups them
_PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {}
for _names, _spec in (
    ("default", ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False, False)),
    ("gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 mellum roberta-bpe", ((_GPT2,), False, False)),
    ("smollm starcoder refact command-r codeshell exaone minerva-7b mellum2", ((r"\p{N}", _GPT2), False, False)),
    ("falcon", ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"), False, False)),
    ("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", ((_LLAMA3,), True, True)),
    ("dbrx smaug-bpe", ((_LLAMA3,), False, False)),
    ("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open", ((_QWEN2,), False, False)),
    ("qwen35", ((_QWEN35,), False, False)),
    ("gpt-4o o200k llama4 kanana2 minimax-m2", ((_GPT4O,), False, False)),
    ("tekken", ((_TEKKEN,), True, True)),
    ("deepseek-v3 hunyuan-dense joyai-llm", (_DEEPSEEK3, False, False)),
    ("deepseek-llm", (_DEEPSEEK_LLM, False, False)),
    ("deepseek-coder", (_DEEPSEEK_CODER, False, False)),
):
    _PRE.update(dict.fromkeys(_names.split(), _spec))

# --- end of generation (llama-vocab.cpp, load: special_eog_ids) -----------------------------------

_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["))
# FIM pad / repo / file-separator tokens also end generation; found by key, else by text
_FIM_EOG = (("fim_pad_token_id", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
            ("fim_rep_token_id", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
            ("fim_sep_token_id", ("<|file_sep|>",)))
_ALWAYS_RENDERED = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))  # gpt-oss


def tokenizer_from_gguf(fields: dict) -> GgufVocab:
    """Build the tokenizer described by a GGUF's ``tokenizer.*`` metadata (key -> decoded value)."""
    model = fields.get(_K + "model")
    if model not in ("gpt2", "llama"):
        raise VocabError(f"{_K}model: tokenizer model {model!r} is not supported (only 'gpt2', 'llama')")
    tokens = _str_list(fields, _K + "tokens")
    n = len(tokens)
    types = fields.get(_K + "token_type")
    types = [1] * n if types is None else [int(t) for t in types]
    if len(types) < n:
        raise VocabError(f"{_K}token_type: {len(types)} entries for {n} tokens")
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != n:
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise VocabError(f"{_K}tokens: token {dup!r} appears more than once")

    template = fields.get("tokenizer.chat_template") or ""
    if not isinstance(template, str):
        raise VocabError("tokenizer.chat_template: not a string")
    spm = model == "llama"
    bos = _token_id(fields, "bos_token_id", n, 1 if spm else None)
    eos = _token_id(fields, "eos_token_id", n, 2 if spm else None)
    if spm:
        body, ignore_merges, add_bos = _spm(fields, tokens, vocab)
    else:
        body, ignore_merges, add_bos = _byte_level(fields, vocab)
    add_bos = bool(fields.get(_K + "add_bos_token", add_bos))
    add_eos = bool(fields.get(_K + "add_eos_token", False))
    for flag, name, tid in ((add_bos, "bos", bos), (add_eos, "eos", eos)):
        if flag and tid is None:
            raise VocabError(f"{_K}{name}_token_id: missing, but the file asks to add {name.upper()}")

    eog, special, plain = _end_of_generation(fields, tokens, vocab, types, eos)
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": i in special} for i in sorted(special | plain)]
    body["model"].update(vocab=vocab, ignore_merges=ignore_merges)
    if not spm:
        body["decoder"] = _byte_level_decoder([tokens[i] for i in special | plain])
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "post_processor": _post_processor(tokens, bos if add_bos else None, eos if add_eos else None),
           **body}
    text = json.dumps(doc, ensure_ascii=False)
    try:
        tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises a bare Exception
        raise VocabError(f"{_K}tokens: the tokenizer library rejects the vocabulary ({e})") from None
    return GgufVocab(text, bos, eog, template, add_bos)


def _str_list(fields: dict, key: str) -> list[str]:
    v = fields.get(key)
    if v is None or isinstance(v, (str, bytes)) or not all(isinstance(t, str) for t in v):
        raise VocabError(f"{key}: missing or not a list of strings")
    return list(v)


def _token_id(fields: dict, name: str, n: int, default: int | None) -> int | None:
    v = fields.get(_K + name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < n:
        raise VocabError(f"{_K}{name}: {v!r} is not a token id (vocabulary of {n})")
    return int(v)


def _byte_level(fields: dict, vocab: dict[str, int]):
    pre = fields.get(_K + "pre") or "default"   # llama.cpp falls back to 'default' (with a warning)
    if pre not in _PRE:
        raise VocabError(f"{_K}pre: pre-tokenizer {pre!r} is not supported")
    regexes, ignore_merges, add_bos = _PRE[pre]
    merges = []
    for i, m in enumerate(_str_list(fields, _K + "merges")):
        cut = m.find(" ", 1)
        a, b = m[:cut], m[cut + 1:]
        if cut < 0 or a not in vocab or b not in vocab or a + b not in vocab:
            raise VocabError(f"{_K}merges: entry {i} ({m!r}) is not two tokens that join into a token")
        merges.append([a, b])
    splits = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
              for r in regexes]
    body = {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": splits + [
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "merges": merges},
    }
    return body, ignore_merges, add_bos


def _byte_level_decoder(added: list[str]) -> dict:
    """ByteLevel decoding, except that an added token is its own text (llama.cpp prints it as is),
    also when that text reads as byte-level characters (DeepSeek's "ö", which is not byte 0xF6)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    to_char = {b: chr(b) for b in keep} | {b: chr(0x100 + k) for k, b in
                                           enumerate(b for b in range(256) if b not in keep)}
    to_byte = {c: b for b, c in to_char.items()}
    fixes = [{"type": "Replace", "pattern": {"Regex": "^" + re.escape(t) + "$"},
              "content": "".join(to_char[b] for b in t.encode())}
             for t in sorted(added) if set(t) <= to_byte.keys() and bytes(to_byte[c] for c in t) != t.encode()]
    return {"type": "Sequence", "decoders": fixes + [
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


def _spm(fields: dict, tokens: list[str], vocab: dict[str, int]):
    scores = fields.get(_K + "scores")
    if scores is None or len(scores) < len(tokens):
        raise VocabError(f"{_K}scores: a SentencePiece ('llama') vocabulary needs a score per token")
    # llama.cpp joins the adjacent pair whose join scores highest; as BPE ranks: every split of a
    # token into two tokens, best-scoring join first
    ranked = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                ranked.append((-float(scores[i]), i, k))
    ranked.sort()
    merges = [[tokens[i][:k], tokens[i][k:]] for _, i, k in ranked]
    unk = _token_id(fields, "unknown_token_id", len(tokens), 0)
    prefix = bool(fields.get(_K + "add_space_prefix", True))
    steps = [{"type": "Prepend", "prepend": "\u2581"}] if prefix else []
    body = {
        "normalizer": {"type": "Sequence", "normalizers": steps + [
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]
            + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk], "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "merges": merges},
    }
    return body, False, True


def _end_of_generation(fields: dict, tokens: list[str], vocab: dict[str, int], types: list[int],
                       eos: int | None):
    """(eog ids, special ids, plain added ids), with llama.cpp's fix-ups of token types by text."""
    n = len(tokens)
    special = {i for i in range(n) if types[i] in (_UNKNOWN, _CONTROL)}
    plain = {i for i in range(n) if types[i] == _USER_DEFINED}
    by_text = {i for t, i in vocab.items() if t in _EOG_TEXTS}
    by_key = {_token_id(fields, k, n, None) for k in ("eot_token_id", "eom_token_id")} | {eos}
    for name, texts in _FIM_EOG:
        found = [vocab[t] for t in texts if t in vocab]
        if (i := _token_id(fields, name, n, None)) is not None:
            by_key.add(i)
        elif found:
            by_text.add(min(found))
    special |= by_text                # llama.cpp makes the ones it finds by text control tokens
    eog = (by_text | by_key) - {None}
    named = {tokens[i]: i for i in eog}
    has = named.__contains__
    if has("<|end|>") and (has("<|return|>") and has("<|call|>") or has("<|calls|>") and has("<|flush|>")):
        end = named["<|end|>"]      # harmony / solar-open: <|end|> ends a message, not generation
        eog.discard(end), special.discard(end), plain.add(end)
    if has("</s>") and (has("<|tool_response>") or has("<|plamo:eos|>")):
        s = named["</s>"]           # gemma4 / plamo: </s> is an ordinary token
        eog.discard(s), special.discard(s), plain.discard(s)
    for t in _ALWAYS_RENDERED & vocab.keys():
        special.discard(vocab[t]), plain.add(vocab[t])
    first = (eos,) if eos in eog else ()
    return first + tuple(sorted(eog - set(first))), special, plain - special


def _post_processor(tokens: list[str], bos: int | None, eos: int | None):
    if bos is None and eos is None:
        return None
    single = ([{"SpecialToken": {"id": tokens[bos], "type_id": 0}}] if bos is not None else []) \
        + [{"Sequence": {"id": "A", "type_id": 0}}] \
        + ([{"SpecialToken": {"id": tokens[eos], "type_id": 0}}] if eos is not None else [])
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}} if x.get("Sequence") else x for x in single]
    return {"type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": {tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]}
                               for i in (bos, eos) if i is not None}}
