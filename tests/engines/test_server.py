"""serve.py's server, through the official `openai` client and raw HTTP: OpenAI's shapes streamed and whole,
greedy equal to cached.py's, 16 concurrent seeded streams each equal to the same request alone, cached tokens
on a chat's second turn, stop strings cut as OpenAI cuts them, every bad request a 4xx with OpenAI's error
JSON, a full server a 429, a hang-up cancelled in the engine, Ctrl-C and SIGTERM draining what is in flight.

    python -m pytest -q tests/engines/test_server.py

The server runs on the shipped holmes.pt in a thread (uvicorn.Server on a free localhost port), or as
`python -m engines.serve --port 0` in a process of its own for the signals. No assert depends on the machine's
speed: where what is in flight matters (16 at once, a full server, a hang-up) the test holds the engine's
steps at a gate instead of racing them, and every timeout is a hang guard only.
"""
import concurrent.futures
import http.client
import json
import logging
import re
import signal
import socket
import subprocess
import sys

import openai
import pytest
import torch

from helpers import ROOT, assert_refused, run_main
from support import command

from engines.serving.engine import StepClock
from servers import HANG_GUARD, Running, Watched, wait_for

SYSTEM = ("You are Sherlock Holmes, the consulting detective of Baker Street. Answer as he would, "
          "briefly, and name what you observe.")


@pytest.fixture(scope="module")
def server(pair):
    model, tokenizer = pair
    running = Running(Watched(model, tokenizer, max_rows=16), tokenizer, model.cfg.context, rows=16, queue_limit=16)
    yield running
    running.close()


@pytest.fixture(scope="module")
def gated(pair):
    """One row and room for one more request: two in flight fill it."""
    model, tokenizer = pair
    running = Running(Watched(model, tokenizer, max_rows=1), tokenizer, model.cfg.context, rows=1, queue_limit=1)
    yield running
    running.engine.gate.set()
    running.close()


def greedy_text(pair, prompt, n_tokens):
    model, tokenizer = pair
    ids = torch.tensor([tokenizer.encode(prompt)])
    return tokenizer.decode(model.generate_cached(ids, n_tokens)[0, ids.shape[1]:].tolist())


