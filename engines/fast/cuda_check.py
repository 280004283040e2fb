"""The decode step's claims on a CUDA GPU: the same tokens as the CPU, and FastEngine's speed against its targets.

    python -m engines.fast.cuda_check [CHECKPOINT] [--prompt TEXT] [--json FILE]

1. Tokens: `python cached.py`'s greedy tokens on the CPU (the prompt's whole window: context - prompt + 1
   tokens, as far as its proof goes), then FastEngine's on the GPU with the decode step eager (the lesson's),
   captured as a CUDA graph, and compiled by torch.compile and captured: float32 with TF32 off (asserted),
   each must give the CPU's tokens. Exit 1 where one does not.
2. Speed: FastEngine.generate_batch with the compiled, captured step, greedy, 1 and 16 rows, float32 and
   bfloat16, the median of five runs after one that compiles, captures and warms up (start-up left out), tok/s
   printed against the targets (a benchmark: a target not met is said, not failed).
"""
import json
import statistics
import time

from engines.edge.cli import Parser, device_from, run_cli
from engines.edge.errors import BadValue

import torch

from engines.edge.checkpoint import load_pair
from engines.edge.checks import prompt_ids
from engines.fast.engine import FastEngine

TARGETS = {("float32", 1): 3_000, ("float32", 16): 25_000, ("bfloat16", 1): 5_000, ("bfloat16", 16): 80_000}
TOKENS = 240  # each timed generation's: the prompt and these within the window


def same_tokens(model, prompt, device):
    """{form: whether its tokens on `device` are the CPU's}, and how many tokens each was."""
    n = model.cfg.context - prompt.shape[1] + 1
    want = model.generate_cached(prompt, n)[0, prompt.shape[1]:].tolist()
    on_gpu = model.to(device)
    forms = {"eager": FastEngine(on_gpu), "graph": FastEngine(on_gpu, cuda_graph=True),
             "compiled graph": FastEngine(on_gpu, compile=True)}
    ids = prompt[0].tolist()
    return {name: engine.generate_batch(ids, 1, max_tokens=n, temperature=0)[0][0] == want
            for name, engine in forms.items()}, n


def tokens_a_second(model, prompt, dtype, rows, runs=5):
    """The median of `runs` generations' tok/s, after one that compiles, captures and warms up."""
    engine, ids, seconds = FastEngine(model, dtype=dtype, compile=True), prompt[0].tolist(), []
    for _ in range(runs + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.generate_batch(ids, rows, max_tokens=TOKENS, temperature=0)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return rows * TOKENS / statistics.median(seconds[1:])


def main():
    ap = Parser(description="The decode step on CUDA: the CPU's tokens, and FastEngine's tok/s against targets.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--prompt", default="The night was")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    device = device_from(args.device)
    if device.type != "cuda":
        raise BadValue(f"--device must be a CUDA device, got {args.device!r}")
    torch.set_float32_matmul_precision("highest")
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 is off at the highest float32 precision"
    model, tokenizer = load_pair(args.checkpoint, args.tokenizer)
    prompt = prompt_ids(tokenizer, args.prompt, model)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, float32 matmul precision "
          f"{torch.get_float32_matmul_precision()}, TF32 {torch.backends.cuda.matmul.allow_tf32}", flush=True)
    same, n = same_tokens(model, prompt, device)
    for name, ok in same.items():
        print(f"{'PASS' if ok else 'FAIL'} tokens: {name} step on {device} gives cached.py's {n} CPU tokens", flush=True)
    speed = {}
    for (dtype, rows), target in TARGETS.items():
        speed[f"{dtype}_{rows}"] = tok_s = tokens_a_second(model, prompt, getattr(torch, dtype), rows)
        print(f"target FastEngine compiled graph, {dtype}, {rows} row(s): {tok_s:,.0f} tok/s, >= {target:,}: "
              f"{'met' if tok_s >= target else 'NOT met'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "same_tokens": same,
                       "tokens": n, "tok_s": speed}, f, indent=1)
    if not all(same.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    run_cli(main)
