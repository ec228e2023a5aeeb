"""HeadFirstWorker: gunicorn's gthread worker that hands a connection to a thread only once its
whole request (head and body, whatever the framing) is in, so slow clients hold no thread.
The default worker class of `colibri http` and configs/gunicorn.conf.py (WORKER_CLASS); built on
first use (`colibri_server.http.HeadFirstWorker`), so importing the gateway does not import
gunicorn's worker machinery."""
from __future__ import annotations

import re
import time

from ..settings.schema import GATEWAY_SETTINGS, gateway_value

HEADER_TIMEOUT = GATEWAY_SETTINGS["header_timeout"].value   # seconds from a request's first byte to its last
WORKER_CLASS = "colibri_server.http.HeadFirstWorker"
LANE_PATHS = (b"/health", b"/metrics")   # GET requests served by threads of their own
LANE_THREADS = 2
LINGER = 2.0                   # seconds a refused connection is drained before it is closed
MAX_CHUNK_LINE = 4096          # bytes of a chunk-size line (with extensions)
MAX_TRAILERS = 8190            # bytes of a chunked body's trailer section
_HEADER = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*(.*?)[ \t]*$")
_STATUS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Payload Too Large"}


class Refuse(Exception):
    """The request cannot be served: answer `status` with `message` and close the connection."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Pending:
    """A request being read by the main loop: its bytes, deadline and what its framing says."""
    __slots__ = ("buf", "deadline", "head_end", "length", "chunk_pos", "chunk_total", "lane")

    def __init__(self, buf: bytearray, deadline: float):
        self.buf, self.deadline = buf, deadline
        self.head_end = None        # offset of the body's first byte once the head is in
        self.length = None          # Content-Length body: its size
        self.chunk_pos = None       # chunked body: offset of the next chunk-size line
        self.chunk_total = 0
        self.lane = False


def _parse_head(p: Pending, max_body: int):
    """The head is in (p.buf[:p.head_end]): read its framing.  Returns (True, b"") when the request
    is for a thread as it stands (no body, or framing gunicorn refuses at once), (False, bytes to
    send first: "100 Continue" or nothing) when a body is to be read here.  Raises Refuse."""
    lines = bytes(p.buf[:p.head_end - 4]).split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) == 3 and parts[0] == b"GET" and parts[1].split(b"?", 1)[0] in LANE_PATHS:
        p.lane = True
    lengths, codings, expect, keep = [], [], False, [lines[0]]
    for line in lines[1:]:
        m = _HEADER.match(line)
        name = m.group(1).lower() if m else b""
        if name == b"content-length":
            lengths.append(m.group(2))
        elif name == b"transfer-encoding":
            codings += [c.strip(b" \t").lower() for c in m.group(2).split(b",")]
        elif name == b"expect" and m.group(2).lower() == b"100-continue":
            expect = True
            continue        # answered here: gunicorn must not send a second "100 Continue"
        keep.append(line)
    if len(lengths) + bool(codings) > 1 or (codings and codings[-1] != b"chunked"):
        return True, b""    # ambiguous framing: gunicorn answers 400 without reading a body
    if codings:
        p.chunk_pos = p.head_end
    elif lengths:
        if not lengths[0].isdigit() or len(lengths[0]) > 18:
            return True, b""
        p.length = int(lengths[0])
        if p.length > max_body:
            raise Refuse(413, f"request body of {p.length} bytes exceeds the limit of {max_body}",
                         "request_too_large")
    else:
        return True, b""
    if not expect:
        return False, b""
    head = b"\r\n".join(keep) + b"\r\n\r\n"
    p.buf[:p.head_end] = head
    p.head_end = len(head)
    if p.chunk_pos is not None:
        p.chunk_pos = p.head_end
    return False, b"HTTP/1.1 100 Continue\r\n\r\n"


def _body_complete(p: Pending, max_body: int) -> bool:
    """Whether the body has fully arrived; chunked framing is checked as it comes (Refuse 400)."""
    buf = p.buf
    if p.length is not None:
        return len(buf) >= p.head_end + p.length
    while True:
        pos = p.chunk_pos
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            if len(buf) - pos > MAX_CHUNK_LINE:
                raise Refuse(400, "malformed chunked body: chunk-size line too long", "invalid_chunked_body")
            return False
        size = bytes(buf[pos:eol]).split(b";", 1)[0].rstrip(b" \t")
        if not size or len(size) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in size):
            raise Refuse(400, f"malformed chunked body: bad chunk size {size[:20].decode('latin-1')!r}",
                         "invalid_chunked_body")
        n = int(size, 16)
        if n == 0:                  # the last chunk, then trailer lines up to an empty line
            if buf[eol + 2:eol + 4] == b"\r\n" or buf.find(b"\r\n\r\n", eol) >= 0:
                return True
            if len(buf) - eol > MAX_TRAILERS:
                raise Refuse(400, "malformed chunked body: trailer section too long", "invalid_chunked_body")
            return False
        if p.chunk_total + n > max_body:
            raise Refuse(413, f"request body exceeds the limit of {max_body} bytes", "request_too_large")
        end = eol + 2 + n
        if len(buf) < end + 2:
            return False
        if buf[end:end + 2] != b"\r\n":
            raise Refuse(400, "malformed chunked body: a chunk does not end with CRLF", "invalid_chunked_body")
        p.chunk_total += n
        p.chunk_pos = end + 2


def _answer(status: int, message: str, code: str) -> bytes:
    import json
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % (status, _STATUS[status], len(body))) + body


def _head_first_worker():
    """gunicorn's gthread worker, except that a connection gets a thread only once its whole
    request is in.  The main loop reads without blocking: the head, then the body as its
    framing says (Content-Length, chunked, after answering "Expect: 100-continue" itself), with
    one deadline from the request's first byte to its last (HEADER_TIMEOUT,
    COLIBRI_HTTP_HEADER_TIMEOUT; 408 after it).  A Content-Length over the app's max_body is
    refused (413) before any body byte is read, and so is a chunked body once it grows past it;
    malformed chunked framing is a 400.  Slow clients thus cost a file descriptor and their
    buffered bytes (at most max_body each), never a thread.  GET /health and /metrics are served
    by threads of their own (LANE_THREADS), so long generations filling every thread do not
    delay a probe.  Plain gthread hands a connection to a thread as soon as a byte arrives and
    that thread then blocks reading the rest: ten half-sent requests stopped the gateway."""
    import selectors
    import socket
    from concurrent import futures
    from functools import partial

    from gunicorn.workers.gthread import ThreadWorker

    from .app import MAX_BODY

    timeout = gateway_value("header_timeout")          # COLIBRI_HTTP_HEADER_TIMEOUT, else HEADER_TIMEOUT

    class HeadFirstWorker(ThreadWorker):
        max_head = 65536 + 8190     # limit_request_fields x field size is gunicorn's own check

        def init_process(self):
            self.heads = {}         # conn -> Pending
            self.closing = {}       # conn -> deadline: refused, draining what the client still sends
            self.lane = futures.ThreadPoolExecutor(max_workers=LANE_THREADS, thread_name_prefix="lane")
            super().init_process()

        def max_body(self) -> int:
            return int(getattr(self.wsgi, "max_body", None) or MAX_BODY)

        def enqueue_req(self, conn):
            if self.cfg.is_ssl or getattr(conn, "is_http2", False) or getattr(conn, "_head_done", False):
                conn._head_done = False
                if getattr(conn, "_lane", False):
                    fs = self.lane.submit(self.handle, conn)
                    fs.add_done_callback(lambda fut: self.method_queue.defer(self.finish_request, conn, fut))
                    return None
                return super().enqueue_req(conn)
            buf = bytearray()
            if conn.parser is not None:          # kept alive: what was read ahead is the next request's start
                buf += conn.parser.unreader.buf.getvalue()
                conn.parser.unreader.buf = type(conn.parser.unreader.buf)()
            conn.sock.setblocking(False)
            self.heads[conn] = Pending(buf, time.monotonic() + timeout)
            if not self._advance(conn):
                self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))

        def _advance(self, conn) -> bool:
            """Read what the buffered bytes allow; True once the connection has left the poller's
            care here (handed to a thread, or refused)."""
            p = self.heads[conn]
            try:
                if p.head_end is None:
                    end = p.buf.find(b"\r\n\r\n")
                    if end < 0:
                        if len(p.buf) <= self.max_head:
                            return False
                        return self._hand_over(conn)     # gunicorn refuses an oversized head
                    p.head_end = end + 4
                    done, send = _parse_head(p, self.max_body())
                    if done:
                        return self._hand_over(conn)
                    if send and not _body_complete(p, self.max_body()):
                        conn.sock.send(send)            # a fresh socket: 25 bytes go out at once
                        return False
                if _body_complete(p, self.max_body()):
                    return self._hand_over(conn)
                return False
            except Refuse as e:
                self._refuse(conn, e.status, e.message, e.code)
                return True
            except OSError:
                self._drop(conn)
                return True

        def _hand_over(self, conn) -> bool:
            p = self.heads.pop(conn)
            self._unregister(conn)
            if conn.parser is None:
                conn.init()                      # plain HTTP/1: makes the parser, reads nothing
            conn.parser.unreader.unread(bytes(p.buf))
            conn.data_ready = True
            conn._head_done, conn._lane = True, p.lane
            self.enqueue_req(conn)
            return True

        def _on_readable(self, conn, client):
            try:
                data = conn.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:                          # the client hung up
                self._drop(conn)
                return
            self.heads[conn].buf += data
            self._advance(conn)                 # the connection stays registered until it leaves

        def finish_request(self, conn, fs):
            """gunicorn closes a connection whose request ended it (an error answer, Connection: close)
            gracefully ON ITS MAIN LOOP: up to 2 s reading what the client still sends, while no other
            connection is served (/health included). Here that drain is the poller's: the same answer
            and FIN, the same 2 s for the client, and no stall."""
            try:
                result = fs.result() if not fs.cancelled() else False
            except Exception:
                result = False
            if result:                              # kept alive, or deferred: gunicorn's own handling
                return super().finish_request(conn, fs)
            self._close_lingering(conn)

        def _close_lingering(self, conn):
            try:
                conn.sock.setblocking(False)
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._drop(conn)
                return
            self.closing[conn] = time.monotonic() + LINGER
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_closing_readable, conn))

        def _refuse(self, conn, status, message, code):
            """Answer `status` and close: first the answer and our side of the connection, then
            reading (and dropping) what the client still sends for up to LINGER seconds, so that
            it reads the answer instead of a reset."""
            self.heads.pop(conn, None)
            self._unregister(conn)
            try:
                conn.sock.send(_answer(status, message, code))
            except OSError:
                self._drop(conn)
                return
            self._close_lingering(conn)

        def _on_closing_readable(self, conn, client):
            try:
                if conn.sock.recv(1 << 16):
                    return
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                pass
            self._drop(conn)

        def _unregister(self, conn):
            try:
                self.poller.unregister(conn.sock)
            except (OSError, KeyError, ValueError):
                pass

        def _drop(self, conn):
            self.heads.pop(conn, None)
            self.closing.pop(conn, None)
            self._unregister(conn)
            self.nr_conns -= 1
            conn.close()

        def murder_pending(self):
            super().murder_pending()
            now = time.monotonic()
            for conn in [c for c, p in self.heads.items() if p.deadline < now]:
                if self.heads[conn].buf:
                    self._refuse(conn, 408, f"the request did not arrive within {timeout:g} s", "request_timeout")
                else:
                    self._drop(conn)
            for conn in [c for c, deadline in self.closing.items() if deadline < now]:
                self._drop(conn)

    return HeadFirstWorker


def __getattr__(name):
    if name == "HeadFirstWorker":
        cls = globals()["HeadFirstWorker"] = _head_first_worker()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
