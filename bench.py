"""Every speed and memory figure the inference post claims, measured here; by default, the post's table.

    python bench.py [cpu|cuda] [THREADS]               # table 0, the post's table (under a minute)
    python bench.py [cpu|cuda] [THREADS] --all         # every table, 0 to 6 (compiles: many minutes)
    python bench.py [cpu|cuda] [THREADS] --tables 0,3,4 [--whole] [--quick] [--runs 3] [--tokens 64 256 1024]
                    [--json PATH [--force]]

Untrained weights, greedy, fp32, 8-token random prompts, seeded. Each figure
is the median of --runs runs after a warm-up, with its spread (half the range,
as a share of the median); the figures a row compares take turns, one run each
a round, so their ratios are measured side by side. Rows print as they are measured.

Every decode figure (tables 0, 4 and 6) stands beside the physical limit, as
gpt-fast and nanochat's infer_bench print it: the header gives the memory read
bandwidth measured first (read_bandwidth: a 1 GiB tensor summed, the median of
5 after a warm-up), and each tok/s figure the bytes a step of it must read
(bytes_per_step: every weight once, and the keys and values it attends to) and
the rate it reads them at as a share of that bandwidth. A decode step at batch B
reads the weights once for B tokens, so the rate is bytes a step x tok/s / B.
A figure near 100% cannot get much faster; one at 20% can.

0. The post's table (what runs with no --tables): tok/s with no cache (Part 3's
   loop) and with cached.py's cache at batch 1 and 16, 64, 256 and 1,024 tokens,
   the speedup, then the cache's bytes for a full window against the post's
   formula 2 x layers x tokens x d_model x bytes. Its times are summed, not run
   whole: a decode step's cost depends only on how many tokens it sees (rerun
   without a cache; kept in it), which stops growing once the window is full.
   So each loop's step is timed at 8, 16, 32, ... tokens up to the window
   (each run, the median of up to 5 calls in a row), a step between two of
   those counts costs their linear interpolation, and a generation's time is
   its prefill plus the sum of its steps (the uncached batch-16 x 1,024-token
   run alone would take minutes). --whole also times whole generations, as
   the post's bench.py does, each beside its sum (docs/bench.md: how well
   they agree).
1. Cache memory measured from the tensors against the formula, grouped-query too.
2. N rows from one prompt: N separate prompt passes against one pass copied into the
   N rows (prefill_clone's clone), both through one lesson Engine; time to the first token
   and in all, and both must give the same tokens.

Tables 3 to 6 are the speed code's own (engines/bench_speed.py, engines/bench_peers.py);
bench.py runs them on --tables or --all, and only then loads anything beyond the lesson.
3. The decode step's matrix multiply: every exact kernel in engines/matmul.py timed
   here, the one the Engine chose, and a whole step with it and with nn.Linear;
   on the CPU, the step compiled each of engines.compile_ways.COMPILE_WAYS worth compiling for the rows
   (autotuned C++ multiplies on frozen weights, inductor's plain ATen ones; for one row each
   output as one dot-product loop, for more the autotuned step with its attention as its
   arithmetic): the Engine runs whichever is fastest here.
4. The post's two loops, timed whole, beside the Engine (engines.fast_engine.FastEngine: the
   preallocated ring cache, fastest kernel) as it runs by default, compiled (compile=True,
   compile time reported apart), in bfloat16, and with int8 weights eager and compiled;
   then how far bfloat16 and int8 drift from float32 on trained weights.
5. CUDA only: kernels per decode step, the share of the step the GPU is busy,
   and the Engine with each decode step a CUDA-graph replay, at batch 1 and 16.
6. The same weights through the serving engines installed (transformers always;
   CTranslate2 float32 and int8, llama.cpp f32 and q8_0 with requirements-serve.txt,
   on the CPU) beside the Engine's forms, the compiled Engine's ratio to llama.cpp f32
   and the compiled int8 Engine's to q8_0; then where each parts from the float32
   Engine on trained weights.
"""
import json
import os
import sys
import time
from bisect import bisect_left
from functools import partial

import torch

from cached import CachedGPT
from cli import Parser, device_from, run_cli
from errors import BadValue
from figures import (PROMPT, bytes_per_step, machine, put_bandwidth, read_bandwidth,
                     untrained_model)
