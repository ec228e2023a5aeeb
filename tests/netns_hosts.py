"""Hosts on one machine: network namespaces joined by veth pairs, for tests and benchmarks of what
crosses a network (the head and its worker hosts). Each host namespace gets one veth pair to the
head's namespace, on its own /24 (10.N.k.0/24: the head is .1, host k is .2); no traffic leaves them.

    with Hosts(prefix, ["a", "b"]) as net:
        net.run("head", [...])              # argv prefix to run a command in that namespace
        net.head_address("a")               # the head's address as host a sees it
        net.cut("a"); net.mend("a")         # the link down / up (from the host's side)

`Hosts.problem()` says why namespaces cannot be made here (not root, no `ip`), or None.
"""
from __future__ import annotations

import os
import shutil
import subprocess


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class Hosts:
    def __init__(self, prefix: str, hosts, subnet: int = 77):
        self.prefix, self.hosts, self.subnet = prefix, list(hosts), subnet
        self.made = []

    @staticmethod
    def problem():
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        probe = "colibri-probe-%d" % os.getpid()
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"ip netns add failed: {r.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def ns(self, name):
        return f"{self.prefix}-{name}"

    def __enter__(self):
        try:
            for name in ["head", *self.hosts]:
                _ip("netns", "add", self.ns(name))
                self.made.append(self.ns(name))
                _ip("-n", self.ns(name), "link", "set", "lo", "up")
            for k, h in enumerate(self.hosts, 1):
                here, there = f"{self.prefix[:6]}h{k}", f"{self.prefix[:6]}w{k}"
                _ip("link", "add", here, "type", "veth", "peer", "name", there)
                _ip("link", "set", here, "netns", self.ns("head"))
                _ip("link", "set", there, "netns", self.ns(h))
                _ip("-n", self.ns("head"), "addr", "add", f"10.{self.subnet}.{k}.1/24", "dev", here)
                _ip("-n", self.ns(h), "addr", "add", f"10.{self.subnet}.{k}.2/24", "dev", there)
                _ip("-n", self.ns("head"), "link", "set", here, "up")
                _ip("-n", self.ns(h), "link", "set", there, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for ns in reversed(self.made):      # deleting a namespace deletes its veth ends (and the peers)
            _ip("netns", "del", ns, check=False)
        self.made = []

    def run(self, name):
        """The argv prefix that runs a command in namespace `name`."""
        return ["ip", "netns", "exec", self.ns(name)]

    def head_address(self, host):
        return f"10.{self.subnet}.{self.hosts.index(host) + 1}.1"

    def _veth(self, host):
        return f"{self.prefix[:6]}w{self.hosts.index(host) + 1}"

    def cut(self, host):
        _ip("-n", self.ns(host), "link", "set", self._veth(host), "down")

    def mend(self, host):
        _ip("-n", self.ns(host), "link", "set", self._veth(host), "up")
