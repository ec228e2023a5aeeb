"""Issue 19, item 5: a request id carried from the HTTP client through the router and the worker into
their log lines and back; JSON log lines; per-expert routing counts in /metrics that sum to tokens x
top_k per layer; prefill and decode histograms; the processes' titles."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import openai
import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_harness import Server
from test_http import free_port
from test_serve_http import _wait

from colibri_server.model import Model


@pytest.fixture(scope="module")
def obs(built, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("obs")
    path = built("mixtral").colibri("f32")
    port = free_port()

    class S:
        pass
    s = S()
    s.model, s.url = Model.open(path), f"http://127.0.0.1:{port}"
    # the cache root as the first variable of the environment, which the cli sets again from the settings:
    # setproctitle, had it not found its area before that, would leave every title unchanged
    from colibri_server.model.numba_cache import cache_root
    s.server = Server(path, tmp, workers=1, extra=["--http", f"127.0.0.1:{port}", "--log-format", "json"],
                      env={"COLIBRI_CACHE_DIR": cache_root()})
    try:
        s.server.wait_ready(1)
        s.server.wait_http(s.url)
        s.oa = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield s
    finally:
        s.server.stop()


def _json_lines(server):
    out = []
    for line in server.logs().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_a_request_id_goes_through_router_and_worker_logs_and_comes_back(obs):
    r = requests.post(obs.url + "/v1/chat/completions", timeout=60, headers={"X-Request-Id": "trace-42.a"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "trace-42.a"
    assert r.json()["id"] == "chatcmpl-trace-42.a"
    lines = _wait(lambda: [e for e in _json_lines(obs.server) if e.get("request_id") == "trace-42.a"] or None,
                  timeout=10, what="log lines of the request")
    roles = {e["role"].split()[0] for e in lines}
    assert roles == {"router", "worker"}, lines
    assert any("done" in e["msg"] for e in lines if e["role"] == "router")
    # a malformed id is replaced, never echoed; the native client names its own and gets it back
    r = requests.post(obs.url + "/v1/completions", timeout=60, headers={"X-Request-Id": "bad id\u00e9"},
                      json={"prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 200 and r.headers["X-Request-Id"] != "bad id\u00e9"
    with obs.server.client() as c:
        assert c.generate([5, 6], max_tokens=2, request_id="native-7").request_id == "native-7"
        assert len(c.generate([5, 6], max_tokens=2).request_id) == 16          # generated


def test_every_server_log_line_is_json_with_its_role(obs):
    lines = [ln for ln in obs.server.logs().splitlines() if ln.strip() and not ln.startswith("[20")]  # gunicorn's own
    assert lines and all(ln.startswith("{") for ln in lines), [ln for ln in lines if not ln.startswith("{")][:3]
    roles = {json.loads(ln)["role"].split()[0] for ln in lines}
    assert {"master", "router", "worker"} <= roles


def test_process_titles_name_their_roles(obs):
    master = psutil.Process(obs.server.pid)
    titles = [" ".join(p.cmdline()).strip() for p in [master] + master.children()]
    assert titles[0].startswith("colibri: master [")
    assert any(t == "colibri: router" for t in titles)
    assert any(t.startswith("colibri: worker 0 [gen 1]") for t in titles), titles



def _metrics(url):
    text = requests.get(url + "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _expert_sums(url):
    fam = _metrics(url)["colibri_expert_selections"]
    per_layer = {}
    for s in fam.samples:
        if s.name.endswith("_total"):
            per_layer[int(s.labels["layer"])] = per_layer.get(int(s.labels["layer"]), 0) + s.value
    return per_layer


def _settled(url, quiet=2.5):
    last, since = None, time.monotonic()
    while True:
        v = _expert_sums(url)
        if v != last:
            last, since = v, time.monotonic()
        elif time.monotonic() - since > quiet:
            return v
        time.sleep(0.3)


def test_expert_counts_sum_to_tokens_times_top_k_per_layer(obs):
    before = _settled(obs.url)
    P, M = 23, 9
    prompt = np.random.default_rng(77).integers(3, obs.model.config.vocab_size, P).tolist()   # no prefix hit
    with obs.server.client() as c:
        c.generate(prompt, max_tokens=M, ignore_eos=True)
    after = _settled(obs.url)
    k = obs.model.config.top_k
    rows = P + M - 1                       # the prompt, then every sampled token but the last is fed back
    assert sorted(after) == list(range(obs.model.config.num_layers))
    assert all(after[l] - before.get(l, 0) == rows * k for l in after), (before, after)
    fams = _metrics(obs.url)
    for name in ("colibri_http_prefill_seconds", "colibri_http_decode_seconds", "colibri_worker_kv_blocks_used",
                 "colibri_worker_prefill_tokens"):
        assert name in fams, name


def test_status_json_is_colibri_status_and_its_heat_map_moves_with_a_request(obs):
    """/status.json (what the status page polls) is the router's stats, as `colibri status --json` prints them:
    workers with their memory and batch engine figures, queue and in flight, the context, and the window of
    recent figures whose expert counts (the heat map) and tokens/s take in a request just served."""
    def status():
        r = requests.get(obs.url + "/status.json", timeout=30)
        assert r.status_code == 200 and r.headers["Cache-Control"] == "no-store"
        return r.json()
    st = obs.server.wait_for(lambda: (lambda s: s if all(w.get("memory_sampled", True) and w.get("engine")
                                                         for w in s["workers"]) else None)(status()),
                             what="the workers' memory and engine figures")
    (w,) = st["workers"]
    assert {"pid", "wid", "generation", "state", "cores", "running", "served", "rss", "uss", "pss"} <= set(w)
    assert w["state"] == "ready" and w["uss"] > 0 and w["pss"] > 0
    assert {"kv_blocks_used", "kv_blocks_free", "kv_blocks_cached", "kv_blocks", "batch_rows_last",
            "batch_rows_mean", "prefix_hits", "preemptions", "tokens_out", "rows_total"} <= set(w["engine"])
    assert {"queue", "in_flight", "context", "expert_counts", "recent", "counters", "generation"} <= set(st)
    assert requests.get(obs.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"] == st["context"] > 0
    cli = subprocess.run([sys.executable, "-m", "colibri_server.cli", "status", "--json", "--connect", obs.server.addr],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and set(json.loads(cli.stdout)) == set(st)
    before = status()["recent"]
    P, M = 19, 11
    prompt = np.random.default_rng(79).integers(3, obs.model.config.vocab_size, P).tolist()
    with obs.server.client() as c:
        c.generate(prompt, max_tokens=M, ignore_eos=True)
    # the workers' next heartbeat brings the request's figures into the window
    after = obs.server.wait_for(lambda: (lambda r: r if r["tokens"] >= M and r["expert_counts"] != before["expert_counts"]
                                         else None)(status()["recent"]), what="the window's figures")
    k, L = obs.model.config.top_k, obs.model.config.num_layers
    assert len(after["expert_counts"]) == L and all(sum(row) >= (P + M - 1) * k for row in after["expert_counts"])
    assert after["tokens_per_s"] > 0 and after["window_s"] > 0 and after["rows_per_step"] >= 1


def _sample(fams, family, url):
    """The one sample of a family of vLLM's names, labelled with the name /v1/models gives."""
    (s,) = [s for s in fams[family].samples if not s.name.endswith("_created")]
    assert s.labels == {"model_name": requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]}
    return s.value


