"""The post's benchmark: tok/s with and without the KV cache, and what the cache holds.

    python bench.py [cpu|cuda] [THREADS] [--tokens 64 256 1024] [--runs 3] [--quick]

Untrained weights (speed does not depend on what the model learned), greedy,
fp32, an 8-token random prompt, as in the post. Each figure is a whole
generation timed: the median of --runs runs after a warm-up, with its spread
(half the range); the loops a row compares take turns, one run each a round,
so a neighbour's load falls on both alike. Three tables:

0. The post's table: tok/s with no cache (Part 3's loop, generate_uncached)
   and with cached.py's (generate_cached) at batch 1 and 16, and the speedup;
   then the cache's bytes for a full window against the post's formula.
1. Cache memory measured from the post's dicts against 2 x layers x tokens x
   kv width x bytes, grouped-query attention too.
2. N rows from one prompt: N separate prompt passes against one pass cloned
   into the N rows (prefill_clone.clone_prompt), through the Engine; time to
   the first token and in all, and both must give the same tokens.

The speed code's tables (kernels, the compiled step, bfloat16 and int8, CUDA
graphs, the serving engines) are engines/bench's: python -m engines.bench.
"""
import argparse
import os
import platform
import sys
import time

import torch

from cached import CachedGPT
from model import Config
from prefill_clone import Engine, clone_prompt

PROMPT = 8  # the post's random prompt, in tokens
FULL = dict(batches=(1, 16), lengths=(64, 256, 1024), prompts=(64, 256), clones=(1, 4, 8, 16), clone_tokens=60)
QUICK = dict(batches=(1, 4), lengths=(8, 16), prompts=(16, 32), clones=(1, 4), clone_tokens=4)


def sync(device):
    if device.type == "cuda":  # a GPU's queued work is part of the time
        torch.cuda.synchronize(device)


def timed_in_turns(fns, runs, device):
    """{name: [seconds of each run]}: each fn warmed up once, then one run of each a round."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def median(xs):
    return sorted(xs)[len(xs) // 2]


def cell(seconds, tokens):
    """tok/s from the median run, and the spread of the runs as a share of it."""
    mid = median(seconds)
    return f"{tokens / mid:>9,.0f} ±{(max(seconds) - min(seconds)) / 2 / mid:>4.0%}"


def table_post(model, device, sizes, runs):
    print(f"\n0. the post's table: greedy tok/s = batch x tokens / seconds of a whole generation from an {PROMPT}-token")
    print(f"   prompt, with no cache (generate_uncached) and with cached.py's (generate_cached); median of {runs} runs")
    print(f"{'batch':>5} {'tokens':>6} {'no cache tok/s':>16} {'cache tok/s':>16} {'speedup':>8}")
    gen = torch.Generator().manual_seed(0)
    for batch in sizes["batches"]:
        prompt = torch.randint(model.cfg.vocab_size, (batch, PROMPT), generator=gen).to(device)
        for n in sizes["lengths"]:
            times = timed_in_turns({"no cache": lambda: model.generate_uncached(prompt, n),
                                    "cache": lambda: model.generate_cached(prompt, n)}, runs, device)
            speedup = median(times["no cache"]) / median(times["cache"])
            print(f"{batch:>5} {n:>6} {cell(times['no cache'], batch * n)} {cell(times['cache'], batch * n)} "
                  f"{speedup:>7.1f}x", flush=True)
    cfg, item = model.cfg, model.emb.weight.element_size()
    measured, formula = window_bytes(model, device), 2 * cfg.n_layers * cfg.context * cfg.d_model * item
    print(f"\ncache at {cfg.context} tokens, batch 1: {measured / 2**20:.2f} MiB measured (2 x {cfg.n_layers} layers "
          f"x {cfg.context} tokens x {cfg.d_model} d_model x {item} bytes = {formula / 2**20:.2f} MiB)")


@torch.no_grad()
def window_bytes(model, device):
    """The bytes of the post's cache dicts once a batch-1 prompt has filled the window."""
    caches = [{} for _ in model.blocks]
    model.step(torch.zeros(1, model.cfg.context, dtype=torch.long, device=device), caches, 0)
    return sum(t.nbytes for cache in caches for t in cache.values())