def test_the_models_list_names_the_served_model_and_health_says_ok(server):
    assert [m.id for m in server.client.models.list().data] == ["holmes"]
    status, health = server.http("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["rows"] == 16 and health["decode_steps"] == "eager"


def test_health_counts_the_engines_steps_and_their_phases_for_the_breakdown(server):
    before = server.http("GET", "/health")[1]
    server.client.completions.create(model="holmes", prompt="The night was", max_tokens=5, temperature=0)
    after = server.http("GET", "/health")[1]
    assert after["steps"] >= before["steps"] + 5  # a step a token at least
    assert list(after["step_seconds"]) == list(StepClock.PHASES)
    assert all(after["step_seconds"][p] >= before["step_seconds"][p] for p in StepClock.PHASES)
    assert after["decoding_steps"]["decode only"][0] >= before["decoding_steps"]["decode only"][0] + 4


def test_a_greedy_completion_is_cacheds_greedy_whole_and_streamed(server, pair):
    prompt, n = "The night was", 10
    expected = greedy_text(pair, prompt, n)
    whole = server.client.completions.create(model="holmes", prompt=prompt, max_tokens=n, temperature=0)
    assert whole.object == "text_completion" and whole.model == "holmes"
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(pair[1].encode(prompt)) and whole.usage.completion_tokens == n
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + n
    chunks = list(server.client.completions.create(model="any name", prompt=prompt, max_tokens=n, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_a_chat_stream_is_openais_chunks_and_says_what_the_whole_answer_says(server):
    ask = dict(model="holmes", messages=[{"role": "user", "content": "What do you observe?"}], max_tokens=8,
               seed=7, temperature=0.9, extra_body={"top_k": 40})
    whole = server.client.chat.completions.create(**ask)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(server.client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks) and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == []
    counts = [(u.prompt_tokens, u.completion_tokens, u.total_tokens) for u in (chunks[-1].usage, whole.usage)]
    assert counts[0] == counts[1]


def test_sixteen_concurrent_seeded_streams_each_equal_the_same_request_alone(server):
    prompts = ["The night was", "Holmes", "It is a capital mistake to theorize before one has data.", "Watson, come"]
    asks = [dict(prompt=prompts[i % 4] * (1 + i % 3), seed=100 + i, temperature=[0.7, 1.0, 1.3, 0][i % 4],
                 top_p=[1.0, 0.9][i // 8],
                 extra_body={"top_k": [0, 40][i % 2], "repetition_penalty": [1.0, 1.3][i % 3 == 0]})
            for i in range(16)]  # prompts of many lengths, each request with its own seed and knobs

    def run(ask):
        chunks = server.client.completions.create(model="holmes", max_tokens=6, stream=True, **ask)
        return [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks]

    alone = [run(ask) for ask in asks]
    server.engine.gate.clear()  # the steps wait until all 16 are in: they run together, not one after another
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = [pool.submit(run, ask) for ask in asks]
            wait_for(lambda: server.in_flight() == 16, "16 requests in flight")
            server.engine.gate.set()
            together = [f.result() for f in together]
    finally:
        server.engine.gate.set()
    assert together == alone


def test_a_chats_second_turn_reuses_its_first_turns_prompt_and_reply_and_says_what_a_fresh_engine_says(server, gated,
                                                                                                        pair):
    """Every full block of turn 1's prompt and reply (all its tokens but the last, which is never fed) is reused.
    Before: the reply, which begins "\n\n", came back stripped and was sent back after "Assistant: ", so turn 2
    parted from turn 1 right after the prompt (48 of the 64 here)."""
    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who rang the bell?"}]
    first = server.client.chat.completions.create(model="holmes", messages=turn, max_tokens=20, temperature=0)
    template = f"System: {SYSTEM}\nUser: Who rang the bell?\nAssistant:"  # the documented chat template
    assert first.usage.prompt_tokens == len(pair[1].encode(template))
    written = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the positions whose keys were made
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And what of the mud on his boots?"}]
    second = server.client.chat.completions.create(model="holmes", messages=turn, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    block = server.engine.block_size
    assert cached == written // block * block > first.usage.prompt_tokens // block * block, (written, second.usage)
    fresh = gated.client.chat.completions.create(model="holmes", messages=turn, max_tokens=6, temperature=0)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == fresh.choices[0].message.content


@pytest.mark.parametrize("max_tokens", [-1, 0, 254, 10**12])
def test_max_tokens_has_one_rule_naming_what_this_prompt_may_ask_for(server, max_tokens):
    status, answer = server.http("POST", "/v1/completions", {"prompt": "The night was", "max_tokens": max_tokens})
    assert status == 400 and answer["error"]["message"].startswith(f"max_tokens must be in 1..253, got {max_tokens}: "
                                                                   "this prompt's 3 tokens leave 253"), answer


def test_only_requests_with_the_same_cache_salt_see_each_others_cached_blocks(server):
    secret = "Holmes said that the bank's vault code was 4711, and Watson wrote it down at once in his book."
    usage = {}
    for who, salt in [("alice", "alice"), ("mallory", "mallory"), ("unsalted", None), ("alice again", "alice")]:
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        answer = server.client.completions.create(model="holmes", prompt=secret, max_tokens=1, temperature=0, **extra)
        usage[who] = answer.usage.prompt_tokens_details.cached_tokens
    assert usage["mallory"] == usage["unsalted"] == 0 and usage["alice again"] > 0, usage


def test_a_stop_string_ends_the_text_before_it_whole_and_streamed(server, pair):
    prompt = "The night was"
    text = greedy_text(pair, prompt, 12)
    stop = text.split()[2]  # a word from the middle, so the text before it is not empty
    before = text[:text.index(stop)]
    ask = dict(model="holmes", prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "never seen"])
    whole = server.client.completions.create(**ask)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (before, "stop")
    chunks = list(server.client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == before and chunks[-1].choices[0].finish_reason == "stop"


TOO_LONG = "It is a capital mistake to theorize before one has data. " * 40
BAD = [  # (what, path, body, the field the error names or None)
    ("bad JSON", "/v1/completions", b'{"prompt": "The night', None),
    ("not an object", "/v1/completions", b"[1, 2]", None),
    ("no prompt", "/v1/completions", {"max_tokens": 4}, "prompt"),
    ("a temperature that is text", "/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ("top_p past 1", "/v1/completions", {"prompt": "Hi", "top_p": 2}, "top_p"),
    ("negative max_tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
    ("max_tokens past the window", "/v1/completions", {"prompt": "Hi", "max_tokens": 10**12}, "max_tokens"),
    ("n=2", "/v1/completions", {"prompt": "Hi", "n": 2}, "n"),
    ("a frequency penalty", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "frequency_penalty": 0.5}, "frequency_penalty"),
    ("an unknown field", "/v1/completions", {"prompt": "Hi", "temprature": 0}, "temprature"),
    ("a stop that is a number", "/v1/completions", {"prompt": "Hi", "stop": 5}, "stop"),
    ("a prompt too long for the window", "/v1/completions", {"prompt": TOO_LONG, "max_tokens": 1}, "prompt"),
    ("a chat too long for the window", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 1}, "messages"),
    ("logprobs 0: the sampled tokens' own", "/v1/completions", {"prompt": "Hi", "logprobs": 0}, "logprobs"),
    ("a lone surrogate in a prompt", "/v1/completions", {"prompt": "Hi \ud800"}, "prompt"),
    ("a lone surrogate in a message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "\udfff"}]}, "messages[1]"),
    ("a lone surrogate in a stop", "/v1/completions", {"prompt": "Hi", "stop": ["\ud800"]}, "stop"),
    ("a lone surrogate in a field's name", "/v1/completions", {"prompt": "Hi", "\ud800": 1}, None),
    ("a cache_salt that is not a string", "/v1/completions", {"prompt": "Hi", "cache_salt": 5}, "cache_salt"),
    ("an empty cache_salt, which would be no salt", "/v1/completions", {"prompt": "Hi", "cache_salt": ""}, "cache_salt"),
    ("a message without a role", "/v1/chat/completions", {"messages": [{"content": "Hi"}]}, "messages[0]"),
    ("no messages", "/v1/chat/completions", {"messages": []}, "messages"),
    ("a message with a name", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "name": "W"}]},
     "messages[0]"),
    ("a message with tool calls", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "content": "", "tool_calls": []}]}, "messages[0]"),
    ("a prompt of more bytes than the window holds", "/v1/completions", {"prompt": "x" * 10**5}, "prompt"),
    ("a chat of more bytes than the window holds", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x" * 10**5}]}, "messages"),
    ("more token ids than the window", "/v1/completions", {"prompt": [1] * 300}, "prompt"),
    ("five stop strings", "/v1/completions", {"prompt": "Hi", "stop": list("abcde")}, "stop"),
    ("a stop string of 65 characters", "/v1/completions", {"prompt": "Hi", "stop": "x" * 65}, "stop"),
    ("JSON nested too deeply", "/v1/completions", b'{"prompt": ' + b"[" * 10**5 + b"]" * 10**5 + b"}", None),
    ("stream_options without a stream", "/v1/completions",
     {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("stream_options with an unknown key", "/v1/completions",
     {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True, "continuous_usage": True}},
     "stream_options"),
    ("include_usage that is not true or false", "/v1/completions",
     {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
]


@pytest.mark.parametrize("what, path, body, param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_is_a_400_with_openais_error_json(server, what, path, body, param):
    status, answer = server.http("POST", path, body)
    assert status == 400, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param
    assert "Traceback" not in answer["error"]["message"] and answer["error"]["message"]


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405),
                                                  ("DELETE", "/v1/models", 405)])
def test_a_wrong_route_or_method_is_a_4xx_with_openais_error_json(server, method, path, status):
    got, answer = server.http(method, path)
    assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}


def test_the_openai_client_raises_its_bad_request_error_naming_the_field(server):
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.completions.create(model="holmes", prompt="Hi", n=2)
    assert refused.value.status_code == 400 and refused.value.body["param"] == "n"


def test_a_full_server_answers_429_and_serves_those_in_flight(gated):
    gated.engine.gate.clear()  # the steps wait: two requests fill the one row and the one place in the queue
    try:
        ask = dict(model="holmes", prompt="The night was", max_tokens=3, temperature=0)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            in_flight = [pool.submit(gated.client.completions.create, **ask) for _ in range(2)]
            wait_for(lambda: gated.in_flight() == 2, "two requests in flight")
            with pytest.raises(openai.RateLimitError) as full:
                gated.client.completions.create(**ask)
            assert full.value.status_code == 429 and full.value.body["code"] == "queue_full"
            gated.engine.gate.set()
            assert [f.result().choices[0].finish_reason for f in in_flight] == ["length", "length"]
    finally:
        gated.engine.gate.set()


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "whole"])
def test_a_client_that_hangs_up_is_cancelled_and_its_row_serves_the_next_request(gated, stream):
    engine, max_tokens = gated.engine, 200
    engine.gate.clear()  # no token is made until the hang-up has been seen: it cannot finish first
    try:
        body = json.dumps({"model": "holmes", "messages": [{"role": "user", "content": "Speak"}], "stream": stream,
                           "max_tokens": max_tokens, "temperature": 0}).encode()
        connection = socket.create_connection(("127.0.0.1", gated.port), timeout=HANG_GUARD)
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json"
                           b"\r\nContent-Length: %d\r\n\r\n%s" % (gated.port, len(body), body))
        if stream:  # the role chunk comes before any token
            received = b""
            while b"data:" not in received:
                part = connection.recv(4096)
                assert part, received  # closed before the role chunk
                received += part
        wait_for(lambda: gated.in_flight() == 1, "the request in flight")
        cancels = len(engine.cancelled)
        connection.close()
        wait_for(lambda: gated.in_flight() == 0, "the hang-up to be seen")
    finally:
        engine.gate.set()
    wait_for(lambda: len(engine.cancelled) == cancels + 1, "the engine's cancel")
    after = gated.client.completions.create(model="holmes", prompt="The night was", max_tokens=2, temperature=0)
    assert after.choices[0].finish_reason == "length"
    hung_up = [e for e in engine.made if e.request_id == engine.cancelled[-1]]
    assert hung_up[-1].finish_reason == "cancelled" and hung_up[-1].completion_tokens < max_tokens
    assert not engine.has_work()