from files import atomic_write, check_output
from model import Config
from prefill_clone import Engine, clone_prompt, run_prompt
from timing import half_range, median, sync, timed_generation, timings

FULL = dict(batches=(1, 16), lengths=(64, 256, 1024), prompts=(64, 256), clones=(1, 4, 8, 16), clone_tokens=60,
            steps=50, drift=256, compiled_ways=True)


QUICK = dict(batches=(1, 4), lengths=(8, 16), prompts=(16, 32), clones=(1, 4), clone_tokens=4, steps=5, drift=16,
             compiled_ways=False)  # not the extra compiles (up to a minute each) of table 3's compiled line


TABLES = "0123456"


def steady(fn, device, calls=5, budget=0.2):
    """fn's seconds a call, for timings(): the median of up to `calls` calls in a row (fewer once `budget`
    seconds are spent), so that one stall on a shared machine does not count for every step of a count."""
    def timed():
        seconds = []
        while len(seconds) < calls and sum(seconds) < budget:
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            seconds.append(time.perf_counter() - t0)
        return median(seconds)
    return timed


def step_counts(longest, context):
    """The token counts a step is timed at: the prompt's, doubling, then the most any step sees."""
    top = min(PROMPT + longest - 1, context)
    counts = [PROMPT]
    while counts[-1] * 2 < top:
        counts.append(counts[-1] * 2)
    return counts + [top] * (top > PROMPT)


def step_weights(counts, seen):
    """How many steps' worth of each timed count's cost the steps that see `seen` tokens cost: a count
    between two timed ones costs their linear interpolation, so the steps cost sum(weight x cost)."""
    weights = [0.0] * len(counts)
    for n in seen:
        i = bisect_left(counts, n)
        if counts[i] == n:
            weights[i] += 1
        else:
            share = (n - counts[i - 1]) / (counts[i] - counts[i - 1])
            weights[i - 1] += 1 - share
            weights[i] += share
    return weights


def generation_weights(n_tokens, context, counts):
    """The weights of n_tokens greedy tokens from a PROMPT-token prompt, per loop: the step that makes
    token j (from 0) sees the text so far, PROMPT + j tokens, of which the uncached loop reruns the last
    `context` and the cached one keeps the last `context` before it (its step for token 0 is the prefill)."""
    return {"no_cache": step_weights(counts, [min(PROMPT + j, context) for j in range(n_tokens)]),
            "cache": step_weights(counts, [min(PROMPT + j - 1, context) for j in range(1, n_tokens)])}


class DecodeAt:
    """cached.py's decode step, callable again and again, with `kept` tokens already in a cache of each layer:
    the cache is put back before every step, and each step is one position on (a new RoPE table), as in the loop."""

    def __init__(self, model, text, kept):
        self.model, self.token = model, text[:, kept:kept + 1]
        self.caches = [{} for _ in model.blocks]
        with torch.no_grad():
            model.step(text[:, :kept], self.caches, 0)
        self.kept = [dict(cache) for cache in self.caches]
        self.position = kept

    @torch.no_grad()
    def __call__(self):
        for cache, kept in zip(self.caches, self.kept):
            cache.update(kept)
        self.model.step(self.token, self.caches, self.position)
        self.position += 1


@torch.no_grad()
def window_bytes(model, device):
    """The bytes of cached.py's cache once a batch-1 prompt has filled the window."""
    caches = [{} for _ in model.blocks]
    model.step(torch.zeros(1, model.cfg.context, dtype=torch.long, device=device), caches, 0)
    return sum(cache["k"].nbytes + cache["v"].nbytes for cache in caches)


def put_speed(row, key, seconds):
    """row[key]: tok/s from the median of each run's seconds, with its spread beside it."""
    row[key], row[key + "_spread"] = row["batch"] * row["tokens"] / median(seconds), half_range(seconds)


def speed_cell(row, key):
    return f"{row[key]:>9,.0f} ±{row[key + '_spread']:>4.0%}"


