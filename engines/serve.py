"""Serve the checkpoint to many users at once: an OpenAI-compatible HTTP server and a chat page.

    pip install -r requirements.txt -r engines/requirements.txt
    python -m engines.serve [CHECKPOINT] [--host 127.0.0.1] [--port 8000] [--api-key-file PATH] [--allow-host NAME]
                    [--rows 16] [--cache-mib MIB] [--queue 64] [--prefill-chunk 128] [--eager] [--compile-cache DIR]
                    [--device cpu|cuda] [--dtype float32|bfloat16|float16]

then open http://127.0.0.1:8000/ for the chat page, or point any OpenAI client at it:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.completions.create(model="holmes", prompt="The night was", max_tokens=20, temperature=0)

Requests run on engines/serving/engine.py's continuous-batching engine (--rows of them decoding together, the
rest waiting, up to --queue; one more is answered 429), whose prefix cache keeps requests' keys and values
within --cache-mib, so a chat's next turn prefills only its new tokens. On a CPU it serves within seconds
on its eager decode steps; the compiled ones are made in a process of their own (about ten minutes on 2
cores the first time, every way worth trying timed; loaded from the compile cache after) and swapped in
between two steps, the tokens unchanged, a line on stderr saying when. On CUDA (--device cuda) each size's
step is compiled and captured as a CUDA graph before the ready line (seconds a size). --eager (or no C++
compiler here) keeps them eager, several times slower under load. The HTTP side is engines/serving/server.py's, its
fields and chat template engines/serving/openai_request.py's; who may use it (the Host and Origin a request names,
the key, the body's size) engines/serving/http_policy.py's.
One line says when the server is ready; Ctrl-C (or SIGTERM) stops taking requests, answers 503 to those whose
body is still arriving, finishes those in flight (for at most STOP_SECONDS: a client that stalls cannot hold
the stop) and exits.
"""
import errno
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time

from engines.edge.cli import (Parser, check_count, check_fits, check_least, check_within, device_from, is_loopback,
                              run_cli, script_name)
from engines.edge.errors import BadValue, CompileFailed
from engines.edge.files import check_input

from engines.edge.checkpoint import load_pair
from engines.edge.checks import cache_bytes
from engines.export import peers
from engines.serving.engine import SERVED_DTYPES

BLOCK_SIZE = 16  # tokens a cache block holds: small blocks suit a 256-token window
KEY_VARIABLE = "TINY_GPT_API_KEY"  # the key where no other user can read it, unlike a flag (ps, /proc/PID/cmdline)
STOP_SECONDS = 60  # a stop waits this long for the requests in flight: a full window of tokens takes far less


def say(line):
    print(f"{script_name()}: {line}", file=sys.stderr, flush=True)


def listening_socket(host, port):
    """A socket bound to host:port and listening (port 0: a free one), or a one-line refusal."""
    check_within("--port", port, 0, 65535)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may bind while old sockets linger
        sock.bind((host, port))
    except socket.gaierror as e:
        raise BadValue(f"--host {host!r} is not an address this machine knows ({e.strerror})") from None
    except OSError as e:
        hint = "; pick another with --port" if e.errno == errno.EADDRINUSE else ""
        raise BadValue(f"cannot listen on {host}:{port} ({e.strerror}){hint}") from None
    sock.listen(2048)
    return sock


def read_api_key(args):
    """The key from --api-key, --api-key-file or $TINY_GPT_API_KEY (one of them), or None; refused in one line
    unless it is printable ASCII without spaces, which an Authorization header carries exactly."""
    sources = {"--api-key": args.api_key, "--api-key-file": args.api_key_file,
               f"${KEY_VARIABLE}": os.environ.get(KEY_VARIABLE), "--no-api-key": args.no_api_key or None}
    given = {name: value for name, value in sources.items() if value is not None}
    if len(given) > 1:
        raise BadValue(f"give one of {', '.join(sources)}, got {' and '.join(given)}")
    source, key = next(iter(given.items()), (None, None))
    if source == "--api-key-file":
        if os.path.exists(key):  # a FIFO or a device would block the start for good (a missing file: open's line)
            check_input(key, "--api-key-file", 2**20)
        try:
            with open(key, encoding="utf-8", errors="replace") as f:
                key = f.read(4097).removesuffix("\n").removesuffix("\r")
        except OSError as e:
            raise BadValue(f"--api-key-file {args.api_key_file!r} cannot be read ({e.strerror})") from None
    if source in (None, "--no-api-key"):
        return None
    if not 1 <= len(key) <= 4096 or not all("!" <= c <= "~" for c in key):
        raise BadValue(f"the key from {source} must be 1 to 4096 printable ASCII characters without spaces "
                       "(a client sends it in an HTTP header exactly)")
    return key


