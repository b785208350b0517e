"""The chat page (examples/chat.html, served by `treadle serve` at /) in a real headless Chromium.

Debian's `chromium` and `chromium-driver` (installed by `make install`) driven by Selenium through
/usr/bin/chromedriver, so nothing is downloaded. The server has `--max-queue 1`: one question at a time
runs, and a request held open by the test makes the page's next one meet a 429.

Screenshots go to test-artifacts/ (gitignored).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.sse import iter_sse_data
from tests.conftest_server import REPO, TreadleServer
from tests.reliability import running_server

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--no-first-run",
                  "--window-size=1000,720")

pytestmark = pytest.mark.slow

# Counts every change to the last assistant message, recording its text length each time, and
# records the bodies and the URLs the page sends. Installed by the test, not shipped in the page.
INSTRUMENT_JS = """
window.__lengths = [];
window.__bodies = [];
new MutationObserver(() => {
  const replies = document.querySelectorAll('.msg.assistant');
  if (replies.length) window.__lengths.push(replies[replies.length - 1].textContent.length);
}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
window.__urls = [];
const originalFetch = window.fetch;
window.fetch = (url, init = {}) => {
  window.__urls.push(`${init.method || "GET"} ${url}`);
  if (!init.body) return originalFetch(url, init);  // a reconnect or a cancel
  const body = JSON.parse(init.body);
  Object.assign(body, window.__extraBody || {});
  window.__bodies.push(body);
  return originalFetch(url, {...init, body: JSON.stringify(body)});
};
"""


@pytest.fixture(scope="module")
def server() -> Iterator[TreadleServer]:
    srv = TreadleServer(["--kv-cache-mb", "96", "--max-queue", "1", "--sse-ping-seconds", "0.5"])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        if os.environ.get("TREADLE_SKIP_BROWSER"):
            pytest.skip("TREADLE_SKIP_BROWSER is set and chromium is not installed")
        pytest.fail("the browser test needs Debian's chromium and chromium-driver: `make install` installs them "
                    "(apt-get install chromium chromium-driver); set TREADLE_SKIP_BROWSER=1 to skip")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="treadle-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def open_page(driver, server: TreadleServer, max_tokens: int, extra_body: dict | None = None) -> None:
    driver.get(server.base_url + "/")
    driver.execute_script(INSTRUMENT_JS)
    driver.execute_script("window.__extraBody = arguments[0];", extra_body or {})
    driver.execute_script("document.getElementById('max-tokens').value = arguments[0];"
                          "document.getElementById('temperature').value = 0;", max_tokens)


def ask(driver, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def last_reply(driver) -> dict:
    return driver.execute_script("""
        const replies = document.querySelectorAll('.msg.assistant');
        const r = replies[replies.length - 1];
        return r ? {text: r.textContent, state: r.dataset.state, count: replies.length} : null;""")


def wait_for(predicate, timeout: float = 60, what: str = "condition"):
    """Poll until `predicate()` is truthy; the timeout only bounds a failing test."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


def running(server: TreadleServer) -> float:
    return server.metrics()["treadle_requests_running"]


def test_reply_streams_in_incrementally_and_the_conversation_is_kept(server, browser):
    open_page(browser, server, max_tokens=48)
    ask(browser, "Name three kinds of loom and say one thing about each.")
    reply = wait_for(lambda: (r := last_reply(browser)) and r["state"] == "done" and r, what="the first reply")
    assert reply["text"].strip(), "the reply is empty"
    lengths = browser.execute_script("return window.__lengths;")
    partial = {n for n in lengths if 0 < n < len(reply["text"])}
    assert len(partial) >= 3, f"the reply did not appear incrementally: lengths seen {lengths}"

    ask(browser, "And which is the oldest?")
    second = wait_for(lambda: (r := last_reply(browser)) and r["count"] == 2 and r["state"] == "done" and r,
                      what="the second reply")
    assert second["text"].strip()
    bodies = browser.execute_script("return window.__bodies;")
    roles = [m["role"] for m in bodies[-1]["messages"]]
    assert roles == ["system", "user", "assistant", "user"], bodies[-1]
    assert bodies[-1]["messages"][2]["content"] == reply["text"]  # the first reply, as shown, is sent back
    assert all(b["stream"] is True for b in bodies)
    assert browser.execute_script("return document.getElementById('status').textContent;").startswith("done")
    screenshot(browser, "chat-page.png")


def test_stop_aborts_the_fetch_and_the_server_stops_generating(server, browser):
    before = server.metrics()
    # ignore_eos keeps the generation going until Stop (1500 tokens take many seconds here).
    open_page(browser, server, max_tokens=1500, extra_body={"ignore_eos": True})
    ask(browser, "Tell me a very long story about a weaver.")
    wait_for(lambda: len((last_reply(browser) or {}).get("text", "")) > 20, what="the reply to start")
    assert running(server) == 1
    browser.find_element("id", "stop").click()
    stopped = wait_for(lambda: (r := last_reply(browser)) and r["state"] == "stopped" and r, what="the stopped state")
    server.wait_for_metrics(lambda m: m["treadle_requests_running"] == 0, timeout=30)
    after = server.wait_for_metrics(
        lambda m: m.get('treadle_request_success_total{finish_reason="abort_client"}', 0)
        > before.get('treadle_request_success_total{finish_reason="abort_client"}', 0), timeout=30)
    generated = after["treadle_generation_tokens_total"] - before.get("treadle_generation_tokens_total", 0)
    assert 0 < generated < 1500, f"the server generated {generated} tokens; Stop should have cut it short"
    time.sleep(0.3)
    assert last_reply(browser)["text"] == stopped["text"], "text kept arriving after Stop"
    assert browser.execute_script("return document.getElementById('send').disabled;") is False


def test_a_429_from_a_full_server_is_shown_as_a_readable_error(server, browser):
    open_page(browser, server, max_tokens=32)
    held_open = threading.Event()
    release = threading.Event()

    def hold_the_only_slot() -> None:  # --max-queue 1: while this streams, the page's request gets 429
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
            for data in iter_sse_data(response.iter_bytes()):
                if data.startswith("{"):
                    stream_id = json.loads(data)["id"]
                    held_open.set()
                if release.is_set():
                    # Cancel, as a client that means to stop does: a dropped connection alone is kept
                    # for a reconnect for the server's stream grace (30 s), as long as this test waits.
                    httpx.post(f"{server.base_url}/v1/completions/{stream_id}/cancel", timeout=30)
                    break

    holder = threading.Thread(target=hold_the_only_slot, daemon=True)
    holder.start()
    try:
        assert held_open.wait(60), "the held request never streamed"
        question = "Is anyone there?"
        ask(browser, question)
        error = wait_for(lambda: browser.execute_script(
            "const e = document.getElementById('error'); return e.hidden ? '' : e.textContent;"),
            timeout=30, what="the error message")
        assert "busy" in error and "429" in error and "try again" in error.lower(), error
        assert "capacity" in error, f"the server's own message is not shown: {error}"
        # The failed turn is taken back and the question restored for a retry.
        assert browser.execute_script("return document.querySelectorAll('.msg').length;") == 0
        assert browser.execute_script("return document.getElementById('input').value;") == question
        path = screenshot(browser, "chat-page-429.png")
        assert path.stat().st_size > 5000
    finally:
        release.set()
        holder.join(timeout=60)
    server.wait_for_metrics(lambda m: m["treadle_requests_running"] == 0, timeout=30)


def test_page_reports_an_unreachable_server(server, browser):
    browser.get(server.base_url + "/?base=http://127.0.0.1:9")  # the discard port: nothing listens
    ask(browser, "Hello?")
    error = wait_for(lambda: browser.execute_script(
        "const e = document.getElementById('error'); return e.hidden ? '' : e.textContent;"),
        timeout=30, what="the error message")
    assert "Could not reach the server at http://127.0.0.1:9" in error, error
    assert json.loads(browser.execute_script("return JSON.stringify(document.getElementById('status').textContent)")) \
        == "error"


def test_tool_calls_show_in_the_reply_as_they_stream(browser, tmp_path):
    """With tools set in the page's settings, a call arrives as deltas and is shown as name(arguments)."""
    from tests.test_tools import TOOLS, hermes_model

    with running_server(["--model", str(hermes_model(tmp_path)), "--kv-cache-mb", "32"]) as server:
        open_page(browser, server, 120, {"tool_choice": "required", "parallel_tool_calls": False, "seed": 1,
                                         "temperature": 1.0})  # fmt: skip
        browser.execute_script("document.getElementById('tools').value = arguments[0];", json.dumps(TOOLS))
        ask(browser, "What is the weather in Paris?")
        reply = wait_for(lambda: (r := last_reply(browser)) and r["state"] == "done" and r, what="the reply")
        name, arguments = re.fullmatch(r"\u2192 (\w+)\((.*)\)", reply["text"], re.DOTALL).groups()
        assert name in {t["function"]["name"] for t in TOOLS}
        json.loads(arguments)
        assert browser.execute_script("return window.__bodies[0].tools.length") == len(TOOLS)
        screenshot(browser, "chat-tool-call.png")


class CuttingProxy:
    """A TCP proxy in front of the server that drops every connection through it on `cut()`, as a
    phone changing networks or a proxy's idle timeout would; new connections go through again."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> int:
        """Drop every open connection (both ends); the number dropped."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        return len(sockets) // 2

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_a_reply_cut_by_a_network_drop_resumes_where_it_left_off(server, browser):
    """The connection is dropped mid-answer; the page reconnects with Last-Event-ID and the reply ends
    as the uncut answer would: nothing lost, nothing twice."""
    proxy = CuttingProxy(server.port)
    try:
        browser.get(f"http://127.0.0.1:{proxy.port}/")  # the page and its API calls go through the proxy
        browser.execute_script(INSTRUMENT_JS)
        browser.execute_script("window.__extraBody = arguments[0];", {"ignore_eos": True})
        browser.execute_script("document.getElementById('max-tokens').value = 160;"
                               "document.getElementById('temperature').value = 0;")
        ask(browser, "Tell me a story about a lighthouse keeper.")
        wait_for(lambda: len((last_reply(browser) or {}).get("text", "")) > 20, what="the reply to start")
        assert proxy.cut() >= 1
        reply = wait_for(lambda: (r := last_reply(browser)) and r["state"] != "streaming" and r, what="the reply")
        assert reply["state"] == "done", browser.execute_script("return document.getElementById('error').textContent")
        urls = browser.execute_script("return window.__urls;")
        assert any(u.startswith("GET ") and u.endswith("/stream") for u in urls), urls
        assert "resumed" in browser.execute_script("return document.getElementById('status').textContent;")
        body = {**browser.execute_script("return window.__bodies[0];"), "stream": False}
        whole = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).json()
        assert reply["text"] == whole["choices"][0]["message"]["content"]
        screenshot(browser, "chat-page-resumed.png")
    finally:
        proxy.close()


