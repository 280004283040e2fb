"""nanochat's trick: run the prompt once at batch 1, copy its cache into N rows.

The cache is the post's dict per layer ("k", "v": batch, heads, positions, head_dim). Engine runs the prompt
once, clones it into N rows (clone_prompt) and lets each row decode on its own as nanochat's Engine does: its
own first token, seeded generator, knobs, forced tokens and stop rule, yielding (token_column, token_masks) a
step. Speed is applied from outside (engines/fast/engine.py's FastEngine extends this loop).

    python prefill_clone.py [CHECKPOINT] [PROMPT] -n 8 --tokens 60 --seed 0   # N samples, then their speed
"""
import argparse
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch

import sampling
from cached import load, tokenize
from model import check_finite

DEFAULT_PROMPT = ("To Sherlock Holmes she is always the woman. I have seldom heard him mention her "
                  "under any other name.")


@torch.inference_mode()
def clone_prompt(model, prompt, n_rows):
    """nanochat's way: one batch-1 pass of the prompt (1, T), its cache copied into n_rows rows."""
    caches = [{} for _ in model.blocks]
    logits = model.step(prompt, caches, 0)
    rows = [{name: t.expand(n_rows, -1, -1, -1) for name, t in cache.items()} for cache in caches]
    return logits.expand(n_rows, -1), rows


def stop_rule(tokenizer, ids, texts):
    """Whether a row's newest token completes a stop: one of the ids, or a text (bytes) that now appears."""
    def stops_at(row, token):
        # a stop text of L bytes first appears ending in the newest token, within the last L tokens' bytes
        new = row.tokens[row.n_prompt:]
        return token in ids or any(t in b"".join(tokenizer.vocab[i] for i in new[-len(t):]) for t in texts)
    return stops_at


@dataclass
class RowState:
    tokens: list
    n_prompt: int
    forced_tokens: deque = field(default_factory=deque)
    completed: bool = False


class Engine:
    """N rows from one prompt: the prompt run once and cloned, then a step a token for every row."""

    def __init__(self, model, tokenizer=None):
        self.model, self.tokenizer, self.rows = model, tokenizer, []

    def prefill(self, prompt, n_rows, max_tokens):
        """The prompt's scores for each row, and the decode step that goes on from them."""
        logits, caches = clone_prompt(self.model, prompt, n_rows)
        return logits, lambda token, pos: self.model.step(token, caches, pos)

    def pick(self, logits, history, generators, settings):
        """One token per row (B,), each row with its own knobs and generator: what it would get alone."""
        return torch.cat([sampling.pick(logits[i:i + 1], history=None if history is None else history[i:i + 1],
                                        generator=[g], **knobs) for i, (g, knobs) in enumerate(zip(generators, settings))])

    def start(self, tokens, num_samples, max_tokens, seed, stop, forced, knobs):
        """Each row's state, generator and knobs, and the stop rule: what generate's loop starts from."""
        if max_tokens is None:
            raise ValueError("give max_tokens: without a bound, a row that never meets a stop would generate forever")
        settings = knobs.pop("settings", None) or [knobs] * num_samples
        seeds = seed if isinstance(seed, (list, tuple)) else [seed + i for i in range(num_samples)]
        generators = [torch.Generator(self.model.emb.weight.device).manual_seed(s) for s in seeds]
        rows = [RowState(list(tokens), len(tokens), deque(f)) for f in forced or [[]] * num_samples]
        stops = [] if stop is None else stop if isinstance(stop, (list, tuple)) else [stop]
        ids, texts = {s for s in stops if isinstance(s, int)}, [s.encode() for s in stops if isinstance(s, str)]
        self.rows = rows
        return rows, generators, list(settings), stop_rule(self.tokenizer, ids, texts)

    def take(self, rows, picked, stops_at):
        """Each row takes its picked token, or its next forced one (mask 0); a completed row takes nothing (None)."""
        column, masks = [None] * len(rows), [None] * len(rows)
        for i, (row, token) in enumerate(zip(rows, picked)):
            if not row.completed:
                masks[i] = 0 if row.forced_tokens else 1
                column[i] = row.forced_tokens.popleft() if row.forced_tokens else token
                row.tokens.append(column[i])
                row.completed = stops_at(row, column[i])
        return column, masks

    @torch.inference_mode()
    def generate(self, tokens, num_samples=1, max_tokens=None, seed=42, stop=None, forced=None, **knobs):
        """Yield (token_column, token_masks) each step: mask 1 sampled, 0 forced, None once a row completed.

        knobs are sampling.pick's, shared or settings=[{...}, ...] one a row; row i draws with seed + i (or
        seed[i]); forced=[[ids], ...] queues tokens a row takes first (self.rows[i].forced_tokens)."""
        rows, generators, settings, stops_at = self.start(tokens, num_samples, max_tokens, seed, stop, forced, knobs)
        device = self.model.emb.weight.device
        prompt = torch.tensor([rows[0].tokens], device=device)
        logits, step = self.prefill(prompt, len(rows), max_tokens)
        # only the repetition penalty reads the tokens so far; keep them only for it
        history = prompt.expand(len(rows), -1) if any(s.get("penalty", 1.0) != 1.0 for s in settings) else None
        pos = prompt.shape[1]
        for n in range(max_tokens):
            picked = self.pick(check_finite(logits, n), history, generators, settings).tolist()
            column, masks = self.take(rows, picked, stops_at)
            yield column, masks
            if n + 1 == max_tokens or all(row.completed for row in rows):
                return  # no step for the last token: nothing would read its logits
            feed = torch.tensor([[row.tokens[-1]] for row in rows], device=device)
            history = None if history is None else torch.cat((history, feed), dim=1)
            logits = step(feed, pos)
            pos += 1

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """Run generate to the end; return each row's new tokens and their masks."""
        steps = list(self.generate(tokens, num_samples, **kwargs))
        return ([[c[i] for c, _ in steps if c[i] is not None] for i in range(len(self.rows))],
                [[m[i] for _, m in steps if m[i] is not None] for i in range(len(self.rows))])


