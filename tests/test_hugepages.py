"""The model mapping on 2 MiB pages (model/hugepages.py): what smaps says, the re-read of a
large file found on 4 KiB pages, the converter's writer dropping its own pages, and on a
kernel and filesystem that keep large page-cache folios, the real thing."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_server.model import Model
from colibri_server.model import format as fmt
from colibri_server.model import hugepages as HP
from synth_model import write_model

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


def test_open_reads_a_large_file_found_on_small_pages_again_once(tmp_path, monkeypatch):
    path = str(tmp_path / "m.colibri")
    size = write_model(path, **SMALL)
    assert size >= HP.MIN_RECACHE
    calls, answers = [], iter([0, size - (1 << 20)])
    monkeypatch.setattr(HP, "pmd_mapped", lambda p, start, size: next(answers))
    monkeypatch.setattr(HP, "drop_cached", lambda p: calls.append(p))
    m = Model.open(path, populate=True)
    assert calls == [path]                                  # dropped once, mapped and faulted again
    assert m.file.huge_bytes == size - (1 << 20)
    cache = m.new_cache()
    assert np.isfinite(m.prefill(cache, np.array([1, 2, 3]))).all()

    calls.clear()
    monkeypatch.setattr(HP, "pmd_mapped", lambda p, start, size_: size)   # already on 2 MiB pages: nothing to do
    assert Model.open(path, populate=True).file.huge_bytes == size and not calls
    monkeypatch.setattr(HP, "pmd_mapped", lambda p, start, size: 0)
    assert Model.open(path, populate=True, hugepages=False).file.huge_bytes is None and not calls
    assert Model.open(path, populate=False).file.huge_bytes is None and not calls


def test_a_small_file_is_never_read_again(tmp_path, monkeypatch):
    path = str(tmp_path / "m.colibri")
    write_model(path, hidden_size=64, num_layers=1, moe_intermediate_size=128, vocab_size=512)
    calls = []
    monkeypatch.setattr(HP, "pmd_mapped", lambda p, start, size: 0)
    monkeypatch.setattr(HP, "drop_cached", lambda p: calls.append(p))
    assert Model.open(path, populate=True).file.huge_bytes == 0 and not calls


def test_the_writer_drops_its_pages_from_the_cache(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(HP, "drop_cached", lambda p: calls.append(p))
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
