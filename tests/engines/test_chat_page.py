"""The chat page (engines/serving/chat.html at GET /) in a real headless browser: a typed message is sent, the reply
streams in, and the next turn re-sends the conversation, which the prefix cache serves.

    python -m pytest -q tests/engines/test_chat_page.py      # needs Debian's chromium and chromium-driver:
                                                     # apt-get install chromium chromium-driver

Driven over the W3C WebDriver protocol (chromedriver's HTTP API) with the standard library alone. Without
chromium or chromedriver the test skips, saying what to install; in CI (CI=true) it fails instead. The
server runs in a thread on the shipped holmes.pt; timeouts are hang guards only.
"""
import json
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request

import pytest
import uvicorn

from helpers import free_port
from engines.serving.engine import ServingEngine
from servers import HANG_GUARD, Running, wait_for

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def browser_or_skip():
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if shutil.which(path) is None]
    if missing:
        message = f"{' and '.join(missing)} not found: apt-get install chromium chromium-driver"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


class WebDriver:
    """One chromium session through chromedriver's HTTP API: just the calls the test makes."""

    def __init__(self, profile):
        port = free_port()
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        wait_for(self.ready, "chromedriver to listen")
        options = {"binary": CHROMIUM, "args": FLAGS + [f"--user-data-dir={profile}"]}
        capabilities = {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}
        self.session = self.call("POST", "/session", {"capabilities": capabilities})["sessionId"]

    def ready(self):
        try:
            return self.call("GET", "/status")["ready"]
        except (OSError, urllib.error.URLError):
            return False

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=HANG_GUARD) as response:
                return json.loads(response.read())["value"]
        except urllib.error.HTTPError as e:  # WebDriver's errors are JSON too: say what the browser said
            raise AssertionError(f"{method} {path}: {e.read().decode()[:500]}") from None

    def on_session(self, method, path, body=None):
        return self.call(method, f"/session/{self.session}{path}", body)

    def open(self, url):
        self.on_session("POST", "/url", {"url": url})

    def element(self, css):
        return self.on_session("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def type(self, css, text):
        element = self.element(css)
        self.on_session("POST", f"/element/{element}/clear", {})
        self.on_session("POST", f"/element/{element}/value", {"text": text})

    def click(self, css):
        self.on_session("POST", f"/element/{self.element(css)}/click", {})

    def script(self, code, *args):
        return self.on_session("POST", "/execute/sync", {"script": code, "args": list(args)})

    def quit(self):
        try:
            self.on_session("DELETE", "")
        finally:
            self.driver.terminate()
            self.driver.wait(HANG_GUARD)


@pytest.fixture(scope="module")
def page_server(pair):
    """The real server in a thread on a free localhost port: its URL, and a function asking it directly."""
    model, tokenizer = pair
    running = Running(ServingEngine(model, tokenizer, max_rows=4), tokenizer, model.cfg.context, 4, 4)

    def ask(body):
        status, answer = running.http("POST", "/v1/chat/completions", body)
        assert status == 200, answer
        return answer
    yield running.url, ask
    running.close()


@pytest.fixture
def browser():
    browser_or_skip()
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: nothing of a user's browser
        driver = WebDriver(profile)
        try:
            yield driver
        finally:
            driver.quit()


REPLIES = """return [...document.querySelectorAll('.turn.assistant .text')]
                  .map(e => [e.textContent, e.dataset.chunks, e.dataset.finish || null])"""
ENDED = """const turns = document.querySelectorAll('.turn'), last = turns[turns.length - 1];
return document.body.dataset.state === 'idle' && turns.length === arguments[0] &&
       (last.classList.contains('error') || Boolean(last.querySelector('.text').dataset.finish))"""


def send(browser, text, turns):
    """Type `text` into the page, press Send, and wait until the reply has ended (the page then shows `turns`
    turns): [text, content chunks, finish_reason] of every reply so far."""
    browser.type("#message", text)
    browser.click("#send")
    wait_for(lambda: browser.script(ENDED, turns), "the reply to finish streaming")
    error = browser.script("const e = document.querySelector('.turn.error'); return e && e.textContent")
    assert not error, f"the page showed an error: {error}"
    return browser.script(REPLIES)


def test_a_typed_message_streams_its_reply_and_the_next_turn_hits_the_cache(page_server, browser):
    url, ask = page_server
    browser.open(url + "/")
    assert browser.script("return document.title") == "Tiny GPT chat"
    browser.type("#temperature", "0")
    browser.type("#max_tokens", "8")
    first = "Holmes, what do you make of the stranger at the door of Baker Street?"
    [(reply, chunks, finish)] = send(browser, first, turns=2)
    history = [{"role": "user", "content": first}]
    expected = ask({"messages": history, "max_tokens": 8, "temperature": 0})["choices"][0]
    assert (reply, finish) == (expected["message"]["content"], expected["finish_reason"])
    assert int(chunks) > 1, "the reply came in one piece: the page did not read the stream as it came"
    second = "And his boots?"
    replies = send(browser, second, turns=4)
    assert len(replies) == 2 and replies[0][0] == reply
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": second}]
    expected = ask({"messages": history, "max_tokens": 8, "temperature": 0})["choices"][0]
    assert replies[1][0] == expected["message"]["content"]
    assert int(browser.script("return document.getElementById('usage').dataset.cached")) > 0
