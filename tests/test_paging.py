"""host/paging: a silent process that reads pages from disk is waiting, not hung (the master's and the
router's silence checks count its major faults as a sign of life)."""
from __future__ import annotations

import mmap
import os

import pytest

from colibri_server.host.paging import FaultWatch, major_faults


def _fs_type(path) -> str:
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, fs = line.split()[:3]
            if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                best, kind = mnt, fs
    return kind


def test_major_faults_count_the_pages_a_process_reads_from_disk(tmp_path):
    """Pages dropped from the page cache and touched through a mapping are major faults of this process."""
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is in memory ({_fs_type(tmp_path)}): no page is read from a disk")
    path = tmp_path / "cold"
    size = 4 << 20
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        before = major_faults(os.getpid())
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            m.madvise(mmap.MADV_RANDOM)                 # one fault a page: no read-around hides them
            total = sum(m[i] for i in range(0, size, mmap.PAGESIZE))
        after = major_faults(os.getpid())
    finally:
        os.close(fd)
    assert total >= 0 and isinstance(before, int)
    assert after - before >= size // mmap.PAGESIZE // 2
    assert major_faults(2 ** 22 + 12345) is None                            # no such process


def test_silence_counts_from_the_last_message_or_the_last_page_read():
    """silent_for: the shorter of the time since the last message and since the faults last grew; a process that
    takes none stays silent from its last message, and a gone one is forgotten."""
    clock, faults = [0.0], {7: 100}
    w = FaultWatch(clock=lambda: clock[0], faults=lambda pid: faults.get(pid))
    assert w.silent_for(7, 50.0) == 50.0                    # never polled: its messages alone decide
    w.poll(7)
    clock[0] = 20.0
    w.poll(7)                                               # no fault since: quiet from the first poll
    assert w.silent_for(7, 50.0) == 20.0
    faults[7] = 101
    clock[0] = 25.0
    w.poll(7)
    clock[0] = 40.0
    w.poll(7)
    assert w.quiet_for(7) == 15.0 and w.silent_for(7, 60.0) == 15.0 and w.silent_for(7, 3.0) == 3.0
    clock[0] = 100.0
    w.poll(7)                                               # hung: no fault for 75 s
    assert w.silent_for(7, 90.0) == 75.0
    del faults[7]
    w.poll(7)
    assert w.quiet_for(7) == float("inf")


def test_hung_is_silent_past_the_timeout_without_paging_and_a_paging_one_is_told_once(caplog):
    """hung(): False within the timeout; past it, True for a process that took no major fault for as long, False
    (and one warning per silence) for one that still reads pages."""
    import logging
    clock, faults = [0.0], {7: 1}
    w = FaultWatch(clock=lambda: clock[0], faults=lambda pid: faults.get(pid))
    w.poll(7)
    assert not w.hung(7, 5.0, 30.0, "worker 7")
    with caplog.at_level(logging.WARNING, logger="colibri.paging"):
        for t in range(10, 60, 10):                     # silent 40-80 s, a fault every 10 s
            clock[0] = float(t)
            faults[7] += 1
            w.poll(7)
            assert not w.hung(7, 30.0 + t, 30.0, "worker 7")
    assert sum("worker 7 silent" in r.message for r in caplog.records) == 1
    clock[0] = 91.0                                     # no fault for 41 s
    w.poll(7)
    assert w.hung(7, 121.0, 30.0, "worker 7")
    fresh = FaultWatch(clock=lambda: clock[0], faults=lambda pid: faults.get(pid))
    assert not fresh.hung(7, 0.5, 30.0, "worker 7") and 7 not in fresh.seen     # answering: nothing read
    assert not fresh.hung(7, 2.0, 30.0, "worker 7") and 7 in fresh.seen         # silent a while: its faults read
