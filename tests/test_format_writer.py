"""The .colibri writer's safety (a failed or misused write leaves nothing, a rewrite never disturbs a live
mapping) and `colibri validate`, on the files of format_files.py."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from format_files import (
    META,
    TEMPLATE,
    TOKENIZER,
    base,  # noqa: F401  (a fixture)
    bases,  # noqa: F401  (a fixture)
    build_file,
    routing_records,
)

from colibri_server import cli
from colibri_server.model import format as fmt
from colibri_server.model.config import expected_tensors
from colibri_server.model.engine import Model
from colibri_server.model.writer import ColibriWriter

# ---------------------------------------------------------------------------- writer safety

def _writer(path, cfg):
    return ColibriWriter(path, config=cfg.to_dict(), metadata=META, tokenizer_json=TOKENIZER,
                         chat_template=TEMPLATE, num_experts=cfg.num_experts, num_layers=cfg.num_layers)


def _declare_all(w, cfg):
    plan = [(n, dts[0], s) for n, s, dts in expected_tensors(cfg)]
    for n, dt, s in plan:
        w.declare(n, dt, s)
    w.set_routing(routing_records(cfg, w.index))
    return plan


def _temps(d):
    return [f for f in os.listdir(d) if f.endswith(".tmp") or f.startswith(".colibri-")]


@pytest.mark.parametrize("when", ["before-data", "mid-tensor", "after-all-data"])
def test_writer_exception_leaves_nothing(base, tmp_path, when):
    target = tmp_path / "m.colibri"
    with pytest.raises(KeyError):
        with _writer(target, base.cfg) as w:
            plan = _declare_all(w, base.cfg)
            if when != "before-data":
                for n, dt, s in plan:
                    a = base.data[n].reshape(-1)
                    w.write(n, a if when == "after-all-data" else a[:3])
                    if when == "mid-tensor":
                        break
            raise KeyError("boom")
    assert not target.exists() and _temps(tmp_path) == []


def test_writer_failed_rewrite_keeps_target(base, tmp_path):
    target = tmp_path / "m.colibri"
    target.write_bytes(base.raw)
    ino, before = os.stat(target).st_ino, target.read_bytes()
    with pytest.raises(KeyError):
        with _writer(target, base.cfg) as w:
            plan = _declare_all(w, base.cfg)
            w.write(plan[0][0], np.zeros(plan[0][2], np.uint16))
            raise KeyError("boom")
    with pytest.raises(RuntimeError, match="never written"):
        with _writer(target, base.cfg) as w:
            _declare_all(w, base.cfg)
    assert target.read_bytes() == before and os.stat(target).st_ino == ino and _temps(tmp_path) == []
    Model.open(target, deep=True).close()


def test_writer_rewrite_does_not_disturb_live_mapping(base, tmp_path):
    # the writer replaces the file (new inode): a mapping of the old one keeps the old bytes
    target = tmp_path / "m.colibri"
    target.write_bytes(base.raw)
    cf = fmt.ColibriFile.open(target)
    old = cf.view("token_embd")
    new_data = build_file(target, base.cfg, seed=99)
    assert old.tobytes() == base.data["token_embd"].tobytes() != new_data["token_embd"].tobytes()
    cf2 = fmt.ColibriFile.open(target)
    assert cf2.view("token_embd").tobytes() == new_data["token_embd"].tobytes()
    del old
    cf.close()
    cf2.close()


def test_writer_misuse_raises(base, tmp_path):
    target = tmp_path / "m.colibri"
    w = _writer(target, base.cfg)
    plan = _declare_all(w, base.cfg)
    with pytest.raises(ValueError):
        w.declare(plan[0][0], "f16", (1,))                       # declared twice
    with pytest.raises(ValueError):
        w.declare("x" * 25, "f32", (1,))                        # name too long
    with pytest.raises(ValueError):
        w.declare("x", "q4", (1,))                              # unknown dtype
    with pytest.raises(ValueError):
        w.declare("x", "f32", (0,))                             # empty dimension
    with pytest.raises(ValueError):
        w.declare("x", "f32", (1, 1, 1, 1, 1))                  # ndim 5
    with pytest.raises(RuntimeError, match="declaration order"):
        w.write(plan[1][0], base.data[plan[1][0]])              # out of order
    first = base.data[plan[0][0]].reshape(-1)
    w.write(plan[0][0], first[:-1])
    with pytest.raises(ValueError, match="bytes written"):
        w.write(plan[0][0], first[-2:])                          # one element too many
    with pytest.raises(RuntimeError):
        w.declare("late", "f32", (1,))                           # declare after writing started
    with pytest.raises(RuntimeError, match="never written"):
        w.close()                                                # not all tensors written
    w.abort()
    assert not target.exists() and _temps(tmp_path) == []


def test_writer_too_many_bytes_in_with(base, tmp_path):
    target = tmp_path / "m.colibri"
    with pytest.raises(ValueError):
        with _writer(target, base.cfg) as w:
            plan = _declare_all(w, base.cfg)
            w.write(plan[0][0], np.zeros(base.data[plan[0][0]].size + 1, np.uint16))
    assert not target.exists() and _temps(tmp_path) == []


def test_writer_needs_routing(base, tmp_path):
    w = _writer(tmp_path / "m.colibri", base.cfg)
    w.declare("token_embd", "f16", (32, 16))
    with pytest.raises(RuntimeError, match="set_routing"):
        w.write("token_embd", base.data["token_embd"])
    with pytest.raises(ValueError):
        w.set_routing([])                                        # one record per layer
    w.abort()
    assert _temps(tmp_path) == []


# ---------------------------------------------------------------------------- colibri validate

def _validate(args, capsys):
    try:
        cli.main(["validate", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_validate(base, tmp_path, capsys):
    assert _validate([base.path], capsys)[0] == 0
    code, out, _ = _validate([base.path, "--deep"], capsys)
    assert code == 0 and "OK" in out and "checksums" in out

    p = base.patch()
    p.b[p.record("output")["offset"]] ^= 1
    crc_bad = p.write(tmp_path / "crc.colibri")
    assert _validate([crc_bad], capsys)[0] == 0
    code, _, err = _validate([crc_bad, "--deep"], capsys)
    assert code == 1 and "ChecksumMismatch" in err and "output" in err

    p = base.patch()
    p.set_route(0, flags=0)
    code, _, err = _validate([p.write(tmp_path / "route.colibri")], capsys)
    assert code == 1 and "BadRouting" in err and "routing[0]" in err

    code, _, err = _validate([str(tmp_path / "nope.colibri")], capsys)
    assert code == 1 and "FileNotFoundError" in err


def test_cli_validate_subprocess(base, tmp_path):
    p = base.patch()
    p.set_header(magic=b"GGUF")
    bad = p.write(tmp_path / "bad.colibri")
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "validate", bad, "--deep"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "BadMagic" in r.stderr and "magic" in r.stderr, r.stderr