def add_key_flags(ap):
    """A server's key flags: --api-key-file, --api-key and --no-api-key (served_key reads them)."""
    ap.add_argument("--api-key-file", metavar="PATH",
                    help=f"a file holding the key every request but the page and /health must send as "
                         f"'Authorization: Bearer KEY' (an OpenAI client's api_key); or set ${KEY_VARIABLE}")
    ap.add_argument("--api-key", metavar="KEY", help="the key on the command line, where every local user can read "
                                                     "it (ps, /proc): prefer --api-key-file or $" + KEY_VARIABLE)
    ap.add_argument("--no-api-key", action="store_true",
                    help="beyond loopback, serve without a key: anyone who reaches the address may use it")


def served_key(args):
    """The key every client must send (read_api_key), or None. Beyond loopback (--host) there must be one, unless
    --no-api-key opens the server to anyone, which is said on stderr. engines.scale.vllm_peer serve asks the same."""
    key = read_api_key(args)
    if not is_loopback(args.host) and key is None:
        if not args.no_api_key:
            raise BadValue(f"--host {args.host} listens beyond this machine, where anyone may reach it: give it a key "
                           f"(--api-key-file PATH or ${KEY_VARIABLE}; every client sends it), or say --no-api-key")
        say(f"no API key (--no-api-key): anyone who reaches {args.host}:{args.port} may use this server")
    return key


def keep_compiled_steps(checkpoint, tokenizer_path, dtype, rows, compile_cache):
    """In a process of its own: the serving engine's decode steps compiled into compile_cache, or found kept."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to answer: it ends this process
    os.nice(10)  # the server's own threads first
    from engines.serving.engine import ServingEngine
    model, tokenizer = load_pair(checkpoint, tokenizer_path)
    model = model.to(dtype)
    try:
        ServingEngine(model, tokenizer, max_rows=rows, compile=True, compile_cache=compile_cache)
    except CompileFailed as e:
        sys.exit(f"{script_name()}: {e}; the decode steps stay eager")


def swap_in_compiled(engine_loop, compiling, compile_cache):
    """Once the process `compiling` has kept the compiled decode steps, have the engine load them."""
    started = time.monotonic()
    compiling.join()
    if compiling.exitcode != 0:  # it said why, or the server stopped it
        return
    engine_loop.use_compiled(compile_cache).result()
    say(f"the compiled decode steps serve from now on (ready {time.monotonic() - started:.0f} s after the server; "
        "the same tokens as the eager ones)")


def serve(app, sock, ready_line, compiling=None):
    """Run the app on uvicorn until Ctrl-C or SIGTERM; in flight requests are finished first, and the process
    `compiling` (if any) is ended."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(ready_line, flush=True)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            if self.force_exit:  # Ctrl-C again: what is in flight is cut off, and uvicorn's log of each cut is noise
                logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)

        async def shutdown(self, sockets=None):
            in_flight = len(app.state.engine_loop.queues)
            say(f"stopping; finishing the {in_flight} request(s) in flight, for {STOP_SECONDS} s at most "
                "(Ctrl-C again cuts them off)")
            app.state.engine_loop.stopping.set()  # a request whose body is still arriving is answered 503
            await super().shutdown(sockets)

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=STOP_SECONDS, lifespan="on")
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the signal it caught again once it has stopped
        pass
    engine_loop = app.state.engine_loop
    if engine_loop.thread.is_alive():  # a forced exit skips the lifespan's stop: a step cut off at exit aborts
        engine_loop.stop()
    if compiling is not None and compiling.is_alive():
        compiling.terminate()
        compiling.join()
    say("stopped")