def table_memory(device):
    print("\n1. cache memory at 256 tokens, batch 1, fp32: 2 (k, v) x layers x tokens x kv width x 4 bytes")
    for name, cfg in (("Part 3 (4 heads)", Config()), ("GQA (4 q heads, 1 kv head)", Config(n_kv_heads=1))):
        measured = window_bytes(CachedGPT(cfg).to(device).eval(), device)
        formula = 2 * cfg.n_layers * 256 * cfg.n_kv_heads * cfg.head_dim * 4
        print(f"  {name:<28} measured {measured / 2**20:.2f} MiB, formula {formula / 2**20:.2f} MiB")


class PromptPerRow(Engine):
    """The naive way the clone is timed against: each row runs the prompt itself, and the rows' caches are joined."""

    def prefill(self, prompt, n_rows, max_tokens):
        runs = [clone_prompt(self.model, prompt, 1) for _ in range(n_rows)]
        caches = [{name: torch.cat([c[layer][name] for _, c in runs]) for name in ("k", "v")}
                  for layer in range(len(self.model.blocks))]
        return torch.cat([logits for logits, _ in runs]), lambda token, pos: self.model.step(token, caches, pos)


def first_and_all(engine, prompt, n, n_tokens, device):
    """(seconds to the first token, seconds in all, the rows) of one greedy generation through `engine`."""
    sync(device)
    t0, rows, first = time.perf_counter(), [[] for _ in range(n)], None
    for column, _ in engine.generate(prompt, n, max_tokens=n_tokens, temperature=0):
        first = first or time.perf_counter() - t0
        for row, token in zip(rows, column):
            row.append(token)
    sync(device)
    return first, time.perf_counter() - t0, rows


def table_clone(model, device, sizes, runs):
    n_tokens = sizes["clone_tokens"]
    print(f"\n2. N rows of {n_tokens} greedy tokens from one prompt: N separate prompt passes against one pass")
    print("   cloned into the N rows (prefill_clone.clone_prompt), in turns (the same tokens from both); time to")
    print("   the first token (ms) and in all (s), median")
    print(f"{'prompt':>6} {'N':>3} {'first: separate':>16} {'clone':>8} {'speedup':>8} "
          f"{'all: separate':>14} {'clone':>7} {'speedup':>8}")
    engines, gen = {"separate": PromptPerRow(model), "clone": Engine(model)}, torch.Generator().manual_seed(1)
    for n_prompt in sizes["prompts"]:
        prompt = torch.randint(model.cfg.vocab_size, (n_prompt,), generator=gen).tolist()
        for n in sizes["clones"]:
            got = {name: [first_and_all(e, prompt, n, n_tokens, device) for _ in range(runs + 1)][1:]
                   for name, e in engines.items()}
            if any(run[2] != got["clone"][0][2] for runs_of in got.values() for run in runs_of):
                sys.exit("bench.py: error: the two ways of filling the rows gave different tokens")
            (sep_first, sep_all), (clone_first, clone_all) = (
                (median([r[0] for r in got[name]]), median([r[1] for r in got[name]])) for name in engines)
            print(f"{n_prompt:>6} {n:>3} {sep_first * 1e3:>13.1f} ms {clone_first * 1e3:>5.1f} ms "
                  f"{sep_first / clone_first:>7.1f}x {sep_all:>12.2f} s {clone_all:>5.2f} s "
                  f"{sep_all / clone_all:>7.2f}x", flush=True)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main():
    ap = argparse.ArgumentParser(description="The post's benchmark: tok/s with and without the KV cache.")
    ap.add_argument("device", nargs="?", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("threads", nargs="?", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per figure (at least 3)")
    ap.add_argument("--tokens", type=int, nargs="+", help="table 0's lengths (default 64 256 1024)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("torch sees no CUDA GPU here; use cpu")
    if args.threads is not None and not 1 <= args.threads <= os.cpu_count():  # far past the cores torch segfaults
        ap.error(f"THREADS must be in 1..{os.cpu_count()} (this machine's cores), got {args.threads}")
    if args.runs < 3:
        ap.error(f"--runs must be at least 3 (figures are medians), got {args.runs}")
    if args.tokens and min(args.tokens) < 1:
        ap.error(f"--tokens must be at least 1, got {min(args.tokens)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = (QUICK if args.quick else FULL) | ({"lengths": tuple(args.tokens)} if args.tokens else {})
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = CachedGPT(Config()).to(device).eval()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"bench.py: {device.type} ({where}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"untrained weights, greedy, fp32, median of {args.runs} runs in turns after a warm-up")
    table_post(model, device, sizes, args.runs)
    table_memory(device)
    table_clone(model, device, sizes, args.runs)


if __name__ == "__main__":
    main()
