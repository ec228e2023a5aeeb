"""CPU topology and pinning (colibri_server/host/pinning.py) on fake sysfs trees, plus apply()
on this process (its affinity is restored afterwards)."""
from __future__ import annotations

import os

import psutil
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from colibri_server.host import pinning as P
from colibri_server.host.pinning import PinningError, Topology


def fake_sysfs(root, cores, nodes=None, siblings_files=True, online=True):
    """A /sys tree. cores: lists of sibling CPU numbers (one list per physical core, in
    package 0); nodes: lists of CPUs per NUMA node (None: no node directory)."""
    cpu_root = root / "devices" / "system" / "cpu"
    cpus = sorted(c for core in cores for c in core)
    for core_id, core in enumerate(cores):
        for c in core:
            topo = cpu_root / f"cpu{c}" / "topology"
            topo.mkdir(parents=True)
            (topo / "core_id").write_text(f"{core_id}\n")
            (topo / "physical_package_id").write_text("0\n")
            if siblings_files:
                (topo / "thread_siblings_list").write_text(P.format_cpulist(core) + "\n")
                (topo / "core_cpus_list").write_text(P.format_cpulist(core) + "\n")
    if online:
        (cpu_root / "online").write_text(P.format_cpulist(cpus) + "\n")
    if nodes is not None:
        for i, n in enumerate(nodes):
            d = root / "devices" / "system" / "node" / f"node{i}"
            d.mkdir(parents=True)
            (d / "cpulist").write_text(P.format_cpulist(n) + "\n")
    return str(root)


# 2 NUMA nodes, 4 cores with 2 hyperthreads each, Linux x86 numbering (siblings i, i+4)
SMT_CORES = [[0, 4], [1, 5], [2, 6], [3, 7]]
SMT_NODES = [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.fixture
def smt(tmp_path):
    return fake_sysfs(tmp_path, SMT_CORES, SMT_NODES)


@pytest.fixture
def small(tmp_path):
    """1 node, 2 cores, no SMT."""
    return fake_sysfs(tmp_path, [[0], [1]], [[0, 1]])


# ------------------------------------------------------------------ cpulists

@pytest.mark.parametrize("text,cpus", [
    ("0-3,8-11", [0, 1, 2, 3, 8, 9, 10, 11]), ("0", [0]), ("", []), ("\n", []),
    ("5,1-2\n", [1, 2, 5]), ("0-0", [0])])
def test_parse_cpulist(text, cpus):
    assert P.parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "-1", "0-3:2"])
def test_parse_cpulist_errors(text):
    with pytest.raises(ValueError):
        P.parse_cpulist(text)


@given(st.sets(st.integers(0, 300)))
@hsettings(max_examples=60, deadline=None)
def test_cpulist_round_trip(cpus):
    assert P.parse_cpulist(P.format_cpulist(cpus)) == sorted(cpus)


# ------------------------------------------------------------------ detect

def test_detect_small(small):
    t = P.detect(small, allowed=[0, 1])
    assert t.cpus == (0, 1)
    assert t.cores == ((0,), (1,))
    assert t.nodes == (P.Node(0, (0, 1)),)
    assert (t.smt, t.physical_cores, P.default_workers(t)) == (1, 2, 2)


def test_detect_smt_two_nodes(smt):
    t = P.detect(smt, allowed=range(8))
    assert t.cpus == tuple(range(8))
    assert t.cores == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert t.nodes == (P.Node(0, (0, 1, 4, 5)), P.Node(1, (2, 3, 6, 7)))
    assert (t.smt, P.default_workers(t), P.default_workers(t, threads_per_worker=2)) == (2, 4, 2)
    assert "8 CPUs (0-7), 4 physical cores, 2 NUMA node(s)" in str(t)


