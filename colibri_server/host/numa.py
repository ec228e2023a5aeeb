"""Where the model's pages live on a machine with more than one NUMA node (`pin = "numa"`).

The model file is one page-cache copy, on whichever node read it. Workers pinned to another node
read it across the interconnect, at a fraction of their own node's bandwidth. `numa_memory` says
what to do about it:

    node        one copy per node (the default): the file is read once per node into memory bound
                to that node (a memfd mapped MAP_SHARED and `mbind(MPOL_BIND)`-ed before the copy, so
                every page is allocated there), and each worker maps its own node's copy. Memory:
                one model per node, on top of the page cache of the file (which the kernel can drop).
    interleave  the file's own pages spread evenly over the nodes (`set_mempolicy(MPOL_INTERLEAVE)`
                while the master reads it: page-cache pages follow the reading task's policy); one
                copy, every worker reads half of it remotely on two nodes, but no node is the
                hot spot.
    off         as a one-node machine: the file's mapping as it came.

On one node (or with another pin mode) nothing here runs: the mapping is the file's, as before.
The kernel's calls go through `Sys` (ctypes on libc's syscall()); tests pass a recording one to
check, on a fake two-node topology, which node each worker's mapping is bound to.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform

log = logging.getLogger("colibri.master")

MPOL_DEFAULT, MPOL_BIND, MPOL_INTERLEAVE = 0, 2, 3
MPOL_MF_STRICT, MPOL_MF_MOVE = 1, 2
_SYSCALLS = {"x86_64": {"mbind": 237, "set_mempolicy": 238},
             "aarch64": {"mbind": 235, "set_mempolicy": 237}}
COPY_CHUNK = 64 << 20


class NumaError(OSError):
    pass


class Sys:
    """mbind and set_mempolicy through libc's syscall() (no libnuma needed)."""

    def __init__(self):
        self.nr = _SYSCALLS.get(platform.machine())
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long

    @staticmethod
    def _mask(nodes):
        bits = 0
        for n in nodes:
            bits |= 1 << n
        words = max(1, (max(nodes, default=0) // 64) + 1)
        arr = (ctypes.c_ulong * words)(*[(bits >> (64 * i)) & ((1 << 64) - 1) for i in range(words)])
        return arr, words * 64 + 1

    def _call(self, name, *args):
        if self.nr is None:
            raise NumaError(f"{name}: no syscall number known for {platform.machine()}")
        r = self.libc.syscall(ctypes.c_long(self.nr[name]), *args)
        if r != 0:
            e = ctypes.get_errno()
            raise NumaError(e, f"{name}: {os.strerror(e)}")

    def mbind(self, mm: mmap.mmap, nodes) -> None:
        mask, maxnode = self._mask(nodes)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self._call("mbind", ctypes.c_void_p(addr), ctypes.c_ulong(len(mm)), ctypes.c_int(MPOL_BIND), mask,
                   ctypes.c_ulong(maxnode), ctypes.c_uint(MPOL_MF_STRICT | MPOL_MF_MOVE))

    def set_mempolicy(self, mode, nodes=()) -> None:
        if mode == MPOL_DEFAULT:
            self._call("set_mempolicy", ctypes.c_int(MPOL_DEFAULT), None, ctypes.c_ulong(0))
            return
        mask, maxnode = self._mask(nodes)
        self._call("set_mempolicy", ctypes.c_int(mode), mask, ctypes.c_ulong(maxnode))


def mode_for(settings, topology) -> str:
    """What applies: "node", "interleave" or "off" (one node, another pin mode, or numa_memory off)."""
    if getattr(settings, "pin", "") != "numa" or len(topology.nodes) < 2:
        return "off"
    return getattr(settings, "numa_memory", "node")


def node_of(cpus, topology):
    """The NUMA node holding a worker's CPUs (its first), or None."""
    if not cpus:
        return None
    for n in topology.nodes:
        if cpus[0] in n.cpus:
            return n.id
    return None


class NodeCopy:
    """The model file read into memory bound to one node: a memfd, its pages allocated on `node`
    by the mbind done before the copy. `path` (/proc/<pid>/fd/N) maps it, in this process and in
    the workers forked from it (they inherit the descriptor)."""

    def __init__(self, src: str, node: int, sys: Sys):
        self.node = node
        size = os.path.getsize(src)
        self.fd = os.memfd_create(f"colibri-model-node{node}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                sys.mbind(mm, [node])       # a shmem range's policy is the file's: every mapping follows it
                with open(src, "rb", buffering=0) as f:
                    pos = 0
                    while pos < size:
                        n = f.readinto(memoryview(mm)[pos: pos + COPY_CHUNK])
                        if not n:
                            raise NumaError(f"{src}: shorter than its size while copying to node {node}")
                        pos += n
            finally:
                mm.close()
        except BaseException:
            os.close(self.fd)
            raise
        os.set_inheritable(self.fd, True)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self):
        try:
            os.close(self.fd)
        except OSError:
            pass


def place(path, settings, topology, open_model, sys=None):
    """The per-node models of a generation: {node: (Model, NodeCopy)} for numa_memory = node; {}
    otherwise (interleave is applied around the master's own open, see interleaved())."""
    if mode_for(settings, topology) != "node":
        return {}
    sys = sys or Sys()
    out = {}
    try:
        for n in topology.nodes:
            copy = NodeCopy(path, n.id, sys)
            try:
                m = open_model(copy.path)
            except BaseException:
                copy.close()
                raise
            out[n.id] = (m, copy)
            log.info("numa: model %s copied to node %d (%.1f MiB bound there) for its workers", path, n.id,
                     os.path.getsize(path) / 2**20)
    except BaseException:
        for m, copy in out.values():
            m.close()
            copy.close()
        raise
    return out


class interleaved:
    """numa_memory = interleave: the master's reads of the file (populate) under MPOL_INTERLEAVE
    over every node; a no-op otherwise."""

    def __init__(self, settings, topology, sys=None):
        self.on = mode_for(settings, topology) == "interleave"
        self.nodes = [n.id for n in topology.nodes]
        self.sys = sys

    def __enter__(self):
        if self.on:
            self.sys = self.sys or Sys()
            self.sys.set_mempolicy(MPOL_INTERLEAVE, self.nodes)
            log.info("numa: reading the model interleaved over nodes %s", self.nodes)
        return self

    def __exit__(self, *exc):
        if self.on:
            self.sys.set_mempolicy(MPOL_DEFAULT)
        return False
