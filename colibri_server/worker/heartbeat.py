"""The heartbeat table: a worker's liveness, readable by the master without ZeroMQ."""
from __future__ import annotations

import mmap
import struct
import time

__all__ = ["HeartbeatTable"]


class HeartbeatTable:
    """Liveness the master can read without ZeroMQ: one float64 per worker slot in an
    anonymous MAP_SHARED page created before fork. A worker stamps time.monotonic();
    a stopped or hung worker stops stamping and the master kills it after `timeout`.
    A second float64 per slot says the router ACCEPTed the worker (a worker host's master has
    no router of its own to tell it)."""

    def __init__(self, slots: int):
        self.slots = slots
        self._mm = mmap.mmap(-1, max(16 * slots, mmap.PAGESIZE), flags=mmap.MAP_SHARED)

    def set_joined(self, slot: int, joined: bool) -> None:
        struct.pack_into("<d", self._mm, 8 * (self.slots + slot), 1.0 if joined else 0.0)

    def joined(self, slot: int) -> bool:
        return struct.unpack_from("<d", self._mm, 8 * (self.slots + slot))[0] != 0.0

    def beat(self, slot: int) -> None:
        struct.pack_into("<d", self._mm, 8 * slot, time.monotonic())

    def age(self, slot: int) -> float:
        (t,) = struct.unpack_from("<d", self._mm, 8 * slot)
        return time.monotonic() - t if t else 0.0

    def clear(self, slot: int) -> None:
        struct.pack_into("<d", self._mm, 8 * slot, 0.0)
        self.set_joined(slot, False)