def table_post(model, device, sizes, runs, whole, bandwidth, out):
    cfg, lengths = model.cfg, sizes["lengths"]
    counts = step_counts(max(lengths), cfg.context)
    print(f"\n0. the post's table: greedy tok/s = batch x tokens / seconds from an {PROMPT}-token prompt, with no "
          "cache (Part 3's")
    print(f"   loop, generate_uncached) and with cached.py's (generate_cached); median of {runs} runs, ± half range.")
    print("   Summed, not run whole: a step's cost depends only on how many tokens it sees (rerun without a cache,")
    print(f"   kept in it), flat once the {cfg.context}-token window is full; each loop's step is timed at "
          f"{', '.join(map(str, counts))}")
    print("   tokens (the median of up to 5 calls in a row, each run), a step in between costs their linear")
    print("   interpolation, and a generation costs its prefill plus its steps"
          + ("." if whole else " (--whole also times whole generations)."))
    print(f"   MB/step: what a cached step must read, the weights ({bytes_per_step(model, 1, 1, False) / 1e6:.1f} MB) "
          "and the keys and values it")
    print("   attends to (mean over the generation); an uncached step reads the weights alone. %bw, each loop: bytes")
    print("   a step x steps a second, over the measured bandwidth")
    if whole:
        print("   whole: whole generations, timed as the post's bench.py does, in turns with the steps; summed/whole:")
        print("   the summed seconds over the whole ones, no cache and cache")
    print(f"{'batch':>5} {'tokens':>6} {'no cache tok/s':>16} {'cache tok/s':>16} {'speedup':>8} {'MB/step':>8} "
          f"{'no cache %bw':>12} {'cache %bw':>9}"
          + (f" {'whole: no cache':>16} {'cache':>16} {'summed/whole':>14}" if whole else ""))
    out.update({"step_counts": counts, "rows": []})
    loops = {"no_cache": model.generate_uncached, "cache": model.generate_cached}
    gen = torch.Generator().manual_seed(0)
    for batch in sizes["batches"]:
        text = torch.randint(cfg.vocab_size, (batch, counts[-1] + 1), generator=gen).to(device)
        prompt = text[:, :PROMPT]
        warmups = {"prefill": lambda: model.generate_cached(prompt, 1)}
        for n in counts:
            warmups["no_cache", n] = lambda n=n: model.generate_uncached(text[:, :n], 1)
            warmups["cache", n] = DecodeAt(model, text, n)
        fns = {name: steady(fn, device) for name, fn in warmups.items()}
        if whole:
            for n in lengths:
                for name, loop in loops.items():
                    fns["whole_" + name, n] = lambda loop=loop, n=n: loop(prompt, n)
                    warmups["whole_" + name, n] = lambda loop=loop: loop(prompt, PROMPT)
        times = timings(fns, runs, device, warmups, label=f"batch {batch}:")
        for n in lengths:
            row = {"batch": batch, "tokens": n}
            for name, weights in generation_weights(n, cfg.context, counts).items():
                put_speed(row, name, [sum(w * times[name, count][r] for w, count in zip(weights, counts))
                                      + (times["prefill"][r] if name == "cache" else 0) for r in range(runs)])
                if whole:
                    put_speed(row, "whole_" + name, times["whole_" + name, n])
            for name in loops:
                put_bandwidth(row, name, bytes_per_step(model, batch, n, cached=name == "cache"), bandwidth)
            out["rows"].append(row)
            line = f"{batch:>5} {n:>6} {speed_cell(row, 'no_cache')} {speed_cell(row, 'cache')} " \
                   f"{row['cache'] / row['no_cache']:>7.1f}x {row['cache_step_bytes'] / 1e6:>8.1f} " \
                   f"{row['no_cache_bandwidth_share']:>12.1%} {row['cache_bandwidth_share']:>9.1%}"
            if whole:  # summed seconds over whole seconds, each loop
                line += (f" {speed_cell(row, 'whole_no_cache')} {speed_cell(row, 'whole_cache')} "
                         f"{row['whole_no_cache'] / row['no_cache']:>6.2f} {row['whole_cache'] / row['cache']:>6.2f}")
            print(line, flush=True)
    measured, item = window_bytes(model, device), model.emb.weight.element_size()
    formula = 2 * cfg.n_layers * cfg.context * cfg.d_model * item
    out["cache"] = {"tokens": cfg.context, "measured_bytes": measured, "formula_bytes": formula}
    print(f"\ncache at {cfg.context} tokens, batch 1: {measured / 2**20:.2f} MiB measured (2 x {cfg.n_layers} layers "
          f"x {cfg.context} tokens x {cfg.d_model} d_model x {item} bytes = {formula / 2**20:.2f} MiB)")


