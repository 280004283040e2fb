"""Every speed and memory figure the inference post claims, measured here.

    python bench.py [cpu|cuda] [THREADS] [--quick] [--json PATH] [--runs 3]

Untrained weights, greedy, fp32, 8-token random prompts, seeded. Each figure
is the median of --runs runs after a warm-up, with its spread (half the range,
as a share of the median). Rows print as they are measured:

1. Cache memory measured from the tensors against the formula.
2. Time to first token: N separate prefills against one prefill plus a copy.
3. Where the time goes: a decode step's matrix multiplies alone against the
   whole step, each with the weights on the left and as nn.Linear runs them.
4. The post's table: tok/s with no cache (Part 3's loop), cached.py's cache,
   and prefill_clone's Engine (preallocated ring cache), as it runs by default
   and with the Linear layers' weights on the left (model.weights_left).
5. CUDA only: kernels per decode step, the share of the step the GPU is busy,
   and the Engine with each decode step a CUDA-graph replay, at batch 1 and 16.
6. The same weights through the serving engines installed (transformers always;
   CTranslate2 and llama.cpp with requirements-serve.txt, on the CPU) beside the Engine.
"""
import json
import os
import platform
import time

import torch

from cached import CachedGPT
from cli import Parser, atomic_write, check_output, device_from, run_cli, show_progress
from model import Config, weights_left
from prefill_clone import Engine, cloned_prefill, prefill, separate_prefills, sync, timed_generation

FULL = dict(batches=(1, 16), lengths=(64, 256, 1024), prompts=(64, 256), clones=(1, 4, 8, 16), steps=50)
QUICK = dict(batches=(1, 4), lengths=(8, 16), prompts=(16, 32), clones=(1, 4), steps=5)
ENGINES = {"engine": False, "engine_weights_left": True}  # column: Engine's weights_left


