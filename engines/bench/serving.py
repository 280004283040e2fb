"""Serving measured against what a user would pick: one seeded arrival trace replayed against three engines.

    bash engines/bench/build_llama_server.sh        # once, ~15 minutes on 2 cores: llama.cpp's own llama-server
    python -m engines.bench.serving [--clients 16] [--requests 160] [--seed 0] [--rate 8] [--think 0.2]
                                    [--max-tokens 16] [--threads N] [--eager] [--llama-server PATH] [--vllm]
                                    [--json PATH]

The trace (seeded): sessions start at Poisson times; most are multi-turn chats of 10 turns sharing one
system prompt (each turn sent a think time after the last reply, its history the chat's earlier turns, each
reply kept as its first HISTORY_TOKENS tokens so ten turns fit the 256-token window), the rest one-shot
prompts of mixed length. At most --clients requests are in flight; a request that finds every client busy
waits for one, and that wait counts in its time to first token. Every request is greedy (temperature 0)
with the same max_tokens, sent as raw text to /v1/completions (the chat template built here, as
engines/serving/openai_request.py's, with "\\nUser:" as a stop), so all three engines see the same tokens:

  engine       one request at a time through the lesson's prefill_clone.Engine (the baseline, no cache)
  serve.py     this repo's server (engines/serving/engine.py: continuous batching, prefix cache), streamed over HTTP,
               replayed once its /health says its compiled decode steps are in (--eager: eager ones)
  llama-server llama.cpp's server on a GGUF f32 of the same weights (engines.export.peers.write_gguf), the same
               number of slots (-np CLIENTS, -c CLIENTS*256), continuous batching and prompt caching on
  vllm         (--vllm) vLLM's OpenAI server on the float32 export, from its own venv (engines/scale/vllm_peer.py;
               engines/requirements-vllm.txt), its threads bound to cores 0..THREADS-1 (VLLM_CPU_OMP_THREADS_BIND)
               with --vllm-kv-gib GiB of KV cache (VLLM_CPU_KVCACHE_SPACE), --vllm-dp replicas behind one address
               (--data-parallel-size), its defaults otherwise (prefix caching on; --enable-prompt-tokens-details,
               so usage counts the cached tokens); its start time (launch to /health answering) is printed

each in a process of its own, one after another, with the same threads. Printed: generated tok/s over the
replay's wall time; time to first token and inter-token latency, p50 and p95; each request's time per
token after the first ((last token - first token) / (n - 1), tpot), p50 and p95; prompt tokens computed
against served from cache (usage.prompt_tokens_details.cached_tokens); turn 1 against turn 10 time to first
token of the chats (medians); where serve.py's engine step spent the replay, ms a step in each phase of
ServingEngine.step (its /health counts them); and the targets, met or not. An engine that cannot run is
said so.
"""
import http.client
import json
import multiprocessing
import os
import queue
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

from engines.edge.cli import Parser, check_least, device_from, run_cli, thread_count

import torch

from bpe import BPE
from engines.fast.engine import check_dtype
from engines.serving.engine import SERVED_DTYPES

CONTEXT, TURNS, HISTORY_TOKENS, NEXT_TURN = 256, 10, 6, "\nUser:"
SYSTEM = "System: You are Sherlock Holmes. Answer the client briefly and plainly, as you would in Baker Street."
QUESTIONS = ["Who sent the letter?", "Where was the lamp?", "What did the clerk see?", "Why was the door open?",
             "Who came at night?", "What of the ring?", "Was the inspector right?", "Where is Watson?",
             "What did you find?", "Who is the man?", "What was in the box?", "When did he leave?"]
TEXT = ("It was a cold morning of the early spring, and we sat after breakfast on either side of a cheery fire in "
        "the old room at Baker Street. A thick fog rolled down between the lines of dun-coloured houses, and the "
        "opposing windows loomed like dark, shapeless blurs through the heavy yellow wreaths. Our gas was lit and "
        "shone on the white cloth and glimmer of china and metal, for the table had not been cleared yet. Sherlock "
        "Holmes had been silent all the morning, dipping continuously into the advertisement columns of a "
        "succession of papers, until at last, having apparently given up his search, he had emerged in no very "
        "sweet temper to lecture me upon my literary shortcomings. There was a ring at the bell, and a moment later "
        "our landlady showed in a tall young woman in a grey travelling dress, who had a letter in her hand.")


