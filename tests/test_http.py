"""The OpenAI-compatible HTTP gateway, as real processes: a `colibri serve` (master, router,
workers on ipc:// in a temp dir) and gunicorn (gthread) on 127.0.0.1, driven by the official
`openai` package and by raw HTTP.

Each test states its promise: OpenAI-shaped answers equal to the server's greedy text, SSE
streams equal to the non-streamed text, the API key enforced, errors named by field, the
Prometheus families present, and a client that hangs up mid-stream frees its worker.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jinja2
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_harness import Server, wait_started

from colibri_server.http import HTTPError, ModelInfo, model_info_from_stats, render_chat
from colibri_server.model.format import ColibriFile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sk-colibri-test-key"
PROMPT = "def main(args):"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """gunicorn serving the gateway in a subprocess."""

    def __init__(self, args, env, log_path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        e = {k: v for k, v in os.environ.items() if not k.startswith("COLIBRI_")}
        e.update(env)
        self.proc = subprocess.Popen(args, env=e, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_listening(self, url, timeout=None):
        """Wait until the gateway answers HTTP at all, while its process lives (server_harness's
        READY_TIMEOUT); returns the first /health response."""
        def answer():        # in a tuple: a Response is false when its status is an error
            try:
                return (requests.get(url + "/health", timeout=10),)
            except requests.ConnectionError:
                return None
        return wait_started(answer, f"gateway {url}", [self.proc], self.logs, timeout)[0]

    def logs(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


class Stack:
    pass


@pytest.fixture(scope="module")
def stack(built, tmp_path_factory):
    """The gateway is started BEFORE the colibri server (pointing at the address the server
    will bind), so its first /health shows the 'not reachable' answer; then the server."""
    tmp = tmp_path_factory.mktemp("http")
    model = built("mixtral").colibri("f32")
    st = Stack()
    st.model = model
    st.addr = f"ipc://{tmp}/s.sock"          # what Server(name="s") binds
    st.port = free_port()
    st.url = f"http://127.0.0.1:{st.port}"
    st.gateway = Gateway([sys.executable, "-m", "gunicorn", "colibri_server.http:app_from_env()",
                          "-c", os.path.join(ROOT, "configs", "gunicorn.conf.py"),
                          "--bind", f"127.0.0.1:{st.port}", "--threads", "4"],
                         {"COLIBRI_HTTP_CONNECT": st.addr, "COLIBRI_HTTP_API_KEY": KEY}, tmp / "gateway.log")
    st.server = None
    try:
        t0 = time.monotonic()
        r = st.gateway.wait_listening(st.url)
        st.health_before = (r.status_code, r.json(), time.monotonic() - t0)
        st.server = Server(model, tmp, workers=2, name="s")
        st.server.wait_ready(2)
        st.oa = openai.OpenAI(base_url=st.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        st.auth = {"Authorization": f"Bearer {KEY}"}
        yield st
    finally:
        st.gateway.stop()
        if st.server is not None:
            st.server.stop()


class _closing:
    def __init__(self, path):
        self.cf = ColibriFile.open(path)

    def __enter__(self):
        return self.cf

    def __exit__(self, *exc):
        self.cf.close()


def model_id(st):
    return st.oa.models.list().data[0].id


def server_greedy(st, prompt, max_tokens, **kw):
    with st.server.client(30) as c:
        return c.generate(prompt, max_tokens=max_tokens, **kw)


def metrics(st):
    r = requests.get(st.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(fams, family, name=None, **labels):
    for s in fams[family].samples:
        if (name is None or s.name == name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


# ---------------------------------------------------------------------------- chat templates (in process)


def test_chat_templates_are_sandboxed_and_fall_back_to_chatml():
    msgs = [{"role": "user", "content": "hi"}]
    info = model_info_from_stats({"model": "/nonexistent/m.colibri", "generation": 3})
    assert (info.name, info.source, info.chat_template, info.generation) == ("m", "unreadable", None, 3)
    assert render_chat(info, msgs) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", True)
    t = ("{{ bos_token }}{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('users only') }}"
         "{% endif %}{{ m.content }}{{ eos_token }}{% endfor %}")
    info = ModelInfo("m", "/p", 1, chat_template=t, bos_token="<s>", eos_token="</s>")
    assert render_chat(info, msgs) == ("<s>hi</s>", False)
    with pytest.raises(HTTPError) as ei:
        render_chat(info, [{"role": "system", "content": "x"}])
    assert (ei.value.status, ei.value.param) == (400, "messages") and "users only" in ei.value.message
    for unsafe in ("{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}", "{{ ''.__class__.__mro__ }}"):
        with pytest.raises(HTTPError) as ei:
            render_chat(ModelInfo("m", "/p", 1, chat_template=unsafe), msgs)
        assert ei.value.status == 500
    # a template that does not compile: ChatML
    assert render_chat(ModelInfo("m", "/p", 1, chat_template="{% for %}"), msgs)[1] is True


# ---------------------------------------------------------------------------- health, models, auth


def test_health_is_503_without_a_server_and_200_once_it_is_ready(stack):
    status, body, took = stack.health_before
    assert status == 503 and body["status"] == "unreachable", body
    assert took < 8, took                              # the ~2 s health timeout, not the request timeout
    r = requests.get(stack.url + "/health", timeout=10)  # no API key needed
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "workers_ready": 2, "generation": 1, "queue": 0}


def test_models_lists_the_served_model(stack):
    with _closing(stack.model) as cf:
        name = json.loads(cf.metadata_json)["name"]
    models = stack.oa.models.list().data
    assert [m.id for m in models] == [name]
    assert models[0].object == "model" and models[0].owned_by == "colibri"
    assert stack.oa.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        stack.oa.models.retrieve("gpt-4")


def test_the_pages_are_public_but_their_data_asks_for_the_key(stack):
    """The chat and status pages hold no data (served without the key; they ask their user for it);
    /status.json, the stats they show, asks for it as the API does."""
    r = requests.get(stack.url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html") and "ETag" in r.headers
    r = requests.get(stack.url + "/status.json", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = requests.get(stack.url + "/status.json", headers=stack.auth, timeout=10)
    assert r.status_code == 200 and len([w for w in r.json()["workers"] if w["state"] == "ready"]) == 2


def test_api_key_is_required_except_on_health_and_metrics(stack):
    bad = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.completions.create(model=model_id(stack), prompt="x", max_tokens=1)
    assert ei.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for path, method in (("/v1/models", "GET"), ("/v1/chat/completions", "POST"), ("/tokenize", "POST"),
                         ("/detokenize", "POST")):
        for headers in ({}, {"Authorization": "Basic " + KEY}, {"Authorization": "Bearer " + KEY + "x"}):
            r = requests.request(method, stack.url + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["WWW-Authenticate"] == "Bearer"
    assert requests.get(stack.url + "/health", timeout=10).status_code == 200
    assert requests.get(stack.url + "/metrics", timeout=10).status_code == 200


# ---------------------------------------------------------------------------- completions


def test_completion_equals_the_servers_greedy_text(stack):
    want = server_greedy(stack, PROMPT, 12)
    r = stack.oa.completions.create(model=model_id(stack), prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == model_id(stack)
    assert abs(r.created - time.time()) < 60
    assert len(r.choices) == 1
    c = r.choices[0]
    assert (c.text, c.index, c.logprobs, c.finish_reason) == (want.text, 0, None, want.finish_reason)
    assert r.usage.prompt_tokens == want.usage["prompt_tokens"]
    assert r.usage.completion_tokens == want.usage["completion_tokens"] == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # token ids, and a batch of exactly one prompt, give the same answer
    with stack.server.client(10) as cl:
        ids = cl.tokenize(PROMPT)
    r2 = stack.oa.completions.create(model=model_id(stack), prompt=ids, max_tokens=12, temperature=0)
    r3 = stack.oa.completions.create(model=model_id(stack), prompt=[PROMPT], max_tokens=12, temperature=0)
    assert r2.choices[0].text == r3.choices[0].text == want.text
    # stop strings are the server's: the text ends before the stop string
    stop = want.text[4:7]
    if stop.strip():
        r4 = stack.oa.completions.create(model=model_id(stack), prompt=PROMPT, max_tokens=12, temperature=0,
                                         stop=[stop])
        assert r4.choices[0].finish_reason == "stop" and stop not in r4.choices[0].text
        assert want.text.startswith(r4.choices[0].text)


def test_streamed_completion_equals_the_non_streamed_one(stack):
    kw = dict(model=model_id(stack), prompt=PROMPT, max_tokens=20, temperature=0)
    full = stack.oa.completions.create(**kw)
    chunks = list(stack.oa.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the raw SSE framing: data: {json}\n\n ... data: [DONE]\n\n
    r = requests.post(stack.url + "/v1/completions", headers=stack.auth, stream=True, timeout=30,
                      json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    raw = r.content.decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


# ---------------------------------------------------------------------------- chat


def expected_chat_ids(st, messages):
    """The prompt the gateway must send: the model's own template, rendered as HF does."""
    with _closing(st.model) as cf:
        template = cf.chat_template
    assert template, "the test model has a chat template"
    text = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    with st.server.client(10) as c:     # the template's text: its control tokens are parsed
        return c.tokenize([(text, True)], add_special_tokens=False)