def median(xs):
    return sorted(xs)[len(xs) // 2]


def measure(fn, runs, device, warmup=None, label=""):
    """Median and spread (half range / median) of fn's wall time over runs, after a warm-up."""
    (warmup or fn)()
    times, started = [], time.time()
    for i in range(runs):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        show_progress(f"  {label} runs", i + 1, runs, started)
    mid = median(times)
    return mid, (max(times) - min(times)) / 2 / mid


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


def table_decode(model, device, sizes, runs, out):
    print("\n4. decode speed, the post's table: tok/s = batch x tokens / seconds (median, ± half range)")
    print("   Engine: prefill_clone's default (nn.Linear's matmul order); Engine, left: weights_left=True")
    print(f"{'batch':>5} {'tokens':>6} {'no cache':>14} {'cached.py':>14} {'Engine':>14} {'Engine, left':>14} "
          f"{'cache/none':>10} {'Engine/cached':>13} {'left/cached':>11}")
    gen = torch.Generator().manual_seed(0)
    for batch in sizes["batches"]:
        prompt = torch.randint(model.cfg.vocab_size, (1, 8), generator=gen)
        idx = prompt.expand(batch, -1).to(device)
        ways = {"no_cache": model.generate_uncached, "cached": model.generate_cached}
        for name, on in ENGINES.items():
            engine = Engine(model, weights_left=on)
            ways[name] = lambda i, k, engine=engine: engine.generate_batch(prompt[0].tolist(), batch, max_tokens=k,
                                                                             temperature=0)
        for n in sizes["lengths"]:
            row = {"batch": batch, "tokens": n}
            for name, fn in ways.items():
                t, spread = measure(lambda: fn(idx, n), runs, device, warmup=lambda: fn(idx, 8),
                                    label=f"batch {batch}, {n} tokens, {name}:")
                row[name] = batch * n / t
                row[name + "_spread"] = spread
            out.append(row)
            cells = " ".join(f"{row[k]:>7,.0f} ±{row[k + '_spread']:>4.0%}" for k in ways)
            ratios = (f"{row['cached'] / row['no_cache']:>9.1f}x {row['engine'] / row['cached']:>12.2f}x "
                      f"{row['engine_weights_left'] / row['cached']:>10.2f}x")
            print(f"{batch:>5} {n:>6} {cells} {ratios}", flush=True)


def table_memory(device, out):
    print("\n1. cache memory at 256 tokens, batch 1, fp32: 2 (k, v) x layers x tokens x kv width x 4 bytes")
    for name, cfg in (("Part 3 (4 heads)", Config()), ("GQA (4 q heads, 1 kv head)", Config(n_kv_heads=1))):
        model = CachedGPT(cfg).to(device).eval()
        _, cache = prefill(model, torch.zeros(1, 256, dtype=torch.long, device=device), 256)  # what a prompt fills
        formula = 2 * cfg.n_layers * 256 * cfg.n_kv_heads * cfg.head_dim * 4
        out.append({"config": name, "measured_bytes": cache.nbytes(), "formula_bytes": formula})
        print(f"  {name:<28} measured {cache.nbytes() / 2**20:.2f} MiB, formula {formula / 2**20:.2f} MiB")


def table_prefill(model, device, sizes, runs, out):
    print("\n2. time to first token: N separate prefills against one prefill + copy (ms, median)")
    print(f"{'prompt':>6} {'N':>3} {'separate':>10} {'clone':>10} {'speedup':>8}")
    gen = torch.Generator().manual_seed(1)
    for n_prompt in sizes["prompts"]:
        prompt = torch.randint(model.cfg.vocab_size, (n_prompt,), generator=gen).tolist()
        for n in sizes["clones"]:
            sep, clone = (measure(lambda: timed_generation(Engine(model, prefill=first), prompt, n, 1, temperature=0),
                                  runs, device)[0]
                          for first in (separate_prefills, cloned_prefill))
            out.append({"prompt": n_prompt, "n": n, "separate_ms": sep * 1e3, "clone_ms": clone * 1e3})
            print(f"{n_prompt:>6} {n:>3} {sep * 1e3:>10.1f} {clone * 1e3:>10.1f} {sep / clone:>7.1f}x", flush=True)


def decode_fixture(model, batch, device):
    """A batch-row cache filled to the full window, and a token to feed."""
    ctx = model.cfg.context
    idx = torch.randint(model.cfg.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(2)).to(device)
    _, cache = prefill(model, idx, ctx)
    return idx[:, -1:], cache


def matmuls_only(model, batch, ctx, device):
    """The decode step's matrix multiplies through the model's own Linear layers, nothing else."""
    cfg = model.cfg
    x = torch.randn(batch, 1, cfg.d_model, device=device)
    h = torch.randn(batch, 1, 4 * cfg.d_model, device=device)
    q = torch.randn(batch, cfg.n_heads, 1, cfg.head_dim, device=device)
    keys = torch.randn(batch, cfg.n_heads, cfg.head_dim, ctx, device=device)
    scores = torch.randn(batch, cfg.n_heads, 1, ctx, device=device)
    values = torch.randn(batch, cfg.n_heads, ctx, cfg.head_dim, device=device)

    def run():
        for block in model.blocks:
            block.attn.qkv(x)
            q @ keys
            scores @ values
            block.attn.out(x)
            block.mlp[0](x)
            block.mlp[2](h)
        return model.head(x[:, -1])
    return run


@torch.inference_mode()
def table_overhead(model, device, sizes, runs, out):
    print(f"\n3. where the time goes: one decode step at a full {model.cfg.context}-position cache "
          f"(ms, median of {sizes['steps']} steps)")
    print("   the whole step, and its matrix multiplies alone, with the weights on the left (W @ rows.T)")
    print("   and as nn.Linear runs them (rows @ W.T, what cached.py runs)")
    print(f"{'batch':>5} {'step, left':>11} {'step, nn':>9} {'matmuls, left':>14} {'matmuls, nn':>12}")
    for batch in sizes["batches"]:
        token, cache = decode_fixture(model, batch, device)
        ctx, steps = model.cfg.context, sizes["steps"]
        floor = matmuls_only(model, batch, ctx, device)
        row = {"batch": batch}
        for name, on in (("left", True), ("nn_linear", False)):
            with weights_left(on):
                step = measure(lambda: [model.step(token, cache, ctx) for _ in range(steps)], runs, device)[0]
                mm = measure(lambda: [floor() for _ in range(steps)], runs, device)[0]
            row[f"step_ms_{name}"], row[f"matmul_ms_{name}"] = step / steps * 1e3, mm / steps * 1e3
        out.append(row)
        print(f"{batch:>5} {row['step_ms_left']:>11.3f} {row['step_ms_nn_linear']:>9.3f} "
              f"{row['matmul_ms_left']:>14.3f} {row['matmul_ms_nn_linear']:>12.3f}", flush=True)


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
        eager, graphed = Engine(model), Engine(model, cuda_graph=True)
        runs_of = {e: lambda e=e: e.generate_batch(prompt, batch, max_tokens=n_tokens, temperature=0)[0]
                   for e in (eager, graphed)}
        same = runs_of[eager]() == runs_of[graphed]()
        t_eager, t_graph = (measure(runs_of[e], runs, device)[0] for e in (eager, graphed))
        row = {"batch": batch, "tokens": n_tokens, "eager_tok_s": batch * n_tokens / t_eager,
               "graph_tok_s": batch * n_tokens / t_graph, "same_tokens": same}
        out["graph"].append(row)
        print(f"  batch {batch:>2}, {n_tokens} tokens: eager {row['eager_tok_s']:,.0f} tok/s, CUDA graph "
              f"{row['graph_tok_s']:,.0f} tok/s ({t_eager / t_graph:.1f}x), same tokens: {same}", flush=True)
        if not same:
            raise SystemExit("bench.py: error: CUDA-graph replay gave other tokens than the eager path")


def table_peers(model, device, sizes, runs, out):
    """The same weights through the serving engines installed, side by side with the Engine, greedy."""
    import importlib.util
    import os
    import tempfile

    import export
    import serve
    from bpe import BPE
    n = min(256, max(sizes["lengths"]))
    print(f"\n6. the same weights through the serving engines: greedy tok/s, {n} tokens (median)")
    bpe = BPE.load("tokenizer.json")
    prompt = torch.randint(model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        export.write_folder(model, bpe, os.path.join(tmp, "hf"))
        hf, tokenizer = export.load_folder(os.path.join(tmp, "hf"))
        hf = hf.to(device)
        engine = Engine(model)
        peers = {"engine": lambda b: engine.generate_batch(prompt, b, max_tokens=n, temperature=0),
                 "transformers": lambda b: hf.generate(torch.tensor([prompt] * b, device=device), max_new_tokens=n,
                                                       min_new_tokens=n, do_sample=False, pad_token_id=0)}
        if device.type == "cpu" and importlib.util.find_spec("ctranslate2"):
            serve.write_ct2(hf, tokenizer, os.path.join(tmp, "ct2"))
            generator, tokens = serve.ct2_generator(os.path.join(tmp, "ct2")), tokenizer.convert_ids_to_tokens(prompt)
            peers["ctranslate2"] = lambda b: serve.ct2_greedy(generator, tokens, b, n)
        if device.type == "cpu" and importlib.util.find_spec("gguf") and importlib.util.find_spec("llama_cpp"):
            gguf = os.path.join(tmp, "model.gguf")
            serve.write_gguf(gguf, model.cfg, export.neox_state_dict(model), *export.spelled_vocabulary(bpe))
            llm = serve.llama(gguf)
            peers["llama_cpp"] = lambda b: (serve.llama_greedy(llm, prompt, n) if b == 1
                                            else serve.llama_greedy_batch(gguf, prompt, b, n))
        print(f"{'batch':>5} " + " ".join(f"{name:>13}" for name in peers))
        for batch in sizes["batches"]:
            row = {"batch": batch, "tokens": n}
            for name, run in peers.items():
                row[name] = batch * n / measure(lambda: run(batch), runs, device, label=f"batch {batch}, {name}:")[0]
            out.append(row)
            print(f"{batch:>5} " + " ".join(f"{row[name]:>13,.0f}" for name in peers), flush=True)


def main():
    ap = Parser(description="Measure the post's speed and memory claims.")
    ap.add_argument("device", nargs="?", default="cpu", help="cpu or cuda")
    ap.add_argument("threads", nargs="?", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--json", metavar="PATH", help="write every figure here")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per figure (at least 3)")
    ap.add_argument("--force", action="store_true", help="replace an existing --json file")
    args = ap.parse_args()
    device = device_from(args.device)
    if args.threads is not None:
        if not 1 <= args.threads <= os.cpu_count():
            raise ValueError(f"THREADS must be in 1..{os.cpu_count()} (this machine's cores), got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.runs < 3:
        raise ValueError(f"--runs must be at least 3 (figures are medians), got {args.runs}")
    if args.json is not None:
        check_output(args.json, args.force)
    sizes = QUICK if args.quick else FULL

    torch.manual_seed(0)
    model = CachedGPT().to(device).eval()
    info = machine(device)
    print(f"bench.py: {info['device']} ({info.get('gpu', info['cpu'])}), {info['threads']} threads, "
          f"torch {info['torch']}, untrained weights, greedy, fp32, median of {args.runs} runs after a warm-up")
    report = {"machine": info, "quick": args.quick, "runs": args.runs,
              "decode": [], "memory": [], "prefill_clone": [], "overhead": [], "cuda": {}}
    table_memory(device, report["memory"])
    table_prefill(model, device, sizes, args.runs, report["prefill_clone"])
    table_overhead(model, device, sizes, args.runs, report["overhead"])
    table_decode(model, device, sizes, args.runs, report["decode"])
    table_cuda(model, device, sizes, args.runs, report["cuda"])
    table_peers(model, device, sizes, args.runs, report.setdefault("peers", []))
    if args.json is not None:
        with atomic_write(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    run_cli(main)
