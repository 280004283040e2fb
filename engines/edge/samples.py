"""A run of N samples from one prompt at the command line: prefill_clone.py's, and engines/fast/engine.py's.

The flags (add_sample_flags), checked before any checkpoint is read (sample_knobs), and the
samples printed with their time to the first token and tokens a second (show_samples).
"""
import torch

from engines.edge.checks import check_cache, check_knobs, check_seeds, prompt_ids
from engines.edge.cli import check_count
from engines.edge.timing import timed_generation
from prefill_clone import DEFAULT_PROMPT


def add_sample_flags(ap):
    """The flags of a run of N samples from one prompt: prefill_clone.py's, and engines/fast/engine.py's."""
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    ap.add_argument("-n", type=int, default=8, help="number of samples")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--device", default="cpu")


def sample_knobs(args):
    """The knobs of a run of N samples (cli.add_sample_flags), its -n, --seed and --tokens checked first."""
    check_count("-n", args.n, 1)
    check_seeds(args.seed, args.n, "--seed")
    check_count("--tokens", args.tokens, 1)
    knobs = dict(temperature=args.temperature, top_p=args.top_p)
    check_knobs(**knobs)
    return knobs


def show_samples(engine, tokenizer, args, knobs, prepare=lambda: ""):
    """Print args.n samples of the prompt, then the time to the first token and the tokens a second, warm (a
    one-token run first: a GPU's start-up, the allocator's first requests are no token's time); prepare() runs
    before anything is timed, and what it returns ends the last line."""
    tokens = prompt_ids(tokenizer, args.prompt, engine.model)[0].tolist()
    check_cache(engine.model, args.n, engine.cache_len(len(tokens), args.tokens))  # before anything allocates it
    note = prepare()
    engine.generate_batch(tokens, 1, max_tokens=1, seed=args.seed, **knobs)
    ttft, seconds, rows = timed_generation(engine, tokens, args.n, args.tokens, "tokens", seed=args.seed, **knobs)
    for i, row in enumerate(rows):
        print(f"--- sample {i} (seed {args.seed + i})")
        print(tokenizer.decode(tokens + row))
    print(f"\nprompt {len(tokens)} tokens, {args.n} samples x {args.tokens} tokens: first token in "
          f"{ttft * 1e3:.1f} ms, {args.n * args.tokens / seconds:,.0f} tok/s ({args.device}, "
          f"{torch.get_num_threads()} threads{note})")
