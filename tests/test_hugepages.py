"""The model mapping on 2 MiB pages (model/hugepages.py): what smaps says, the re-read of a
large file found on 4 KiB pages, the converter's writer dropping its own pages, and on a
kernel and filesystem that keep large page-cache folios, the real thing."""
from __future__ import annotations

import numpy as np
import pytest
from synth_model import write_model

from colibri_server.model import Model
from colibri_server.model import format as fmt
from colibri_server.model import hugepages as HP

SMALL = dict(hidden_size=512, num_layers=1, moe_intermediate_size=2048)   # ~115 MiB of f16


def test_pmd_mapped_sums_this_files_mappings(tmp_path):
    model = tmp_path / "m.colibri"
    model.write_bytes(b"x")
    other = tmp_path / "other.colibri"
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"7f0000000000-7f0000400000 r--s 00000000 fe:00 12 {model}\n"
        "Size:               4096 kB\nFilePmdMapped:      2048 kB\n"
        f"7f0000400000-7f0000800000 r--s 00400000 fe:00 12 {model}\n"
        "Size:               4096 kB\nFilePmdMapped:      4096 kB\n"
        f"7f0000800000-7f0000a00000 r--s 00000000 fe:00 13 {other}\n"
        "FilePmdMapped:      2048 kB\n"
        f"7f1000000000-7f1000200000 r--s 00000000 fe:00 12 {model}\n"
        "FilePmdMapped:      2048 kB\n"
        "7f0000a00000-7f0000c00000 rw-p 00000000 00:00 0\n"
        "FilePmdMapped:         0 kB\n")
    assert HP.pmd_mapped(str(model), smaps=str(smaps)) == 8 << 20              # every mapping of the file
    # one mapping's range only (a reload maps the file twice in one process)
    assert HP.pmd_mapped(str(model), 0x7f0000000000, 8 << 20, smaps=str(smaps)) == 6 << 20
    assert HP.pmd_mapped(str(model), 0x7f1000000000, 2 << 20, smaps=str(smaps)) == 2 << 20
    assert HP.pmd_mapped(str(tmp_path / "absent"), smaps=str(smaps)) is None      # no mapping: unknown
    assert HP.pmd_mapped(str(model), smaps=str(tmp_path / "no-smaps")) is None


def test_gaps_are_whole_2mib_pieces_outside_the_huge_runs():
    M = HP.PMD_SIZE
    base = 0x7f0000000000
    assert HP.gaps([], base, base + 4 * M) == [(0, 4 * M)]
    assert HP.gaps([(base, base + 4 * M)], base, base + 4 * M) == []
    assert HP.gaps([(base + M, base + 2 * M), (base + 3 * M, base + 5 * M)], base, base + 6 * M) == \
        [(0, M), (2 * M, M), (5 * M, M)]
    assert HP.gaps([(base + 2 * M, base + 9 * M)], base, base + 4 * M) == [(0, 2 * M)]   # clipped to the end


def _spy_rehome(monkeypatch, huge, pieces):
    """Stub the kernel's answers; record what open() drops and faults again."""
    calls = {"drop": [], "fault": []}
    answers = iter(huge)
    monkeypatch.setattr(HP, "pmd_mapped", lambda p, start, size: next(answers))
    monkeypatch.setattr(HP, "small_pieces", lambda start, size: pieces)
    monkeypatch.setattr(HP, "drop_cached", lambda p, pc=None: calls["drop"].append((p, pc)))
    real = HP.populate
    monkeypatch.setattr(HP, "populate", lambda mm, size, start=0: (calls["fault"].append((start, size)),
                                                                   real(mm, size, start)))
    return calls


def test_open_reads_the_pieces_found_on_small_pages_again_last_first(tmp_path, monkeypatch):
    path = str(tmp_path / "m.colibri")
    size = write_model(path, **SMALL)
    assert size >= HP.MIN_RECACHE
    M = HP.PMD_SIZE
    calls = _spy_rehome(monkeypatch, [size - 8 * M, size - M], [(2 * M, M), (10 * M, 3 * M)])
    m = Model.open(path, populate=True)
    assert calls["drop"] == [(path, [(2 * M, M), (10 * M, 3 * M)])]
    assert calls["fault"][-2:] == [(10 * M, 3 * M), (2 * M, M)]     # after the whole-file populate
    assert m.file.huge_bytes == size - M
    cache = m.new_cache()
    assert np.isfinite(m.prefill(cache, np.array([1, 2, 3]))).all()    # the zapped pieces read back


