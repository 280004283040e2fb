"""One checkpoint, one prompt, eight sampling settings, side by side.

The eight settings run as eight rows of one prefill (prefill_clone's Engine),
each row with its own generator seeded the same, so every row is what that
setting gives alone, and every run on the CPU prints the same text.

    python sample_grid.py [CHECKPOINT] [PROMPT] --tokens 60 --seed 1
"""
import argparse
import sys

from cached import load, tokenize
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


def grid(engine, tokens, n_tokens, seed):
    """Each setting's new tokens, all eight rows from one run of the prompt through `engine`."""
    rows, _ = engine.generate_batch(tokens, len(SETTINGS), max_tokens=n_tokens, seed=[seed] * len(SETTINGS),
                                    settings=list(SETTINGS.values()))
    return dict(zip(SETTINGS, rows))


def main():
    ap = argparse.ArgumentParser(description="Eight sampling settings on one checkpoint.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("prompt", nargs="?", default="Holmes")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if not 0 <= args.tokens <= 100_000 or not 0 <= args.seed < 2**63:
        ap.error(f"--tokens must be in 0..100000 and --seed in 0..2**63 - 1, got {args.tokens} and {args.seed}")
    try:
        model = load(args.checkpoint, args.device)
        tokenizer, prompt = tokenize(args.tokenizer, args.prompt, model)
        tokens = prompt[0].tolist()
        rows = grid(Engine(model, tokenizer), tokens, args.tokens, args.seed)
    except ValueError as e:
        sys.exit(f"sample_grid.py: error: {e}")
    for name, row in rows.items():
        print(f"=== {name}")
        print(tokenizer.decode(tokens + row).strip())
        print()


if __name__ == "__main__":
    main()