def test_chat_completion_uses_the_models_template_and_streams_the_same_text(stack):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def f():"}]
    ids = expected_chat_ids(stack, messages)
    want = server_greedy(stack, ids, 16)
    r = stack.oa.chat.completions.create(model=model_id(stack), messages=messages, max_tokens=16, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want.text
    assert c.finish_reason == want.finish_reason and c.index == 0
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)

    chunks = list(stack.oa.chat.completions.create(model=model_id(stack), messages=messages, max_tokens=16,
                                                   temperature=0, stream=True))
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == [want.finish_reason]
    assert chunks[-1].choices[0].delta.content is None

    # text parts are joined; max_completion_tokens is max_tokens
    parts = [{"role": "system", "content": [{"type": "text", "text": "You write Python."}]},
             {"role": "user", "content": "def f():"}]
    r2 = stack.oa.chat.completions.create(model=model_id(stack), messages=parts, max_completion_tokens=16,
                                          temperature=0)
    assert r2.choices[0].message.content == want.text


# ---------------------------------------------------------------------------- tokenize


def test_tokenize_detokenize_round_trip(stack):
    text = "for i in range(10):\n    print(i)"
    r = requests.post(stack.url + "/tokenize", headers=stack.auth, json={"prompt": text}, timeout=10)
    assert r.status_code == 200
    body = r.json()
    with stack.server.client(10) as c:
        assert body["tokens"] == c.tokenize(text)
    assert body["count"] == len(body["tokens"]) > 0
    r2 = requests.post(stack.url + "/tokenize", headers=stack.auth, timeout=10,
                       json={"prompt": text, "add_special_tokens": False})
    d = requests.post(stack.url + "/detokenize", headers=stack.auth, json={"tokens": r2.json()["tokens"]},
                      timeout=10)
    assert d.status_code == 200 and d.json() == {"prompt": text}


