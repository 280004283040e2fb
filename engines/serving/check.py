"""The serving engine's claim on the shipped checkpoint: each request gets the tokens the Engine gives it alone.

    python -m engines.serving.check [CHECKPOINT] [--chats 16] [--tokens 40] [--fixed-shapes] [--compile] [--threads N]
                                    [--device cpu|cuda] [--dtype float32|bfloat16|float16]

Replays seeded chats through one ServingEngine: turn 1 of every chat (a shared system prompt, a user
line, random knobs and seed) arriving at random steps, then turn 2 of each (turn 1, its reply and a new
line), which finds turn 1's blocks in the prefix cache. Every request is run again alone through
prefill_clone.Engine; the check asserts the tokens agree and prints the largest difference between a
served row's logits and the same row's alone, the prompt tokens served from the cache, and the tokens a
second each way (those vary with the machine and its load; the tokens do not). --compile: the decode step
compiled, or loaded from the compile cache, before the chats start. In a narrower --dtype than float32 the
batch's shape can move a row's logits, so there it reports the requests that part from the Engine alone and
the first token where each does, instead of asserting.
"""
import random
import time

from engines.edge.cli import Parser, check_least, device_from, run_cli, thread_count

import torch

from engines.edge.checkpoint import load_pair
from engines.edge.errors import BadValue
from engines.fast.engine import check_dtype
from engines.serving.engine import SERVED_DTYPES, Request, ServingEngine
from prefill_clone import DEFAULT_PROMPT, Engine

MAX_CHATS = 10_000  # the docs' run is 16; a thousand times more proves nothing more
LINES = ["What do you make of the letter?", "Where were you last night, Watson?", "Tell me of the woman.",
         "Who rang the bell at so late an hour?", "The hound, Holmes, the hound!", "Why the speckled band?"]
KNOBS = [dict(temperature=0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=40),
         dict(temperature=0.7, penalty=1.2)]


def served(engine, arrivals):
    """Run [(step, Request)] through engine: {id: tokens}, {id: [logits]}, {id: cached tokens}, seconds."""
    tokens, logits, cached = {}, {}, {}

    def recording(rows, seqs):  # the logits each request's tokens are picked from
        for row, s in zip(rows, seqs):
            logits.setdefault(s.id, []).append(row.float())
    engine.runner.on_logits, pending, step, started = recording, sorted(arrivals, key=lambda a: a[0]), 0, time.perf_counter()
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            engine.submit(pending.pop(0)[1])
        for event in engine.step():
            tokens.setdefault(event.request_id, []).append(event.token)
            cached[event.request_id] = event.cached_tokens
        step += 1
    engine.runner.on_logits = None
    return tokens, logits, cached, time.perf_counter() - started


def alone(model, tokenizer, r):
    """r's tokens and logits from the lesson's Engine, r alone."""
    engine, logits = Engine(model, tokenizer), []
    pick = engine.pick
    engine.pick = lambda rows, *rest: logits.append(rows[0].float()) or pick(rows, *rest)
    knobs = dict(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, penalty=r.penalty)
    rows, _ = engine.generate_batch(r.prompt, 1, max_tokens=r.max_tokens, seed=r.seed, stop=r.stop, **knobs)
    return rows[0], logits


def compare(model, tokenizer, requests, result, exact):
    """Each request's served tokens against the Engine's alone, asserted equal where `exact`: (largest logit
    difference, its scale, seconds, {id: the first token where the two part})."""
    tokens, logits, _, _ = result
    worst, scale, parted, started = 0.0, 0.0, {}, time.perf_counter()
    for r in requests:
        want, want_logits = alone(model, tokenizer, r)
        if tokens[r.id] != want:
            if exact:
                raise SystemExit(f"serving_check: FAILED: request {r.id} served {tokens[r.id]}, alone {want}")
            parted[r.id] = next((i for i, (a, b) in enumerate(zip(tokens[r.id], want)) if a != b),
                                min(len(tokens[r.id]), len(want)))
        for got, expected in zip(logits[r.id], want_logits):
            worst, scale = max(worst, (got - expected).abs().max().item()), max(scale, expected.abs().max().item())
    return worst, scale, time.perf_counter() - started, parted


def main():
    ap = Parser(description="Serve seeded two-turn chats at once; assert each request's tokens equal the Engine's "
                            "for it alone; print the largest logit difference and the prefix cache's hits.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=40, help="max_tokens of each turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixed-shapes", action="store_true")
    ap.add_argument("--compile", action="store_true", help="the decode step compiled (or loaded from the compile cache)")
    ap.add_argument("--threads", type=thread_count, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    ap.add_argument("--dtype", default="float32", choices=SERVED_DTYPES)
    args = ap.parse_args()
    for name, value, least in (("--chats", args.chats, 1), ("--tokens", args.tokens, 1)):
        check_least(name, value, least)
    if args.chats > MAX_CHATS:  # each chat is held, and replayed alone, in memory: 10**9 would run until it ran out
        raise BadValue(f"--chats must be at most {MAX_CHATS:,} (the check holds and replays every chat), "
                       f"got {args.chats:,}")
    device = device_from(args.device)
    dtype = check_dtype(args.dtype, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_pair(args.checkpoint, args.tokenizer, device)
    model = model.to(dtype)
    rng, system = random.Random(args.seed), tokenizer.encode(DEFAULT_PROMPT)
    engine = ServingEngine(model, tokenizer, fixed_shapes=args.fixed_shapes, compile=args.compile)
    print(f"{args.checkpoint}: {args.chats} chats, {args.tokens} tokens a turn, a {len(system)}-token system prompt, "
          f"{'fixed' if args.fixed_shapes else 'variable'} shapes, the decode step "
          f"{'compiled' if args.compile else 'eager'}, {device}, {args.dtype}, {torch.get_num_threads()} threads")
    turn1 = [Request(f"chat{i}.1", system + tokenizer.encode(" " + rng.choice(LINES)), args.tokens,
                     seed=rng.randrange(2**32), **rng.choice(KNOBS)) for i in range(args.chats)]
    first = served(engine, [(rng.randrange(3 * args.chats), r) for r in turn1])
    prompts = [r.prompt + first[0][r.id] + tokenizer.encode("\n" + rng.choice(LINES)) for r in turn1]
    turn2 = [Request(f"chat{i}.2", p, min(args.tokens, model.cfg.context - len(p)), seed=r.seed + 1,
                     temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, penalty=r.penalty)
             for i, (r, p) in enumerate(zip(turn1, prompts))]
    second = served(engine, [(rng.randrange(args.chats), r) for r in turn2])
    for name, requests, result in (("turn 1", turn1, first), ("turn 2", turn2, second)):
        worst, scale, seconds, parted = compare(model, tokenizer, requests, result, exact=dtype == torch.float32)
        made, prompts = sum(len(t) for t in result[0].values()), sum(len(r.prompt) for r in requests)
        equal = (f"every request's {made} tokens equal the Engine's alone" if not parted else
                 f"{len(requests) - len(parted)} of {len(requests)} requests equal the Engine's alone, the others "
                 f"parting at token {min(parted.values())} at the earliest ({args.dtype}: the batch moves logits)")
        print(f"{name}: {equal}; largest logit difference {worst:.3g} "
              f"(logits up to {scale:.3g}); {sum(result[2].values())} of {prompts} prompt tokens from the cache; "
              f"{made / result[3]:,.0f} tok/s served, {made / seconds:,.0f} tok/s one at a time")


if __name__ == "__main__":
    run_cli(main)
