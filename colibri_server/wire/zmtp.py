"""ZMTP options both ends of a tcp link set (the router's backend and a joining worker)."""
from __future__ import annotations

import zmq

__all__ = ["zmtp_heartbeats"]


def zmtp_heartbeats(sock, settings):
    """ZMTP heartbeats on a tcp connection, so a cut link is noticed within `timeout` and the
    connection re-made, instead of TCP keeping a dead one for minutes."""
    ivl = int(settings.heartbeat_interval * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(ivl, 100))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(settings.timeout * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(settings.timeout * 1000))
