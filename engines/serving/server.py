"""The OpenAI-compatible HTTP server over the continuous-batching engine (engines/serving/engine.py), on Starlette.

    python -m engines.serve [CHECKPOINT] [--host 127.0.0.1] [--port 8000]     # the entry point; this is its app

GET /v1/models, GET /health, GET / (the chat page, engines/serving/chat.html), POST /v1/completions (the prompt
encoded as given, no template: temperature 0 gives cached.py's greedy tokens) and POST /v1/chat/completions
(openai_request.CHAT_TEMPLATE), each streamed as server-sent events or answered whole. A request's fields are
read once (engines/serving/openai_request.py), their values checked by the engine's submit; a refusal is OpenAI's
error JSON with a 4xx status (429 when the server is full). The engine is single-threaded: EngineLoop runs it
in one thread, the only one that touches it, and hands each step's events to the requests waiting on the
event loop; a request whose client hangs up is cancelled there, freeing its row at the next step.
tests/engines/test_server.py runs it through the official `openai` client.
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

from engines.edge.errors import BadValue
from engines.serving.http_policy import HttpPolicy, Refused
from engines.serving.openai_request import COMPLETION_DEFAULT_TOKENS, ROLE_LINES, chat_prompt, read_request, refusal
from engines.serving.engine import Request as EngineRequest

CHAT_PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat.html")


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
        self.stopping = asyncio.Event()  # set as the server stops: a body still arriving is not waited for
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

    async def unless_stopping(self, work):
        """What the awaitable `work` gives, or a 503 once the server stops first (a client that holds its body
        half-sent would otherwise hold the stop)."""
        work, stop = asyncio.ensure_future(work), asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait((work, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not work.done():
            work.cancel()
            raise Refused("the server is stopping; send the request again once it is back", status=503,
                          kind="server_error", code="stopping")
        return work.result()

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
            raise
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
    """(text, event) for each event; a chat reply without its first character where that is a space, which
    chat_prompt puts back (openai_request.CHAT_TEMPLATE)."""
    started = not chat
    async for event in events:
        text = event.text if started else event.text.removeprefix(" ")
        started = started or bool(event.text)
        yield text, event


def sse(data):
    return f"data: {json.dumps(data)}\n\n"


def create_app(engine, tokenizer, model_id, context, rows, queue_limit, hosts, api_key=None):
    """The Starlette app serving `engine` (a ServingEngine of `rows` rows, run by an EngineLoop that lets
    queue_limit more requests wait) as `model_id`, a model of `context` positions, behind engines/serving/http_policy.py's
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
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt  # the engine checks their count against the window, each against the vocabulary
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
            data = await loop.unless_stopping(request.body())
        except ClientDisconnect:  # gone mid-body: nobody to answer
            return Response(status_code=499)
        fields, ids = await asyncio.to_thread(parsed, data, chat)
        stops = fields["stop"] + (ROLE_LINES if chat else [])
        room = context - len(ids)  # OpenAI's default max_tokens: what the prompt leaves of the window
        max_tokens = fields["max_tokens"]
        if max_tokens is None:
            max_tokens = room if chat else min(COMPLETION_DEFAULT_TOKENS, room)
        job = EngineRequest(id=uuid.uuid4().hex, prompt=ids, max_tokens=max_tokens, stop=stops,
                            seed=secrets.randbits(63) if fields["seed"] is None else fields["seed"],  # OpenAI's: fresh
                            temperature=fields["temperature"], top_k=fields["top_k"], top_p=fields["top_p"],
                            penalty=fields["repetition_penalty"], cache_salt=fields["cache_salt"])
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
        """The status; with the key (or on a server without one) the load too, which moves with others' requests."""
        status, steps = {"status": "failed" if loop.failed else "ok"}, "compiled" if engine.runner.compile else "eager"
        if request.scope["with_key"]:
            status |= {"model": model_id, "rows": rows, "in_flight": len(loop.queues), "decode_steps": steps,
                       "steps": engine.clock.steps, "step_seconds": dict(engine.clock.seconds),
                       "decoding_steps": {kind: list(v) for kind, v in engine.clock.decoding.items()}}
        return JSONResponse(status, status_code=503 if loop.failed else 200)

    async def page(request):
        return FileResponse(CHAT_PAGE, media_type="text/html")

    async def refused(request, error):
        if isinstance(error, BadValue):  # the engine's or the tokenizer's refusal of a value
            error = refusal(error, chat=request.url.path == "/v1/chat/completions")
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
