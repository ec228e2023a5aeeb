"""What the master does before it opens the model, and while it loads it (arbiter.py's start).

Every listening address is taken first, so that a busy one fails the start in a second instead of
after a load and a kernel compile that can take minutes:
- the gateway's HTTP address (`http`) is bound here, in the master, and handed to every gateway it
  starts (gateway.py). The port stays this server's for its whole life: a gateway restarted later
  cannot find it taken, and connections made while no gateway runs wait in the backlog instead of
  being refused;
- the router is forked before the model is opened (generation 0, see router/loop.py): it binds the client
  address (and backend_bind), and the master waits for its "up" or its bind failure.

While the model loads and the kernels compile (`Loading`), the router answers `health` "starting"
and refuses other requests with "starting", and the gateway answers 503 with Retry-After. The master
runs no loop then, so a SIGALRM every TICK_S stands in for it: EXTEND_TIMEOUT_USEC (and the STATUS)
to systemd, so that a long first compile does not hit TimeoutStartSec, and the router's pipe read, so
that its "alive" messages neither fill the pipe nor leave it judged silent. No thread: the checksum
processes fork during the load. TERM, INT and QUIT stop the start (the load is abandoned; the
children are stopped by the master's cleanup). The stop is raised from the signal handler; when the
handler happens to run inside a C library's callback into Python (llvmlite's object cache while a
kernel compiles), the callback swallows the exception as "unraisable": the hook installed here
silences that one exception and fires the alarm 1 ms on, whose handler raises the stop again.

Owns: the HTTP listening socket, the wait for the router's bind, the loading phase's signals.
Never: forks (arbiter.py does), opens the model (loading.py does).
"""
from __future__ import annotations

import errno
import logging
import os
import select
import signal
import socket
import sys
import time

from .loading import EXIT_BIND, EXIT_LOAD, HaltServer, describe_exit

log = logging.getLogger("colibri.master")

HTTP_BACKLOG = 2048      # gunicorn's default backlog
ROUTER_UP_S = 30.0       # a router that neither listens nor fails within this is a failed start
TICK_S = 5.0             # how often the loading master tells systemd it is still starting
# EXTEND_TIMEOUT_USEC asks systemd for this much more time at each tick. Larger than TICK_S by far: a
# signal handler runs only between Python steps, and one C call (LLVM optimising a large kernel, the
# page faults of a big model's MAP_POPULATE) can hold it back for tens of seconds.
EXTEND_S = 90
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


def bind_http(address: str) -> socket.socket:
    """A listening TCP socket on `address` (HOST:PORT, [v6]:PORT), or HaltServer naming it."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, ValueError) as e:
        raise HaltServer(f"http: cannot listen on {address}: {getattr(e, 'strerror', None) or e}",
                         EXIT_BIND) from None
    sock = socket.socket(family, kind, proto)
    try:
        # as gunicorn does: a port left in TIME_WAIT by the previous server is free to take
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(HTTP_BACKLOG)
    except OSError as e:
        sock.close()
        hint = " (another process listens there: stop it or choose another --http)" \
            if e.errno == errno.EADDRINUSE else ""
        raise HaltServer(f"http: cannot listen on {address}: {e.strerror}{hint}", EXIT_BIND) from None
    log.info("HTTP: listening on %s (503 \"starting\" until the model is loaded)", address)
    return sock


def wait_router_up(arb, timeout: float = ROUTER_UP_S) -> None:
    """Wait until the router forked by `arb` (the Arbiter) listens; HaltServer when it cannot bind
    (EXIT_BIND, its one-line reason naming the address) or exits or hangs before it listens."""
    deadline = time.monotonic() + timeout
    while True:
        select.select([arb.pipe], [], [], 0.05)
        arb.read_router()
        if arb.bind_error:
            raise HaltServer(arb.bind_error, EXIT_BIND)
        if arb.router_up:
            return
        pid, status = os.waitpid(arb.router_pid, os.WNOHANG)
        if pid:
            arb.router_pid = None
            arb.read_router()               # its last words (bind_failed) are in the pipe
            if arb.bind_error:
                raise HaltServer(arb.bind_error, EXIT_BIND)
            raise HaltServer(f"the router exited before it listened on {arb.settings.bind} "
                             f"({describe_exit(os.waitstatus_to_exitcode(status))}); see its log above", EXIT_LOAD)
        if time.monotonic() > deadline:
            raise HaltServer(f"the router did not listen on {arb.settings.bind} within {timeout:.0f}s", EXIT_LOAD)


class Loading:
    """`with Loading(notify, tick):` around the model's load and compile: see the module's doc.
    tick(): called at each tick (errors ignored: they must not break the load)."""

    def __init__(self, notify, tick=None, what="the model", every: float = TICK_S):
        self.notify, self.tick, self.what, self.every = notify, tick, what, every
        self.stop_signal = None
        self._old = {}
        self._old_unraisable = None

    def __enter__(self):
        self.t0 = time.monotonic()
        for sig in (signal.SIGALRM, *STOP_SIGNALS):
            self._old[sig] = signal.getsignal(sig)
        signal.signal(signal.SIGALRM, self._on_alarm)
        signal.siginterrupt(signal.SIGALRM, False)     # C code's blocking calls resume, never see EINTR
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_stop)
        self._old_unraisable = sys.unraisablehook
        sys.unraisablehook = self._on_unraisable
        self._on_alarm()                    # at once: a warm start may be over before the first tick
        signal.setitimer(signal.ITIMER_REAL, self.every, self.every)
        return self

    def _on_alarm(self, *_):
        if self.stop_signal is not None:    # a stop swallowed by a C callback (_on_unraisable)
            self._on_stop(self.stop_signal, None)
        try:
            self.notify(f"EXTEND_TIMEOUT_USEC={EXTEND_S * 1_000_000}\nSTATUS=starting: loading {self.what} and "
                        f"compiling kernels ({time.monotonic() - self.t0:.0f}s)")
            if self.tick is not None:
                self.tick()
        except Exception as e:      # noqa: BLE001 - a failed notification must not fail the load
            log.debug("loading tick failed: %r", e)

    def _on_stop(self, signum, frame):
        self.stop_signal = signum
        raise HaltServer(f"{signal.Signals(signum).name} while loading {self.what}: stopped", 0)

    def _on_unraisable(self, unraisable):
        """The stop raised inside a C callback, which swallowed it: raise it again from the next step."""
        if isinstance(unraisable.exc_value, HaltServer) and self.stop_signal is not None:
            # not from here (a handler run inside this hook is swallowed again): the alarm, 1 ms on
            signal.setitimer(signal.ITIMER_REAL, 0.001, self.every)
        else:
            self._old_unraisable(unraisable)

    def __exit__(self, kind, exc, tb):
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.unraisablehook = self._old_unraisable
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        if self.stop_signal is not None:   # whatever the load made of the exception the handler raised
            raise HaltServer(f"{signal.Signals(self.stop_signal).name} while loading {self.what}: stopped",
                             0) from None
        return False
