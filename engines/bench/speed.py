"""The engines' speed tables: the decode step's products and compiled ways (3), the Engine's forms (4), CUDA (5).

Run through python -m engines.bench, which prints its header first:

    python -m engines.bench --tables 3,4        # --tables 5 on a CUDA machine

Every figure is timed as bench.py's are (timing.timings: a warm-up, then in
turns, the median and its spread), beside the bytes a step must read.
"""
import os
import time

import torch

from engines.bench.figures import bandwidth_cells, bytes_per_step, put_bandwidth, untrained_model
from cached import first_difference
from engines.edge.checkpoint import load_cached as load
from engines.fast.compile_ways import compile_ways
from engines.fast.decode_step import DecodeStep, GraphCache
from engines.fast.engine import FastEngine
from engines.fast.matmul import KERNELS, choose, with_kernel
from engines.fast.rope import with_row_attention
from bench import sync
from engines.edge.timing import measure


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.int8: "int8"}


CHECKPOINT = "holmes.pt"  # the shipped weights, for the bf16 drift


def decode_fixture(model, batch, device):
    """A batch-row cache filled to the full window, and a token to feed; model's attention writes it in place
    (engines.fast.rope.with_row_attention's)."""
    ctx = model.cfg.context
    idx = torch.randint(model.cfg.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(2)).to(device)
    cache = GraphCache.for_model(model, batch, ctx)  # what the runner's decode step writes
    model.step(idx, cache, 0)
    return idx[:, -1:], cache


