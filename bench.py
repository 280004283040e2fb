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
   N rows (prefill_clone's clone), both through one Engine; time to the first token
   and in all, and both must give the same tokens.
3. The decode step's matrix multiply: every exact kernel in kernels.py timed
   here, the one the Engine chose, and a whole step with it and with nn.Linear;
   on the CPU, the step compiled each of kernels.COMPILE_WAYS worth compiling for the rows
   (autotuned C++ multiplies on frozen weights, inductor's plain ATen ones; for one row each
   output as one dot-product loop, for more the autotuned step with its attention as its
   arithmetic): the Engine runs whichever is fastest here.
4. The post's two loops, timed whole, beside the Engine (kernels.FastEngine: the
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
import platform
import time
from bisect import bisect_left
from functools import partial

# before torch: cli.startup_failure makes a failing import one line
from cli import Parser, atomic_write, check_output, device_from, free_memory, run_cli, show_progress

import torch

from cached import CachedGPT, LayerCache, first_difference, load
from checks import cache_bytes
from kernels import KERNELS, DecodeStep, FastEngine, GraphCache, check_compiler, choose, compile_ways, sync, with_kernel
from model import Config
from prefill_clone import clone_prompt, run_prompt

FULL = dict(batches=(1, 16), lengths=(64, 256, 1024), prompts=(64, 256), clones=(1, 4, 8, 16), clone_tokens=60,
            steps=50, drift=256, compiled_ways=True)
QUICK = dict(batches=(1, 4), lengths=(8, 16), prompts=(16, 32), clones=(1, 4), clone_tokens=4, steps=5, drift=16,
             compiled_ways=False)  # not the extra compiles (up to a minute each) of table 3's compiled line
CHECKPOINT = "holmes.pt"  # the shipped weights, for the bf16 drift
TABLES = "0123456"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.int8: "int8"}
PROMPT = 8  # the post's prompt length, in tokens
READ_BYTES = 2**30  # the tensor read_bandwidth sums: far past any last-level cache