def test_a_client_gone_mid_body_is_let_go_without_an_error_in_the_log(gated):
    """Before: request.body() raised ClientDisconnect into the app, and uvicorn logged its traceback."""
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        state = gated.server.server_state
        connection = socket.create_connection(("127.0.0.1", gated.port), timeout=HANG_GUARD)
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json"
                           b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": " % gated.port)
        wait_for(lambda: state.tasks, "the request to reach the app")
        connection.close()
        wait_for(lambda: not state.tasks, "the request's task to end")
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not errors, [record.getMessage() for record in errors]
    assert gated.http("GET", "/health")[0] == 200


def refused_connection(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD).close()
        return False
    except ConnectionRefusedError:
        return True


def test_a_stop_takes_no_new_request_and_finishes_the_streams_in_flight_first(pair):
    model, tokenizer = pair
    running = Running(Watched(model, tokenizer, max_rows=1), tokenizer, model.cfg.context, rows=1, queue_limit=0)
    running.engine.gate.clear()  # the stream is in flight, and no token made, when the stop comes
    try:
        stream = running.client.chat.completions.create(model="holmes", messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=5, temperature=0, stream=True)
        first = next(stream)
        running.server.handle_exit(signal.SIGINT, None)  # what Ctrl-C does to uvicorn in a main thread
        wait_for(lambda: refused_connection(running.port), "the server to stop listening")
        running.engine.gate.set()
        rest = list(stream)
    finally:
        running.engine.gate.set()
        running.close()
    assert first.choices[0].delta.role == "assistant" and rest[-1].choices[0].finish_reason == "length"
    assert not running.thread.is_alive() and not running.engine.has_work()


