"""Tokenizer wrapper (Hugging Face ``tokenizers``) and a streaming decoder.

The model file embeds a ``tokenizer.json``; :meth:`Tokenizer.from_json` turns
it into a :class:`Tokenizer`.  Model-level metadata that ``tokenizer.json``
does not carry reliably (BOS/EOS ids, chat template, whether to prepend BOS)
is passed in explicitly by the loader.

:class:`IncrementalDecoder` turns a stream of token ids into a stream of text
without ever emitting half a character.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import tokenizers

__all__ = ["Tokenizer", "IncrementalDecoder"]


class Tokenizer:
    """Thin wrapper around :class:`tokenizers.Tokenizer`.

    ``add_bos``: prepend ``bos_token_id`` in :meth:`encode` (when
    ``add_special_tokens``) if the tokenizer's own post-processor did not
    already put it first.
    """

    def __init__(
        self,
        tk: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] | int = (),
        chat_template: str | None = None,
        add_bos: bool = False,
    ) -> None:
        self._tk = tk
        n = tk.get_vocab_size(with_added_tokens=True)
        if isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        eos = tuple(int(i) for i in eos_token_ids)
        for name, ids in (("bos_token_id", () if bos_token_id is None else (bos_token_id,)),
                          ("eos_token_ids", eos)):
            for i in ids:
                if isinstance(i, bool) or not 0 <= int(i) < n:
                    raise ValueError(f"{name}: token id {i!r} is outside the vocabulary (size {n})")
        if add_bos and bos_token_id is None:
            raise ValueError("add_bos: requires bos_token_id")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError("chat_template: must be a string or None")
        self.bos_token_id: int | None = None if bos_token_id is None else int(bos_token_id)
        self.eos_token_ids: tuple[int, ...] = eos
        self.chat_template: str | None = chat_template
        self.add_bos: bool = bool(add_bos)
        self._vocab_size = n

    # -- construction ----------------------------------------------------

    @classmethod
    def from_json(
        cls,
        data: bytes | bytearray | memoryview | str,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] | int = (),
        chat_template: str | None = None,
        add_bos: bool = False,
    ) -> "Tokenizer":
        """Build from the text of a ``tokenizer.json``.

        Raises ``ValueError("invalid tokenizer JSON: ...")`` if the data is
        not UTF-8, not JSON, or not a tokenizer the library understands.
        """
        if isinstance(data, (bytes, bytearray, memoryview)):
            try:
                data = bytes(data).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"invalid tokenizer JSON: not UTF-8 ({e})") from None
        if not isinstance(data, str):
            raise ValueError(f"invalid tokenizer JSON: expected bytes or str, got {type(data).__name__}")
        try:
            tk = tokenizers.Tokenizer.from_str(data)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"invalid tokenizer JSON: {e}") from None
        return cls(
            tk,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            chat_template=chat_template,
            add_bos=add_bos,
        )

    # -- properties ------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included.

        (The model's embedding table may be larger; ids beyond this decode to
        nothing.)
        """
        return self._vocab_size

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tk

    # -- encode / decode -------------------------------------------------

    def _plain(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that reads special-token text as ordinary text (the
        library's own ``encode_special_tokens``): ``"</s>"`` in user content stays characters.
        A copy, not a toggled flag, so that concurrent callers never see the other mode."""
        tk = self.__dict__.get("_tk_plain")
        if tk is None:
            tk = tokenizers.Tokenizer.from_str(self._tk.to_str())
            tk.encode_special_tokens = True
            self.__dict__["_tk_plain"] = tk
        return tk

    def encode(self, text: str, add_special_tokens: bool = True, *, parse_special: bool = False) -> list[int]:
        """Token ids for ``text``.

        ``add_special_tokens`` runs the tokenizer's post-processor (which may
        add BOS/EOS) and, if ``add_bos``, prepends BOS when it is not already
        first.  ``parse_special``: special-token strings in ``text`` (like
        ``"<s>"``) become their control tokens, as in HF.  Off by default: text
        from users must never end a turn or forge one; only text that the
        server's own templates wrote is parsed (see :meth:`encode_segments`).
        """
        return self.encode_segments([(text, parse_special)], add_special_tokens)

    def _special_re(self):
        rx = self.__dict__.get("_special_rx", False)
        if rx is False:
            import re
            words = sorted({t.content for t in self._tk.get_added_tokens_decoder().values() if t.special and t.content},
                           key=len, reverse=True)
            rx = re.compile("|".join(map(re.escape, words))) if words else None
            self.__dict__["_special_rx"] = rx
        return rx

    def encode_segments(self, segments, add_special_tokens: bool = True) -> list[int]:
        """Token ids for the concatenation of ``segments``: ``(text, parse_special)`` pairs, e.g.
        a rendered chat template's own text (True: its control tokens are parsed) around
        pieces of user content (False: special-token text in them stays text).

        The text between two control tokens is encoded in one piece, whichever segments it
        comes from, so a template's text and the content beside it merge as they would in
        one string (as `apply_chat_template` tokenizes): only where the template itself
        writes a special token is the text cut."""
        segments = [(t, bool(p)) for t, p in segments]
        for text, _ in segments:
            if not isinstance(text, str):
                raise TypeError(f"text must be str, got {type(text).__name__}")
        if len(segments) == 1:
            text, parse = segments[0]
            ids = (self._tk if parse else self._plain()).encode(text, add_special_tokens=add_special_tokens).ids
        else:
            rx = self._special_re()
            encs, buf = [], []

            def flush():
                if buf:
                    encs.append(self._plain().encode("".join(buf), add_special_tokens=False))
                    buf.clear()
            for text, parse in segments:
                if not parse or rx is None:
                    buf.append(text)
                    continue
                pos = 0
                for m in rx.finditer(text):
                    buf.append(text[pos:m.start()])
                    flush()
                    encs.append(self._tk.encode(m.group(0), add_special_tokens=False))
                    pos = m.end()
                buf.append(text[pos:])
            flush()
            merged = tokenizers.Encoding.merge(encs, growing_offsets=True) if encs else \
                self._tk.encode("", add_special_tokens=False)
            if add_special_tokens:
                merged = self._tk.post_process(merged, add_special_tokens=True)
            ids = merged.ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; unknown ids (>= vocab_size) decode to nothing.

        Raises ``ValueError`` for negative ids.
        """
        try:
            return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"invalid token ids: {e}") from None

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (special tokens included; a token that is part of a
        UTF-8 character decodes to U+FFFD): what logprobs name each token by. Cached."""
        cache = self.__dict__.setdefault("_token_text", {})
        t = cache.get(token_id)
        if t is None:
            t = cache[token_id] = self.decode([token_id], skip_special_tokens=False)
        return t

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for. A token holding part of a UTF-8 character (its text is
        U+FFFD) gives its own bytes: a byte-level BPE token's characters mapped back to bytes (GPT-2's
        table), a byte-fallback token ``<0xE2>`` its byte; so the bytes of consecutive tokens,
        concatenated, are the text's. Other tokens: the UTF-8 of their text. Cached."""
        cache = self.__dict__.setdefault("_token_bytes", {})
        b = cache.get(token_id)
        if b is None:
            text = self.token_text(token_id)
            b = text.encode("utf-8")
            if "\ufffd" in text:
                piece = self._tk.id_to_token(int(token_id)) or ""
                import re
                m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
                table = _unicode_to_byte()
                if m:
                    b = bytes([int(m.group(1), 16)])
                elif piece and all(c in table for c in piece):
                    b = bytes(table[c] for c in piece)
            cache[token_id] = b
        return b

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id < 0:
            return None
        return self._tk.id_to_token(token_id)

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_token_ids

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={self.eos_token_ids})"
        )


