"""CPU topology and per-worker CPU pinning.

`detect()` reads the machine: logical CPUs, physical cores (hyperthread siblings grouped)
and NUMA nodes from sysfs, keeping only the CPUs this process may run on (its affinity
mask, which on Linux already reflects the cgroup cpuset and `taskset`). `plan()` turns a
worker count, threads per worker and a pin mode into one CPU list per worker; `apply()`
pins a process to one.

Pin modes:
  cores  one logical CPU per worker thread, on distinct physical cores first: the CPU
         order is the first hyperthread of every core (cores grouped by NUMA node), then
         the second hyperthread of every core, and so on. Worker i takes the next
         threads_per_worker CPUs of that order, so workers get disjoint CPUs while there
         are enough, use SMT siblings only once every core has a worker thread, and wrap
         around (sharing CPUs: `Plan.oversubscribed`) when there are more threads than CPUs.
         A worker gets exactly its CPUs, not its cores' idle siblings: each compute thread
         has a CPU of its own and two workers never meet on one core while cores are free.
  numa   workers round-robin over the NUMA nodes that have allowed CPUs; each is pinned to
         all of its node's allowed CPUs (the kernel balances within the node). Memory is
         numa.py's: a copy of the model per node, or the file interleaved (numa_memory).
  none   no pinning: every worker's entry is None.

The sysfs root is a parameter so tests run on fake trees.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import psutil

__all__ = ["PinningError", "Node", "Topology", "Plan", "MODES", "SYSFS", "parse_cpulist",
           "format_cpulist", "detect", "default_workers", "plan", "plan_for", "plan_free", "apply",
           "current_affinity"]

SYSFS = "/sys"
MODES = ("none", "cores", "numa")


class PinningError(RuntimeError):
    pass


def parse_cpulist(text: str) -> list[int]:
    """Kernel cpulist syntax -> sorted CPU numbers: '0-3,8-11' -> [0, 1, 2, 3, 8, 9, 10, 11];
    '' -> []. Raises ValueError on anything else."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad cpulist {text.strip()!r}") from None
        if a < 0 or b < a:
            raise ValueError(f"bad cpulist {text.strip()!r}")
        out.update(range(a, b + 1))
    return sorted(out)