def table_memory(device, out):
    print("\n1. cache memory at 256 tokens, batch 1, fp32: 2 (k, v) x layers x tokens x kv width x 4 bytes")
    for name, cfg in (("Part 3 (4 heads)", Config()), ("GQA (4 q heads, 1 kv head)", Config(n_kv_heads=1))):
        model = CachedGPT(cfg).to(device).eval()
        _, cache = run_prompt(model, torch.zeros(1, 256, dtype=torch.long, device=device), 256)  # what a prompt fills
        formula = 2 * cfg.n_layers * 256 * cfg.n_kv_heads * cfg.head_dim * 4
        out.append({"config": name, "measured_bytes": cache.nbytes(), "formula_bytes": formula})
        print(f"  {name:<28} measured {cache.nbytes() / 2**20:.2f} MiB, formula {formula / 2**20:.2f} MiB")


def prompt_per_row(model, prompt, cache):
    """The naive way the clone is timed against: each row of `cache` runs the same prompt itself."""
    T = prompt.shape[1]
    for i in range(cache.shape["batch"]):
        logits, one = run_prompt(model, prompt, T)
        cache.k[:, i, :T], cache.v[:, i, :T] = one.k[:, 0], one.v[:, 0]
    cache.cache_seqlens.fill_(T)
    return logits.expand(cache.shape["batch"], -1)


FILLS = {"separate": prompt_per_row, "clone": clone_prompt}  # the Engine's two ways to give N rows the prompt


def fills_side_by_side(engine, tokens, n, n_tokens, runs, device, label="", **kwargs):
    """{fill: (median time to first token, median total)} of FILLS through one engine, so through one decode
    step, timed in turns as timings() does; every run of both must give the same tokens."""
    firsts, rows = {name: [] for name in FILLS}, []

    def run(name, warm_up=False):
        engine.fill = FILLS[name]
        ttft, total, got = timed_generation(engine, tokens, n, n_tokens, **kwargs)
        if not warm_up:
            firsts[name].append(ttft)
        rows.append(got)
        return total
    totals = timings({name: partial(run, name) for name in FILLS}, runs, device,
                     warmups={name: partial(run, name, warm_up=True) for name in FILLS}, label=label)
    if any(got != rows[0] for got in rows):
        raise SystemExit("bench.py: error: the two ways of filling the rows gave different tokens")
    return {name: (median(firsts[name]), median(totals[name])) for name in FILLS}


def table_clone(model, device, sizes, runs, out):
    n_tokens = sizes["clone_tokens"]
    print(f"\n2. N rows of {n_tokens} greedy tokens from one prompt: N separate prompt passes against one pass")
    print("   copied into the N rows (prefill_clone.clone_prompt), through one Engine, so through the same decode")
    print("   step, in turns (the same tokens from both); time to the first token (ms) and in all (s), median")
    print(f"{'prompt':>6} {'N':>3} {'first: separate':>16} {'clone':>8} {'speedup':>8} "
          f"{'all: separate':>14} {'clone':>7} {'speedup':>8}")
    engine, gen = Engine(model), torch.Generator().manual_seed(1)
    for n_prompt in sizes["prompts"]:
        prompt = torch.randint(model.cfg.vocab_size, (n_prompt,), generator=gen).tolist()
        for n in sizes["clones"]:
            timed = fills_side_by_side(engine, prompt, n, n_tokens, runs, device, f"prompt {n_prompt}, N {n}:",
                                       temperature=0)
            (sep_first, sep_all), (clone_first, clone_all) = timed["separate"], timed["clone"]
            out.append({"prompt": n_prompt, "n": n, "tokens": n_tokens, "separate_ms": sep_first * 1e3,
                        "clone_ms": clone_first * 1e3, "separate_s": sep_all, "clone_s": clone_all})
            print(f"{n_prompt:>6} {n:>3} {sep_first * 1e3:>13.1f} ms {clone_first * 1e3:>5.1f} ms "
                  f"{sep_first / clone_first:>7.1f}x {sep_all:>12.2f} s {clone_all:>5.2f} s "
                  f"{sep_all / clone_all:>7.2f}x", flush=True)