def test_without_pagemap_scan_a_mostly_small_file_is_read_again_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "m.colibri")
    size = write_model(path, **SMALL)
    calls = _spy_rehome(monkeypatch, [0, size], None)
    assert Model.open(path, populate=True).file.huge_bytes == size
    assert calls["drop"] == [(path, [(0, size)])]
    calls = _spy_rehome(monkeypatch, [size // 2], None)         # half on 2 MiB pages: left alone
    assert Model.open(path, populate=True).file.huge_bytes == size // 2 and not calls["drop"]


def test_nothing_is_read_again_when_it_cannot_help(tmp_path, monkeypatch):
    path = str(tmp_path / "m.colibri")
    size = write_model(path, **SMALL)
    calls = _spy_rehome(monkeypatch, [size], [])                 # every piece already on 2 MiB pages
    assert Model.open(path, populate=True).file.huge_bytes == size and not calls["drop"]
    calls = _spy_rehome(monkeypatch, [0], [(0, size)])
    assert Model.open(path, populate=True, hugepages=False).file.huge_bytes is None
    assert Model.open(path, populate=False).file.huge_bytes is None and not calls["drop"]
    small = str(tmp_path / "small.colibri")
    write_model(small, hidden_size=64, num_layers=1, moe_intermediate_size=128, vocab_size=512)
    calls = _spy_rehome(monkeypatch, [0], [(0, HP.PMD_SIZE)])
    assert Model.open(small, populate=True).file.huge_bytes == 0 and not calls["drop"]


def test_the_writer_drops_its_pages_from_the_cache(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(HP, "drop_cached", lambda p, pieces=None: calls.append(p))
    path = str(tmp_path / "m.colibri")
    write_model(path, hidden_size=64, num_layers=1, moe_intermediate_size=128, vocab_size=512)
    assert calls == [path]


def test_a_large_file_is_mapped_on_2mib_pages_where_the_kernel_can(tmp_path):
    path = str(tmp_path / "m.colibri")
    size = write_model(path, **SMALL)
    cf = fmt.ColibriFile.open(path, populate=True)
    try:
        if not cf.huge_bytes:
            pytest.skip("this kernel or filesystem keeps the file on 4 KiB page-cache folios")
        assert cf.huge_bytes >= size // 2
    finally:
        cf.close()


def test_pieces_evicted_and_read_back_small_come_back_on_2mib_pages(tmp_path):
    """The real kernel: part of the file evicted, then read back by read() without readahead (small
    folios, as a backup tool or a cold start's stray reader leaves it); the next open mends it."""
    import os
    path = str(tmp_path / "m.colibri")
    size = write_model(path, **SMALL)
    cf = fmt.ColibriFile.open(path, populate=True)
    start = HP.address(cf._mm)
    pieces = HP.small_pieces(start, size)
    cf.close()
    if pieces is None:
        pytest.skip("this kernel has no PAGEMAP_SCAN (Linux < 6.7)")
    if not cf.huge_bytes:
        pytest.skip("this kernel or filesystem keeps the file on 4 KiB page-cache folios")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for lo in range(16 << 20, 100 << 20, 6 << 20):      # holes between huge pieces: the order matters
            os.posix_fadvise(fd, lo, 4 << 20, os.POSIX_FADV_DONTNEED)
            for off in range(lo, lo + (4 << 20), 1 << 20):
                os.pread(fd, 1 << 20, off)
    finally:
        os.close(fd)
    mm, _, _ = fmt.ColibriFile._map(path, True, True)              # mapped, not mended
    try:
        small = HP.small_pieces(HP.address(mm), size)
    finally:
        mm.close()
    assert sum(n for _, n in small) >= 28 << 20                      # the experiment made small pieces
    cf = fmt.ColibriFile.open(path, populate=True)
    try:
        assert HP.small_pieces(HP.address(cf._mm), size) == []
        assert cf.huge_bytes >= size // HP.PMD_SIZE * HP.PMD_SIZE
    finally:
        cf.close()


def test_a_piece_that_cannot_be_zapped_stops_the_re_read_there(tmp_path, monkeypatch):
    """madvise refused on the second piece: only the first (zapped) piece is dropped and faulted
    again; the rest stay mapped as they were."""
    import mmap
    import os
    path = str(tmp_path / "m.colibri")
    size = write_model(path, **SMALL)
    M = HP.PMD_SIZE

    class Refusing(mmap.mmap):
        calls = 0

        def madvise(self, option, start=0, length=0):
            if option == mmap.MADV_DONTNEED:
                Refusing.calls += 1
                if Refusing.calls == 2:
                    raise OSError("refused")
            return super().madvise(option, start, length)

    fd = os.open(path, os.O_RDONLY)
    mm = Refusing(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    calls = _spy_rehome(monkeypatch, [0, 5 * M], [(2 * M, M), (10 * M, M), (20 * M, M)])
    try:
        assert HP.rehome(path, mm, size) == 5 * M
        assert calls["drop"] == [(path, [(2 * M, M)])] and calls["fault"] == [(2 * M, M)]
    finally:
        mm.close()