def format_cpulist(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (the inverse of parse_cpulist)."""
    cpus = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        runs.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(runs)


class Node(NamedTuple):
    id: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """The CPUs this process may use. `cores`: physical cores, each the tuple of its allowed
    hyperthread siblings, ordered by NUMA node then first CPU. `nodes`: NUMA nodes with
    their allowed CPUs (nodes without any are left out). `physical_cores`: the core count
    used for `default_workers` (len(cores), or an estimate from psutil when sysfs has no
    topology)."""
    cpus: tuple[int, ...]
    cores: tuple[tuple[int, ...], ...]
    nodes: tuple[Node, ...]
    physical_cores: int

    @classmethod
    def from_cores(cls, cores, nodes=None) -> "Topology":
        """Built by hand: cores as lists of sibling CPUs; nodes as lists of CPUs (default:
        one node holding everything)."""
        cores = tuple(tuple(sorted(c)) for c in cores if c)
        cpus = tuple(sorted(c for core in cores for c in core))
        if nodes is None:
            nodes = [cpus]
        node_t = tuple(Node(i, tuple(sorted(n))) for i, n in enumerate(nodes) if n)
        return cls(cpus, _order_cores(cores, node_t), node_t, len(cores))

    @classmethod
    def detect(cls, sysfs_root: str = SYSFS, allowed: Sequence[int] | None = None) -> "Topology":
        """Same as the module's detect()."""
        return detect(sysfs_root, allowed)

    @property
    def smt(self) -> int:
        """Most allowed hyperthreads on one core (1: no SMT)."""
        return max((len(c) for c in self.cores), default=1)

    def __str__(self):
        nodes = "; ".join(f"node{n.id}: {format_cpulist(n.cpus)}" for n in self.nodes)
        return (f"{len(self.cpus)} CPUs ({format_cpulist(self.cpus)}), {len(self.cores)} physical "
                f"cores, {len(self.nodes)} NUMA node(s) [{nodes}]")


def _order_cores(cores, nodes):
    node_of = {c: i for i, n in enumerate(nodes) for c in n.cpus}
    return tuple(sorted(cores, key=lambda core: (node_of.get(core[0], len(nodes)), core[0])))


def current_affinity(pid: int | None = None) -> list[int] | None:
    """The CPUs the process may run on, or None where the platform cannot tell."""
    proc = psutil.Process(pid)
    if not hasattr(proc, "cpu_affinity"):
        return None
    return sorted(proc.cpu_affinity())


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def detect(sysfs_root: str = SYSFS, allowed: Sequence[int] | None = None) -> Topology:
    """The topology under `sysfs_root` restricted to `allowed` CPUs (default: this process's
    affinity). Without sysfs (not Linux) every allowed CPU counts as a core and
    psutil.cpu_count(logical=False) estimates the physical cores."""
    cpu_root = os.path.join(sysfs_root, "devices", "system", "cpu")
    node_root = os.path.join(sysfs_root, "devices", "system", "node")
    online_text = _read(os.path.join(cpu_root, "online"))
    if online_text is not None:
        online = set(parse_cpulist(online_text))
    else:
        try:
            online = {int(d[3:]) for d in os.listdir(cpu_root) if d[:3] == "cpu" and d[3:].isdigit()}
        except OSError:
            online = set()
    from_sysfs = bool(online)
    if not online:
        online = set(range(psutil.cpu_count(logical=True) or 1))
    if allowed is None:
        allowed = current_affinity()
    cpus = sorted(online if allowed is None else online & set(allowed))
    if not cpus:
        raise PinningError(f"no usable CPUs: online {format_cpulist(online)}, "
                           f"allowed {format_cpulist(allowed or [])}")
    cpu_set = set(cpus)

    # physical cores: the kernel's sibling list, else (package, die, core id), else alone
    groups: dict[object, list[int]] = {}
    for c in cpus:
        topo = os.path.join(cpu_root, f"cpu{c}", "topology")
        key: object = None
        for name in ("core_cpus_list", "thread_siblings_list"):
            t = _read(os.path.join(topo, name))
            if t:
                try:
                    key = ("siblings", tuple(parse_cpulist(t)))
                    break
                except ValueError:
                    pass
        if key is None:
            ids = [_read(os.path.join(topo, n)) for n in ("physical_package_id", "die_id", "core_id")]
            if ids[2] is not None:
                key = ("ids", ids[0], ids[1], ids[2])
        groups.setdefault(key if key is not None else ("cpu", c), []).append(c)
    cores = tuple(tuple(sorted(g)) for g in groups.values())

    # NUMA nodes
    nodes: list[Node] = []
    try:
        node_dirs = sorted((int(d[4:]), d) for d in os.listdir(node_root)
                           if d.startswith("node") and d[4:].isdigit())
    except OSError:
        node_dirs = []
    seen: set[int] = set()
    for nid, d in node_dirs:
        t = _read(os.path.join(node_root, d, "cpulist"))
        try:
            members = tuple(c for c in parse_cpulist(t or "") if c in cpu_set and c not in seen)
        except ValueError:
            continue
        if members:
            nodes.append(Node(nid, members))
            seen.update(members)
    rest = tuple(c for c in cpus if c not in seen)
    if rest:  # no NUMA information (or CPUs missing from it): one more node
        if nodes:
            nodes.append(Node(max(n.id for n in nodes) + 1, rest))
        else:
            nodes.append(Node(0, rest))
    node_t = tuple(nodes)

    physical = len(cores)
    if not from_sysfs or all(k[0] == "cpu" for k in groups):
        p, n = psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)
        if p and n and p < n:
            physical = max(1, round(len(cpus) * p / n))
    return Topology(tuple(cpus), _order_cores(cores, node_t), node_t, physical)


