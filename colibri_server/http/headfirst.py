"""HeadFirstWorker: gunicorn's gthread worker that hands a connection to a thread only once its
request head (and a body up to 2 MiB) is in, so idle or slowloris connections hold no thread.
The default worker class of `colibri http` and configs/gunicorn.conf.py (WORKER_CLASS); built on
first use (`colibri_server.http.HeadFirstWorker`), so importing the gateway does not import
gunicorn's worker machinery."""
from __future__ import annotations

import os
import re
import time

HEADER_TIMEOUT = 10.0          # seconds a connection may take to send its request head (and a body up to 2 MiB)
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d{1,12})[ \t]*\r\n", re.IGNORECASE)
WORKER_CLASS = "colibri_server.http.HeadFirstWorker"


def _head_first_worker():
    """gunicorn's gthread worker, except that a connection gets a thread only once its request
    head (request line and headers) has fully arrived, and its body when Content-Length says
    it is at most 2 MiB.  The main loop reads heads without
    blocking, each with a deadline (HEADER_TIMEOUT, COLIBRI_HTTP_HEADER_TIMEOUT): idle and
    half-sent connections (slowloris) wait in the poller, costing a file descriptor, never a
    thread, and are closed at their deadline.  Plain gthread hands a connection to a thread
    as soon as a byte arrives and that thread then blocks reading the rest: ten idle
    half-sent requests stopped the gateway answering anything, /health included."""
    import selectors
    from functools import partial

    from gunicorn.workers.gthread import ThreadWorker

    timeout = float(os.environ.get("COLIBRI_HTTP_HEADER_TIMEOUT") or HEADER_TIMEOUT)

    class HeadFirstWorker(ThreadWorker):
        max_head = 65536 + 8190     # limit_request_fields x field size is gunicorn's own check
        max_prebody = 2 << 20       # bodies up to this are read here too (the app's limit is 1 MiB)

        def init_process(self):
            self.heads = {}         # conn -> (bytearray, deadline)
            super().init_process()

        def enqueue_req(self, conn):
            if self.cfg.is_ssl or getattr(conn, "is_http2", False) or getattr(conn, "_head_done", False):
                conn._head_done = False
                return super().enqueue_req(conn)
            buf = bytearray()
            if conn.parser is not None:          # kept alive: what was read ahead is the next head's start
                buf += conn.parser.unreader.buf.getvalue()
                conn.parser.unreader.buf = type(conn.parser.unreader.buf)()
            conn.sock.setblocking(False)
            self.heads[conn] = (buf, time.monotonic() + timeout)
            if not self._head_complete(conn):
                self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_head_readable, conn))

        def _ready(self, buf) -> bool:
            """The head is in, and so is the body when its Content-Length is small enough to
            buffer here (a slow body would hold a thread as surely as a slow head)."""
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return len(buf) > self.max_head
            head = bytes(buf[:end + 2])
            m = _CONTENT_LENGTH.search(head)
            low = head.lower()
            if m is None or b"\r\ntransfer-encoding:" in low or b"\r\nexpect:" in low:
                return True         # chunked, or a client waiting for "100 Continue" (curl): a thread's job
            n = int(m.group(1))
            return n > self.max_prebody or len(buf) >= end + 4 + n

        def _head_complete(self, conn) -> bool:
            buf, _ = self.heads[conn]
            if not self._ready(buf):
                return False
            del self.heads[conn]
            if conn.parser is None:
                conn.init()                      # plain HTTP/1: makes the parser, reads nothing
            conn.parser.unreader.unread(bytes(buf))
            conn.data_ready = True
            conn._head_done = True
            self.enqueue_req(conn)
            return True

        def _on_head_readable(self, conn, client):
            buf, _ = self.heads[conn]
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:                          # the client hung up
                self._drop_head(conn)
                return
            buf += data
            if self._ready(buf):
                self.poller.unregister(conn.sock)
                self._head_complete(conn)

        def _drop_head(self, conn):
            self.heads.pop(conn, None)
            try:
                self.poller.unregister(conn.sock)
            except (OSError, KeyError, ValueError):
                pass
            self.nr_conns -= 1
            conn.close()

        def murder_pending(self):
            super().murder_pending()
            now = time.monotonic()
            for conn in [c for c, (_, deadline) in self.heads.items() if deadline < now]:
                self._drop_head(conn)

    return HeadFirstWorker


def __getattr__(name):
    if name == "HeadFirstWorker":
        cls = globals()["HeadFirstWorker"] = _head_first_worker()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
