"""Debug tools: the routing trace is the reference's routing; inspect --gate prints the gate."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from colibri_server.commands.debug import routing_trace
from colibri_server.model import Model


def test_routing_trace_matches_transformers_router(built):
    b = built("qwen2_moe")
    m = Model.open(b.colibri("f32"))
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 512, size=12)]
    got_ids, trace = routing_trace(m, ids)
    assert list(got_ids) == ids
    assert [layer for layer, _, _ in trace] == [1, 3]          # qwen2_moe fixture: layers 0, 2 are dense
    with torch.no_grad():
        out = b.hf(input_ids=torch.tensor([ids]), output_router_logits=True, use_cache=False)
    for (layer, idx, w), logits in zip(trace, out.router_logits):
        probs = torch.softmax(logits.reshape(len(ids), -1).float(), dim=-1)
        top = torch.topk(probs, 2, dim=-1)
        assert (idx == top.indices.numpy()).all(), layer
        np.testing.assert_allclose(w, top.values.numpy(), atol=1e-5)   # norm_topk_prob False: raw probs


def test_cli_debug_routing_and_gate(built):
    path = built("mixtral").colibri("f32")
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "debug", "routing", "--model", path,
                        "--input", "def f(x):"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "layer   0:" in r.stdout and "layer   1:" in r.stdout and "expert load" in r.stdout
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "inspect", path, "--gate", "1", "--rows", "3"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "blk.1.ffn_gate_inp f32[4, 64]" in r.stdout and "e2:" in r.stdout
    assert "e3:" not in r.stdout
    r = subprocess.run([sys.executable, "-m", "colibri_server.cli", "inspect", path, "--gate", "9"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "layer 9 has no router gate" in r.stderr
