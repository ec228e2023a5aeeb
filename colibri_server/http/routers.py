"""The gateway in front of several routers (`colibri http --connect A --connect B`, or
COLIBRI_HTTP_CONNECT="A,B"): the addresses it is given, /health with every router's state, and
/metrics' server families per router (a `router` label). Its threads' clients share one
`client.RouterSet` (which router is down, the requests each holds, whose turn it is; see
colibri_server.client.pool). With one address none of this is used: the gateway is as it always was.

Owns: asking every router at once (a short-lived Client each, on threads, so a router that does not
answer costs the health timeout once, not once per router; a router the clients already found down
gets KNOWN_DOWN_WAIT seconds to connect, so that /health stays quick while one machine is away).
Never: the choice of a router for a
request (client/pool.py does it).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..client import Client, ColibriError, ColibriTimeout, Unreachable, failure_cause, merge_health, parse_addresses
from .openai import _json_bytes, _Resp

_HEALTH_KEYS = ("status", "workers_ready", "generation", "queue")
KNOWN_DOWN_WAIT = 0.3       # seconds a router already found down gets to connect for /health and /metrics


def connect_addresses(connect) -> tuple:
    """The gateway's `connect` (an address, "A,B", or a list of them) -> the addresses, checked
    (ValueError naming a malformed or repeated one)."""
    if isinstance(connect, str) and "," not in connect and "://" not in connect:
        raise ValueError(f"connect address {connect!r} must look like tcp://host:port or ipc:///path")
    return parse_addresses(connect)


def ask_each(gw, kind: str) -> list:
    """[(address, answer or the exception)] of `kind` ("health", "stats") asked of every router at once."""
    addrs, timeout = gw.routers.addrs, gw.health_timeout
    down = {a for a in addrs if gw.routers.state(a)["failures"]}

    def one(a):
        try:
            with Client(a, timeout=timeout, curve=gw.curve,
                        connect_timeout=min(timeout, KNOWN_DOWN_WAIT) if a in down else timeout) as c:
                return getattr(c, kind)()
        except Exception as e:      # noqa: BLE001  (reported per router)
            return e
    with ThreadPoolExecutor(len(addrs), thread_name_prefix="colibri-probe") as ex:
        return list(zip(addrs, ex.map(one, addrs)))


def health(gw) -> _Resp:
    """/health over several routers: 200 while at least one answers ok; each router's answer (or
    why it did not) and what the gateway's clients believe of it (failures in a row, seconds it is
    still skipped, requests in flight and served through this gateway process)."""
    rows = []
    for a, h in ask_each(gw, "health"):
        if isinstance(h, dict):
            gw.routers.succeeded(a)
            gw.saw_generation(h.get("generation"), router=a)
            row = {"addr": a, **{k: h.get(k) for k in _HEALTH_KEYS}}
        else:
            if isinstance(h, Unreachable):
                gw.routers.failed(a, failure_cause(h))
            row = {"addr": a, "status": "unreachable" if isinstance(h, ColibriTimeout) else "error",
                   "error": failure_cause(h) if isinstance(h, ColibriError) else type(h).__name__}
        rows.append({**row, **gw.routers.state(a)})
    out = merge_health(rows)
    ok = out["status"] == "ok"
    return _Resp(200 if ok else 503, _json_bytes(out), outcome="ok" if ok else "unavailable")


def server_families(gw, families):
    """The colibri_* families of every router's stats (families(stats) -> one router's), each
    sample labelled with its router; colibri_up is 1 while one router answered, colibri_router_up
    says which."""
    from prometheus_client.core import GaugeMetricFamily, Metric
    up = GaugeMetricFamily("colibri_up", "1 when at least one colibri router answered stats at this scrape")
    each = GaugeMetricFamily("colibri_router_up", "1 when this router answered stats at this scrape",
                             labels=["router"])
    merged: dict = {}
    answered = 0
    for a, st in ask_each(gw, "stats"):
        each.add_metric([a], 1 if isinstance(st, dict) else 0)
        if not isinstance(st, dict):
            continue
        answered += 1
        gw.saw_generation(st.get("generation"), st.get("model"), router=a)
        for fam in families(st):
            m = merged.get(fam.name)
            if m is None:
                m = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            m.samples.extend(s._replace(labels={**s.labels, "router": a}) for s in fam.samples)
    up.add_metric([], 1 if answered else 0)
    yield up
    yield each
    yield from merged.values()