def test_a_thinking_models_reasoning_is_folded_above_its_answer(browser, tmp_path):
    """The reasoning streams into a closed <details> above the answer, and both match what the API says."""
    import httpx

    from tests.thinking_models import qwen3_thinking_model

    directory = qwen3_thinking_model(tmp_path, opens=True)
    with running_server(["--model", str(directory), "--kv-cache-mb", "32", "--default-thinking-budget", "6"]) as server:
        sampling = {"seed": 4, "temperature": 1.0}
        open_page(browser, server, 30, sampling)
        ask(browser, "What is 2 + 2?")
        wait_for(lambda: (r := last_reply(browser)) and r["state"] == "done", what="the reply")
        shown = browser.execute_script("""
            const reply = document.querySelectorAll('.msg.assistant')[0];
            const details = reply.querySelector('details.thinking');
            return details && {first: reply.firstChild === details, open: details.open,
                               summary: details.firstChild.textContent, thought: details.lastChild.textContent,
                               answer: reply.querySelector('span').textContent};""")
        sent = browser.execute_script("return window.__bodies[0]")
        expected = httpx.post(server.base_url + "/v1/chat/completions", json={**sent, "stream": False},
                              timeout=120).json()["choices"][0]["message"]  # the same request, whole
        assert shown["first"] and not shown["open"] and shown["summary"] == "Thought"
        assert (shown["thought"], shown["answer"]) == (expected["reasoning_content"], expected["content"])
        screenshot(browser, "chat-thinking.png")