@torch.inference_mode()
def table_kernels(model, device, sizes, runs, out):
    model = with_row_attention(model)  # the attention that writes a KVCache in place, as the Engine's
    print(f"\n3. the decode step's matrix multiply: every exact kernel (engines/fast/matmul.py) timed for one step's "
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
            print(f"            compiled (engines.fast.compile_ways.COMPILE_WAYS, the Engine runs the fastest): whole step {ways}")


def compiled_ways(model, device, batch, steps, runs):
    """The step for `batch` rows compiled each of engines.fast.compile_ways.COMPILE_WAYS worth compiling for them, timed in
    turns at a full cache (ms), with the bench's runs and medians (the Engine, to choose, times them at half)."""
    token, cache = decode_fixture(model, batch, device)
    ways = {name: DecodeStep(model, cache, compile=True, ways={name: o})
            for name, o in compile_ways(device, batch).items()}
    full = model.cfg.context  # a position past the window: each step attends to every slot
    timed = measure({name: lambda s=s: [s(token, full) for _ in range(steps)] for name, s in ways.items()},
                    runs, device)
    return {name: t / steps * 1e3 for name, (t, _) in timed.items()}


def engine_forms(model):
    """The Engine as tables 4 and 6 run it: default, compiled, bfloat16, int8 weights and int8 compiled;
    each compiled form compiles once per batch."""
    return {"engine": FastEngine(model), "engine_compiled": FastEngine(model, compile=True),
            "engine_bf16": FastEngine(model, dtype=torch.bfloat16), "engine_int8": FastEngine(model, dtype=torch.int8),
            "engine_int8_compiled": FastEngine(model, dtype=torch.int8, compile=True)}


COMPILED_FORMS = {"engine_compiled": "compiled", "engine_int8_compiled": "int8 compiled"}


def step_alone(engine, batch, prompt, n, device):
    """The kept step a greedy generation of n tokens runs after its first, alone: n - 1 steps from the
    prompt's end, each fed the tokens the one before picked (where the step picks; else the same tokens
    throughout, which cost what any do), with no Python around it but the loop."""
    engine.prepare(batch)
    step = engine.steps[batch, ()]

    @torch.inference_mode()
    def run():
        step.cache.reset()
        step.cache.cache_seqlens.fill_(len(prompt))
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        step.knobs.set([{"temperature": 0}] * batch, prompt)
        for pos in range(len(prompt), len(prompt) + n - 1):
            tokens = step(tokens, pos)[1]
    return run


def outside_the_step(row, timed, batch, n):
    """Each compiled form's step alone and its token (a generation of n tokens less one of 1 token, over
    n - 1: what a token after the first costs), in ms, and the share of a token spent outside the step."""
    for name in COMPILED_FORMS:
        step = timed[name + ":step"][0] / (n - 1) * 1e3
        token = (timed[name][0] - timed[name + ":first"][0]) / (n - 1) * 1e3
        row.update({f"{name}_step_ms": step, f"{name}_token_ms": token, f"{name}_outside": token / step - 1})


def table_decode(model, engines, device, sizes, runs, bandwidth, out):
    print("\n4. decode speed, the post's two loops timed whole beside the Engine: tok/s = batch x tokens / seconds")
    print("   (median, ± half range)")
    print("   Engine: engines.fast.engine.FastEngine's default (the fastest exact kernel, table 3); compiled: compile=True;")
    print("   bf16: dtype=torch.bfloat16 (weights and cache); int8: dtype=torch.int8 (weights one scale per output")
    print("   channel, input rows one a row, int8 products, the cache float32), eager and compiled; drift below")
    print("   Under each row, MB %bw: what a step must read (table 0's MB/step, at each form's dtype), and bytes a")
    print("   step x steps a second over the measured bandwidth. Then, for each compiled form: its step alone (ms,")
    print("   the compiled step with its pick, fed what it picked, n - 1 times), a token after the first (ms: n")
    print("   tokens less 1 token, over n - 1) and the share of that token spent outside the step")
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
            fns = {name: lambda fn=fn: fn(idx, n) for name, fn in ways.items()}
            for name in COMPILED_FORMS:
                fns[name + ":first"] = lambda fn=ways[name]: fn(idx, 1)
                fns[name + ":step"] = step_alone(engines[name], batch, prompt[0].tolist(), n, device)
            warmups = {name: (lambda fn=ways[name]: fn(idx, 8)) if name in ways else fn for name, fn in fns.items()}
            timed = measure(fns, runs, device, warmups=warmups, label=f"batch {batch}, {n} tokens:")
            outside_the_step(row, timed, batch, n)
            timed = {name: timed[name] for name in ways}
            for name, (t, spread) in timed.items():
                row[name], row[name + "_spread"] = batch * n / t, spread
            row["compile_seconds"] = engines["engine_compiled"].prepare(batch)  # made already: what it took
            row["int8_compile_seconds"] = engines["engine_int8_compiled"].prepare(batch)
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
            print(f"{'MB %bw':>12} {bandwidth_cells(row, ways, 13)}")
            print(f"{'':>12} " + "; ".join(
                f"{label}: step {row[name + '_step_ms']:.3f} ms, token {row[name + '_token_ms']:.3f} ms, outside "
                f"{row[name + '_outside']:.0%}" for name, label in COMPILED_FORMS.items()), flush=True)
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


@torch.inference_mode()
def table_cuda(model, device, sizes, runs, out):
    model = with_row_attention(model)  # the attention that writes a KVCache in place, as the Engine's
    print("\n5. CUDA: kernels per decode step, GPU busy share; the decode step eager, captured as a CUDA graph, and "
          "compiled (torch.compile) and captured")
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
        forms = {"eager": FastEngine(model), "graph": FastEngine(model, cuda_graph=True),
                 "compiled graph": FastEngine(model, compile=True)}
        for engine in forms.values():  # compiling and capturing are not what is timed
            engine.prepare(batch)
        runs_of = {name: lambda e=e: e.generate_batch(prompt, batch, max_tokens=n_tokens, temperature=0)[0]
                   for name, e in forms.items()}
        tokens = {name: run() for name, run in runs_of.items()}
        same = all(t == tokens["eager"] for t in tokens.values())
        timed = measure(runs_of, runs, device)
        row = {"batch": batch, "tokens": n_tokens, "same_tokens": same}
        row.update({f"{name.replace(' ', '_')}_tok_s": batch * n_tokens / t for name, (t, _) in timed.items()})
        out["graph"].append(row)
        cells = ", ".join(f"{name} {batch * n_tokens / t:,.0f}" for name, (t, _) in timed.items())
        print(f"  batch {batch:>2}, {n_tokens} tokens (tok/s): {cells}; the same tokens: {same}", flush=True)
        if not same:
            raise SystemExit("bench.py: error: a CUDA graph gave other tokens than the eager path")