_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Streaming detokenizer.

    ``push(token_id)`` returns the text newly completed by that token (maybe
    ``""``); ``flush()`` returns whatever is still held back.  The
    concatenation of all pushes and the flush equals
    ``tokenizer.decode(all_ids, skip_special_tokens)`` for byte-level BPE
    tokenizers.

    Technique (as in TGI/vLLM): keep two offsets into the id list.  Decode
    the window ``ids[prefix:read]`` (already emitted) and ``ids[prefix:]``;
    the new text is the difference.  If the window's text ends with U+FFFD,
    the last token(s) end inside a multi-byte UTF-8 character (byte-level BPE
    splits characters across tokens), so nothing is emitted until a later
    token completes it.  Decoding a window with some left context (rather
    than the new token alone) also keeps decoders that strip a leading space
    (SentencePiece-style ``Strip``) correct.

    ``context_ids`` (e.g. the last few prompt ids) seed the left context
    without being emitted, so that the first generated token gets the same
    leading-space treatment as in ``decode(prompt + generated)``.

    Each push costs two decodes of a short window; if a long run of tokens
    keeps ending in U+FFFD (garbage bytes), the window grows until a token
    ends on a character boundary.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in context_ids]
        self._prefix = 0
        self._read = len(self._ids)
        self._n_context = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        ids = self._ids
        ids.append(int(token_id))
        prefix_text = self._decode(ids[self._prefix : self._read])
        new_text = self._decode(ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            out = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(ids)
            self._trim()
            return out
        return ""

    def flush(self) -> str:
        """Text still held back (e.g. an incomplete character, as U+FFFD)."""
        ids = self._ids
        if self._read >= len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix : self._read])
        new_text = self._decode(ids[self._prefix :])
        self._prefix = self._read
        self._read = len(ids)
        self._trim()
        return new_text[len(prefix_text) :]

    def _trim(self) -> None:
        # Drop ids left of the window so the list does not grow forever.
        if self._prefix > 64:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0


def _unicode_to_byte() -> dict:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of its bytes_to_unicode)."""
    global _U2B
    if _U2B is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
            list(range(ord("\xae"), ord("\xff") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _U2B = {chr(c): b for b, c in zip(bs, cs)}
    return _U2B


_U2B = None
