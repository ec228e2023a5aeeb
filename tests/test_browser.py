"""The chat and status pages in a real browser (Debian's Chromium, headless, driven by selenium with
the system chromedriver) against `colibri serve --http` on the bundled model with an API key set:
the page asks for the key once, the chat streams an answer (the greedy answer of the API, in many
pieces), Stop cancels the request at the router (cancelled, not done; nothing in flight after), the
status page shows the workers and a heat map whose cells change after a request, and a first load
stays under 200 KB with no request to any other host.

    apt-get install -y chromium chromium-driver && pip install -e '.[browser]'
    python -m pytest -q -m browser -n 0 tests/test_browser.py

COLIBRI_TEST_SCREENSHOTS=DIR saves a screenshot of each page there (the README's are docs/images/)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from urllib.parse import urlsplit

import pytest
import requests
from server_harness import Server, wait_until
from test_http import free_port

from colibri_server.bundled import BUNDLED_MODEL

pytestmark = pytest.mark.browser

KEY = "sk-browser-test"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select
    _missing = None
except ImportError:
    _missing = "selenium is not installed (pip install -e '.[browser]')"
if _missing is None and not (CHROMIUM and CHROMEDRIVER):
    _missing = "Chromium or chromedriver is not installed (apt-get install -y chromium chromium-driver)"


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    if _missing:
        pytest.skip(_missing)
    tmp = tmp_path_factory.mktemp("browser")
    port = free_port()

    class W:
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {KEY}"}
    w = W()
    w.server = Server(BUNDLED_MODEL, tmp, workers=1, extra=["--http", f"127.0.0.1:{port}"],
                      env={"COLIBRI_HTTP_API_KEY": KEY})
    w.driver = None
    try:
        w.server.wait_ready(1)
        w.server.wait_http(w.url)
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860",
                  "--disable-background-networking", "--disable-component-update", "--no-first-run"):
            opts.add_argument(a)
        opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
        w.driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
        w.driver.set_script_timeout(30)
        yield w
    finally:
        if w.driver is not None:
            w.driver.quit()
        w.server.stop()


def _network(driver):
    """(urls requested, bytes transferred) since the last call, from Chromium's performance log."""
    urls, transferred = [], 0
    for entry in driver.get_log("performance"):
        m = json.loads(entry["message"])["message"]
        if m["method"] == "Network.requestWillBeSent":
            urls.append(m["params"]["request"]["url"])
        elif m["method"] == "Network.loadingFinished":
            transferred += m["params"]["encodedDataLength"]
    return urls, transferred


def _screenshot(driver, name):
    d = os.environ.get("COLIBRI_TEST_SCREENSHOTS")
    if d:
        os.makedirs(d, exist_ok=True)
        driver.save_screenshot(os.path.join(d, name))


def _wait(driver, fn, timeout=30.0, what="the page"):
    return wait_until(lambda: fn(driver), timeout, what, lambda: driver.find_element(By.TAG_NAME, "body").text[-2000:])


def _give_key(driver):
    """A page just loaded asks for the key (it keeps it in memory only: every load asks again)."""
    _wait(driver, lambda d: d.find_element(By.ID, "keydlg").is_displayed(), what="the API key prompt")
    driver.find_element(By.ID, "keyinput").send_keys(KEY, Keys.ENTER)