def main():
    ap = Parser(description="An OpenAI-compatible server and a chat page on the continuous-batching engine.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface; "
                                                         "beyond loopback a key is needed, or --no-api-key)")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free one (the ready line names it)")
    add_key_flags(ap)
    ap.add_argument("--allow-host", metavar="NAME[:PORT]", action="append", default=[],
                    help="a name clients reach the server by, beside localhost's (repeat for more); a request "
                         "naming another Host is refused (it stops DNS rebinding; it is not access control)")
    ap.add_argument("--rows", type=int, default=16, help="requests decoding together, one row each")
    ap.add_argument("--cache-mib", type=int, default=None,
                    help="memory for the prefix cache's blocks, in MiB, beside the rows' own (default: as much as "
                         "the rows hold, every row at the full window)")
    ap.add_argument("--queue", type=int, default=64, help="requests that may wait for a row; one more is answered 429")
    ap.add_argument("--prefill-chunk", type=int, default=128,
                    help="prompt tokens computed a step beside the decoding rows (more: a prompt's first token "
                         "sooner, the running rows' next later)")
    ap.add_argument("--eager", action="store_true",
                    help="keep the decode step eager: no compiling (by default the compiled steps, made in the "
                         "background the first time, minutes, then loaded from the compile cache, take over)")
    ap.add_argument("--compile-cache", metavar="DIR", default=None,
                    help="where compiled decode steps are kept (default: $XDG_CACHE_HOME/tiny-gpt or ~/.cache/tiny-gpt)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    ap.add_argument("--dtype", default="float32", choices=SERVED_DTYPES,
                    help="weights and cache (float16: CUDA only); at float32 each request's tokens are the lesson "
                         "Engine's for it alone, in a narrower type the batch's shape can move them")
    args = ap.parse_args()
    check_count("--queue", args.queue)
    check_count("--cache-mib", args.cache_mib or 0)
    check_least("--rows", args.rows, 1)
    check_least("--prefill-chunk", args.prefill_chunk, 1)
    for package in ("uvicorn", "starlette"):  # one missing is said in one line naming the requirements file
        peers.engine(package)
    from engines.serving.blocks import blocks_for_bytes, blocks_per_row
    from engines.fast.compile_cache import check_compile_cache
    from engines.fast.compile_ways import compiler_missing
    from engines.fast.engine import check_dtype, slower_than_float32
    from engines.serving.runner import compiles_in_process
    from engines.serving.http_policy import allowed_hosts
    from engines.serving.server import create_app
    from engines.serving.engine import ServingEngine
    api_key = served_key(args)
    device = device_from(args.device)
    dtype = check_dtype(args.dtype, device)
    compile = not args.eager
    if compile and (missing := compiler_missing(device)):
        say(f"{missing}; the decode step runs eager (--eager says so and quiets this line)")
        compile = False
    compile_cache = check_compile_cache(args.compile_cache) if compile else None
    sock = listening_socket(args.host, args.port)  # before the model loads: a port in use is said at once
    model, tokenizer = load_pair(args.checkpoint, args.tokenizer, device)
    if not compile and (note := slower_than_float32(model, dtype, args.rows)):  # eager steps serve throughout
        say(note)
    model = model.to(dtype)
    itemsize, context = model.emb.weight.element_size(), model.cfg.context
    rows_bytes = cache_bytes(model.cfg, args.rows, context, itemsize)  # keys and values, every layer
    block_bytes = cache_bytes(model.cfg, 1, BLOCK_SIZE, itemsize)
    blocks = (args.rows * blocks_per_row(context, BLOCK_SIZE) if args.cache_mib is None else  # the engine's default
              blocks_for_bytes(model, args.cache_mib * 2**20, BLOCK_SIZE))
    mib = (rows_bytes + blocks * block_bytes) / 2**20
    check_fits(rows_bytes + blocks * block_bytes, f"{mib:.0f} MiB of cache (--rows, --cache-mib)", model.emb.weight.device)
    # where compiling takes seconds (CUDA) the steps are compiled now; elsewhere eager steps serve at once,
    # and the compiled ones are made in a process of their own and swapped in when ready
    in_process = compile and compiles_in_process(device)
    if in_process:
        say(f"compiling the decode step for each batch size on {device}")
    engine = ServingEngine(model, tokenizer, max_rows=args.rows, block_size=BLOCK_SIZE,
                           cache_blocks=blocks, prefill_chunk=args.prefill_chunk, compile=in_process)
    model_id = os.path.splitext(os.path.basename(args.checkpoint))[0]
    host, port = sock.getsockname()[:2]
    app = create_app(engine, tokenizer, model_id, model.cfg.context, args.rows, args.queue,
                     allowed_hosts(args.host, port, args.allow_host, api_key is not None), api_key)
    rows, compiling = ", ".join(map(str, engine.runner.sizes)), None
    step = f"the decode step {'compiled' if in_process else 'eager'}, for {rows} rows, on {device}, {args.dtype}"
    if compile and not in_process:
        compiling = multiprocessing.get_context("spawn").Process(
            target=keep_compiled_steps, args=(args.checkpoint, args.tokenizer, dtype, args.rows, compile_cache))
        compiling.start()
        threading.Thread(target=swap_in_compiled, args=(app.state.engine_loop, compiling, compile_cache),
                         daemon=True).start()
        step += ", until the compiled ones are ready (a line says when)"
    where = f"[{host}]" if ":" in host else host
    serve(app, sock, f"{script_name()}: ready at http://{where}:{port}/ ({model_id}, {args.rows} rows, queue {args.queue}, "
                     f"{mib:.0f} MiB of cache, {blocks} blocks of it the prefix cache's; {step}); Ctrl-C stops",
          compiling)


if __name__ == "__main__":
    run_cli(main)
