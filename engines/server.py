"""The OpenAI-compatible HTTP server over the continuous-batching engine (engines/serving.py), on Starlette.

    python serve.py [CHECKPOINT] [--host 127.0.0.1] [--port 8000]     # the entry point; this is its app

GET /v1/models, GET /health, GET / (the chat page, engines/chat.html), POST /v1/completions (the prompt
encoded as given, no template: temperature 0 gives cached.py's greedy tokens) and POST /v1/chat/completions
(CHAT_TEMPLATE), each streamed as server-sent events or answered whole. The fields: seed (absent: a fresh
one), temperature (0: greedy), top_p, top_k, repetition_penalty (the lesson's; OpenAI's frequency and
presence penalties are another thing, refused by name unless 0), stop (a string or a list), max_tokens or
max_completion_tokens, stream and stream_options.include_usage; model may name anything, answers name the
served one; n and best_of only 1 (NOT_OFFERED lists the rest). They are read once here (read_request),
their values checked by the engine's submit; a refusal is OpenAI's error JSON with a 4xx status (429 when
the server is full). The engine is single-threaded: EngineLoop runs it in one thread, the only one that
touches it, and hands each step's events to the requests waiting on the event loop; a request whose client
hangs up is cancelled there, freeing its row at the next step. tests/engines/test_server.py runs it through the
official `openai` client.
"""
import asyncio
import concurrent.futures
import contextlib
import functools
import json
import os
import queue
import secrets
import threading
import time
import traceback
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from errors import BadValue
from engines.http_policy import HttpPolicy, Refused
from engines.serving import Request as EngineRequest

CHAT_PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.html")
CHAT_TEMPLATE = """One line a message, its role's name, a colon, a space and its content ("System: ...", "User: ...",
"Assistant: ..."; "developer" reads as System), joined by newlines, then a last line "Assistant:" for the
model to go on from. A message whose content holds a line that begins with a role's name and a colon is
refused: it would read as a message of that role, so one text could speak for others. The reply ends at
max_tokens, at a stop string, or where the model begins a line of a role (the server adds ROLE_LINES to the
stops, so a reply sent back as history is never refused); the whitespace before its first character (the
space after "Assistant:") is dropped, so the reply sent back as history reads as the model wrote it."""
ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
ROLE_LINES = [f"\n{name}:" for name in ("System", "User", "Assistant")]
MAX_STOPS, MAX_STOP_CHARS = 4, 64  # OpenAI's 4 stop strings; every token is checked against each
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is what the window has left
NUMBER, WHOLE = (int, float), (int,)
# Every field a request may carry: its JSON types and its default (where absent or null). `model`: any name is
# accepted, answers name the served model; user, metadata, store, parallel_tool_calls: bookkeeping, unused.
FIELDS = {"model": ((str,), None), "stream": ((bool,), False), "stream_options": ((dict,), {}),
          "max_tokens": (WHOLE, None), "max_completion_tokens": (WHOLE, None), "seed": (WHOLE, None),
          "temperature": (NUMBER, 1.0), "top_p": (NUMBER, 1.0), "top_k": (WHOLE, 0),
          "repetition_penalty": (NUMBER, 1.0),
          "stop": ((str, list), []), "user": ((str,), None), "metadata": ((dict,), None), "store": ((bool,), None),
          "parallel_tool_calls": ((bool,), None)}
TYPE_NAMES = {NUMBER: "a number", WHOLE: "a whole number", (str,): "a string", (bool,): "true or false",
              (dict,): "an object", (str, list): "a string or a list of strings"}
PENALTIES = ("this model's knob is repetition_penalty (a repeated token's score divided by it if positive, "
             "multiplied if negative), not OpenAI's subtracted penalties; send repetition_penalty instead")
