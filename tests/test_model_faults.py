"""master/faults.ModelFaults: a generation's model file changed in place is found and the generation marked faulty;
a file renamed over the path is another file, whatever the path held when something was last opened (a refused
reload's file, a file that took the inode of one since unmapped), and marks nothing."""
from __future__ import annotations

import logging
import os
import shutil
from types import SimpleNamespace

from colibri_server.bundled import BUNDLED_MODEL
from colibri_server.master.faults import ModelFaults
from colibri_server.model.format import ColibriFile


def _faults(gens):
    sent = []
    f = ModelFaults(gens=gens, to_router=sent.append)
    return f, sent


def _check(f):
    f.last_check = -1e9            # the 2 s between checks is the arbiter loop's, not this test's
    f.check_file()


def test_a_file_renamed_over_the_path_and_then_changed_is_not_the_served_generations(tmp_path, caplog):
    """Generation 1 maps the file at the path. A reload's file is renamed over it, opened and refused (unmapped),
    then that file is truncated where it lies: generation 1's file is untouched, nothing is marked, nothing said.
    With generation 1's own file back at the path (a hard link renamed over it) and truncated in place: marked
    faulty (truncated), once, and said once."""
    live, keep = tmp_path / "live.colibri", tmp_path / "keep.colibri"
    shutil.copy(BUNDLED_MODEL, live)
    os.link(live, keep)
    served = ColibriFile.open(live)
    gens = {1: SimpleNamespace(model=SimpleNamespace(path=str(live), file=served))}
    f, sent = _faults(gens)
    try:
        incoming = tmp_path / "incoming.colibri"
        shutil.copy(BUNDLED_MODEL, incoming)
        os.replace(incoming, live)
        ColibriFile.open(live).close()          # a reload that opened it, then rolled back
        _check(f)
        assert not f.faulty and not sent
        with caplog.at_level(logging.CRITICAL, logger="colibri.master"):
            os.truncate(live, os.path.getsize(live) // 2)
            _check(f)
            assert not f.faulty and not sent and "IN PLACE" not in caplog.text

            os.replace(keep, live)              # generation 1's file at the path again: unchanged yet
            _check(f)
            assert not f.faulty
            os.truncate(live, os.path.getsize(live) - 4096)
            _check(f)
            _check(f)
        assert list(f.faulty) == [1] and "changed in place (truncated)" in f.faulty[1]
        assert [m["generation"] for m in sent] == [1]
        assert caplog.text.count("IN PLACE") == 1
    finally:
        served.close()


def test_bytes_rewritten_in_place_mark_every_generation_mapping_that_file(tmp_path, caplog):
    """Two generations map the same file (a HUP to the same path), a third another file since renamed away: bytes
    written into the file at the path (same size, new mtime) mark the two, as rewritten, not the third; the file
    is named once."""
    live = tmp_path / "live.colibri"
    old = tmp_path / "old.colibri"
    shutil.copy(BUNDLED_MODEL, old)
    first = ColibriFile.open(old)
    shutil.copy(BUNDLED_MODEL, live)
    a, b = ColibriFile.open(live), ColibriFile.open(live)
    gens = {g: SimpleNamespace(model=SimpleNamespace(path=str(live), file=cf)) for g, cf in ((1, first), (2, a),
                                                                                             (3, b))}
    f, sent = _faults(gens)
    try:
        _check(f)
        assert not f.faulty
        st = os.stat(live)
        with open(live, "r+b") as fh:           # what an operator must never do: write the mapped file
            fh.seek(-16, os.SEEK_END)
            fh.write(b"\0" * 16)
        os.utime(live, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        with caplog.at_level(logging.CRITICAL, logger="colibri.master"):
            _check(f)
        assert caplog.text.count("IN PLACE") == 1
        assert sorted(f.faulty) == [2, 3] and all("(rewritten)" in f.faulty[g] for g in (2, 3))
    finally:
        for cf in (first, a, b):
            cf.close()
