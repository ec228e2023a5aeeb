"""A worker process: messages from the router to its batch engine and back (process.py), and the
heartbeat table the master reads its liveness from."""

from .heartbeat import HeartbeatTable
from .process import EXIT_BOOT_FAILED, EXIT_RETIRED, Worker, worker_main

__all__ = ["Worker", "worker_main", "HeartbeatTable", "EXIT_BOOT_FAILED", "EXIT_RETIRED"]