# OpenAI's fields this server does not offer: the values that ask for nothing (accepted), and why others are refused.
NOT_OFFERED = {"n": ((1,), "one choice a request; send n requests, each with its own seed"),
               "best_of": ((1,), "one choice a request; send several requests, each with its own seed"),
               "frequency_penalty": ((0,), PENALTIES), "presence_penalty": ((0,), PENALTIES),
               "logprobs": ((False, 0), "log probabilities are not returned"),
               "top_logprobs": ((0,), "log probabilities are not returned"), "echo": ((False,), "no echo"),
               "suffix": (("",), "no insertion mode"), "logit_bias": (({},), "no logit bias; use stop, top_k or top_p"),
               "tools": (([],), "the model has no tools"), "tool_choice": (("none", "auto"), "the model has no tools"),
               "response_format": (({"type": "text"},), "plain text only")}


def refusal(error):
    """A BadValue (the engine's, the tokenizer's) as a 400; the field its message begins with is the param."""
    message = str(error)
    name = message.split(" ", 1)[0]
    if name == "penalty":  # the engine's name for this server's repetition_penalty
        message, name = "repetition_" + message, "repetition_penalty"
    return Refused(message, name if name in FIELDS else None)


def shown(value):
    return json.dumps(value)[:80]


def asks_nothing(value, allowed):
    """Whether a NOT_OFFERED field's value is one that asks for nothing (0 is 0.0, but true is not 1)."""
    return value is None or any(value is v or value == v and type(value) is not bool for v in allowed)


def read_request(body, prompt_field):
    """The JSON body's fields as {name: value}: each known, of its type, or Refused naming it."""
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object")
    if prompt_field not in body:
        raise Refused(f"'{prompt_field}' is required", prompt_field)
    for name, value in body.items():
        if name in NOT_OFFERED and not asks_nothing(value, NOT_OFFERED[name][0]):
            raise Refused(f"{name}={shown(value)} is not offered: {NOT_OFFERED[name][1]}", name)
        if name in FIELDS and value is not None and type(value) not in FIELDS[name][0]:
            raise Refused(f"{name} must be {TYPE_NAMES[FIELDS[name][0]]}, got {shown(value)}", name)
        if name not in (prompt_field, *FIELDS, *NOT_OFFERED):
            known = sorted([prompt_field, *FIELDS, *NOT_OFFERED])
            raise Refused(f"unknown field {name!r}; the fields are {known}", name)
    fields = {name: default if body.get(name) is None else body[name] for name, (_, default) in FIELDS.items()}
    for name in (n for n, (kinds, _) in FIELDS.items() if kinds is NUMBER):
        try:
            fields[name] = float(fields[name])  # the engine's knobs are floats; JSON may say 1 or 1e999
        except OverflowError:
            raise Refused(f"{name} {shown(fields[name])} is too large for a number", name) from None
    if fields["max_tokens"] is not None and fields["max_completion_tokens"] is not None:
        raise Refused("give max_tokens or max_completion_tokens (the same thing), not both", "max_completion_tokens")
    fields["max_tokens"] = fields["max_completion_tokens"] if fields["max_tokens"] is None else fields["max_tokens"]
    stops = [fields["stop"]] if isinstance(fields["stop"], str) else fields["stop"]
    if not all(isinstance(s, str) and s for s in stops):
        raise Refused(f"stop must be a non-empty string or a list of them, got {shown(fields['stop'])}", "stop")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise Refused(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    options = fields["stream_options"]
    if options and not fields["stream"]:
        raise Refused('stream_options is for a stream only ("stream": true)', "stream_options")
    if set(options) - {"include_usage"} or any(type(v) is not bool for v in options.values()):
        raise Refused(f'stream_options takes {{"include_usage": true or false}} alone, got {shown(options)}',
                      "stream_options")
    return {**fields, prompt_field: body[prompt_field], "stop": stops}


def chat_prompt(messages):
    """The text CHAT_TEMPLATE makes of OpenAI's messages."""
    if not isinstance(messages, list) or not messages:
        raise Refused('messages must be a non-empty list of {"role", "content"} objects', "messages")
    lines = []
    for i, message in enumerate(messages):
        role, content = (message.get("role"), message.get("content")) if isinstance(message, dict) else (None, None)
        if unknown := sorted(set(message) - {"role", "content"}) if isinstance(message, dict) else None:
            raise Refused(f"messages[{i}].{unknown[0]} is not offered: a message is its role and content alone",
                          f"messages[{i}]")
        if isinstance(content, list):  # OpenAI's content parts: text parts only
            parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
            content = "".join(parts) if all(isinstance(p, str) for p in parts) else None
        if role not in ROLES or not isinstance(content, str):
            raise Refused(f'messages[{i}] must be {{"role": one of {sorted(ROLES)}, "content": text}}, got '
                          f"{shown(message)}", f"messages[{i}]")
        if forged := min((line for line in ROLE_LINES if line in content), key=content.index, default=None):
            raise Refused(f"messages[{i}]'s content holds a line that begins {forged[1:]!r}, which would read as a "
                          "message of that role; send it as a message of its own, or begin the line otherwise",
                          f"messages[{i}]")
        lines.append(f"{ROLES[role]}: {content}")
    return "\n".join(lines + ["Assistant:"])


def usage(event):
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}


