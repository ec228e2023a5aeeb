"""What the HTTP gateway knows of the served model, and its chat template (see
`colibri_server.http`).

Chat templates: the gateway has no tokenizer of its own.  `fetch_template(client)` asks the
server for `stats` (the model file's path), opens that file's header with
`ColibriFile.open` (a read-only map: nothing is loaded) and reads the chat template, the
model name and the bos/eos token strings.  This needs the gateway to run on the server's host
(or see the same path); when the file cannot be read the gateway logs a warning and falls
back to ChatML.  The rendered prompt is tokenized by the server with add_special_tokens=False
(the template writes its own special tokens, as in `apply_chat_template`); a ChatML fallback
is tokenized with them.  It is sent as segments (`render_chat_segments`): only the template's
own text is parsed for special tokens, never the messages' content.  The template runs in jinja2's ImmutableSandboxedEnvironment.  The
model info is cached per process and refreshed every `http.INFO_TTL` seconds, and as soon as an
answer reveals a new model generation (`colibri reload`).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..client import Client
from .openai import HTTPError, _bad

log = logging.getLogger("colibri.http")

STATS_TIMEOUT = 5.0            # seconds to wait for the `stats` answer naming the model file

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# ---------------------------------------------------------------------------- model info


@dataclass
class ModelInfo:
    """What the gateway knows of the served model (see `fetch_template`)."""
    name: str
    path: str
    generation: Optional[int]
    chat_template: Optional[str] = None     # None: the model has none (or its file is unreadable): ChatML
    bos_token: str = ""
    eos_token: str = ""
    created: int = 0
    source: str = "file"                    # "file" | "unreadable"
    context: Optional[int] = None           # the router's context length (tokens) for this generation
    fetched_at: float = field(default_factory=time.monotonic)
    _compiled: Any = field(default=None, repr=False)
    _compile_error: Optional[str] = field(default=None, repr=False)


def name_from_path(path: str) -> str:
    base = os.path.basename(path or "") or "colibri"
    return base[:-len(".colibri")] if base.endswith(".colibri") else base


def model_info_from_stats(stats: dict, model_name: Optional[str] = None) -> ModelInfo:
    """Open the model file named by a `stats` answer and read its header blobs."""
    path = stats.get("model") or ""
    gen = stats.get("generation")
    ctx = stats.get("context") if isinstance(stats.get("context"), int) else None
    try:
        from ..model.format import ColibriFile
        cf = ColibriFile.open(path)
    except Exception as e:  # another host, permissions, a replaced file, ...
        log.warning("cannot read the model file %r (%s): chat completions fall back to ChatML; "
                    "run the gateway on the server's host to use the model's template", path, e)
        return ModelInfo(model_name or name_from_path(path), path, gen, created=int(time.time()),
                         source="unreadable", context=ctx)
    try:
        try:
            meta = json.loads(cf.metadata_json or "{}")
        except ValueError:
            meta = {}
        try:
            cfg = json.loads(cf.config_json or "{}")
        except ValueError:
            cfg = {}
        template = cf.chat_template or None
        bos = eos = ""
        bos_id = cfg.get("bos_token_id", -1)
        eos_ids = cfg.get("eos_token_ids") or []
        if cf.tokenizer_json and (isinstance(bos_id, int) and bos_id >= 0 or eos_ids):
            try:
                import tokenizers
                tk = tokenizers.Tokenizer.from_str(cf.tokenizer_json)
                if isinstance(bos_id, int) and bos_id >= 0:
                    bos = tk.id_to_token(bos_id) or ""
                if eos_ids and isinstance(eos_ids[0], int):
                    eos = tk.id_to_token(eos_ids[0]) or ""
            except Exception as e:
                log.warning("cannot read the tokenizer of %r (%s): bos_token/eos_token are empty", path, e)
        name = model_name or (meta.get("name") if isinstance(meta.get("name"), str) and meta.get("name")
                              else name_from_path(path))
        try:
            created = int(os.path.getmtime(path))
        except OSError:
            created = int(time.time())
        return ModelInfo(name, path, gen, template, bos, eos, created, "file", ctx)
    finally:
        cf.close()


def fetch_template(client: Client, model_name: Optional[str] = None, *, timeout: float = STATS_TIMEOUT) -> ModelInfo:
    """Ask the server which model it serves (`stats`) and read that file's chat template,
    bos/eos token strings and name.  Works only when the gateway can open the same path
    (same host); otherwise the ModelInfo has no template (ChatML is used) and `source` is
    "unreadable".  Raises ColibriError when the server does not answer."""
    return model_info_from_stats(client.stats(timeout=timeout), model_name)


# ---------------------------------------------------------------------------- chat templates


class _TemplateRaise(Exception):
    pass


def _raise_exception(message):
    raise _TemplateRaise(str(message))


def _strftime_now(fmt):
    return time.strftime(str(fmt))


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                                        autoescape=False)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    return env


_ENV = None
_ENV_LOCK = threading.Lock()


def _compile(source: str):
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            _ENV = _environment()
        return _ENV.from_string(source)


def render_chat_segments(info: ModelInfo, messages: list, add_generation_prompt: bool = True, **extra) -> tuple:
    """messages -> ([(text, is_template_text), ...], add_special_tokens), for the server's
    tokenize: the template's own text is parsed for special tokens, the messages' content is
    not, so "</s>" typed by a user stays text and can neither end a turn nor forge one.

    The template is rendered once with each content replaced by a unique marker, and the
    output is split at the markers. A template that transforms content (so that a marker does
    not come out exactly once) is rendered again with the real content, located by search;
    content that cannot be located is refused rather than parsed for control tokens."""
    import secrets
    nonce = secrets.token_hex(6)
    marked, contents = [], []
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str) and c:
            marked.append({**m, "content": f"\ue000{nonce}.{len(contents)}\ue001"})
            contents.append(c)
        else:
            marked.append(m)
    text, special = render_chat(info, marked, add_generation_prompt, **extra)
    import re
    pieces = re.split(f"\ue000{nonce}\\.(\\d+)\ue001", text)
    found = [int(x) for x in pieces[1::2]]
    if sorted(found) == list(range(len(contents))):
        segs = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                if piece:
                    segs.append((piece, True))
            else:
                segs.append((contents[int(piece)], False))
        return segs or [("", True)], special
    text, special = render_chat(info, messages, add_generation_prompt, **extra)
    segs, pos = [], 0
    for c in contents:
        at = text.find(c, pos)
        if at < 0:
            raise _bad("the model's chat template transforms message content in a way that cannot be kept "
                       "apart from its control tokens", "messages")
        if at > pos:
            segs.append((text[pos:at], True))
        segs.append((c, False))
        pos = at + len(c)
    if pos < len(text):
        segs.append((text[pos:], True))
    return segs or [("", True)], special


def render_chat(info: ModelInfo, messages: list, add_generation_prompt: bool = True, **extra) -> tuple:
    """messages -> (prompt text, add_special_tokens for tokenizing it).

    The model's template when it has one (and it compiles), else ChatML.  Raises HTTPError
    (400 when the template refuses these messages).  To tokenize, use render_chat_segments:
    this text mixes the template's control tokens with user content."""
    import jinja2
    compiled = None
    if info.chat_template and info._compile_error is None:
        if info._compiled is None:
            try:
                info._compiled = _compile(info.chat_template)
            except jinja2.TemplateError as e:
                info._compile_error = str(e)
                log.warning("the chat template of %s does not compile (%s): using ChatML", info.path, e)
        compiled = info._compiled
    templated = compiled is not None
    if compiled is None:
        compiled = _compile(CHATML)
    try:
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=info.bos_token, eos_token=info.eos_token, **extra)
    except _TemplateRaise as e:
        raise _bad(f"the model's chat template refused these messages: {e}", "messages") from None
    except jinja2.exceptions.SecurityError as e:
        log.error("the chat template of %s attempted an unsafe operation: %s", info.path, e)
        raise HTTPError(500, "the model's chat template attempted an unsafe operation",
                        code="internal", outcome="internal") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise _bad(f"the model's chat template failed on these messages: {type(e).__name__}: {e}",
                   "messages") from None
    # a template writes its own special tokens (as apply_chat_template); ChatML text does not
    return text, not templated
