"""Prometheus metrics of the HTTP gateway (`colibri_server.http`, served at /metrics).

Each gateway process has its own registry (not prometheus_client's global one).
Request counters, the in-flight gauge, token counters and latency histograms count the
requests of THAT process only: with gunicorn `workers > 1` a scrape sees one process at random,
so run one gateway process with more threads (the default: workers=1, threads=8) or scrape
each process separately.  The `colibri_*` families (queue, in flight, workers, memory per
worker pid, server counters, model generation) come from the server's `stats`, fetched at
scrape time; `colibri_up` is 0 when that failed. With several routers each router's families carry
a `router` label, `colibri_router_up{router}` says which answered, and `colibri_up` is 1 while one did.
"""
from __future__ import annotations

import logging

from .openai import _is_num
from .template import name_from_path

log = logging.getLogger("colibri.http")

# ---------------------------------------------------------------------------- metrics


class _ServerCollector:
    """colibri_* families from the server's `stats`, fetched at scrape time."""

    def __init__(self, gw):   # a colibri_server.http.Gateway
        self.gw = gw

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        if self.gw.routers is not None:         # several routers: each one's, labelled (http/routers.py)
            from .routers import server_families
            yield from server_families(self.gw, self._families)
            return
        up = GaugeMetricFamily("colibri_up", "1 when the colibri server answered stats at this scrape")
        try:
            with self.gw.probe_client() as c:
                st = c.stats()
        except Exception as e:
            log.info("metrics: stats failed: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        self.gw.saw_generation(st.get("generation"), st.get("model"))
        yield from self._families(st)
        yield from vllm_families(st, self.model_name(st))

    def model_name(self, st) -> str:
        """The name /v1/models gives first (the gateway's cached model info), else the file's."""
        try:
            return self.gw.model_info().name
        except Exception:
            return name_from_path(str(st.get("model") or ""))

    @staticmethod
    def _families(st):
        """The colibri_* families of one router's stats."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value or 0))
            return g
        yield gauge("colibri_queue_depth", "requests queued at the router", st.get("queue"))
        yield gauge("colibri_in_flight", "requests running on workers", st.get("in_flight"))
        yield gauge("colibri_draining", "1 while the server drains before stopping", 1 if st.get("draining") else 0)
        yield gauge("colibri_model_generation", "generation of the served model (+1 per reload)",
                    st.get("generation"))
        yield gauge("colibri_model_size_bytes", "size of the served model file", st.get("model_bytes"))
        yield gauge("colibri_uptime_seconds", "router uptime", st.get("uptime_s"))
        info = GaugeMetricFamily("colibri_model_info", "the served model file", labels=["path", "generation"])
        info.add_metric([str(st.get("model", "")), str(st.get("generation", ""))], 1)
        yield info
        workers = [w for w in (st.get("workers") or []) if isinstance(w, dict)]
        states = GaugeMetricFamily("colibri_workers", "worker processes by state", labels=["state"])
        counts = {"ready": 0}
        for w in workers:
            counts[str(w.get("state"))] = counts.get(str(w.get("state")), 0) + 1
        for s, n in sorted(counts.items()):
            states.add_metric([s], n)
        yield states
        labels = ["pid", "wid", "generation"]
        fams = {k: GaugeMetricFamily(f"colibri_worker_{k}_bytes", doc, labels=labels) for k, doc in (
            ("rss", "worker resident set size"), ("uss", "worker unique set size (memory only it maps)"),
            ("pss", "worker proportional set size (shared pages divided among sharers)"),
            ("anon", "worker anonymous memory (smaps_rollup Anonymous)"))}
        running = GaugeMetricFamily("colibri_worker_running", "sequences running on the worker", labels=labels)
        served = CounterMetricFamily("colibri_worker_served", "requests the worker has finished", labels=labels)
        for w in workers:
            lv = [str(w.get("pid")), str(w.get("wid")), str(w.get("generation"))]
            for k, fam in fams.items():
                if k == "rss" or w.get("memory_sampled", True):     # not sampled yet: no figure, not 0
                    fam.add_metric(lv, float(w.get(k) or 0))
            running.add_metric(lv, float(w.get("running") or 0))
            served.add_metric(lv, float(w.get("served") or 0))
        yield from fams.values()
        yield running
        yield served
        yield from _engine_families(workers, labels)
        router = st.get("router") or {}
        if isinstance(router, dict):
            yield gauge("colibri_router_rss_bytes", "router resident set size", router.get("rss"))
        counters = st.get("counters") or {}
        if isinstance(counters, dict):
            ev = CounterMetricFamily("colibri_server_events", "the router's event counters (requests, done, "
                                     "error:<code>, client_gone, retries, worker_lost, ...)", labels=["event"])
            for k, v in sorted(counters.items()):
                if _is_num(v):
                    ev.add_metric([str(k)], float(v))
            yield ev
            restarts = counters.get("worker_restarts")          # the router's count (router/loop.py)
            if _is_num(restarts):
                yield CounterMetricFamily("colibri_worker_restarts", "workers replaced after dying", value=restarts)
        yield from _expert_family(st.get("expert_counts"))
        yield from _weights_families(workers)


# a weights budget's figures (model/residency.py), shared by the workers of one mapping: the first's
_WEIGHTS = (("weights_memory", "gauge", "weights_memory_bytes", "the weights budget (bytes kept resident)"),
            ("locked_bytes", "gauge", "weights_locked_bytes", "model bytes locked in memory now"),
            ("ceiling", "gauge", "weights_ceiling_bytes", "bytes the budget may lock now: below weights_memory "
             "while the server's processes need the room"),
            ("experts_resident", "gauge", "weights_experts_resident", "experts locked in memory now"),
            ("routes", "counter", "weights_expert_uses", "experts a layer needed (once per step)"),
            ("resident", "counter", "weights_expert_uses_resident", "of those, locked in memory"),
            ("predicted", "counter", "weights_expert_uses_read_ahead", "of those, not locked but asked for "
             "by the previous layer's prediction"),
            ("missed", "counter", "weights_stalls", "uses that found some of the expert's bytes not in memory"),
            ("missing_bytes", "counter", "weights_stall_bytes", "bytes a layer found not in memory when it "
             "needed them (read from disk while it waited)"),
            ("predictions", "counter", "weights_routes_predicted", "routes of layers whose experts were predicted"),
            ("prediction_hits", "counter", "weights_prediction_hits", "of those, experts the prediction named"))


def _weights_families(workers):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    w = next((e["weights"] for e in (w.get("engine") for w in workers) if isinstance(e, dict)
              and isinstance(e.get("weights"), dict)), None)
    if w is None:
        return
    for key, kind, name, doc in _WEIGHTS:
        if _is_num(w.get(key)):
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield cls(f"colibri_{name}", doc, value=float(w[key]))


def _expert_family(counts):
    """colibri_expert_selections_total{layer, expert}: how often each layer's router chose each expert
    (the load-balance view), over the workers of the serving generation; per layer the sum is the tokens
    computed x top_k."""
    from prometheus_client.core import CounterMetricFamily
    fam = CounterMetricFamily("colibri_expert_selections", "times each layer's router chose each expert "
                              "(all workers of the serving generation)", labels=["layer", "expert"])
    if isinstance(counts, list):
        for l, row in enumerate(counts):
            if isinstance(row, list):
                for e, v in enumerate(row):
                    if _is_num(v):
                        fam.add_metric([str(l), str(e)], float(v))
    yield fam


class _Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter("colibri_http_requests", "HTTP requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.in_flight = Gauge("colibri_http_requests_in_flight", "HTTP requests being answered", registry=r)
        self.duration = Histogram("colibri_http_request_duration_seconds", "HTTP request duration (streams "
                                  "included, until their last event)", ["endpoint"], registry=r,
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.prompt_tokens = Counter("colibri_http_prompt_tokens", "prompt tokens of finished generations",
                                     registry=r)
        self.completion_tokens = Counter("colibri_http_completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("colibri_http_time_to_first_token_seconds", "from sending a generate to its first "
                              "token (queueing and prefill)", registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.prefill = Histogram("colibri_http_prefill_seconds", "worker time computing a request's prompt "
                                 "(its share of the batched steps)", registry=r,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.decode = Histogram("colibri_http_decode_seconds", "worker time generating a request's tokens after "
                                "the first", registry=r,
                                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.itl = Histogram("colibri_http_inter_token_latency_seconds", "time between consecutive streamed "
                             "tokens", registry=r,
                             buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))



# the batch engine's figures each worker reports in its heartbeat (model/serving.py BatchEngine.stats)
_ENGINE = (("kv_blocks_used", "gauge", "KV pool blocks held by running sequences"),
           ("kv_blocks_free", "gauge", "KV pool blocks never used or released without a prefix"),
           ("kv_blocks_cached", "gauge", "KV pool blocks kept for prefix reuse (evicted on demand)"),
           ("batch_rows_last", "gauge", "rows (tokens) in the worker's last batched step"),
           ("batch_rows_mean", "gauge", "mean rows per batched step since the worker started"),
           ("steps", "counter", "batched steps run"),
           ("preemptions", "counter", "sequences preempted for KV memory (recomputed later)"),
           ("prefix_hits", "counter", "KV blocks reused from the prefix cache"),
           ("prefill_tokens", "counter", "prompt positions computed (n completions of a prompt: once)"),
           ("kv_blocks", "gauge", "KV pool blocks in all"))


def vllm_families(st, model_name):
    """The scheduling figures under vLLM's names, which Kubernetes' inference gateway (its endpoint
    picker's model server protocol) and other vLLM dashboards read: queue length, running requests,
    KV cache usage (a fraction, over every worker's pool) and the prefix cache's queried and hit
    prompt tokens. Labelled model_name, as vLLM's are."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    workers = [w for w in (st.get("workers") or []) if isinstance(w, dict)]
    engines = [w["engine"] for w in workers if isinstance(w.get("engine"), dict)]

    def total(key):
        return sum(float(e[key]) for e in engines if _is_num(e.get(key)))
    blocks = total("kv_blocks")
    usage = total("kv_blocks_used") / blocks if blocks else 0.0
    for name, doc, value in (
            ("vllm:num_requests_waiting", "requests waiting to be scheduled (the router's queue)", st.get("queue")),
            ("vllm:num_requests_running", "requests running on workers", st.get("in_flight")),
            ("vllm:kv_cache_usage_perc", "KV cache usage, 1 is 100% (blocks held over all workers' pools)", usage),
            ("vllm:gpu_cache_usage_perc", "the same KV cache usage under vLLM's older name", usage)):
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([model_name], float(value) if _is_num(value) else 0.0)
        yield g
    for name, doc, key in (("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                            "prefix_query_tokens"),
                           ("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache", "prefix_hit_tokens")):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([model_name], total(key))
        yield c


def _engine_families(workers, labels):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    for key, kind, doc in _ENGINE:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        fam = cls(f"colibri_worker_{key}", doc, labels=labels)
        for w in workers:
            eng = w.get("engine") if isinstance(w.get("engine"), dict) else {}
            if _is_num(eng.get(key)):
                fam.add_metric([str(w.get("pid")), str(w.get("wid")), str(w.get("generation"))], float(eng[key]))
        yield fam
