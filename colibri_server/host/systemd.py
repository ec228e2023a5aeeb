"""sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET (READY=1, RELOADING=1,
STOPPING=1, STATUS=..., WATCHDOG=1). A no-op outside systemd."""
from __future__ import annotations

import os
import socket
import time

SEND_TIMEOUT_S = 1.0


class Notifier:
    def __init__(self, path: str):
        self.path = "\0" + path[1:] if path.startswith("@") else path

    def __call__(self, message: str) -> None:
        if message.startswith("RELOADING=1") and "MONOTONIC_USEC" not in message:
            message += f"\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            # a receiver that does not read (its queue full: 10 datagrams by default) must not stop
            # the master: it notifies from its loop and from a signal handler while loading
            s.settimeout(SEND_TIMEOUT_S)
            try:
                s.connect(self.path)
                s.send(message.encode())
            except OSError:
                pass


def notifier():
    """A Notifier for $NOTIFY_SOCKET, or None outside systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    return Notifier(path) if path else None


def watchdog_interval() -> float:
    """Half of $WATCHDOG_USEC in seconds (0: no watchdog), when it is meant for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return 0.0
    return int(usec) / 2e6
