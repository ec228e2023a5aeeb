"""The gateway's pages for a person with a browser: `/` a chat with the model (streamed from
/v1/chat/completions), `/status` the live server (workers, batch, KV blocks, memory, and a heat map
of which experts each layer routes to), and `/status.json`, the router's `stats` exactly as
`colibri status --json` prints them, which the status page polls.

The pages are plain HTML, CSS and JavaScript in `static/` (package data: no build step, nothing
fetched from any other host; the Content-Security-Policy says so to the browser too). They are read
once per process. A script or stylesheet is named in its page with a hash of its content
(`/static/chat.js?v=HASH`) and served `immutable` for a year; a page is served `no-cache` with an
ETag, so a browser asks again and gets a 304 until the package changes.

Read-only: the pages read /v1/models, /status.json and the chat endpoint, nothing else; nothing on
them reloads, scales or stops the server. The pages and their assets carry no data and are served
without the API key; /status.json and the API ask for it as every endpoint does, and the page asks
its user for the key once (on a 401) and keeps it in a variable of the page, never in storage.
`pages = false` (COLIBRI_HTTP_PAGES, `--pages false`) turns all of it off (404).

Owns: the static files, their hashes and cache headers, /status.json. Never: generates or talks to a
worker (the chat page is a client of the OpenAI endpoint like any other).
"""
from __future__ import annotations

import hashlib
import os
import re

from .openai import _json, _Resp
from .template import STATS_TIMEOUT

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
PAGES = {"/": "chat.html", "/status": "status.html"}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# the browser may load and connect to this origin only: no script, style or request goes anywhere else
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_ASSET_REF = re.compile(r"\{\{asset:([\w.-]+)\}\}")


class Asset:
    __slots__ = ("body", "etag", "content_type", "cache")

    def __init__(self, body: bytes, content_type: str, cache: str):
        self.body, self.content_type, self.cache = body, content_type, cache
        self.etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'


def load_assets(directory: str = STATIC) -> dict:
    """{url path: Asset} of every page and asset in `directory`; a page's `{{asset:NAME}}` becomes
    NAME's URL with its content hash."""
    assets, pages = {}, {}
    for name in sorted(os.listdir(directory)):
        ext = os.path.splitext(name)[1]
        if ext not in TYPES:
            continue
        with open(os.path.join(directory, name), "rb") as f:
            body = f.read()
        if ext == ".html":
            pages[name] = body
        else:
            assets["/static/" + name] = Asset(body, TYPES[ext], "public, max-age=31536000, immutable")

    def ref(m):
        a = assets.get("/static/" + m.group(1))
        if a is None:
            raise ValueError(f"page asset {m.group(1)!r} is not in {directory}")
        return f"/static/{m.group(1)}?v={a.etag.strip(chr(34))[:12]}"
    for path, name in PAGES.items():
        html = _ASSET_REF.sub(ref, pages[name].decode("utf-8")).encode("utf-8")
        assets[path] = Asset(html, TYPES[".html"], "no-cache")
    return assets


class Pages:
    """The routes of the pages for a Gateway `gw` (its `call` runs a client call with its errors mapped)."""

    def __init__(self, gw):
        self.gw = gw
        self.assets = load_assets()

    def routes(self) -> dict:
        """{path: (methods, handler(environ) -> _Resp, requires the API key)}."""
        out = {path: (("GET",), self._serve(path), False) for path in self.assets}
        out["/status.json"] = (("GET",), self.status_json, True)
        return out

    def _serve(self, path):
        a = self.assets[path]

        def handler(environ) -> _Resp:
            headers = [("ETag", a.etag), ("Cache-Control", a.cache), ("X-Content-Type-Options", "nosniff")]
            if a.content_type.startswith("text/html"):
                headers += [("Content-Security-Policy", CSP), ("Referrer-Policy", "no-referrer")]
            if a.etag in (environ.get("HTTP_IF_NONE_MATCH") or ""):
                return _Resp(304, b"", headers, content_type=a.content_type)
            return _Resp(200, a.body, headers, content_type=a.content_type)
        return handler

    def status_json(self, environ) -> _Resp:
        """The router's stats (one router's, with several: its address under "addr"), as `colibri status --json`."""
        st = self.gw.call(lambda c: c.stats(timeout=min(self.gw.timeout, STATS_TIMEOUT)))
        return _json(st, headers=[("Cache-Control", "no-store")])
