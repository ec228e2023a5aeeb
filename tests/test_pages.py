"""Issue 35: the gateway's chat page at /, status page at /status and their assets (http/pages.py),
answered in process by the WSGI app (no server: the pages carry no data). With a server:
test_http.py (the API key), test_observability.py (/status.json); in a browser: test_browser.py."""
from __future__ import annotations

import hashlib
import json
import re

import pytest

from colibri_server.http import create_app, options_from_env
from colibri_server.http.pages import STATIC

KEY = "sk-pages"


def get(app, path, **headers):
    env = {"PATH_INFO": path, "REQUEST_METHOD": "GET", **{"HTTP_" + k.upper(): v for k, v in headers.items()}}
    out = {}

    def start_response(status, hdrs):
        out["status"], out["headers"] = int(status.split()[0]), dict(hdrs)
    body = b"".join(app(env, start_response))
    return out["status"], out["headers"], body


@pytest.fixture(scope="module")
def app():
    return create_app("tcp://127.0.0.1:9", api_key=KEY)       # nothing listens there: the pages need no server


def _refs(html: bytes):
    return re.findall(r'(?:src|href)="([^"]*)"', html.decode())


def test_pages_and_their_assets_are_served_with_cache_headers(app):
    for path, title in (("/", "colibri: chat"), ("/status", "colibri: status")):
        status, h, body = get(app, path)           # no API key: a page holds no data
        assert status == 200 and h["Content-Type"] == "text/html; charset=utf-8"
        assert f"<title>{title}</title>" in body.decode()
        assert h["Cache-Control"] == "no-cache" and h["ETag"].startswith('"')
        assert "default-src 'none'" in h["Content-Security-Policy"] and "connect-src 'self'" in \
            h["Content-Security-Policy"]
        st304, h304, b304 = get(app, path, if_none_match=h["ETag"])
        assert (st304, b304, h304["ETag"]) == (304, b"", h["ETag"])
        scripts = [r for r in _refs(body) if r.startswith("/static/")]
        assert any(r.endswith(".css", 0, r.index("?")) for r in scripts)
        for ref in scripts:                         # named by the hash of their content, cached for good
            path_, _, version = ref.partition("?v=")
            st, ah, ab = get(app, path_)
            assert st == 200 and ah["Cache-Control"] == "public, max-age=31536000, immutable"
            assert hashlib.sha256(ab).hexdigest().startswith(version) and len(version) == 12
            assert ab == open(f"{STATIC}/{path_.rsplit('/', 1)[1]}", "rb").read()
            assert get(app, path_, if_none_match=ah["ETag"])[0] == 304
            assert get(app, path_, if_none_match='"other"')[0] == 200


def test_a_first_load_is_small_and_names_no_other_host(app):
    for page in ("/", "/status"):
        body = get(app, page)[2]
        total = len(body)
        for ref in _refs(body):
            assert ref.startswith("/") and not ref.startswith("//") or ref == "data:,", ref    # this origin only
            if ref.startswith("/static/"):
                total += len(get(app, ref.partition("?")[0])[2])
        assert total < 200_000, total
    for name in ("chat.js", "status.js", "common.js", "markdown.js"):
        js = open(f"{STATIC}/{name}").read()
        assert not re.search(r"""["'`](https?:)?//""", js), name     # no URL of another host in a script
        assert "localStorage" not in js and "sessionStorage" not in js and "cookie" not in js   # the key: memory only


def test_status_json_and_the_api_ask_for_the_key_the_pages_do_not(app):
    status, h, body = get(app, "/status.json")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert get(app, "/v1/models")[0] == 401
    assert get(app, "/static/chat.js")[0] == 200
    # with the key the call goes to the server (none here: 502/503/504, not 401)
    assert get(app, "/status.json", authorization=f"Bearer {KEY}")[0] != 401


def test_the_pages_setting_turns_them_off():
    off = create_app("tcp://127.0.0.1:9", pages=False)
    for path in ("/", "/status", "/status.json", "/static/chat.js"):
        assert get(off, path)[0] == 404, path
    assert options_from_env({"COLIBRI_HTTP_PAGES": "false"})["pages"] is False
    assert "pages" not in options_from_env({})            # the default: on
    from colibri_server.http.serve import add_http_arguments
    from colibri_server.settings import Parser
    assert add_http_arguments(Parser(prog="colibri http")).parse_args(["--pages", "false"]).pages is False