def test_a_raw_completion_prompt_reads_special_tokens_as_chat_renders_them(stack):
    """/v1/completions parses special-token text in a raw prompt into its control tokens, as
    llama.cpp's server and vLLM do: the chat template's text sent as a prompt is the same tokens
    as the chat request (not `<s>` spelled out in characters, running on to `length`).
    /tokenize counts a prompt the same way and takes `messages` (as chat renders them);
    /apply-template gives the template's text, llama.cpp's endpoint. Message content stays text."""
    messages = [{"role": "user", "content": "def add(a, b):"}]
    post = lambda path, body: requests.post(stack.url + path, headers=stack.auth, json=body, timeout=30)  # noqa: E731
    text = post("/apply-template", {"messages": messages}).json()["prompt"]
    assert text == "<s>user\ndef add(a, b):</s>\n<s>assistant\n"             # the test model's template
    chat = stack.oa.chat.completions.create(model=model_id(stack), messages=messages, max_tokens=8, temperature=0)
    raw = stack.oa.completions.create(model=model_id(stack), prompt=text, max_tokens=8, temperature=0)
    assert raw.usage.prompt_tokens == chat.usage.prompt_tokens
    assert raw.choices[0].text == chat.choices[0].message.content
    by_messages = post("/tokenize", {"messages": messages}).json()
    by_prompt = post("/tokenize", {"prompt": text}).json()
    assert by_messages["count"] == by_prompt["count"] == chat.usage.prompt_tokens
    assert by_messages["tokens"] == by_prompt["tokens"]
    # <s> twice (the first is the BOS), </s> once
    assert by_prompt["tokens"].count(1) == 2 and by_prompt["tokens"].count(2) == 1
    # content is text: "</s>" typed in a message is not the end-of-sequence token
    forged = post("/tokenize", {"messages": [{"role": "user", "content": "</s>"}]}).json()["tokens"]
    assert forged.count(2) == 1
    r = post("/tokenize", {"prompt": text, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------------------- errors

LONG = list(range(3, 303))   # 300 tokens: more than the test model's context of 256

BAD = [
    # (path, body (bytes: sent as is), status, param, code)
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None, "invalid_json"),
    ("/v1/completions", b"\xff\xfe{}", 400, None, "invalid_json"),
    ("/v1/completions", {}, 400, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_k": 2.5}, 400, "top_k", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, 400, "echo", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -2.5}, 400, "presence_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 5}, 400, "frequency_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 5}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 5}}, 400, "logit_bias", "bad_request"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 400, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus", "unknown_parameter"),
    # checked by the colibri server, mapped by the gateway
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100_000}, 400, "max_tokens", "too_large"),
    ("/v1/completions", {"prompt": [100_000]}, 400, "prompt", "bad_request"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content",
     "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "colour": 1}]}, 400,
     "messages[0].colour", "unknown_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools[0]", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                              "max_completion_tokens": 3}, 400, "max_completion_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    ("/tokenize", {"prompt": 3}, 400, "prompt", "invalid_type"),
    ("/tokenize", {"text": "x"}, 400, "text", "unknown_parameter"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [100_000]}, 400, "tokens", "bad_request"),
]