def default_workers(topology: Topology, threads_per_worker: int = 1) -> int:
    """One worker per allowed physical core (per threads_per_worker cores), at least 1."""
    return max(1, topology.physical_cores // max(1, threads_per_worker))


class Plan(list):
    """Per-worker CPU lists (None: don't pin), with what the caller should log:
    `oversubscribed` (workers share logical CPUs) and `warnings` (sentences)."""

    def __init__(self, sets, mode: str, oversubscribed: bool, warnings: Sequence[str]):
        super().__init__(sets)
        self.mode = mode
        self.oversubscribed = oversubscribed
        self.warnings = tuple(warnings)

    def __repr__(self):
        return (f"Plan({list(self)!r}, mode={self.mode!r}, oversubscribed={self.oversubscribed}, "
                f"warnings={self.warnings!r})")


def plan(topology: Topology, workers: int, threads_per_worker: int = 1, mode: str = "cores") -> Plan:
    """CPU lists for `workers` workers (0: default_workers) of `threads_per_worker` threads.
    See the module doc for the modes."""
    if mode not in MODES:
        raise ValueError(f"pin mode {mode!r}: expected one of {', '.join(MODES)}")
    if workers < 0 or threads_per_worker < 1:
        raise ValueError(f"workers={workers}, threads_per_worker={threads_per_worker}: "
                         "expected workers >= 0 and threads_per_worker >= 1")
    t = threads_per_worker
    n = workers or default_workers(topology, t)
    total = n * t
    ncpu = len(topology.cpus)
    warnings: list[str] = []
    oversub_msg = (f"{n} workers x {t} threads = {total} threads on {ncpu} allowed CPUs "
                   f"({format_cpulist(topology.cpus)}): workers share CPUs")

    if mode == "none":
        sets: list = [None] * n
        oversub = total > ncpu
    elif mode == "cores":
        order = [core[level] for level in range(topology.smt) for core in topology.cores
                 if len(core) > level]
        sets = [sorted({order[(i * t + j) % len(order)] for j in range(t)}) for i in range(n)]
        oversub = total > len(order)
        if not oversub and total > len(topology.cores):
            warnings.append(f"{total} threads on {len(topology.cores)} physical cores: "
                            "some share a core with a hyperthread sibling")
    else:  # numa
        nodes = topology.nodes
        sets = [list(nodes[i % len(nodes)].cpus) for i in range(n)]
        load = [0] * len(nodes)
        for i in range(n):
            load[i % len(nodes)] += t
        crowded = [f"node{nd.id}: {ld} threads on {len(nd.cpus)} CPUs"
                   for nd, ld in zip(nodes, load) if ld > len(nd.cpus)]
        oversub = bool(crowded)
        if crowded:
            oversub_msg += " (" + "; ".join(crowded) + ")"
    if oversub:
        warnings.insert(0, oversub_msg)
    return Plan(sets, mode, oversub, warnings)


_TOPOLOGY_CACHE: dict = {}


def plan_for(settings, workers: int, index: int, topology: Topology | None = None):
    """The CPU list (or None) for worker `index` of `workers` under settings.pin and
    settings.threads_per_worker: plan(...)[index % workers]. Pass the worker's slot
    (0..workers-1), not an ever-growing id, so a replacement gets its predecessor's CPUs.
    The topology is detected once per affinity mask of the calling process."""
    if settings.pin == "none":
        return None
    if topology is None:
        key = tuple(current_affinity() or ())
        topology = _TOPOLOGY_CACHE.get(key)
        if topology is None:
            topology = _TOPOLOGY_CACHE[key] = detect()
    workers = workers or default_workers(topology, settings.threads_per_worker)
    return plan(topology, workers, settings.threads_per_worker, settings.pin)[index % workers]


def plan_free(settings, workers: int, taken, topology: Topology | None = None):
    """(CPU list or None, Plan) for a NEW worker beside the workers that keep running, whose CPU
    lists are `taken`: the first set of the plan for max(workers, len(taken) + 1) workers that
    shares no CPU with them, else the one sharing the fewest. A worker's CPUs follow from the
    CPUs free when it starts, not from a slot number: after TTIN, TTOU, HUP or a crash each
    worker has a core of its own while there are enough (plan_for by slot could hand two
    workers the same core once slots and the worker count drifted apart)."""
    if settings.pin == "none":
        return None, None
    if topology is None:
        key = tuple(current_affinity() or ())
        topology = _TOPOLOGY_CACHE.get(key)
        if topology is None:
            topology = _TOPOLOGY_CACHE[key] = detect()
    taken = [list(t) for t in taken if t]
    n = max(workers or default_workers(topology, settings.threads_per_worker), len(taken) + 1)
    p = plan(topology, n, settings.threads_per_worker, settings.pin)
    load: dict = {}
    for t in taken:
        for c in t:
            load[c] = load.get(c, 0) + 1
    best = min(range(len(p)), key=lambda i: (sum(load.get(c, 0) for c in p[i]), i))
    return p[best], p


def apply(cpus: Sequence[int] | None, pid: int | None = None) -> None:
    """Pin the process (default: this one) to `cpus`; None does nothing."""
    if cpus is None:
        return
    want = sorted({int(c) for c in cpus})
    who = f"process {pid if pid is not None else os.getpid()}"
    if not want:
        raise PinningError(f"cannot pin {who} to an empty CPU set")
    try:
        proc = psutil.Process(pid)
        if not hasattr(proc, "cpu_affinity"):
            raise PinningError("CPU pinning is not supported on this platform; set pin = \"none\"")
        proc.cpu_affinity(want)
    except (ValueError, OSError, psutil.Error) as e:
        try:
            now = format_cpulist(current_affinity(pid) or [])
        except Exception:
            now = "unknown"
        why = str(e) or type(e).__name__
        if isinstance(e, OSError) and e.errno == errno.EINVAL:
            why = "CPUs outside the allowed set (cgroup cpuset, taskset or offline)"
        raise PinningError(f"cannot pin {who} to CPUs {format_cpulist(want)}: {why}; "
                           f"it may run on {now}; set pin = \"none\" to skip pinning") from e