def main():
    ap = Parser(description="Measure the post's speed and memory claims: by default its table (table 0).")
    ap.add_argument("device", nargs="?", default="cpu", help="cpu or cuda")
    ap.add_argument("threads", nargs="?", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--json", metavar="PATH", help="write every figure here")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per figure (at least 3)")
    ap.add_argument("--force", action="store_true", help="replace an existing --json file")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--tables", default="0", help="which tables to run, e.g. 0,3,4 (default: 0, the post's)")
    which.add_argument("--all", action="store_true", help="run every table, 0 to 6")
    ap.add_argument("--whole", action="store_true",
                    help="table 0 also times whole generations beside its summed steps (minutes at 1,024 tokens)")
    ap.add_argument("--tokens", type=int, nargs="+", help="tables 0 and 4's lengths only (default 64 256 1024)")
    args = ap.parse_args()
    tables = set(TABLES) if args.all else set(args.tables.split(","))
    if not tables <= set(TABLES):
        raise BadValue(f"--tables takes numbers 0 to 6 separated by commas, got {args.tables!r}")
    if args.whole and "0" not in tables:
        raise BadValue("--whole times table 0's generations whole; add 0 to --tables")
    device = device_from(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise BadValue(f"THREADS must be at least 1, got {args.threads}")
        if args.threads > os.cpu_count():
            print(f"bench.py: {args.threads} threads on {os.cpu_count()} cores oversubscribes them: threads take turns "
                  "on a core, and the figures show it", file=sys.stderr)
        torch.set_num_threads(args.threads)
    if args.runs < 3:
        raise BadValue(f"--runs must be at least 3 (figures are medians), got {args.runs}")
    if args.json is not None:
        check_output(args.json, args.force)
    if tables & set("3456"):  # the speed code's tables, beside the lesson: only now is it loaded
        from engines import bench_speed
        from engines.compile_ways import check_compiler
    if tables & set("346"):  # each times the compiled decode step
        check_compiler(device, "or run only --tables 0,1,2,5")
    sizes = QUICK if args.quick else FULL
    if args.tokens:
        if min(args.tokens) < 8:
            raise BadValue(f"--tokens must be at least 8 (the warm-up's length), got {min(args.tokens)}")
        sizes = sizes | {"lengths": tuple(args.tokens)}

    model = untrained_model(device)
    engines = bench_speed.engine_forms(model) if tables & set("46") else {}
    info = machine(device)
    bandwidth = info["read_bytes_per_s"] = read_bandwidth(device)
    print(f"bench.py: {info['device']} ({info.get('gpu', info['cpu'])}), {info['threads']} "
          f"thread{'s' * (info['threads'] != 1)}, memory read {bandwidth / 1e9:.1f} GB/s (a tensor sum), "
          f"torch {info['torch']}, untrained weights, greedy, fp32, median of {args.runs} runs in turns after a "
          "warm-up")
    report = {"machine": info, "quick": args.quick, "runs": args.runs, "tables": sorted(tables), "post": {},
              "decode": [], "memory": [], "prefill_clone": [], "kernels": [], "bf16_drift": {}, "int8_drift": {},
              "cuda": {}}
    if "0" in tables:
        table_post(model, device, sizes, args.runs, args.whole, bandwidth, report["post"])
    if "1" in tables:
        table_memory(device, report["memory"])
    if "2" in tables:
        table_clone(model, device, sizes, args.runs, report["prefill_clone"])
    if "3" in tables:
        bench_speed.table_kernels(model, device, sizes, args.runs, report["kernels"])
    if "4" in tables:
        bench_speed.table_decode(model, engines, device, sizes, args.runs, bandwidth, report["decode"])
        bench_speed.table_drift(device, sizes["drift"], {torch.bfloat16: report["bf16_drift"], torch.int8: report["int8_drift"]})
    if "5" in tables:
        bench_speed.table_cuda(model, device, sizes, args.runs, report["cuda"])
    if "6" in tables:
        from engines import bench_peers
        bench_peers.table_peers(model, engines, device, sizes, args.runs, bandwidth, report["decode"],
                    report.setdefault("peers", []))
        bench_peers.table_peers_drift(device, sizes["drift"], report.setdefault("peers_drift", {}))
    if args.json is not None:
        with atomic_write(args.json, "w", force=args.force) as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    run_cli(main)