@pytest.fixture(scope="module")
def session(stack):
    s = requests.Session()
    s.headers.update(stack.auth)
    yield s
    s.close()


@pytest.mark.parametrize("path,body,status,param,code", BAD,
                         ids=[f"{i}-{p.strip('/').replace('/', '_')}" for i, (p, *_) in enumerate(BAD)])
def test_bad_request_bodies_name_the_field(stack, session, path, body, status, param, code):
    if isinstance(body, bytes):
        r = session.post(stack.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=10)
    else:
        r = session.post(stack.url + path, json=body, timeout=10)
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, code), err
    assert err["type"] == "invalid_request_error" and err["message"]
    assert "Traceback" not in r.text


def test_size_limit_methods_and_unknown_paths(stack, session):
    r = session.post(stack.url + "/v1/completions", data=b'{"prompt": "' + b"a" * (1 << 20) + b'"}',
                     headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = session.get(stack.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    r = session.get(stack.url + "/v2/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # openai maps them to its exception classes
    with pytest.raises(openai.BadRequestError) as ei:
        stack.oa.completions.create(model=model_id(stack), prompt="x", n=17)
    assert ei.value.body["param"] == "n"


# ---------------------------------------------------------------------------- metrics


def test_metrics_families_after_requests(stack):
    before = metrics(stack)
    n_before = sample(before, "colibri_http_requests", outcome="ok", endpoint="/v1/completions") or 0
    kw = dict(model=model_id(stack), prompt=PROMPT, max_tokens=8, temperature=0)
    for _ in range(2):
        stack.oa.completions.create(**kw)
    list(stack.oa.completions.create(stream=True, **kw))
    with pytest.raises(openai.BadRequestError):
        stack.oa.completions.create(model=model_id(stack), prompt="x", max_tokens=0)
    fams = metrics(stack)
    assert sample(fams, "colibri_http_requests", outcome="ok", endpoint="/v1/completions") == n_before + 3
    assert sample(fams, "colibri_http_requests", outcome="bad_request", endpoint="/v1/completions") >= 1
    assert 1 <= sample(fams, "colibri_http_requests_in_flight") <= 4      # this scrape itself
    assert sample(fams, "colibri_http_completion_tokens") >= 24
    assert sample(fams, "colibri_http_prompt_tokens") >= 3
    ttft = sample(fams, "colibri_http_time_to_first_token_seconds", "colibri_http_time_to_first_token_seconds_count")
    assert ttft >= 3
    assert 0 < sample(fams, "colibri_http_time_to_first_token_seconds",
                      "colibri_http_time_to_first_token_seconds_sum") < 30 * ttft
    assert sample(fams, "colibri_http_inter_token_latency_seconds",
                  "colibri_http_inter_token_latency_seconds_count") >= 3 * 6
    assert sample(fams, "colibri_http_request_duration_seconds", "colibri_http_request_duration_seconds_count",
                  endpoint="/v1/completions") >= 4
    # from the server's stats
    st = stack.server.stats()
    assert sample(fams, "colibri_up") == 1
    assert sample(fams, "colibri_queue_depth") == 0
    assert sample(fams, "colibri_in_flight") == 0
    assert sample(fams, "colibri_workers", state="ready") == 2
    assert sample(fams, "colibri_model_generation") == 1
    assert sample(fams, "colibri_model_size_bytes") == os.path.getsize(stack.model)
    assert sample(fams, "colibri_server_events", event="done") >= 3
    for w in st["workers"]:
        for kind in ("rss", "uss", "pss"):
            v = sample(fams, f"colibri_worker_{kind}_bytes", pid=str(w["pid"]))
            assert v is not None and v > 0, (kind, w)
        assert sample(fams, "colibri_worker_served", pid=str(w["pid"])) is not None


# ---------------------------------------------------------------------------- disconnects


class Throttle:
    """Slow the workers down (run 2 ms, pause 50 ms, with SIGSTOP/SIGCONT) so that a
    generation of this tiny model lasts seconds instead of ~0.1 s."""

    def __init__(self, pids, run=0.002, pause=0.05):
        self.pids, self.run, self.pause = pids, run, pause
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _signal(self, sig):
        for pid in self.pids:
            os.kill(pid, sig)

    def _loop(self):
        while not self.stop.is_set():
            self._signal(signal.SIGCONT)
            time.sleep(self.run)
            self._signal(signal.SIGSTOP)
            self.stop.wait(self.pause)

    def __enter__(self):
        self._signal(signal.SIGSTOP)
        return self

    def start(self):
        self.thread.start()

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(5)
        self._signal(signal.SIGCONT)


def test_client_hanging_up_mid_stream_cancels_the_generation(stack):
    """The workers are paused while the request is dispatched and the HTTP client hangs up,
    then run slowly: the gateway's next writes fail, gunicorn closes the response, the
    colibri Stream sends a cancel and the router ends the request on its worker."""
    s = stack.server
    before = s.stats()["counters"]
    gone_before = sample(metrics(stack), "colibri_http_requests", endpoint="/v1/completions",
                         outcome="disconnected") or 0
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()
    req = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    def cancelled():
        st = s.stats()
        return st["counters"].get("error:cancelled", 0) > before.get("error:cancelled", 0) and st["in_flight"] == 0
    with Throttle(s.worker_pids()) as throttle:
        sock = socket.create_connection(("127.0.0.1", stack.port), timeout=10)
        sock.sendall(req)
        s.wait_for(lambda: s.stats()["in_flight"] == 1, timeout=10, what="dispatch")
        sock.close()                                   # the HTTP client goes away
        throttle.start()
        try:
            s.wait_for(cancelled, timeout=20, what="the router cancelling the abandoned request")
        except TimeoutError:
            raise AssertionError(f"not cancelled: counters {before} -> {s.stats()['counters']}\n"
                                 f"{stack.gateway.logs()[-3000:]}") from None
    after = s.stats()["counters"]
    assert after.get("done", 0) == before.get("done", 0), "the abandoned request ran to its end"
    fams = metrics(stack)
    assert sample(fams, "colibri_http_requests", endpoint="/v1/completions", outcome="disconnected") == gone_before + 1
    # the gateway thread is free again
    r = stack.oa.completions.create(model=model_id(stack), prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_client_hanging_up_on_a_non_streaming_request_frees_its_worker(stack):
    """Issue 20 item 9: no write reveals the hang-up of a non-streaming request; the gateway
    probes the connection between tokens, cancels the request and the worker is free."""
    s = stack.server
    before = s.stats()["counters"]
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0}).encode()
    req = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    def cancelled():
        st = s.stats()
        return st["counters"].get("error:cancelled", 0) > before.get("error:cancelled", 0) and st["in_flight"] == 0
    with Throttle(s.worker_pids()) as throttle:
        sock = socket.create_connection(("127.0.0.1", stack.port), timeout=10)
        sock.sendall(req)
        s.wait_for(lambda: s.stats()["in_flight"] == 1, timeout=10, what="dispatch")
        sock.close()
        throttle.start()
        s.wait_for(cancelled, timeout=20, what="the router cancelling the abandoned request")
    assert s.stats()["counters"].get("done", 0) == before.get("done", 0), "the abandoned request ran to its end"


def test_idle_and_half_sent_connections_do_not_stop_health(stack):
    """Issue 20 item 8 (slowloris): 12 connections that sent half a request head, 12 that sent
    nothing and 12 that sent a head and part of the body hold no gateway thread: /health and
    the API still answer at once."""
    conns = []
    try:
        for i in range(36):
            c = socket.create_connection(("127.0.0.1", stack.port), timeout=10)
            if i % 3 == 1:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            elif i % 3 == 2:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
            conns.append(c)
        time.sleep(0.5)
        t0 = time.monotonic()
        r = requests.get(f"http://127.0.0.1:{stack.port}/health", timeout=10)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0
        r = stack.oa.completions.create(model=model_id(stack), prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.choices[0].finish_reason == "length" and time.monotonic() - t0 < 5.0
    finally:
        for c in conns:
            c.close()


def test_a_head_not_finished_in_time_is_closed(tmp_path):
    """Issue 20 item 8: the gateway answers 408 and closes a connection whose request head has not arrived within the
    header timeout (COLIBRI_HTTP_HEADER_TIMEOUT, 10 s by default; 1 s here), while a connection that
    sends its head in time is answered."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    g = Gateway([sys.executable, "-m", "colibri_server.http", "--connect", f"ipc://{tmp_path}/nobody.sock",
                 "--bind", f"127.0.0.1:{port}", "--threads", "2", "--timeout", "1"],
                {"COLIBRI_HTTP_HEADER_TIMEOUT": "1"}, tmp_path / "g.log")
    try:
        g.wait_listening(url)
        half = socket.create_connection(("127.0.0.1", port), timeout=10)
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")          # no blank line: never finished
        t0 = time.monotonic()
        ans = b""
        while True:                                                        # answered 408, then closed
            data = half.recv(4096)
            if not data:
                break
            ans += data
        waited = time.monotonic() - t0
        assert ans.startswith(b"HTTP/1.1 408 "), ans[:200]
        assert 0.8 < waited < 5.0, waited
        late = socket.create_connection(("127.0.0.1", port), timeout=10)
        late.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)
        late.sendall(b"\r\n")                                               # finished within the timeout
        assert late.recv(4096).startswith(b"HTTP/1.1 ")
        half.close()
        late.close()
    finally:
        g.stop()


# ---------------------------------------------------------------------------- serve() without a server


def test_serve_without_a_server_answers_503(tmp_path):
    """`python -m colibri_server.http` (serve(): gunicorn run programmatically), no API key,
    pointed at an address where nothing listens."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    g = Gateway([sys.executable, "-m", "colibri_server.http", "--connect", f"ipc://{tmp_path}/nobody.sock",
                 "--bind", f"127.0.0.1:{port}", "--threads", "2", "--timeout", "1"], {}, tmp_path / "g.log")
    try:
        t0 = time.monotonic()
        r = g.wait_listening(url)
        assert r.status_code == 503 and r.json()["status"] == "unreachable"
        assert time.monotonic() - t0 < 10
        with ThreadPoolExecutor(2) as ex:        # both wait for their timeout: in parallel
            comp = ex.submit(requests.post, url + "/v1/completions", json={"prompt": "x"}, timeout=10)
            scrape = ex.submit(requests.get, url + "/metrics", timeout=10)
            r, m = comp.result(), scrape.result()
        # no key needed; nothing listens: 503 naming the address at once, not a 504 after the timeout
        assert r.status_code == 503 and r.json()["error"]["code"] == "unreachable", r.text
        assert "nobody.sock" in r.json()["error"]["message"]
        fams = {f.name: f for f in text_string_to_metric_families(m.text)}
        assert sample(fams, "colibri_up") == 0
        assert sample(fams, "colibri_http_requests", endpoint="/health", outcome="unavailable") == 1
    finally:
        g.stop()
    assert "Traceback" not in g.logs()
