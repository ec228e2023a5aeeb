"""One command for an HTTP API: `colibri serve --http HOST:PORT` starts the OpenAI gateway under the
master (issue 19, item 4): it answers the openai package under --served-model-name, comes back when
killed, and goes away with the server (the port is free again)."""
from __future__ import annotations

import os
import signal
import socket

import openai
import psutil
import requests
from server_harness import Server, wait_started, wait_until
from test_http import free_port


def _gateway_pid(server):
    for c in psutil.Process(server.pid).children():
        try:
            t = " ".join(c.cmdline())           # gunicorn titles its arbiter "gunicorn: master [colibri-http]"
            if "colibri-http" in t or "colibri_server.http" in t or t.startswith("colibri: http"):
                return c.pid
        except psutil.NoSuchProcess:
            pass
    return None


def _gone(p):
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(pred, timeout=60.0, what="condition"):
    return wait_until(pred, timeout, what)


def _health(url):
    try:
        return requests.get(url + "/health", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


def test_serve_with_http_answers_restarts_and_stops_with_the_server(built, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    s = Server(built("mixtral").colibri("f32"), tmp_path, workers=1,
               extra=["--http", f"127.0.0.1:{port}", "--served-model-name", "tiny-moe,tiny"])
    try:
        s.wait_ready(1)
        s.wait_http(url)
        oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in oa.models.list().data] == ["tiny-moe", "tiny"]          # aliases
        r = oa.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert r.model == "tiny-moe" and oa.models.retrieve("tiny").id == "tiny"
        with s.client() as c:
            assert r.choices[0].text == c.generate([5, 6, 7], max_tokens=4).text
        assert f"http://127.0.0.1:{port}/v1" in s.logs()
        # killed: the master starts another
        first = _gateway_pid(s)
        orphans = psutil.Process(first).children()  # its gunicorn workers: they leave once they see it gone
        os.kill(first, signal.SIGKILL)
        wait_started(lambda: (_gateway_pid(s) or first) != first and _health(url), "a new gateway", [s.proc], s.logs)
        assert "HTTP gateway" in s.logs() and "restarting it" in s.logs()
        gw = _gateway_pid(s)
        # they share the port the master holds: wait for them, as a new gateway's bind once did
        wait_started(lambda: all(map(_gone, orphans)), "the killed gateway's workers leaving", [s.proc], s.logs)
    finally:
        s.stop()
    assert not psutil.pid_exists(gw) or psutil.Process(gw).status() == psutil.STATUS_ZOMBIE
    with socket.socket() as sock:                    # nobody listens on the port any more (TIME_WAITs may stay)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_a_bad_http_address_is_refused_by_name(built, tmp_path):
    s = Server(built("mixtral").colibri("f32"), tmp_path, workers=1, extra=["--http", "http://x:80"])
    code = s.proc.wait(30)
    assert code != 0 and "invalid value for http" in s.logs(), s.logs()


def _readme_openai_snippet() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        text = f.read()
    start = text.index("```python\nfrom openai import OpenAI") + len("```python\n")
    return text[start:text.index("```", start)]


def test_the_readmes_openai_snippet_returns_what_it_shows(tmp_path):
    """The quick start's OpenAI call, run as written against `serve --http ... --served-model-name tiny`
    on the bundled model (only the port differs): every answer is complete JSON (finish_reason stop)
    of the schema it asks for (json_object with max_tokens 32 ends at `length` mid-object on this
    model). Five runs of n = 2 at temperature 0.8: ten samples."""
    import contextlib
    import io
    import json

    import jsonschema

    from colibri_server.bundled import BUNDLED_MODEL
    code = _readme_openai_snippet()
    assert 'model="tiny"' in code and "http://127.0.0.1:8000/v1" in code
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    s = Server(BUNDLED_MODEL, tmp_path, workers=1, extra=["--http", f"127.0.0.1:{port}", "--served-model-name", "tiny"])
    try:
        s.wait_ready(1)
        _wait(lambda: _health(url), what="the gateway's /health")
        for _ in range(5):
            ns, out = {}, io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code.replace("http://127.0.0.1:8000/v1", url + "/v1"), "README.md", "exec"), ns)
            r = ns["r"]
            assert len(r.choices) == 2
            for c in r.choices:
                assert c.finish_reason == "stop", c
                value = json.loads(c.message.content)
                if "call" in ns:
                    jsonschema.validate(value, ns["call"])
                assert c.logprobs.content and len(c.logprobs.content[0].top_logprobs) == 3
            assert out.getvalue().strip()
    finally:
        s.stop()