def test_vllm_names_for_the_inference_gateway(obs):
    """The figures Kubernetes' inference gateway reads, under vLLM's names: queue and running
    requests, KV cache usage as a fraction, and the prefix cache's looked-up and found prompt tokens
    (a prompt sent twice: the second finds its whole blocks)."""
    with obs.server.client() as c:
        bs = c.stats()["workers"][0]["engine"]["kv_block_size"]

    def prefix():
        f = _metrics(obs.url)
        return _sample(f, "vllm:prefix_cache_queries", obs.url), _sample(f, "vllm:prefix_cache_hits", obs.url)

    def settled(quiet=2.5):
        last, since = None, time.monotonic()
        while True:
            v = prefix()
            if v != last:
                last, since = v, time.monotonic()
            elif time.monotonic() - since > quiet:
                return v
            time.sleep(0.3)
    q0, h0 = settled()
    P = 2 * bs + 5
    prompt = np.random.default_rng(78).integers(3, obs.model.config.vocab_size, P).tolist()
    with obs.server.client() as c:
        for _ in range(2):
            c.generate(prompt, max_tokens=2, ignore_eos=True)
    q1, h1 = settled()
    assert q1 - q0 == 2 * (P - 1), (q0, q1)          # each start looks up all but its last token
    assert h1 - h0 == ((P - 1) // bs) * bs, (h0, h1)  # the second finds the first's whole blocks
    f = _metrics(obs.url)
    usage = _sample(f, "vllm:kv_cache_usage_perc", obs.url)
    assert 0.0 <= usage <= 1.0 and _sample(f, "vllm:gpu_cache_usage_perc", obs.url) == usage
    assert _sample(f, "vllm:num_requests_waiting", obs.url) == 0
    assert _sample(f, "vllm:num_requests_running", obs.url) == 0
