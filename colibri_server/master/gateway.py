"""The HTTP gateway as a child of the master (`colibri serve --http HOST:PORT`): one command for a
server with an OpenAI API, as `llama-server -m` or `vllm serve` give.

The gateway is `python -m colibri_server.http` (gunicorn, its own arbiter and threads) exec'd in a
process of its own, connected to the router's address. The master binds the HTTP address itself,
before it loads the model (startup.py), and every gateway it starts takes that socket as systemd's
socket activation hands one over (LISTEN_FDS=1, fd 3: gunicorn's own support), so the gateway
answers (503 "starting") while the model loads, and the port is never found taken by a restarted
gateway: it is held by the master for the server's life. The master starts it after the router,
restarts it when it dies (after a delay that grows while it keeps dying young, as the router's, each
death logged with the delay), and stops it with TERM when the server stops (gunicorn finishes the
requests in hand). It asks the kernel to TERM it if the master itself dies (PR_SET_PDEATHSIG), so a
killed master leaves no orphan. NOTIFY_SOCKET is the master's alone: the gateway is started without
it (gunicorn would say READY=1 for a server still loading). `colibri http` remains for a gateway on
another host.

Owns: the gateway's process, its restarts and its stop. Never: binds, parses HTTP or talks to the router.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time

# the master handles these: a forked child must not run its handlers
_FORWARDED = {signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM,
              signal.SIGINT, signal.SIGQUIT, signal.SIGCHLD}

log = logging.getLogger("colibri.master")

YOUNG_S = 10.0          # a gateway that dies younger than this is restarted after a growing delay
BACKOFF_MAX_S = 30.0
PR_SET_PDEATHSIG = 1
LISTEN_FD = 3           # SD_LISTEN_FDS_START: where socket activation puts the first socket


class HttpChild:
    def __init__(self, settings, connect: str, listener):
        """listener: the socket bound to settings.http (startup.bind_http), kept open by the master."""
        self.bind, self.connect, self.name = settings.http, connect, settings.served_model_name
        self.listener = listener
        self.log_level, self.log_format = settings.log_level, settings.log_format
        self.pid = None
        self.started = 0.0
        self.backoff = 0.0
        self.next_start = 0.0
        self.stopping = False

    def argv(self) -> list:
        a = [sys.executable, "-m", "colibri_server.http", "--connect", self.connect, "--bind", self.bind,
             "--log-level", self.log_level, "--log-format", self.log_format]
        return a + (["--model-name", self.name] if self.name else [])

    def start(self) -> None:
        argv = self.argv()
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "LISTEN_FDNAMES")}
        # the master's signals blocked across the fork: its handlers would take a signal meant for the
        # child (a stop) and drop it; the child puts the defaults back, then unblocks, then execs
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
        pid = os.fork()
        if pid != 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if pid == 0:                                  # the child: die with the master, become the gateway
            try:
                signal.set_wakeup_fd(-1)
                for sig in _FORWARDED:
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
                if os.getppid() == 1:                 # the master died before prctl took hold
                    os._exit(0)
                if self.listener.fileno() != LISTEN_FD:
                    os.dup2(self.listener.fileno(), LISTEN_FD)      # inheritable, unlike the original
                else:
                    os.set_inheritable(LISTEN_FD, True)
                env.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()))
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.started = pid, time.monotonic()
        log.info("HTTP gateway %d: OpenAI API at http://%s/v1 (to %s)", pid, self.bind, self.connect)

    def poll(self) -> None:
        """Start it when it is due (at start, and after a death once its delay has passed)."""
        if self.pid is None and not self.stopping and time.monotonic() >= self.next_start:
            self.start()

    def reaped(self, pid: int, code: int, describe) -> bool:
        """The master reaped `pid`: True when it was the gateway (restarted later unless stopping)."""
        if pid != self.pid:
            return False
        self.pid = None
        if self.stopping:
            log.info("HTTP gateway %d exited (%s)", pid, describe(code))
            return True
        now = time.monotonic()
        self.backoff = min(max(1.0, self.backoff * 2), BACKOFF_MAX_S) if now - self.started < YOUNG_S else 0.0
        self.next_start = now + self.backoff
        log.error("HTTP gateway %d exited (%s): restarting it%s", pid, describe(code),
                  f" in {self.backoff:.0f}s (its log above says why)" if self.backoff else "")
        return True

    def stop(self, sig=signal.SIGTERM) -> None:
        self.stopping = True
        if self.pid is not None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
