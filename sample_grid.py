"""One checkpoint, one prompt, eight sampling settings, side by side.

The eight settings run as eight rows of one prefill (prefill_clone's Engine),
each row with its own generator seeded the same, so every row is what that
setting gives alone, and every run on the CPU prints the same text.

    python sample_grid.py [CHECKPOINT] [PROMPT] --tokens 60 --seed 1 [--compile] [--dtype bfloat16]

--compile and --dtype run the eight rows on engines.fast_engine's FastEngine
instead (only then is anything beyond the lesson loaded): the text is the
same compiled, and may part from float32's in bfloat16 or int8. Compiling
comes first, and its time is printed last.
"""
from cli import Parser, add_speed_flags, check_count, run_cli, with_progress
from errors import BadValue

from cached import load_pair
from checks import prompt_ids
from prefill_clone import Engine

SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 0.5": dict(temperature=0.5),
    "temperature 1.0": dict(temperature=1.0),
    "temperature 1.5": dict(temperature=1.5),
    "top-k 40": dict(top_k=40),
    "top-p 0.9": dict(top_p=0.9),
    "greedy + penalty 1.3": dict(temperature=0, penalty=1.3),
    "top-p 0.9, temperature 0.8, penalty 1.3": dict(top_p=0.9, temperature=0.8, penalty=1.3),
}


def grid(engine, tokens, n_tokens, seed, progress=None):
    """Each setting's new tokens, all eight rows from one run of the prompt through `engine`."""
    if progress:  # a token a step for every row: count the Engine's picks
        engine.pick = with_progress(engine.pick, n_tokens, progress)
    rows, _ = engine.generate_batch(tokens, len(SETTINGS), max_tokens=n_tokens, seed=[seed] * len(SETTINGS),
                                    settings=list(SETTINGS.values()))
    return dict(zip(SETTINGS, rows))


def main():
    ap = Parser(description="Eight sampling settings on one checkpoint.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("prompt", nargs="?", default="Holmes")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--device", default="cpu")
    add_speed_flags(ap)
    args = ap.parse_args()
    check_count("--tokens", args.tokens)
    if not 0 <= args.seed < 2**64:
        raise BadValue(f"--seed must be in 0..{2**64 - 1}, got {args.seed}")
    fast = args.compile or args.dtype != "float32"
    if fast:  # the speed the flags ask for, from beside the lesson
        from engines.fast_engine import FastEngine, speed_flags
        speed = speed_flags(args)  # checked before the checkpoint is read
    model, tokenizer = load_pair(args.checkpoint, args.tokenizer, args.device)
    tokens = prompt_ids(tokenizer, args.prompt, model)[0].tolist()
    engine = FastEngine(model, **speed) if fast else Engine(model)
    compile_seconds = engine.prepare(len(SETTINGS), list(SETTINGS.values())) if fast else 0.0  # before the ETA
    rows = grid(engine, tokens, args.tokens, args.seed, "tokens")
    for name, row in rows.items():
        print(f"=== {name}")
        print(tokenizer.decode(tokens + row).strip())
        print()
    if args.compile:
        print(f"the compiled decode step ready in {compile_seconds:.1f} s")


if __name__ == "__main__":
    run_cli(main)