def test_detect_core_ids_without_sibling_lists(tmp_path):
    root = fake_sysfs(tmp_path, SMT_CORES, SMT_NODES, siblings_files=False, online=False)
    t = P.detect(root, allowed=range(8))
    assert t.cores == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_detect_affinity_mask(smt):
    # allowed: one hyperthread of core 0, both of core 2, and a CPU that is not online
    t = P.detect(smt, allowed=[0, 2, 6, 42])
    assert t.cpus == (0, 2, 6)
    assert t.cores == ((0,), (2, 6))
    assert t.nodes == (P.Node(0, (0,)), P.Node(1, (2, 6)))
    assert P.default_workers(t) == 2
    assert P.plan(t, 0, 1, "cores") == [[0], [2]]
    assert P.plan(t, 3, 1, "cores") == [[0], [2], [6]]
    with pytest.raises(PinningError, match="no usable CPUs"):
        P.detect(smt, allowed=[40, 41])


def test_detect_without_numa_or_sysfs(tmp_path):
    root = fake_sysfs(tmp_path, [[0, 2], [1, 3]], nodes=None)
    t = P.detect(root, allowed=range(4))
    assert t.nodes == (P.Node(0, (0, 1, 2, 3)),)
    # no sysfs at all: every allowed CPU alone; psutil estimates the physical cores
    t = P.detect(str(tmp_path / "nothing"), allowed=[0])
    assert t.cpus == (0,) and t.cores == ((0,),) and t.physical_cores == 1


def test_detect_real_machine():
    t = P.detect()
    allowed = sorted(psutil.Process().cpu_affinity())
    assert list(t.cpus) == allowed
    assert sorted(c for core in t.cores for c in core) == allowed
    assert sorted(c for n in t.nodes for c in n.cpus) == allowed
    assert 1 <= P.default_workers(t) <= len(allowed)


# ------------------------------------------------------------------ plans

def test_plan_cores_small(small):
    t = P.detect(small, allowed=[0, 1])
    p = P.plan(t, 2, 1, "cores")
    assert p == [[0], [1]] and not p.oversubscribed and p.warnings == ()
    p = P.plan(t, 1, 2, "cores")
    assert p == [[0, 1]] and not p.oversubscribed
    p = P.plan(t, 3, 1, "cores")  # oversubscribed: wraps around
    assert p == [[0], [1], [0]] and p.oversubscribed
    assert "3 workers x 1 threads = 3 threads on 2 allowed CPUs" in p.warnings[0]
    p = P.plan(t, 1, 3, "cores")  # more threads than CPUs in one worker
    assert p == [[0, 1]] and p.oversubscribed


def test_plan_cores_smt(smt):
    t = P.detect(smt, allowed=range(8))
    # distinct physical cores first, in NUMA order
    assert P.plan(t, 4, 1, "cores") == [[0], [1], [2], [3]]
    assert P.plan(t, 2, 2, "cores") == [[0, 1], [2, 3]]  # each worker within one node
    p = P.plan(t, 0, 1, "cores")
    assert p == [[0], [1], [2], [3]] and p.warnings == ()
    # then the hyperthread siblings, with a warning but not oversubscribed
    p = P.plan(t, 6, 1, "cores")
    assert p == [[0], [1], [2], [3], [4], [5]]
    assert not p.oversubscribed and "share a core with a hyperthread sibling" in p.warnings[0]
    p = P.plan(t, 1, 8, "cores")
    assert p == [list(range(8))] and not p.oversubscribed
    # beyond the logical CPUs: wrap around
    p = P.plan(t, 5, 2, "cores")
    assert p == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]] and p.oversubscribed


def test_plan_numa(smt):
    t = P.detect(smt, allowed=range(8))
    p = P.plan(t, 3, 1, "numa")
    assert p == [[0, 1, 4, 5], [2, 3, 6, 7], [0, 1, 4, 5]] and not p.oversubscribed
    p = P.plan(t, 3, 4, "numa")  # node0 gets 8 threads on 4 CPUs
    assert p.oversubscribed and "node0: 8 threads on 4 CPUs" in p.warnings[0]
    assert "node1" not in p.warnings[0]
    t1 = P.detect(smt, allowed=[2, 3])  # only node 1 is allowed
    assert P.plan(t1, 2, 1, "numa") == [[2, 3], [2, 3]]


