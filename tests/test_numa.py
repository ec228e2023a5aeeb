"""host/numa.py: with pin = numa on several NUMA nodes, each worker computes on a copy of the model bound
to its own node (numa_memory = node), or the file's pages are read interleaved (interleave). The
placement is checked on a fake two-node topology with a recording kernel interface, and the real
mbind on this machine's node 0 (numa_maps); on one node nothing runs."""
from __future__ import annotations

import os
import types

import pytest

from colibri_server.bundled import BUNDLED_MODEL
from colibri_server.host import numa
from colibri_server.host.pinning import Topology, plan_free
from colibri_server.master.generations import Generation
from colibri_server.model import Model, hugepages

TWO_NODES = Topology.from_cores([[0], [1], [2], [3]], nodes=[[0, 1], [2, 3]])
ONE_NODE = Topology.from_cores([[0], [1], [2], [3]])


class Recording:
    """The kernel interface, recording which node each mapping was bound to (by the memfd's name)."""

    def __init__(self):
        self.bound, self.policies = [], []

    def mbind(self, mm, nodes):
        self.bound.append((list(nodes), len(mm)))

    def set_mempolicy(self, mode, nodes=()):
        self.policies.append((mode, list(nodes)))


def _settings(**kw):
    base = dict(pin="numa", numa_memory="node", workers=4, threads_per_worker=1, context=256)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_each_worker_maps_the_copy_bound_to_its_own_node():
    s = _settings()
    rec = Recording()
    nodes = numa.place(BUNDLED_MODEL, s, TWO_NODES, lambda p: Model.open(p), sys=rec)
    try:
        assert sorted(nodes) == [0, 1]
        size = os.path.getsize(BUNDLED_MODEL)
        assert rec.bound == [([0], size), ([1], size)]          # each copy bound before it was written
        gen = Generation(1, Model.open(BUNDLED_MODEL), s, node_models=nodes)
        taken = []
        for k in range(4):              # the master's order: each worker's CPUs from the numa plan
            cpus, _ = plan_free(s, 4, taken, topology=TWO_NODES)
            taken.append(cpus)
            node = numa.node_of(cpus, TWO_NODES)
            assert node == k % 2                                # round-robin over the nodes
            m = gen.model_for(node)
            assert m is nodes[node][0] and m is not gen.model
            assert os.readlink(m.path).startswith(f"/memfd:colibri-model-node{node}")
            assert m.file.identity == gen.model.file.identity   # the same model, so hosts still match
        ref = gen.model.generate([5, 6, 7], max_tokens=6, ignore_eos=True)
        assert all(nodes[n][0].generate([5, 6, 7], max_tokens=6, ignore_eos=True) == ref for n in nodes)
        gen.close()
        assert all(not os.path.exists(c.path) for _, c in nodes.values())    # the copies are freed
    finally:
        for m, c in nodes.values():
            c.close()


def test_interleave_reads_the_file_under_an_interleave_policy_then_restores_it():
    rec = Recording()
    with numa.interleaved(_settings(numa_memory="interleave"), TWO_NODES, sys=rec):
        assert rec.policies == [(numa.MPOL_INTERLEAVE, [0, 1])]
    assert rec.policies[-1] == (numa.MPOL_DEFAULT, [])
    assert numa.place(BUNDLED_MODEL, _settings(numa_memory="interleave"), TWO_NODES, Model.open, sys=rec) == {}


@pytest.mark.parametrize("settings, topology", [
    (_settings(), ONE_NODE),                      # one node: the file's mapping, nothing placed
    (_settings(pin="cores"), TWO_NODES),          # not pinned per node
    (_settings(numa_memory="off"), TWO_NODES),
])
def test_nothing_is_placed_unless_pinned_per_node_on_several_nodes(settings, topology):
    rec = Recording()
    assert numa.mode_for(settings, topology) in ("off",)
    assert numa.place(BUNDLED_MODEL, settings, topology, Model.open, sys=rec) == {}
    with numa.interleaved(settings, topology, sys=rec):
        pass
    assert rec.bound == [] and rec.policies == []


def test_the_kernel_binds_a_copy_to_node_0_here():
    """This machine's real mbind: the copy's pages are bound to node 0 and allocated there
    (numa_maps), and the model read from it answers as the file's."""
    if not os.path.exists("/proc/self/numa_maps"):
        pytest.skip("no /proc/self/numa_maps (a kernel without NUMA)")
    try:
        copy = numa.NodeCopy(BUNDLED_MODEL, 0, numa.Sys())
    except numa.NumaError as e:
        pytest.skip(f"mbind unavailable here: {e}")
    try:
        m = Model.open(copy.path, populate=True)
        # this model's mapping: other tests' copies of node 0 (fake mbind, "default") may still be mapped
        # in this process until they are collected
        start = f"{hugepages.address(m.file._mm):x} "
        lines = [ln for ln in open("/proc/self/numa_maps") if "colibri-model-node0" in ln and ln.startswith(start)]
        assert lines and "bind:0" in lines[0], lines
        fields = dict(f.split("=", 1) for f in lines[0].split() if "=" in f)
        pages = (os.path.getsize(BUNDLED_MODEL) + 4095) // 4096
        assert int(fields.get("N0", 0)) >= pages * 0.99, lines[0]
        assert m.generate([5, 6, 7], max_tokens=6) == Model.open(BUNDLED_MODEL).generate([5, 6, 7], max_tokens=6)
        m.close()
    finally:
        copy.close()
