"""The speed code's tables, beside the post's (bench.py): what the engines make of the same decode step.

    python -m engines.bench [cpu|cuda] [THREADS] [--tables 3,4,5,6] [--quick] [--runs 3] [--tokens 64 256 1024]
                            [--json PATH [--force]]

Untrained weights, greedy, 8-token random prompts, seeded. Each figure is the median of --runs runs
after a warm-up, with its spread (half the range, as a share of the median); the figures a row
compares take turns, one run each a round (engines/edge/timing.py). Every decode figure stands beside
the physical limit, as gpt-fast and nanochat's infer_bench print it: the header gives the memory read
bandwidth measured first (a 1 GiB tensor summed), each tok/s figure the bytes a step must read (every
weight once, and the keys and values it attends to) and the rate it reads them at as a share of it.

3. The decode step's matrix multiply: every exact kernel in engines/fast/matmul.py timed here, the one
   the Engine chose, and a whole step with it and with nn.Linear; on the CPU, the step compiled each of
   engines.fast.compile_ways.COMPILE_WAYS worth compiling for the rows.
4. The post's two loops, timed whole, beside FastEngine as it runs by default, compiled (compile time
   reported apart), in bfloat16, and with int8 weights eager and compiled; then how far bfloat16 and
   int8 drift from float32 on trained weights.
5. CUDA only: kernels per decode step, the share of the step the GPU is busy, and FastEngine with each
   decode step a CUDA-graph replay, at batch 1 and 16.
6. The same weights through the serving engines installed (transformers; CTranslate2 float32 and int8,
   llama.cpp f32 and q8_0, on the CPU) beside the Engine's forms; then where each parts from float32.
"""
import json

import torch

from engines.bench import peers, speed
from engines.edge.cli import Parser, device_from, run_cli, thread_count
from engines.edge.errors import BadValue
from engines.bench.figures import machine, read_bandwidth, untrained_model
from engines.edge.files import atomic_write, check_output, starts_with
from engines.fast.compile_ways import check_compiler

FULL = dict(batches=(1, 16), lengths=(64, 256, 1024), steps=50, drift=256, compiled_ways=True)
QUICK = dict(batches=(1, 4), lengths=(8, 16), steps=5, drift=16, compiled_ways=False)  # no extra compiles
TABLES = "3456"
REPORT = starts_with(b'{\n "machine": ')  # how json.dump(report, indent=1) begins: --force replaces only that


def main():
    ap = Parser(description="The engines' speed tables (3 to 6), beside bench.py's post tables.")
    ap.add_argument("device", nargs="?", default="cpu", help="cpu or cuda")
    ap.add_argument("threads", nargs="?", type=thread_count, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--tables", default="3,4,6", help="which tables to run, e.g. 4,6 (default 3,4,6; 5 is CUDA's)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per figure (at least 3)")
    ap.add_argument("--tokens", type=int, nargs="+", help="table 4's lengths (default 64 256 1024)")
    ap.add_argument("--json", metavar="PATH", help="write every figure here")
    ap.add_argument("--force", action="store_true", help="replace an existing --json file")
    args = ap.parse_args()
    tables = set(args.tables.split(","))
    if not tables <= set(TABLES):
        raise BadValue(f"--tables takes numbers 3 to 6 separated by commas, got {args.tables!r}")
    device = device_from(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.runs < 3:
        raise BadValue(f"--runs must be at least 3 (figures are medians), got {args.runs}")
    if args.tokens and min(args.tokens) < 8:
        raise BadValue(f"--tokens must be at least 8 (the warm-up's length), got {min(args.tokens)}")
    if args.json is not None:
        check_output(args.json, args.force, ours=REPORT)
    if tables & set("346"):  # each times the compiled decode step
        check_compiler(device, "or run only --tables 5")
    sizes = (QUICK if args.quick else FULL) | ({"lengths": tuple(args.tokens)} if args.tokens else {})

    model = untrained_model(device)
    forms = speed.engine_forms(model) if tables & set("46") else {}
    info = machine(device)
    bandwidth = info["read_bytes_per_s"] = read_bandwidth(device)
    print(f"python -m engines.bench: {info['device']} ({info.get('gpu', info['cpu'])}), {info['threads']} "
          f"thread{'s' * (info['threads'] != 1)}, memory read {bandwidth / 1e9:.1f} GB/s (a tensor sum), "
          f"torch {info['torch']}, untrained weights, greedy, median of {args.runs} runs in turns after a warm-up")
    report = {"machine": info, "quick": args.quick, "runs": args.runs, "tables": sorted(tables), "decode": [],
              "kernels": [], "bf16_drift": {}, "int8_drift": {}, "cuda": {}}
    if "3" in tables:
        speed.table_kernels(model, device, sizes, args.runs, report["kernels"])
    if "4" in tables:
        speed.table_decode(model, forms, device, sizes, args.runs, bandwidth, report["decode"])
        speed.table_drift(device, sizes["drift"], {torch.bfloat16: report["bf16_drift"], torch.int8: report["int8_drift"]})
    if "5" in tables:
        speed.table_cuda(model, device, sizes, args.runs, report["cuda"])
    if "6" in tables:
        peers.table_peers(model, forms, device, sizes, args.runs, bandwidth, report["decode"],
                          report.setdefault("peers", []))
        peers.table_peers_drift(device, sizes["drift"], report.setdefault("peers_drift", {}))
    if args.json is not None:
        with atomic_write(args.json, "w", force=args.force, ours=REPORT) as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    run_cli(main)
