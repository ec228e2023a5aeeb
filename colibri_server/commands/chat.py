"""Chat from the command line: `colibri chat` (a conversation, one user turn a line), `colibri run
--chat TEXT` and `colibri generate --chat TEXT` (one user turn).

The messages go through the model's own chat template, rendered as the HTTP gateway renders it
(http/template.py: the template's text parsed for special tokens, the user's text never), so an
instruct model gets the turn markers it was trained on and answers instead of continuing raw text.
The answer ends at the model's end-of-sequence tokens (eos_token_ids: an instruct model's end of
turn). A model without a chat template is refused in one line: a base model has no turns to mark.
"""
from __future__ import annotations

import sys


class ChatError(Exception):
    """A user-caused problem, one line (the CLI prints it as `colibri: error: ...`)."""


def model_info(path: str):
    """The template, bos/eos token strings and name of the model file at `path`."""
    from ..http.template import model_info_from_stats
    info = model_info_from_stats({"model": path})
    if not info.chat_template:
        raise ChatError(f"{path} has no chat template (a base model): chat needs one; "
                        "give the prompt without --chat to continue raw text")
    return info


def model_info_of_server(client):
    """The chat template of the model a running server serves (its file read on this host)."""
    from ..http.template import fetch_template
    info = fetch_template(client)
    if info.source != "file":
        raise ChatError(f"cannot read the served model file {info.path!r} on this host: its chat template is "
                        "unknown; run `colibri generate --chat` on the server's host")
    if not info.chat_template:
        raise ChatError(f"{info.path} has no chat template (a base model): chat needs one; "
                        "give the prompt without --chat to continue raw text")
    return info


def render(info, messages: list) -> tuple:
    """(segments, add_special_tokens) of `messages` with the generation prompt, for a tokenizer's
    encode_segments or a server's tokenize."""
    from ..http.openai import HTTPError
    from ..http.template import render_chat_segments
    try:
        return render_chat_segments(info, messages, True)
    except HTTPError as e:
        raise ChatError(e.message) from None


def messages_for(text: str, system: str | None = None) -> list:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def prompt_ids(model, info, messages: list) -> list:
    """Token ids of `messages` rendered by the model's chat template, as apply_chat_template gives them."""
    segments, special = render(info, messages)
    return model.tokenizer.encode_segments(segments, add_special_tokens=special)


def converse(model, info, params: dict, system: str | None = None, stdin=None, out=None) -> None:
    """A conversation: each line of stdin is a user turn, answered (streamed to `out`) with every
    turn so far in the prompt. Ends at end of input or a line `/exit`."""
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    tty = stdin.isatty()
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        if tty:
            out.write("> ")
            out.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        ids = prompt_ids(model, info, messages)
        answer = []
        try:
            for ev in model.stream(ids, **params):
                answer.append(ev.text)
                out.write(ev.text)
                out.flush()
        except ValueError as e:
            raise ChatError(str(e)) from None
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": "".join(answer)})