class EngineLoop:
    """The engine's one thread: it empties an inbox (submit, cancel, stop) before each step and hands the
    step's events to their requests' asyncio queues on the event loop. A request is in flight, counted
    against the limit, from its arrival to its last event or its hang-up."""

    def __init__(self, engine, in_flight_limit):
        self.engine, self.in_flight_limit = engine, in_flight_limit
        self.inbox, self.queues, self.failed = queue.SimpleQueue(), {}, None
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)

    def start(self):
        self.loop = asyncio.get_running_loop()
        self.thread.start()

    def stop(self):
        self.inbox.put(("stop", None, None))
        self.thread.join()

    def run(self):
        while True:
            item = self.next_item(wait=not self.engine.has_work())
            while item is not None:
                kind, payload, done = item
                if kind == "stop":
                    return
                try:
                    getattr(self.engine, kind)(payload)  # submit, cancel or use_compiled
                    done.set_result(None)
                except Exception as e:  # a BadValue: the request's values; anything else a bug, answered as one
                    done.set_exception(e)
                item = self.next_item(wait=False)
            if self.engine.has_work():
                try:
                    events = self.engine.step()
                except Exception as e:  # a bug, or memory: every waiting request is told, none left hanging
                    traceback.print_exc()
                    self.failed = f"the engine failed ({type(e).__name__}: {e}); restart the server"
                    self.loop.call_soon_threadsafe(self.fail_all)
                    return
                try:
                    self.loop.call_soon_threadsafe(self.deliver, events)
                except RuntimeError:  # the event loop is closed: a forced exit, with nobody left to deliver to
                    return

    def next_item(self, wait):
        try:
            return self.inbox.get(block=wait)
        except queue.Empty:
            return None

    def deliver(self, events):
        for event in events:
            if event.request_id in self.queues:
                self.queues[event.request_id].put_nowait(event)
                if event.finish_reason is not None:
                    del self.queues[event.request_id]

    def fail_all(self):
        for waiting in self.queues.values():
            waiting.put_nowait(None)
        self.queues.clear()

    def cancel(self, request_id):
        self.inbox.put(("cancel", request_id, concurrent.futures.Future()))

    def use_compiled(self, compile_cache):
        """Have the engine's thread load the compiled decode steps kept in compile_cache between two steps
        (ServingEngine.use_compiled); a future, done once they run. The engine's own thread, not this one: torch's
        and the compiled programs' threads then serve one caller (loaded from another, they made every step slower)."""
        done = concurrent.futures.Future()
        self.inbox.put(("use_compiled", compile_cache, done))
        return done

    async def submit(self, request):
        """Admit a request: an async iterator of its events, or Refused (a full server, a value refused)."""
        if self.failed:
            raise Refused(self.failed, status=503, kind="server_error", code="engine_failed")
        if len(self.queues) >= self.in_flight_limit:
            raise Refused(f"the server is full ({self.in_flight_limit} requests in flight, running or waiting for "
                          "a row); try again shortly", status=429, kind="rate_limit_error", code="queue_full")
        waiting = self.queues[request.id] = asyncio.Queue()
        done = concurrent.futures.Future()
        self.inbox.put(("submit", request, done))
        try:
            await asyncio.wrap_future(done)
        except BaseException as e:
            self.queues.pop(request.id, None)
            if isinstance(e, asyncio.CancelledError):  # gone before it was admitted
                self.cancel(request.id)
            raise refusal(e) if isinstance(e, BadValue) else e from None
        return self.events(request.id, waiting)

    async def events(self, request_id, waiting):
        """The request's events up to its last; closed before it (a hang-up), it cancels the request."""
        finished = False
        try:
            while not finished:
                event = await waiting.get()
                if event is None:
                    raise Refused(self.failed, status=503, kind="server_error", code="engine_failed")
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished and self.queues.pop(request_id, None) is not None:
                self.cancel(request_id)  # the client went away: its row is freed at the engine's next step


