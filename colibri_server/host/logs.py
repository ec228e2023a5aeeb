"""How the server's processes log and show themselves: text or JSON lines, the role of each process
(in JSON lines and in its title, as gunicorn names its processes in `ps`), and the request id a line
is about.

    setup("info", "json")                  # the master, before it forks: children inherit it
    set_role("worker 2 [gen 3]")           # title "colibri: worker 2 [gen 3]"
    log.info("request %s done", rid, extra=request(rid))

JSON lines: {"ts", "level", "logger", "pid", "role", "msg", "request_id"?, "exc"?}, one per line,
for log shippers; text lines stay what they were (the id is in the message).

Owns: the log format, the process title. Never: decides what is logged.
"""
from __future__ import annotations

import json
import logging
import sys
import time

TEXT_FORMAT = "%(asctime)s [%(process)d] %(name)s %(levelname)s: %(message)s"
ROLE = "colibri"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "pid": record.process, "role": ROLE,
               "msg": record.getMessage()}
        rid = getattr(record, "request_id", None)
        if rid is not None:
            out["request_id"] = rid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(level: str = "info", fmt: str = "text") -> None:
    """The root logger: one stderr handler, text or JSON lines (replacing any handler set before)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(h)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


def claim_title() -> None:
    """Let setproctitle find this process's argv area now: it looks on its first call, and fails quietly
    once an inherited environment variable has been replaced (COLIBRI_CACHE_DIR set in the environment
    and again from the settings), which leaves every later title unchanged. The cli calls it first."""
    try:
        import setproctitle
        setproctitle.getproctitle()
    except Exception:           # a title is a nicety: never a reason to fail
        pass


def set_role(role: str) -> None:
    """This process's role, in JSON lines and in its title ("colibri: <role>" in ps and top)."""
    global ROLE
    ROLE = role
    try:
        import setproctitle
        setproctitle.setproctitle(f"colibri: {role}")
    except Exception:           # a title is a nicety: never a reason to fail
        pass


def request(request_id) -> dict:
    """The `extra` of a log call about a request (its id becomes a JSON field)."""
    return {"request_id": request_id}