def test_plan_none(smt):
    t = P.detect(smt, allowed=range(8))
    p = P.plan(t, 3, 2, "none")
    assert p == [None, None, None] and not p.oversubscribed
    p = P.plan(t, 5, 2, "none")
    assert p.oversubscribed and p.warnings
    assert P.plan(t, 0, 1, "none") == [None] * 4


def test_plan_arguments(small):
    t = P.detect(small, allowed=[0, 1])
    with pytest.raises(ValueError, match="pin mode 'all'"):
        P.plan(t, 1, 1, "all")
    with pytest.raises(ValueError):
        P.plan(t, -1, 1, "cores")
    with pytest.raises(ValueError):
        P.plan(t, 1, 0, "cores")


@given(cores=st.lists(st.integers(1, 4), min_size=1, max_size=8),
       workers=st.integers(1, 12), threads=st.integers(1, 6), numa=st.booleans())
@hsettings(max_examples=80, deadline=None)
def test_plan_cores_invariants(cores, workers, threads, numa):
    # cores: SMT width per core; CPUs numbered Linux-style (first threads, then siblings)
    n = len(cores)
    core_lists = [[i + level * n for level in range(w)] for i, w in enumerate(cores)]
    nodes = None
    if numa and n > 1:
        nodes = [sum(core_lists[: n // 2], []), sum(core_lists[n // 2:], [])]
    t = Topology.from_cores(core_lists, nodes)
    p = P.plan(t, workers, threads, "cores")
    assert len(p) == workers
    allowed = set(t.cpus)
    for s in p:
        assert s == sorted(set(s)) and set(s) <= allowed
        assert len(s) == min(threads, len(allowed))
    used = [c for s in p for c in s]
    if workers * threads <= len(allowed):
        assert not p.oversubscribed and len(used) == len(set(used))  # disjoint
        if workers * threads <= n:  # one thread per physical core
            core_of = {c: i for i, cl in enumerate(core_lists) for c in cl}
            assert len({core_of[c] for c in used}) == len(used)
    else:
        assert p.oversubscribed and p.warnings


def test_plan_for_settings(smt):
    from colibri_server.settings import load_settings
    t = P.detect(smt, allowed=range(8))
    s = load_settings({"pin": "cores", "threads_per_worker": 2}, env={})
    assert [P.plan_for(s, 2, i, t) for i in range(3)] == [[0, 1], [2, 3], [0, 1]]
    assert P.plan_for(s, 0, 1, t) == [2, 3]  # 0 workers: default_workers
    s = load_settings({"pin": "none"}, env={})
    assert P.plan_for(s, 4, 0) is None
    s = load_settings({"pin": "numa"}, env={})
    assert P.plan_for(s, 4, 1, t) == [2, 3, 6, 7]
    assert set(P.plan_for(load_settings(env={}), 1, 0)) <= set(P.detect().cpus)
    assert P.Topology.detect(smt, allowed=range(8)) == t


# ------------------------------------------------------------------ apply

@pytest.fixture
def restore_affinity():
    before = psutil.Process().cpu_affinity()
    yield before
    psutil.Process().cpu_affinity(before)
    assert psutil.Process().cpu_affinity() == before


def test_apply_real_process(restore_affinity):
    allowed = restore_affinity
    P.apply(None)  # no-op
    assert psutil.Process().cpu_affinity() == allowed
    P.apply([allowed[-1]])
    assert psutil.Process().cpu_affinity() == [allowed[-1]]
    assert os.sched_getaffinity(0) == {allowed[-1]}
    P.apply(allowed)
    assert psutil.Process().cpu_affinity() == allowed
    # the plan for this machine applies cleanly
    for cpus in P.plan(P.detect(allowed=allowed), 0, 1, "cores"):
        P.apply(cpus)
        assert psutil.Process().cpu_affinity() == cpus


def test_apply_errors(restore_affinity):
    with pytest.raises(PinningError, match=r"cannot pin process \d+ to CPUs 100000: .*it may run on"):
        P.apply([100000])
    with pytest.raises(PinningError, match="empty CPU set"):
        P.apply([])
    assert psutil.Process().cpu_affinity() == restore_affinity