def median(xs):
    return sorted(xs)[len(xs) // 2]


def half_range(xs):
    """Half the range, as a share of the median."""
    return (max(xs) - min(xs)) / 2 / median(xs)


def timings(fns, runs, device, warmups=None, label=""):
    """{name: [seconds of each run]} of each fn's wall time; a fn that times itself (an engine in a
    process of its own) returns its own seconds instead.

    Each fn is warmed up once (with warmups[name] if given), then they take turns, one run each a
    round: on a shared machine a neighbour's load then falls on all of them alike, and the ratios
    between them, measured side by side, stay fair.
    """
    for name, fn in fns.items():
        (warmups or fns)[name]()
    times, started = {name: [] for name in fns}, time.time()
    for i in range(runs):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            own = fn()
            sync(device)
            times[name].append(own if isinstance(own, float) else time.perf_counter() - t0)
        show_progress(f"  {label} rounds", i + 1, runs, started)
    return times


def measure(fns, runs, device, warmups=None, label=""):
    """{name: (median, spread)} of each fn's wall time over runs, timed in turns as timings() does."""
    return {name: (median(ts), half_range(ts)) for name, ts in timings(fns, runs, device, warmups, label).items()}


def read_bandwidth(device, nbytes=READ_BYTES, runs=5):
    """Bytes per second this machine reads from memory with torch's threads here: a float32 tensor of
    nbytes (at most a quarter of the memory available) summed, the median of `runs` after a warm-up."""
    available = free_memory(device)
    if available is not None:
        nbytes = min(nbytes, available // 4)
    # filled, not torch.empty: untouched pages all map the one zero page, and summing them reads no memory
    x = torch.ones(nbytes // 4, device=device)
    seconds = timings({"sum": x.sum}, runs, device, label="memory read:")["sum"]
    return x.nbytes / median(seconds)


def bytes_per_step(model, batch, n_tokens, cached=True, cache_dtype=None):
    """The bytes a step of a greedy generation of `batch` rows must read from memory, averaged over the
    n_tokens steps that make its tokens from a PROMPT-token prompt: over a step's time, the rate it reads
    at (gpt-fast counts the weights alone; nanochat's infer_bench the weights and the cache, as here).

    Every weight once, at its own dtype: a step reads them once for all its rows (parameters and
    buffers alike, as gpt-fast counts them). The embedding table only at the rows it looks up,
    unless the head reads it whole (tied, as here), when it counts once. Cached, each row's keys and
    values at the positions it attends to, in cache_dtype (default the embedding's, as KVCache keeps
    them): the step making token j attends min(PROMPT + j, context) (the prefill, j = 0, its
    prompt); a step that reads more than that (the compiled one reads the whole window behind a
    mask) is not credited for it. Uncached, a step recomputes its keys rather than reading them.
    """
    cfg, emb = model.cfg, model.emb.weight
    attended = [min(PROMPT + j, cfg.context) for j in range(n_tokens)]
    weights = sum(t.nbytes for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values())
    if not any(t is emb for t in (*model.head.parameters(), *model.head.buffers())):
        looked_up = batch if cached else batch * sum(attended) / n_tokens  # the uncached step feeds what it attends
        weights += looked_up * emb[0].nbytes - emb.nbytes
    if not cached:
        return weights
    per_position = cache_bytes(cfg, batch, 1, torch.finfo(cache_dtype or emb.dtype).bits // 8)
    return weights + per_position * sum(attended) / n_tokens


def put_bandwidth(row, key, step_bytes, bandwidth):
    """row[key + "_step_bytes"] and row[key + "_bandwidth_share"]: what a step of row[key] tok/s reads, and
    the rate it reads at (bytes a step x steps a second, tok/s over the batch) as a share of the bandwidth."""
    row[key + "_step_bytes"] = step_bytes
    row[key + "_bandwidth_share"] = step_bytes * row[key] / row["batch"] / bandwidth


def bandwidth_cells(row, keys, width):
    """Each key's MB a step reads and its share of the bandwidth, one cell of `width` each."""
    return " ".join(f"{row[k + '_step_bytes'] / 1e6:>{width - 8}.1f} MB {row[k + '_bandwidth_share']:>4.0%}"
                    for k in keys)


def machine(device):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"device": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


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
        self.caches = [LayerCache(model.cfg.context) for _ in model.blocks]
        with torch.no_grad():
            model.step(text[:, :kept], self.caches, 0)
        self.kept = [(cache.k, cache.v) for cache in self.caches]
        self.position = kept

    @torch.no_grad()
    def __call__(self):
        for cache, (k, v) in zip(self.caches, self.kept):
            cache.k, cache.v = k, v
        self.model.step(self.token, self.caches, self.position)
        self.position += 1


@torch.no_grad()
def window_bytes(model, device):
    """The bytes of cached.py's cache once a batch-1 prompt has filled the window."""
    caches = [LayerCache(model.cfg.context) for _ in model.blocks]
    model.step(torch.zeros(1, model.cfg.context, dtype=torch.long, device=device), caches, 0)
    return sum(cache.k.nbytes + cache.v.nbytes for cache in caches)


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


def untrained_model(device):
    """The speed tables' model: Part 3's, with seeded random weights (speed does not depend on training)."""
    torch.manual_seed(0)
    return CachedGPT().to(device).eval()


def engine_forms(model):
    """The Engine as tables 4 and 6 run it: default, compiled, bfloat16, int8 weights and int8 compiled;
    each compiled form compiles once per batch."""
    return {"engine": FastEngine(model), "engine_compiled": FastEngine(model, compile=True),
            "engine_bf16": FastEngine(model, dtype=torch.bfloat16), "engine_int8": FastEngine(model, dtype=torch.int8),
            "engine_int8_compiled": FastEngine(model, dtype=torch.int8, compile=True)}


def table_decode(model, engines, device, sizes, runs, bandwidth, out):
    print("\n4. decode speed, the post's two loops timed whole beside the Engine: tok/s = batch x tokens / seconds")
    print("   (median, ± half range)")
    print("   Engine: kernels.FastEngine's default (the fastest exact kernel, table 3); compiled: compile=True;")
    print("   bf16: dtype=torch.bfloat16 (weights and cache); int8: dtype=torch.int8 (weights only, one scale per")
    print("   output channel, the cache float32), eager and compiled; their drift from float32 below")
    print("   Under each row, MB %bw: what a step must read (table 0's MB/step, at each form's dtype), and bytes a")
    print("   step x steps a second over the measured bandwidth")
    print(f"{'batch':>5} {'tokens':>6} {'no cache':>14} {'cached.py':>14} {'Engine':>14} {'compiled':>14} "
          f"{'bf16':>14} {'int8':>14} {'int8 compiled':>14} {'cache/none':>10} {'Engine/cached':>13} "
          f"{'compiled/cached':>15} {'bf16/cached':>11} {'int8/cached':>11} {'int8 c/cached':>13}")
    gen = torch.Generator().manual_seed(0)
    for batch in sizes["batches"]:
        prompt = torch.randint(model.cfg.vocab_size, (1, 8), generator=gen)
        idx = prompt.expand(batch, -1).to(device)
        ways = {"no_cache": model.generate_uncached, "cached": model.generate_cached}
        for name, engine in engines.items():
            ways[name] = lambda i, k, engine=engine: engine.generate_batch(prompt[0].tolist(), batch, max_tokens=k,
                                                                             temperature=0)[0]
        for eager in ("engine", "engine_int8"):  # the first call also compiles
            if ways[eager + "_compiled"](idx, 32) != ways[eager](idx, 32):
                raise SystemExit(f"bench.py: error: the compiled {eager} gave other tokens than the eager one")
        for n in sizes["lengths"]:
            row = {"batch": batch, "tokens": n}
            timed = measure({name: lambda fn=fn: fn(idx, n) for name, fn in ways.items()}, runs, device,
                            warmups={name: lambda fn=fn: fn(idx, 8) for name, fn in ways.items()},
                            label=f"batch {batch}, {n} tokens:")
            for name, (t, spread) in timed.items():
                row[name], row[name + "_spread"] = batch * n / t, spread
            row["compile_seconds"] = engines["engine_compiled"].compile_seconds[batch]
            row["int8_compile_seconds"] = engines["engine_int8_compiled"].compile_seconds[batch]
            for name in ways:
                reads = engines[name].model if name in engines else model
                put_bandwidth(row, name, bytes_per_step(reads, batch, n, cached=name != "no_cache"), bandwidth)
            out.append(row)
            cells = " ".join(f"{row[k]:>7,.0f} ±{row[k + '_spread']:>4.0%}" for k in ways)
            ratios = (f"{row['cached'] / row['no_cache']:>9.1f}x {row['engine'] / row['cached']:>12.2f}x "
                      f"{row['engine_compiled'] / row['cached']:>14.2f}x {row['engine_bf16'] / row['cached']:>10.2f}x "
                      f"{row['engine_int8'] / row['cached']:>10.2f}x "
                      f"{row['engine_int8_compiled'] / row['cached']:>12.2f}x")
            print(f"{batch:>5} {n:>6} {cells} {ratios}")
            print(f"{'MB %bw':>12} {bandwidth_cells(row, ways, 13)}", flush=True)
        print(f"   batch {batch}: compiling the step took {row['compile_seconds']:.1f} s, int8 "
              f"{row['int8_compile_seconds']:.1f} s (not in the figures); Engine's kernel: "
              f"{engines['engine'].chosen[batch]}, int8's: {engines['engine_int8'].chosen[batch]}")


def drift_model(device):
    """The weights drift is measured on: the shipped checkpoint (untrained scores are too flat to say much)."""
    return load(CHECKPOINT, device) if os.path.exists(CHECKPOINT) else untrained_model(device)


def drift_prompt(model):
    return torch.randint(model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(4)).tolist()


@torch.inference_mode()
def dtype_drift(model, dtype, prompt, n_tokens):
    """How far the Engine in `dtype` drifts from float32's, greedy from prompt: the first new token where
    the two part (None: never, in n_tokens) and the largest logit difference along the float32 tokens
    (at most the context's positions, in one forward)."""
    full, low = FastEngine(model), FastEngine(model, dtype=dtype)
    tokens, other = (e.generate_batch(prompt, 1, max_tokens=n_tokens, temperature=0)[0][0] for e in (full, low))
    ids = torch.tensor([prompt + tokens], device=model.emb.weight.device)[:, :model.cfg.context]
    diff = (low.model(ids)[0].float() - model(ids)[0]).abs().max().item()
    return {"first_difference": first_difference(tokens, other), "max_logit_difference": diff}


def table_drift(device, n_tokens, outs):
    """outs: {dtype: the dict its figures go into}."""
    names = " and ".join(DTYPE_NAMES[dtype] for dtype in outs)
    print(f"\n4b. {names} drift from float32, {CHECKPOINT} (trained weights: untrained scores are too flat to say")
    print(f"   much), greedy, {n_tokens} tokens from an 8-token prompt: the first token where each parts, and the")
    print("   largest logit difference along the float32 tokens (at most the context's positions, in one forward)")
    model = drift_model(device)
    for dtype, out in outs.items():
        out.update({"weights": CHECKPOINT if os.path.exists(CHECKPOINT) else "untrained", "tokens": n_tokens,
                    **dtype_drift(model, dtype, drift_prompt(model), n_tokens)})
        parts = out["first_difference"]
        where = f"at token {parts}" if parts is not None else "never"
        print(f"  {DTYPE_NAMES[dtype]} parts from float32 {where} of {n_tokens}; largest logit difference "
              f"{out['max_logit_difference']:.3f}", flush=True)


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


def timed_generation(engine, tokens, n, n_tokens, progress=None, **kwargs):
    """(time to first token, total time, rows) for Engine.generate run to the end."""
    device = engine.model.emb.weight.device
    sync(device)
    t0, started = time.perf_counter(), time.time()
    rows, ttft = [[] for _ in range(n)], None
    for step, (column, _) in enumerate(engine.generate(tokens, n, max_tokens=n_tokens, **kwargs), 1):
        ttft = ttft or time.perf_counter() - t0
        if progress:
            show_progress(progress, step, n_tokens, started)
        for row, token in zip(rows, column):
            row.append(token)
    sync(device)
    return ttft, time.perf_counter() - t0, rows


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
    engine, gen = FastEngine(model), torch.Generator().manual_seed(1)
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


def decode_fixture(model, batch, device):
    """A batch-row cache filled to the full window, and a token to feed."""
    ctx = model.cfg.context
    idx = torch.randint(model.cfg.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(2)).to(device)
    cache = GraphCache.for_model(model, batch, ctx)  # what kernels.DecodeStep writes
    model.step(idx, cache, 0)
    return idx[:, -1:], cache


@torch.inference_mode()
def table_kernels(model, device, sizes, runs, out):
    print(f"\n3. the decode step's matrix multiply: every exact kernel (kernels.py) timed for one step's "
          f"{sum(isinstance(m, torch.nn.Linear) for m in model.modules())} products")
    print("   (ms, fastest of 5 interleaved runs), as the Engine measures them; then one whole step at a full")
    print(f"   {model.cfg.context}-position cache with the chosen kernel and with nn.Linear (ms, median of "
          f"{sizes['steps']} steps)")
    for batch in sizes["batches"]:
        chosen, measured = choose(model, batch)
        token, cache = decode_fixture(model, batch, device)
        ctx, steps = model.cfg.context, sizes["steps"]
        row = {"batch": batch, "kernels_ms": {n: t and t * 1e3 for n, t in measured.items()}, "chosen": chosen}
        def steps_with(runner):
            for _ in range(steps):
                runner.step(token, cache, ctx)
        fast = with_kernel(model, KERNELS[chosen])
        timed = measure({"chosen": lambda: steps_with(fast), "nn": lambda: steps_with(model)}, runs, device)
        for name, (t, _) in timed.items():
            row[f"step_ms_{name}"] = t / steps * 1e3
        out.append(row)
        cells = ", ".join(f"{n} {'not exact' if t is None else f'{t:.2f}'}" for n, t in row["kernels_ms"].items())
        print(f"  batch {batch:>2}: {cells}")
        print(f"            chosen: {chosen}; whole step {row['step_ms_chosen']:.3f} ms, "
              f"with nn.Linear {row['step_ms_nn']:.3f} ms", flush=True)
        if device.type == "cpu" and sizes["compiled_ways"]:
            row["compiled_step_ms"] = compiled_ways(model, device, batch, steps, runs)
            ways = ", ".join(f"{name} {ms:.3f} ms" for name, ms in row["compiled_step_ms"].items())
            print(f"            compiled (kernels.COMPILE_WAYS, the Engine runs the fastest): whole step {ways}")


def compiled_ways(model, device, batch, steps, runs):
    """The step for `batch` rows compiled each of kernels.COMPILE_WAYS worth compiling for them, timed in
    turns at a full cache (ms), with the bench's runs and medians (the Engine, to choose, times them at half)."""
    token, cache = decode_fixture(model, batch, device)
    ways = {name: DecodeStep(model, cache, compile=True, ways={name: o})
            for name, o in compile_ways(device, batch).items()}
    full = model.cfg.context  # a position past the window: each step attends to every slot
    timed = measure({name: lambda s=s: [s(token, full) for _ in range(steps)] for name, s in ways.items()},
                    runs, device)
    return {name: t / steps * 1e3 for name, (t, _) in timed.items()}


@torch.inference_mode()
def table_cuda(model, device, sizes, runs, out):
    print("\n5. CUDA: kernels per decode step, GPU busy share, CUDA-graph decode")
    if device.type != "cuda":
        reason = "skipped: needs a CUDA device (kernel counts, GPU busy time and CUDA graphs exist only there)"
        out["skipped"] = reason
        print(f"  {reason}")
        return
    from torch.profiler import ProfilerActivity, profile
    token, cache = decode_fixture(model, 1, device)
    n, ctx = 20, model.cfg.context
    model.step(token, cache, ctx)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            model.step(token, cache, ctx)
        sync(device)
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    out.update({"kernels_per_step": len(kernels) / n, "gpu_busy_share": busy / wall,
                "profiled_step_ms": wall / n * 1e3})
    print(f"  batch 1: {len(kernels) / n:.0f} kernels per step, "
          f"GPU busy {busy / wall:.0%} of a {wall / n * 1e3:.2f} ms step (profiled)")
    prompt = torch.randint(model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    n_tokens = sizes["lengths"][-1]
    out["graph"] = []
    for batch in sizes["batches"]:
        eager, graphed = FastEngine(model), FastEngine(model, cuda_graph=True)
        runs_of = {e: lambda e=e: e.generate_batch(prompt, batch, max_tokens=n_tokens, temperature=0)[0]
                   for e in (eager, graphed)}
        same = runs_of[eager]() == runs_of[graphed]()
        t_eager, t_graph = (t for t, _ in measure(runs_of, runs, device).values())
        row = {"batch": batch, "tokens": n_tokens, "eager_tok_s": batch * n_tokens / t_eager,
               "graph_tok_s": batch * n_tokens / t_graph, "same_tokens": same}
        out["graph"].append(row)
        print(f"  batch {batch:>2}, {n_tokens} tokens: eager {row['eager_tok_s']:,.0f} tok/s, CUDA graph "
              f"{row['graph_tok_s']:,.0f} tok/s ({t_eager / t_graph:.1f}x), same tokens: {same}", flush=True)
        if not same:
            raise SystemExit("bench.py: error: CUDA-graph replay gave other tokens than the eager path")


# table 6's serving engines: the modules each needs, and the requirements file that installs them
# (CTranslate2 int8: its own int8 compute on the float32 conversion; llama.cpp q8_0: a q8_0 GGUF)
PEERS = {"transformers": (("transformers",), "requirements.txt"),
         "ctranslate2": (("ctranslate2",), "requirements-serve.txt"),
         "ctranslate2_int8": (("ctranslate2",), "requirements-serve.txt"),
         "llama_cpp": (("gguf", "llama_cpp"), "requirements-serve.txt"),
         "llama_cpp_q8_0": (("gguf", "llama_cpp"), "requirements-serve.txt")}
GGUF_KINDS = {"llama_cpp": "f32", "llama_cpp_q8_0": "q8_0"}
CT2_COMPUTE = {"ctranslate2": "float32", "ctranslate2_int8": "int8"}
# what a serving engine's step reads, where it is not the float32 Engine's: the 8-bit engines' weights as the
# int8 Engine's (a byte a weight, a scale a row; q8_0 has one a 32-value block, 6% more), and llama.cpp's
# keys and values in f16, its default cache
PEER_READS = {"ctranslate2_int8": "engine_int8", "llama_cpp_q8_0": "engine_int8"}
PEER_CACHE_DTYPES = {"llama_cpp": torch.float16, "llama_cpp_q8_0": torch.float16}


def missing_peers(device):
    """{peer: why it cannot run here}, for each serving engine of table 6 that cannot."""
    import importlib.util
    missing = {}
    for name, (modules, requirements) in PEERS.items():
        if not all(importlib.util.find_spec(m) for m in modules):
            missing[name] = f"not installed (pip install -r {requirements})"
        elif name != "transformers" and "transformers" in missing:  # the model reaches them through export.py
            missing[name] = "needs transformers to export the model (pip install -r requirements.txt)"
        elif name != "transformers" and device.type != "cpu":
            missing[name] = "run on the CPU only here"
    return missing


def peer_runs(model, engines, missing, prompt, n, folder):
    """{name: run(batch)} for the Engine's forms given and each serving engine installed, on model's weights
    (the serving engines' files written under folder): a run generates batch greedy rows of n tokens from
    prompt and returns (the rows' new ids, the seconds it timed itself in a process of its own, or None)."""
    import export
    import serve
    from bpe import BPE
    device, threads = model.emb.weight.device, torch.get_num_threads()
    runs = {name: lambda b, e=engine: (e.generate_batch(prompt, b, max_tokens=n, temperature=0)[0], None)
            for name, engine in engines.items()}
    if "transformers" in missing:
        return runs
    bpe = BPE.load("tokenizer.json")
    export.logging.disable_progress_bar()  # transformers' bars for writing and loading would break the table's rows
    # and so would its reminder that prompt + n tokens pass the context: 6b compares those tokens
    export.logging.set_verbosity_error()
    export.write_folder(model, bpe, os.path.join(folder, "hf"))
    hf, tokenizer = export.load_folder(os.path.join(folder, "hf"))
    hf = hf.to(device)
    runs["transformers"] = lambda b: (hf.generate(torch.tensor([prompt] * b, device=device), max_new_tokens=n,
                                                  min_new_tokens=n, do_sample=False,
                                                  pad_token_id=0)[:, len(prompt):].tolist(), None)
    tokens = tokenizer.convert_ids_to_tokens(prompt)
    for name, compute in CT2_COMPUTE.items():
        if name not in missing:
            ct2 = os.path.join(folder, "ct2")
            if not os.path.exists(ct2):
                serve.write_ct2(hf, tokenizer, ct2)
            runs[name] = lambda b, compute=compute: last_run(serve.isolated(
                "CTranslate2", serve.ct2_greedy, ct2, tokens, b, n, threads, 2, compute))
    for name, kind in GGUF_KINDS.items():
        if name not in missing:
            gguf = os.path.join(folder, f"model-{kind}.gguf")
            serve.write_gguf(gguf, model.cfg, export.neox_state_dict(model), *export.spelled_vocabulary(bpe), kind)
            runs[name] = lambda b, gguf=gguf: last_run(serve.isolated(
                "llama.cpp", serve.llama_greedy, gguf, prompt, b, n, threads, 2))
    return runs


def last_run(result):
    """(rows, seconds of the last run) from an engine's (rows, [seconds of each run]): the first run warms up."""
    rows, seconds = result
    return rows, seconds[-1]


def table_peers(model, engines, device, sizes, runs, bandwidth, decode, out):
    """The same weights through the serving engines, side by side with the Engine's forms, greedy; an engine
    that cannot run here keeps its column, shown as -, and a line says why. Under each batch, the Engine's
    forms here over their own figures in table 4 (decode: its rows in this run), where it ran that length.

    llama.cpp and CTranslate2 each bring a thread pool that, once started in a process, slows torch
    and every other engine there for the rest of it; so each runs in a fresh process of its own,
    every round (a warm-up, then the timed run), and never during another's timing."""
    import tempfile

    n = min(256, max(sizes["lengths"]))
    print(f"\n6. the same weights through the serving engines: greedy tok/s, {n} tokens (median); the Engine's "
          "forms as in table 4; llama.cpp and CTranslate2 each in a fresh process of its own every round")
    print("   Under each row, %bw: the MB a step must read (as in table 4; the 8-bit engines' weights counted as the")
    print("   int8 Engine's, llama.cpp's keys and values in f16) and bytes a step x steps a second over the bandwidth")
    missing = missing_peers(device)
    for name, why in missing.items():
        print(f"   {name}: {why}")
    prompt = drift_prompt(model)
    ratios = {"compiled/llama_cpp": ("engine_compiled", "llama_cpp"),
              "int8 compiled/q8_0": ("engine_int8_compiled", "llama_cpp_q8_0")}
    with tempfile.TemporaryDirectory() as tmp:
        peers = peer_runs(model, engines, missing, prompt, n, tmp)
        columns = [*engines, *PEERS]
        print(f"{'batch':>5} " + " ".join(f"{name:>15}" for name in columns)
              + "".join(f" {name:>20}" for name in ratios))
        for batch in sizes["batches"]:
            row = {"batch": batch, "tokens": n}
            timed = measure({name: lambda run=run: run(batch)[1] for name, run in peers.items()}, runs, device,
                            label=f"batch {batch}:")
            row.update({name: batch * n / t for name, (t, _) in timed.items()})
            for name in timed:
                reads = engines[PEER_READS.get(name, name)].model if PEER_READS.get(name, name) in engines else model
                put_bandwidth(row, name, bytes_per_step(reads, batch, n, cache_dtype=PEER_CACHE_DTYPES.get(name)),
                              bandwidth)
            out.append(row)
            cells = [f"{row[a] / row[b]:>19.2f}x" if a in row and b in row else f"{'-':>20}"
                     for a, b in ratios.values()]
            print(f"{batch:>5} " + " ".join(f"{row[name]:>15,.0f}" if name in row else f"{'-':>15}" for name in columns)
                  + "".join(f" {cell}" for cell in cells))
            print(f"{'%bw':>5} " + " ".join(bandwidth_cells(row, [name], 15) if name in row else f"{'-':>15}"
                                           for name in columns))
            print(f"{'':>5} {against_table_4(row, engines, decode)}", flush=True)


def against_table_4(row, engines, decode):
    """A line setting the Engine's forms in a table 6 row beside their figures in table 4's rows `decode`
    of the same run (kept in row["over_table_4"]): a form timed twice in one run should agree with itself."""
    same = [r for r in decode if (r["batch"], r["tokens"]) == (row["batch"], row["tokens"])]
    if not same:
        return f"(table 4 did not run batch {row['batch']}, {row['tokens']} tokens in this run: nothing to set beside)"
    row["over_table_4"] = {name: row[name] / same[0][name] for name in engines}
    return ("over table 4 in this run: " + ", ".join(f"{name} {x:.2f}x" for name, x in row["over_table_4"].items())
            + " (the same forms timed twice, a prompt apart)")


def table_peers_drift(device, n_tokens, out):
    """Where each form of the Engine and each serving engine parts from the float32 Engine, greedy, on the
    trained weights (table 6's 8-bit engines beside their float32 forms)."""
    import tempfile

    print(f"\n6b. drift on {CHECKPOINT}: the first of {n_tokens} greedy tokens (8-token prompt, as 4b) where each "
          "parts from the float32 Engine;")
    print("   the compiled forms give their eager forms' tokens (table 4 checks)")
    model = drift_model(device)
    engines = {"engine": FastEngine(model), "engine_bf16": FastEngine(model, dtype=torch.bfloat16),
               "engine_int8": FastEngine(model, dtype=torch.int8)}
    prompt = drift_prompt(model)
    with tempfile.TemporaryDirectory() as tmp:
        runs = peer_runs(model, engines, missing_peers(device), prompt, n_tokens, tmp)
        reference = runs.pop("engine")(1)[0][0]
        for name, run in runs.items():
            out[name] = first_difference(reference, run(1)[0][0])
            print(f"  {name:<17} {'never' if out[name] is None else f'at token {out[name]}'}", flush=True)


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
        raise ValueError(f"--tables takes numbers 0 to 6 separated by commas, got {args.tables!r}")
    if args.whole and "0" not in tables:
        raise ValueError("--whole times table 0's generations whole; add 0 to --tables")
    device = device_from(args.device)
    if args.threads is not None:
        if not 1 <= args.threads <= os.cpu_count():
            raise ValueError(f"THREADS must be in 1..{os.cpu_count()} (this machine's cores), got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.runs < 3:
        raise ValueError(f"--runs must be at least 3 (figures are medians), got {args.runs}")
    if args.json is not None:
        check_output(args.json, args.force)
    if tables & set("346"):  # each times the compiled decode step
        check_compiler(device, "or run only --tables 0,1,2,5")
    sizes = QUICK if args.quick else FULL
    if args.tokens:
        if min(args.tokens) < 8:
            raise ValueError(f"--tokens must be at least 8 (the warm-up's length), got {min(args.tokens)}")
        sizes = sizes | {"lengths": tuple(args.tokens)}

    model = untrained_model(device)
    engines = engine_forms(model) if tables & set("46") else {}
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
        table_kernels(model, device, sizes, args.runs, report["kernels"])
    if "4" in tables:
        table_decode(model, engines, device, sizes, args.runs, bandwidth, report["decode"])
        table_drift(device, sizes["drift"], {torch.bfloat16: report["bf16_drift"], torch.int8: report["int8_drift"]})
    if "5" in tables:
        table_cuda(model, device, sizes, args.runs, report["cuda"])
    if "6" in tables:
        table_peers(model, engines, device, sizes, args.runs, bandwidth, report["decode"],
                    report.setdefault("peers", []))
        table_peers_drift(device, sizes["drift"], report.setdefault("peers_drift", {}))
    if args.json is not None:
        with atomic_write(args.json, "w", force=args.force) as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    run_cli(main)