def build_trace(requests, seed, rate, think):
    """[session]: {"start": seconds, "kind": "chat" | "once", "texts": user messages or one prompt, "think"}."""
    rng = random.Random(seed)
    chats = max(1, requests * 3 // 4 // TURNS)
    kinds = ["chat"] * chats + ["once"] * max(0, requests - TURNS * chats)
    rng.shuffle(kinds)
    words, sessions, t = TEXT.split(), [], 0.0
    for kind in kinds:
        t += rng.expovariate(rate)
        if kind == "chat":
            texts = [rng.choice(QUESTIONS) for _ in range(TURNS)]
        else:
            start = rng.randrange(len(words) // 2)
            texts = [" ".join(words[start:start + rng.choice([4, 12, 30, 60, 100])])]
        sessions.append({"start": t, "kind": kind, "texts": texts,
                         "think": [rng.expovariate(1 / think) for _ in texts]})
    return sessions


def chat_text(history, question):
    return "\n".join([SYSTEM, *history, f"User: {question}", "Assistant:"])


def replay(sessions, clients, send, bpe, max_tokens):
    """Run every session in a thread of its own, at most `clients` requests in flight; send(text) returns a
    record {"ttft", "gaps", "completion", "prompt", "cached", "text"} (seconds from the send). Records gain
    "waited" (time for a free client, added to ttft), "kind" and "turn"."""
    free, records, lock, t0 = threading.Semaphore(clients), [], threading.Lock(), time.perf_counter()

    def session(s):
        time.sleep(max(0.0, s["start"] - (time.perf_counter() - t0)))
        history = []
        for turn, (user, think) in enumerate(zip(s["texts"], s["think"]), 1):
            text = chat_text(history, user) if s["kind"] == "chat" else user
            if len(bpe.encode(text)) + max_tokens > CONTEXT:
                raise SystemExit(f"a trace prompt passes the {CONTEXT}-token window; lower --max-tokens")
            asked = time.perf_counter()
            with free:
                began = time.perf_counter()
                record = send(text)
            record |= {"waited": began - asked, "kind": s["kind"], "turn": turn, "end": time.perf_counter() - t0}
            record["ttft"] += record["waited"]
            with lock:
                records.append(record)
            reply = record["text"].split(NEXT_TURN)[0].strip()
            history += [f"User: {user}", f"Assistant: {bpe.decode(bpe.encode(reply)[:HISTORY_TOKENS]).strip()}"]
            time.sleep(think)

    threads = [threading.Thread(target=session, args=(s,)) for s in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return records, time.perf_counter() - t0


def http_send(port, max_tokens, extra):
    """send(text) for an OpenAI-compatible server on port: /v1/completions, streamed."""
    def send(text):
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "stop": [NEXT_TURN], "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise SystemExit(f"port {port} answered {response.status}: {response.read()[:300]!r}")
        times, text, usage = [], "", {}
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if piece:
                times.append(time.perf_counter() - t0)
                text += piece
            usage = chunk.get("usage") or usage
            if "timings" in chunk and not usage.get("prompt_tokens_details"):  # llama-server's own count
                usage = {**usage, "prompt_tokens_details": {"cached_tokens": chunk["timings"].get("cache_n", 0)}}
        conn.close()
        return {"ttft": times[0] if times else time.perf_counter() - t0, "gaps": [b - a for a, b in zip(times, times[1:])],
                "completion": usage.get("completion_tokens", 0), "prompt": usage.get("prompt_tokens", 0),
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "text": text}
    return send


def baseline_run(sessions, args, out):
    """In a process of its own: the trace through prefill_clone.Engine, one request at a time (a FIFO)."""
    torch.set_num_threads(args.threads)
    from engines.edge.checkpoint import load_pair
    from prefill_clone import Engine
    model, tokenizer = load_pair(args.checkpoint, "tokenizer.json", args.device)
    model = model.to(getattr(torch, args.dtype))
    engine, bpe, jobs = Engine(model, tokenizer), BPE.load("tokenizer.json"), queue.Queue()

    def generate(text):
        ids, t0, times, new = bpe.encode(text), time.perf_counter(), [], []
        for column, _ in engine.generate(ids, 1, max_tokens=args.max_tokens, temperature=0, stop=[NEXT_TURN]):
            times.append(time.perf_counter() - t0)
            new.append(column[0])
        return {"ttft": times[0], "gaps": [b - a for a, b in zip(times, times[1:])], "completion": len(new),
                "prompt": len(ids), "cached": 0, "text": bpe.decode(new)}

    def worker():
        while True:
            text, box, done = jobs.get()
            box.append(generate(text))
            done.set()

    def send(text):
        box, done = [], threading.Event()
        jobs.put((text, box, done))
        done.wait()
        return box[0]

    generate("Warm up the engine once.")
    threading.Thread(target=worker, daemon=True).start()
    out.put(replay(sessions, args.clients, send, bpe, args.max_tokens))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    return json.loads(conn.getresponse().read())


def wait_healthy(port, process, name, compiled, seconds=1800):
    """Until /health answers 200 (serve.py's: with its compiled decode steps in, where `compiled`)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited ({process.returncode}) before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            response = conn.getresponse()
            if response.status == 200 and (not compiled or json.loads(response.read())["decode_steps"] == "compiled"):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} was not ready after {seconds}s")


def server_run(name, command, port, sessions, args, bpe, extra, env=None, log=None):
    env = env or {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    process = subprocess.Popen(command, env=env, stdout=log or subprocess.DEVNULL, stderr=log or (
        subprocess.PIPE if name == "llama-server" else None))
    try:
        started = time.perf_counter()
        wait_healthy(port, process, name, compiled=name == "serve.py" and not args.eager)
        start_s = time.perf_counter() - started
        print(f"  {name}: ready in {start_s:.0f} s", flush=True)
        send = http_send(port, args.max_tokens, extra)
        send("Warm up the engine once.")
        before = health(port) if name == "serve.py" else None
        records, wall = replay(sessions, args.clients, send, bpe, args.max_tokens)
        result = summary(records, wall) | {"start_s": start_s}
        if before is not None:  # where serve.py's engine step spent the replay, phase by phase
            after = health(port)
            steps = after["steps"] - before["steps"]
            result["steps"] = steps
            result["step_ms"] = {phase: (t - before["step_seconds"][phase]) / steps * 1e3
                                 for phase, t in after["step_seconds"].items()}
            result["decoding_step_ms"] = {kind: (t - before["decoding_steps"][kind][1]) / max(1, n - before[
                "decoding_steps"][kind][0]) * 1e3 for kind, (n, t) in after["decoding_steps"].items()}
        return result
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def vllm_run(python, sessions, args, bpe):
    """vLLM's server on the float32 export of the checkpoint, written to a temporary folder; its log kept there
    and its last error said if it does not start."""
    from engines.edge.checkpoint import load_pair
    from engines.export.hf_folder import write_folder
    from engines.scale import vllm_peer
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = load_pair(args.checkpoint, "tokenizer.json")
        folder = os.path.join(tmp, "holmes-hf")
        write_folder(model, tokenizer, folder)
        each = args.threads // args.vllm_dp  # cores a replica: "0-1", or "0|1" for two replicas of one core
        port = free_port()
        cpus = "|".join(str(r * each) if each == 1 else f"{r * each}-{r * each + each - 1}"
                        for r in range(args.vllm_dp))
        env = vllm_peer.cpu_env(cpus, args.vllm_kv_gib)
        print(f"  vllm: VLLM_CPU_OMP_THREADS_BIND={cpus} VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_gib} "
              f"OMP_NUM_THREADS={each}" + (f", --data-parallel-size {args.vllm_dp}" if args.vllm_dp > 1 else ""),
              flush=True)
        with open(os.path.join(tmp, "vllm.log"), "w") as log:
            try:
                return server_run("vllm", vllm_peer.serve_command(python, folder, "127.0.0.1", port, extra=[
                    "--data-parallel-size", str(args.vllm_dp), "--enable-prompt-tokens-details"]), port,
                                  sessions, args, bpe, {}, env, log)
            except SystemExit as e:
                log.flush()
                with open(log.name) as f:
                    raise SystemExit(f"{e.code}: {vllm_peer.last_error(f.read())}") from None


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000 if xs else float("nan")


def summary(records, wall):
    gaps = [g for r in records for g in r["gaps"]]
    ttfts = [r["ttft"] for r in records]
    per_token = [sum(r["gaps"]) / len(r["gaps"]) for r in records if r["gaps"]]  # (last - first) / (n - 1)
    turn = lambda k: [r["ttft"] for r in records if r["kind"] == "chat" and r["turn"] == k]
    return {"tok_s": sum(r["completion"] for r in records) / wall, "wall_s": wall, "requests": len(records),
            "ttft_p50_ms": pct(ttfts, 50), "ttft_p95_ms": pct(ttfts, 95), "itl_p50_ms": pct(gaps, 50),
            "itl_p95_ms": pct(gaps, 95), "tpot_p50_ms": pct(per_token, 50), "tpot_p95_ms": pct(per_token, 95),
            "prompt_tokens": sum(r["prompt"] for r in records),
            "cached_tokens": sum(r["cached"] for r in records),
            "turn1_ttft_ms": pct(turn(1), 50), "turn10_ttft_ms": pct(turn(TURNS), 50)}


def main():
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16, help="requests in flight at most; llama-server's slots")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=8.0, help="sessions starting a second (Poisson)")
    ap.add_argument("--think", type=float, default=0.2, help="a chat's mean pause between a reply and its next turn, s")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=thread_count, default=torch.get_num_threads())
    ap.add_argument("--checkpoint", default="holmes.pt")
    ap.add_argument("--eager", action="store_true", help="serve.py --eager: its decode step not compiled")
    ap.add_argument("--device", default="cpu", help="serve.py's and the one-at-a-time Engine's: cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=SERVED_DTYPES)
    ap.add_argument("--llama-server", default=None, help="the binary engines/bench/build_llama_server.sh built")
    ap.add_argument("--vllm", action="store_true", help="add vLLM's server, from its venv (engines/scale/vllm_peer.py)")
    ap.add_argument("--vllm-venv", default=None, help="default $TINY_GPT_VLLM_VENV, else .venv-vllm")
    ap.add_argument("--vllm-dp", type=int, default=1, help="vLLM's --data-parallel-size: replicas behind one "
                                                           "address, the threads split among them")
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--skip", default="", help="engines to leave out, comma-separated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for name, least in (("vllm_kv_gib", 1), ("vllm_dp", 1), ("clients", 1), ("requests", 1), ("rate", 0.01),
                        ("think", 0), ("max_tokens", 1)):
        check_least("--" + name.replace("_", "-"), getattr(args, name), least)
    if args.vllm:  # before any work: a missing or wrong vLLM venv is one line
        from engines.scale import vllm_peer
        vllm_python = vllm_peer.check_venv(vllm_peer.venv_path(args.vllm_venv))
        if args.threads % args.vllm_dp:
            raise SystemExit(f"--threads {args.threads}: vLLM binds a thread a core, the same number to each of "
                             f"--vllm-dp {args.vllm_dp} replicas")
    from engines.bench.figures import machine
    device = device_from(args.device)
    check_dtype(args.dtype, device)
    info = machine(device) | {"threads": args.threads, "dtype": args.dtype}
    sessions, bpe, results = build_trace(args.requests, args.seed, args.rate, args.think), BPE.load("tokenizer.json"), {}
    chats = sum(s["kind"] == "chat" for s in sessions)
    print(f"{info.get('gpu', info['cpu'])}, {args.dtype}, {args.threads} threads, torch {info['torch']}")
    print(f"trace (seed {args.seed}): {sum(len(s['texts']) for s in sessions)} requests, {chats} chats of {TURNS} "
          f"turns sharing a system prompt and {len(sessions) - chats} one-shot prompts, sessions at {args.rate}/s "
          f"(Poisson), {args.clients} clients, greedy, max_tokens {args.max_tokens}", flush=True)
    skip = set(args.skip.split(","))
    if "engine" not in skip:
        out = multiprocessing.get_context("spawn").Queue()
        child = multiprocessing.get_context("spawn").Process(target=baseline_run, args=(sessions, args, out))
        child.start()
        results["engine"] = summary(*out.get())
        child.join()
        print("  engine: done", flush=True)
    if "serve.py" not in skip:
        port = free_port()
        results["serve.py"] = server_run("serve.py", [sys.executable, "-m", "engines.serve", args.checkpoint, "--port",
                                                              str(port), "--rows", str(args.clients), "--device",
                                                              args.device, "--dtype", args.dtype] +
                                                  ["--eager"] * args.eager,
                                         port, sessions, args, bpe, {})
        print("  serve.py: done", flush=True)
    if "llama-server" not in skip:
        if not args.llama_server or not os.path.exists(args.llama_server):
            print("  llama-server: not run (build it: bash engines/bench/build_llama_server.sh; then --llama-server PATH)")
        else:
            from engines.edge.checkpoint import load_pair
            from engines.export import hf_folder
            from engines.export import peers
            with tempfile.TemporaryDirectory() as tmp:
                model, _ = load_pair(args.checkpoint, "tokenizer.json")
                gguf = os.path.join(tmp, "model-f32.gguf")
                peers.write_gguf(gguf, model.cfg, hf_folder.neox_state_dict(model),
                                 *hf_folder.spelled_vocabulary(BPE.load("tokenizer.json")), "f32")
                port = free_port()
                command = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                           "-np", str(args.clients), "-c", str(args.clients * CONTEXT), "-t", str(args.threads),
                           "-tb", str(args.threads), "-cb", "--log-disable"]
                results["llama-server"] = server_run("llama-server", command, port, sessions, args, bpe,
                                                     {"repeat_penalty": 1.0, "cache_prompt": True})
            print("  llama-server: done", flush=True)
    if args.vllm:
        results["vllm" if args.vllm_dp == 1 else f"vllm dp{args.vllm_dp}"] = vllm_run(vllm_python, sessions, args, bpe)
        print("  vllm: done", flush=True)
    print(f"\n{'':<13}{'tok/s':>7} {'ttft p50':>9} {'ttft p95':>9} {'itl p50':>8} {'itl p95':>8} {'tpot p50':>9} "
          f"{'tpot p95':>9} "
          f"{'prompt tok':>11} {'cached':>7} {'turn1 ttft':>11} {'turn10 ttft':>12} {'start s':>8}   (ms)")
    for name, r in results.items():
        print(f"{name:<13}{r['tok_s']:>7.0f} {r['ttft_p50_ms']:>9.0f} {r['ttft_p95_ms']:>9.0f} {r['itl_p50_ms']:>8.1f} "
              f"{r['itl_p95_ms']:>8.1f} {r['tpot_p50_ms']:>9.1f} {r['tpot_p95_ms']:>9.1f} {r['prompt_tokens']:>11} "
              f"{r['cached_tokens']:>7} {r['turn1_ttft_ms']:>11.0f} "
              f"{r['turn10_ttft_ms']:>12.0f} {r.get('start_s', float('nan')):>8.0f}")
    ours = results.get("serve.py")
    if ours:
        phases = ", ".join(f"{phase} {ms:.2f}" for phase, ms in ours["step_ms"].items())
        print(f"serve.py's engine step, ms a step over the replay's {ours['steps']} steps (the host's clock): {phases}; "
              f"{sum(ours['step_ms'].values()):.2f} in all, against an inter-token p50 of {ours['itl_p50_ms']:.2f}")
        only, mixed = ours["decoding_step_ms"]["decode only"], ours["decoding_step_ms"]["with prefill"]
        print(f"serve.py's steps that decode: {only:.2f} ms decode-only, {mixed:.2f} ms with prompt chunks beside "
              f"({mixed / only:.2f}x; target <= 2x: {'met' if mixed <= 2 * only else 'NOT met'})")
        targets = [("serve.py / llama-server throughput", "llama-server", lambda o: ours["tok_s"] / o["tok_s"], 1.0),
                   ("serve.py / one-at-a-time throughput", "engine", lambda o: ours["tok_s"] / o["tok_s"], 5.0)]
        for label, other, ratio, least in targets:
            if other in results:
                x = ratio(results[other])
                print(f"target {label} >= {least:g}x: {x:.2f}x, {'met' if x >= least else 'NOT met'}")
        x = ours["turn10_ttft_ms"] / ours["turn1_ttft_ms"]
        print(f"target serve.py turn 10 / turn 1 first token <= 1.5x: {x:.2f}x, {'met' if x <= 1.5 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    run_cli(main)