async def texts(events, chat):
    """(text, event) for each event; a chat reply without the whitespace before its first character."""
    started = not chat
    async for event in events:
        text = event.text if started else event.text.lstrip()  # whole characters stay whole
        started = started or bool(text)
        yield text, event


def sse(data):
    return f"data: {json.dumps(data)}\n\n"


def create_app(engine, tokenizer, model_id, context, rows, queue_limit, hosts, api_key=None):
    """The Starlette app serving `engine` (a ServingEngine of `rows` rows, run by an EngineLoop that lets
    queue_limit more requests wait) as `model_id`, a model of `context` positions, behind engines/http_policy.py's
    rules: hosts, http_policy.allowed_hosts(); api_key, the key every request needs (None: none)."""
    loop = EngineLoop(engine, rows + queue_limit)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.stop()  # after uvicorn has drained the requests in flight

    most_bytes = (context - 1) * max(map(len, tokenizer.vocab))  # a longer text takes at least `context` tokens

    def prompt_ids(fields):
        """The chat template's tokens, or /v1/completions' prompt: a string or token ids, or either alone in a list."""
        prompt = chat_prompt(fields["messages"]) if "messages" in fields else fields["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if (size := len(prompt.encode())) > most_bytes:
                raise Refused(f"the prompt is {size} bytes; more than {most_bytes} can never fit the model's "
                              f"{context}-token window", "messages" if "messages" in fields else "prompt")
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and len(prompt) >= context:
            raise Refused(f"the prompt is {len(prompt)} token ids; at most {context - 1} fit the model's window", "prompt")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt  # the engine checks each id against the vocabulary
        raise Refused("prompt must be a string or a list of token ids (one prompt a request)", "prompt")

    def parsed(data, chat):
        """The request's fields and its prompt's token ids, or Refused: CPU work, run off the event loop."""
        try:  # a deep nesting raises RecursionError in json's loads and dumps (a refused value is shown)
            try:
                body = json.loads(data)
            except (ValueError, UnicodeDecodeError) as e:
                raise Refused(f"the request body is not valid JSON ({e})") from None
            fields = read_request(body, "messages" if chat else "prompt")
            return fields, prompt_ids(fields)
        except RecursionError:
            raise Refused("the request body is nested too deeply") from None

    async def answer(request, chat):
        try:
            data = await request.body()
        except ClientDisconnect:  # gone mid-body: nobody to answer
            return Response(status_code=499)
        fields, ids = await asyncio.to_thread(parsed, data, chat)
        stops = fields["stop"] + (ROLE_LINES if chat else [])
        max_tokens = fields["max_tokens"]
        if max_tokens is None:
            max_tokens = max(context - len(ids), 1) if chat else COMPLETION_DEFAULT_TOKENS
        if max_tokens > context:  # said before the engine's memory check, which would not name the field
            raise Refused(f"max_tokens {max_tokens} is more than the model's {context}-token window", "max_tokens")
        job = EngineRequest(id=uuid.uuid4().hex, prompt=ids, max_tokens=max_tokens, stop=stops,
                            seed=secrets.randbits(63) if fields["seed"] is None else fields["seed"],  # OpenAI's: fresh
                            temperature=fields["temperature"], top_k=fields["top_k"], top_p=fields["top_p"],
                            penalty=fields["repetition_penalty"])
        events = await loop.submit(job)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "created": int(time.time()), "model": model_id}
        if fields["stream"]:
            with_usage = fields["stream_options"].get("include_usage") is True
            return StreamingResponse(stream(head, chat, events, with_usage), media_type="text/event-stream")
        whole, hung_up = asyncio.ensure_future(collect(events, chat)), asyncio.ensure_future(disconnected(request))
        await asyncio.wait((whole, hung_up), return_when=asyncio.FIRST_COMPLETED)
        hung_up.cancel()
        if not whole.done():  # cancelling the collection closes `events`, which cancels the request
            whole.cancel()
            return Response(status_code=499)  # nginx's "client closed request": nobody is there to read it
        text, last = whole.result()
        choice = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**head, "object": kind, "choices": [choice], "usage": usage(last)})

    async def collect(events, chat):
        whole = ""
        async for text, last in texts(events, chat):
            whole += text
        return whole, last

    async def disconnected(request):
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def stream(head, chat, events, with_usage):
        """A chunk for each event with text (chat: a chunk with the role first), one with the finish_reason,
        one with the usage if asked for (choices empty; the others' usage is null), then [DONE]."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(text="", finish_reason=None, role=None):
            part = {"delta": {"role": role} if role else {"content": text} if text else {}} if chat else {"text": text}
            return sse({**head, "choices": [{"index": 0, **part, "logprobs": None, "finish_reason": finish_reason}],
                        "usage": None})
        if chat:
            yield chunk(role="assistant")
        try:
            async for text, event in texts(events, chat):
                if text:
                    yield chunk(text)
                if event.finish_reason is not None:
                    yield chunk(finish_reason=event.finish_reason)
                    if with_usage:
                        yield sse({**head, "choices": [], "usage": usage(event)})
        except Refused as e:  # the engine failed mid-stream: the openai client raises on a chunk holding "error"
            yield sse(e.body())
        yield "data: [DONE]\n\n"

    async def models(request):
        card = {"id": model_id, "object": "model", "created": 0, "owned_by": "tiny-gpt", "max_model_len": context}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request):
        steps = "compiled" if engine.runner.steps.compile else "eager"
        return JSONResponse({"status": "failed" if loop.failed else "ok", "model": model_id, "rows": rows,
                             "in_flight": len(loop.queues), "decode_steps": steps, "steps": engine.clock.steps,
                             "step_seconds": dict(engine.clock.seconds),
                             "decoding_steps": {kind: list(v) for kind, v in engine.clock.decoding.items()}},
                            status_code=503 if loop.failed else 200)

    async def page(request):
        return FileResponse(CHAT_PAGE, media_type="text/html")

    async def refused(request, error):
        if isinstance(error, BadValue):  # the engine's or the tokenizer's refusal of a value
            error = refusal(error)
        elif isinstance(error, HTTPException):  # Starlette's: no such route, or not that method
            message = {404: f"no route {request.url.path}; the routes are GET /, /health and /v1/models, POST "
                            "/v1/completions and /v1/chat/completions",
                       405: f"{request.url.path} does not take {request.method}"}.get(error.status_code, error.detail)
            error = Refused(message, status=error.status_code,
                            kind="not_found_error" if error.status_code == 404 else "invalid_request_error")
        elif not isinstance(error, Refused):  # a bug: said without a traceback (the server's log has it)
            error = Refused("internal error; the server's log has the traceback", status=500, kind="server_error")
        return JSONResponse(error.body(), status_code=error.status)

    routes = [Route("/", page), Route("/health", health), Route("/v1/models", models),
              Route("/v1/completions", functools.partial(answer, chat=False), methods=["POST"]),
              Route("/v1/chat/completions", functools.partial(answer, chat=True), methods=["POST"])]
    handlers = {kind: refused for kind in (Refused, BadValue, HTTPException, Exception)}
    with open(CHAT_PAGE, encoding="utf-8") as f:
        policy = Middleware(HttpPolicy, hosts=hosts, api_key=api_key, page=f.read())
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=[policy])
    app.state.engine_loop = loop
    return app
