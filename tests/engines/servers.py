"""The server tests' helpers: engines/serving/server.py's app on uvicorn in a thread, the real engine behind a gate,
and a hang guard. No assert waits on the machine's speed: HANG_GUARD only ends a hang."""
import http.client
import json
import socket
import threading
import time

import openai
import uvicorn

from engines.serving.http_policy import allowed_hosts
from engines.serving.server import create_app
from engines.serving.engine import ServingEngine

HANG_GUARD = 120  # seconds: only a hang ever waits this long


def wait_for(condition, what):
    deadline = time.monotonic() + HANG_GUARD
    while not condition():
        assert time.monotonic() < deadline, f"waited {HANG_GUARD}s for {what}"
        time.sleep(0.02)


class Watched(ServingEngine):
    """The real engine with a gate before each step (closed, it holds the steps, so the test decides what is
    in flight instead of racing the machine's speed) and a record of its events and cancels."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.made, self.cancelled = threading.Event(), [], []
        self.gate.set()

    def step(self):
        self.gate.wait(HANG_GUARD)
        events = super().step()
        self.made += events
        return events

    def cancel(self, request_id):
        self.cancelled.append(request_id)
        super().cancel(request_id)


class Running:
    """create_app's server on uvicorn in a thread, on a free localhost port, serving the hosts serve.py
    serves there, and an openai client for it."""

    def __init__(self, engine, tokenizer, context, rows, queue_limit, api_key=None):
        self.engine = engine
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(engine, tokenizer, "holmes", context, rows, queue_limit,
                              allowed_hosts("127.0.0.1", self.port), api_key)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none",
                                    timeout=HANG_GUARD, max_retries=0)  # no retry: a 429 must reach the test

    def close(self):
        self.server.should_exit = True
        self.thread.join(HANG_GUARD)

    def request(self, method, path, body=None, headers=None):
        """(status, headers, body) of one raw request; body: a dict or list as JSON, anything else as it is (an
        iterator is sent chunked); headers beside Content-Type: application/json (None leaves a header out)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HANG_GUARD)
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        sent = {k: v for k, v in {"Content-Type": "application/json", **(headers or {})}.items() if v is not None}
        connection.request(method, path, body=data, headers=sent)
        response = connection.getresponse()
        answer = response.status, dict(response.getheaders()), response.read()
        connection.close()
        return answer

    def http(self, method, path, body=None, headers=None):
        """(status, JSON) of one raw request, as request() sends it."""
        status, _, answer = self.request(method, path, body, headers)
        return status, json.loads(answer)

    def in_flight(self):
        return self.http("GET", "/health")[1]["in_flight"]