def _assistant(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def _send(driver, text):
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def test_the_chat_streams_the_models_answer_after_asking_for_the_key_once(web):
    d = web.driver
    _network(d)
    d.get(web.url + "/")
    _wait(d, lambda d: d.find_element(By.ID, "keydlg").is_displayed(), what="the API key prompt")
    d.find_element(By.ID, "keyinput").send_keys(KEY, Keys.ENTER)
    _wait(d, lambda d: "context 256" in d.find_element(By.ID, "model").text, what="the model's name and context")
    assert d.find_element(By.ID, "model").text.startswith("colibri-tiny-stdlib")
    # greedy, so that the answer is the API's own
    for field, value in (("temperature", "0"), ("max_tokens", "40")):
        e = d.find_element(By.ID, field)
        e.clear()
        e.send_keys(value)
    _send(d, "def add(a, b):")
    _wait(d, lambda d: _assistant(d).get_attribute("data-state") == "done", what="the answer")
    msg = _assistant(d)
    chunks = int(msg.get_attribute("data-chunks"))
    api = requests.post(web.url + "/v1/chat/completions", headers=web.auth, timeout=60, json={
        "messages": [{"role": "user", "content": "def add(a, b):"}], "temperature": 0, "max_tokens": 40}).json()
    want = api["choices"][0]["message"]["content"]
    assert chunks > 5, f"the answer came in {chunks} piece(s): not streamed"
    rendered = d.execute_script("return arguments[0].querySelector('.body').textContent", msg)
    assert want.strip() and _alnum(rendered) == _alnum(want)
    assert "40 tokens" in msg.find_element(By.CLASS_NAME, "meta").text
    # the key lives in the page's memory only
    assert d.execute_script("return localStorage.length + sessionStorage.length + document.cookie.length") == 0
    urls, transferred = _network(d)
    hosts = {urlsplit(u).netloc for u in urls if not u.startswith("data:")}
    assert hosts == {urlsplit(web.url).netloc}, urls
    assert transferred < 200_000, transferred
    _screenshot(d, "chat.png")


def _alnum(s):
    """The letters and digits of a text: what rendering its markdown keeps."""
    return "".join(c for c in s if c.isalnum())


@contextlib.contextmanager
def throttled(pid, run_s=0.003, stop_s=0.1):
    """The worker process stopped (SIGSTOP) all but run_s of every run_s + stop_s seconds: a machine ~30x
    slower, where a generation lasts long enough to be stopped midway."""
    done = threading.Event()

    def loop():
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        os.kill(pid, signal.SIGCONT)


def test_stop_cancels_the_request_at_the_router(web):
    d = web.driver
    if not d.current_url.startswith(web.url + "/") or "status" in d.current_url:
        d.get(web.url + "/")
        _give_key(d)
    d.find_element(By.ID, "clear").click()          # a new chat: the prompt is this message alone
    before = web.server.stats()["counters"]
    e = d.find_element(By.ID, "max_tokens")
    e.clear()
    e.send_keys("200")
    with throttled(web.server.worker_pids()[0]):
        _send(d, "import os")
        _wait(d, lambda d: int(_assistant(d).get_attribute("data-chunks")) >= 3, 60, "the first pieces")
        d.find_element(By.ID, "stopbtn").click()
        _wait(d, lambda d: _assistant(d).get_attribute("data-state") == "stopped", what="the stopped answer")
        st = wait_until(lambda: (lambda s: s if s["in_flight"] == 0 and s["queue"] == 0 else None)(web.server.stats()),
                        10, "nothing in flight at the router")
    after = st["counters"]
    assert after.get("error:cancelled", 0) == before.get("error:cancelled", 0) + 1, after
    assert after.get("done", 0) == before.get("done", 0), "the request ran to its end"
    assert not d.find_element(By.ID, "send").get_attribute("disabled")


def _cells(d):
    return d.execute_script("return Array.from(document.querySelectorAll('#heatmap .cell'))"
                            ".map(c => Number(c.dataset.count || 0))")


def test_the_status_page_shows_the_workers_and_a_heat_map_that_moves(web):
    d = web.driver
    d.get(web.url + "/status")
    _give_key(d)
    pid = web.server.worker_pids()[0]
    row = _wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, f"#workers tr.worker[data-pid='{pid}']"),
                what="the worker's row")[0]
    assert row.get_attribute("data-state") == "ready"
    assert len(_wait(d, _cells, what="the heat map")) == 4 * 8          # the bundled model: 4 layers x 8 experts
    mode = Select(d.find_element(By.ID, "heatmode"))
    mode.select_by_value("total")               # since the generation started: only grows
    before = _cells(d)
    r = requests.post(web.url + "/v1/completions", headers=web.auth, timeout=60,
                      json={"prompt": "class Stack:\n    def push(self, x):", "max_tokens": 30, "temperature": 0})
    assert r.status_code == 200
    after = _wait(d, lambda d: (lambda c: c if c != before and sum(c) > sum(before) else None)(_cells(d)), 20,
                  "the heat map's cells to change")
    assert sum(after) - sum(before) >= 4 * 2 * 30      # top-2 of 8: two choices per layer and token
    mode.select_by_value("recent")              # the last half minute: the request is in it
    assert sum(_cells(d)) >= 4 * 2 * 30
    assert d.find_element(By.ID, "in-flight").text == "0"
    assert not d.find_element(By.ID, "problem").is_displayed()
    _screenshot(d, "status.png")


def test_an_api_error_is_shown_as_the_api_words_it(web):
    d = web.driver
    d.get(web.url + "/")
    _give_key(d)
    _wait(d, lambda d: "context 256" in d.find_element(By.ID, "model").text, what="the model")
    e = d.find_element(By.ID, "max_tokens")
    e.clear()
    e.send_keys("1000")                             # more than the bundled model's context of 256
    _send(d, "hello")
    _wait(d, lambda d: _assistant(d).get_attribute("data-state") == "error", what="the error")
    shown = _assistant(d).find_element(By.CLASS_NAME, "error").text
    api = requests.post(web.url + "/v1/chat/completions", headers=web.auth, timeout=60, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1000, "stream": True}).json()["error"]
    assert shown == f"{api['message']} ({api['code']})"


def test_the_markdown_renderer_escapes_and_renders(web):
    d = web.driver
    if "/status" in d.current_url or not d.current_url.startswith(web.url):
        d.get(web.url + "/")
    render = lambda s: d.execute_script("return markdown.render(arguments[0])", s)   # noqa: E731
    assert render('<img src=x onerror="alert(1)">') == "<p>&lt;img src=x onerror=&quot;alert(1)&quot;&gt;</p>"
    assert render("a **b** `<i>` [l](javascript:x)") == "<p>a <strong>b</strong> <code>&lt;i&gt;</code> [l](javascript:x)</p>"
    assert render("```py\nif a < b:\n    pass\n```\n- one\n- two") == \
        '<pre><code class="lang-py">if a &lt; b:\n    pass</code></pre><ul><li>one</li><li>two</li></ul>'
    assert render("```\nstill streaming") == "<pre><code>still streaming</code></pre>"
    assert render("[colibri](https://example.org/a)") == \
        '<p><a href="https://example.org/a" rel="noopener noreferrer" target="_blank">colibri</a></p>'