@pytest.fixture
def serve_process():
    """`python -m engines.serve --port 0 --eager` started (compiling the shipped model's steps would take minutes; the
    compiled engine's tokens are test_serving_engine's), and (process, its base URL) once it says it is ready."""
    process = subprocess.Popen([sys.executable, "-m", "engines.serve", "--port", "0", "--rows", "2", "--eager"], cwd=ROOT,
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready = process.stdout.readline()  # the one line it prints once it listens (a hang guard: the pytest run)
        found = re.match(r"python -m engines\.serve: ready at (http://127\.0\.0\.1:\d+)/ \(holmes, 2 rows", ready)
        assert found, ready + process.stderr.read() if process.poll() is not None else ready
        yield process, found.group(1)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_serve_py_on_a_signal_finishes_its_stream_and_exits_0_saying_so(serve_process, sig):
    process, url = serve_process
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD)
    ask = {"prompt": "The night was", "max_tokens": 40, "temperature": 0, "stream": True}
    connection.request("POST", "/v1/completions", body=json.dumps(ask), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    first = response.readline()  # a token is out: the request is in flight
    assert first.startswith(b"data: {"), first
    process.send_signal(sig)
    rest = response.read().decode()
    events = [json.loads(line[6:]) for line in (first.decode() + rest).splitlines() if line.startswith("data: {")]
    assert rest.rstrip().endswith("data: [DONE]") and events[-1]["choices"][0]["finish_reason"] == "length"
    assert process.wait(HANG_GUARD) == 0
    err = process.stderr.read()
    assert "python -m engines.serve: stopping; finishing the" in err and "python -m engines.serve: stopped" in err, err
    assert "Traceback" not in err


def test_serve_py_on_sigterm_answers_a_half_sent_body_503_at_once_and_stops_quietly(serve_process):
    """Before: it waited its whole STOP_SECONDS for the rest of the body, then printed uvicorn's traceback of the
    cut. The 100 Continue says the app is reading the body (no race with the signal); the bound is a hang guard
    shorter than STOP_SECONDS, not a speed test."""
    from engines.serve import STOP_SECONDS
    process, url = serve_process
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "The night was", "max_tokens": 5}).encode()
    connection = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD)
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (port, len(body)))
    assert connection.recv(4096).startswith(b"HTTP/1.1 100 "), "the app never asked for the body"
    connection.sendall(body[:len(body) // 2])
    process.send_signal(signal.SIGTERM)
    assert process.wait(STOP_SECONDS // 2) == 0
    answer = b"".join(iter(lambda: connection.recv(4096), b""))
    assert answer.startswith(b"HTTP/1.1 503 ") and b'"code":"stopping"' in answer, answer
    err = process.stderr.read()
    assert "Traceback" not in err and all(line.startswith("python -m engines.serve: ") for line in err.splitlines()), err


def test_serve_py_on_a_second_ctrl_c_cuts_its_stream_and_exits_0(serve_process):
    """Before: the engine's thread, mid-step at exit, aborted the process ("terminate called without an active
    exception", exit 134)."""
    process, url = serve_process
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD)
    ask = {"prompt": "The night was", "max_tokens": 250, "temperature": 0, "stream": True}
    connection.request("POST", "/v1/completions", body=json.dumps(ask), headers={"Content-Type": "application/json"})
    assert connection.getresponse().readline().startswith(b"data: {")  # a token is out: the request is in flight
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGINT)
    assert process.wait(HANG_GUARD) == 0
    err = process.stderr.read()
    assert "python -m engines.serve: stopped" in err and "terminate called" not in err and "Traceback" not in err, err


def test_serve_refuses_a_port_in_use_or_out_of_range_in_one_line(monkeypatch, capsys):
    from engines import serve
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert_refused(run_main(command(serve.main), ["serve.py", "--port", port], monkeypatch, capsys),
                       f"cannot listen on 127.0.0.1:{port} (Address already in use); pick another with --port")
    assert_refused(run_main(command(serve.main), ["serve.py", "--port", 70000], monkeypatch, capsys),
                   "--port must be in 0..65535, got 70000")


@pytest.mark.parametrize("flags, message", [
    (["--rows", "0"], "--rows must be at least 1, got 0"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1, got 0"),
    (["--cache-mib", "-1"], "--cache-mib must be a whole number >= 0, got -1"),
    (["--dtype", "float16"], "float16 runs only on CUDA here; on the CPU use bfloat16"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "torch sees no CUDA GPU here; use 'cpu'")]))
def test_serve_refuses_a_size_it_cannot_run_in_one_line_before_it_loads_anything(flags, message, monkeypatch, capsys):
    from engines import serve
    assert_refused(run_main(command(serve.main), ["serve.py", "--port", "0", "--eager", *flags], monkeypatch, capsys), message)
