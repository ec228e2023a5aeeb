"""Whether a silent process is hung or waiting on the disk: its major page faults.

A worker answers between two steps; a step that faults its weights in from disk (a weights budget
below the model's size, a memory limit that evicted them) can take longer than `timeout`, and a
process whose own code pages were evicted stalls the same way. Killing it then loses its requests
and frees nothing: its replacement faults the same pages in. A hung process (a deadlock, a stopped
one) takes no major faults; one that is paging does. So the silence checks (the master's of the
router and the workers, the router's of the workers) measure silence as the time since the later
of the process's last message and its last major fault.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("colibri.paging")

POLL_AFTER = 1.0        # seconds of silence after which hung() starts reading a process's major faults


def major_faults(pid: int):
    """The process's major page faults so far (all its threads; /proc/PID/stat), None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[9])     # field 12, majflt, counted after the name
    except (OSError, ValueError, IndexError):
        return None


class FaultWatch:
    """The last time each watched process's major faults grew (poll(): one read of /proc/PID/stat);
    quiet_for(pid) is how long it has taken none since it was first polled."""

    def __init__(self, clock=time.monotonic, faults=major_faults):
        self.clock, self.faults = clock, faults
        self.seen = {}          # pid -> (faults, when they last grew)
        self.told = set()       # pids silent past the timeout while paging: said once

    def poll(self, pid: int) -> None:
        n = self.faults(pid)
        if n is None:
            self.seen.pop(pid, None)
            return
        last = self.seen.get(pid)
        if last is None or n > last[0]:
            self.seen[pid] = (n, self.clock())

    def quiet_for(self, pid: int) -> float:
        """Seconds since pid's major faults last grew (since it was first polled, at most); inf if never polled."""
        last = self.seen.get(pid)
        return float("inf") if last is None else self.clock() - last[1]

    def silent_for(self, pid: int, silent: float) -> float:
        """A process's silence counting its paging as a sign of life: the shorter of `silent` (since its last
        message) and the time since its last major fault."""
        return min(silent, self.quiet_for(pid))

    def hung(self, pid: int, silent: float, timeout: float, name: str) -> bool:
        """Whether `name` (pid), silent for `silent` seconds since its last message, is hung: silent past
        `timeout` and no major fault for as long. Silent past it while paging: said once, and False. Called
        every turn of the caller's loop; it reads the process's faults only once it has been silent for
        POLL_AFTER (a process that answers costs nothing), so a hung one is killed at most that late."""
        if silent > min(POLL_AFTER, timeout / 2):
            self.poll(pid)
        if silent <= timeout:
            self.told.discard(pid)
            return False
        if self.silent_for(pid, silent) > timeout:
            return True
        if pid not in self.told:
            self.told.add(pid)
            log.warning("%s silent for %.1fs while it reads pages from disk (major faults): memory is short; "
                        "waiting for it", name, silent)
        return False

    def forget(self, pid: int) -> None:
        self.seen.pop(pid, None)
        self.told.discard(pid)