def flags(ap):
    """The command line: a checkpoint, a prompt, N samples and their knobs."""
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    ap.add_argument("-n", type=int, default=8, help="number of samples")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--device", default="cpu")
    return ap


def main():
    ap = flags(argparse.ArgumentParser(description="One prompt pass, N samples: nanochat's prefill-and-clone trick."))
    args = ap.parse_args()
    if not 1 <= args.n <= 1000 or not 1 <= args.tokens <= 100_000 or not 0 <= args.seed < 2**63 - args.n:
        ap.error("-n must be in 1..1000, --tokens in 1..100000, --seed in 0..2**63 - n")
    if not (args.temperature == 0 or 1e-4 <= args.temperature < 1e4) or not 0 < args.top_p <= 1:
        ap.error("--temperature must be 0 (greedy) or in [1e-4, 1e4), --top-p in (0, 1]")
    try:
        model = load(args.checkpoint, args.device)
        tokenizer, prompt = tokenize(args.tokenizer, args.prompt, model)
        tokens = prompt[0].tolist()
        engine, knobs = Engine(model, tokenizer), dict(temperature=args.temperature, top_p=args.top_p)
        engine.generate_batch(tokens, 1, max_tokens=1, seed=args.seed, **knobs)  # warm: no start-up in the timing
        t0 = time.perf_counter()
        rows, _ = engine.generate_batch(tokens, args.n, max_tokens=args.tokens, seed=args.seed, **knobs)
        seconds = time.perf_counter() - t0
    except ValueError as e:
        sys.exit(f"prefill_clone.py: error: {e}")
    for i, row in enumerate(rows):
        print(f"--- sample {i} (seed {args.seed + i})")
        print(tokenizer.decode(tokens + row))
    print(f"\nprompt {len(tokens)} tokens, {args.n} samples x {args.tokens} tokens: "
          f"{args.n * args.tokens / seconds:,.0f} tok/s ({args.device}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
