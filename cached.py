"""A KV cache for the Part 3 GPT, added without retraining, and its proof.

The prompt pass runs the whole prompt once and keeps each layer's keys and
values in the post's dict per layer; every later step feeds one token at its
true position (rope_at) and attends to the kept keys, unmasked (is_causal=T > 1).
The same forward runs prefill_clone.py's ring, which writes in place.

    python cached.py [CHECKPOINT] [--prompt TEXT] [--tokens 600]

asserts greedy tokens with and without the cache agree while the uncached loop
sees the whole text (context - prompt + 1 tokens), and says where they part.

    python cached.py --break rope     # RoPE without the offset
    python cached.py --break mask     # is_causal=True on one-query steps

reproduce the two bugs and report after how many of 100 tokens each drifts.
"""
import sys
import time

import torch

from checkpoint import load_checkpoint, tokenizer_for
from checks import check_kept_tokens, prompt_ids
from cli import Parser, check_count, run_cli, with_progress
# Config too: the series' scripts import it from here (`from cached import CachedGPT, Config`).
from model import GPT, Block, Config, RoPEAttention, check_finite, greedy, in_training, rope_at  # noqa: F401


class CachedAttention(RoPEAttention):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.context = cfg.context

    def forward(self, x, cache=None, start=0):
        """With no cache this is Part 3's attention, so model(idx) still works. cache: the post's dict, or
        one that writes in place (prefill_clone's ring), whose update(k, v, start) returns what to attend to."""
        T = x.shape[1]
        q, k, v = self.heads(x)
        # Gotcha 1: rotate the new tokens at their true positions; from 0, each new token would
        # look like the start of the text, and its distance to every cached key would be wrong.
        q, k = rope_at(q, start), rope_at(k, start)
        if isinstance(cache, dict):
            if "k" in cache:
                assert T == 1, "after the prompt, feed one token at a time"
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            # keep the last `context`; this step still attends to all it has (context + 1 past the window)
            cache["k"], cache["v"] = k[:, :, -self.context:], v[:, :, -self.context:]
        elif cache is not None:
            k, v = cache.update(k, v, start)
        # Gotcha 2: SDPA's causal mask is aligned top-left; with one query it would hide every
        # key but the first, so mask only the prompt's many queries.
        return self.attend(q, k, v, is_causal=T > 1)


class RopeFromZero(CachedAttention):
    """Gotcha 1 on purpose: the attention forgets the offset, every token is rotated as if it came first."""

    def forward(self, x, cache=None, start=0):
        return super().forward(x, cache, 0)


class AlwaysCausal(CachedAttention):
    """Gotcha 2 on purpose: is_causal=True even for one query, which then sees only the first key."""

    def attend(self, q, k, v, is_causal, attn_mask=None):
        return super().attend(q, k, v, True, attn_mask)


GOTCHAS = {"rope": RopeFromZero, "mask": AlwaysCausal}  # --break NAME


class CachedBlock(Block):
    attention = CachedAttention


class CachedGPT(GPT):
    block = CachedBlock  # same parameter names, so Part 3 checkpoints load

    def step(self, idx, caches, start):
        """Run only the new tokens idx (B, T) at positions start..; the last position's logits (B, vocab).
        caches: one cache per layer (the post's dicts, or a prefill_clone.KVCache)."""
        x = self.emb(idx)
        for block, cache in zip(self.blocks, caches):
            x = x + block.attn(block.norm1(x), cache, start)
            x = x + block.mlp(block.norm2(x))
        return self.head(self.norm(x[:, -1]))

    @torch.no_grad()
    def generate_cached(self, idx, n_tokens, pick=greedy):
        """pick(logits, idx) chooses the next token; idx is everything so far."""
        assert not in_training(self), "call model.eval() first: in training mode dropout changes every token"
        caches = [{} for _ in self.blocks]
        prompt = idx[:, -self.cfg.context:]
        logits = self.step(prompt, caches, 0)  # prefill: the whole prompt in one pass
        pos = prompt.shape[1]
        for i in range(n_tokens):
            nxt = pick(check_finite(logits, i), idx)[:, None]
            idx = torch.cat([idx, nxt], dim=1)
            logits = self.step(nxt, caches, pos)
            pos += 1
        return idx


def load(path, device="cpu"):
    return load_checkpoint(path, device, cls=CachedGPT)


def first_difference(a, b):
    """Index of the first position where two token lists differ, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def exact_tokens(context, n_prompt):
    """The generated tokens the cache must reproduce exactly: those the uncached loop makes seeing the whole text."""
    return context - min(n_prompt, context) + 1


def load_pair(checkpoint, tokenizer_path, device="cpu"):
    """The model and the tokenizer it was trained with (checkpoint.tokenizer_for says how that is known)."""
    model = load(checkpoint, device)
    return model, tokenizer_for(model, checkpoint, tokenizer_path)


def timed(generate, prompt, n_tokens, label):
    t0 = time.time()
    tokens = generate(prompt, n_tokens, with_progress(greedy, n_tokens, f"{label} tokens"))[0].tolist()
    seconds = time.time() - t0
    print(f"{label + ':':<10}{n_tokens} tokens in {seconds:5.1f}s ({n_tokens / seconds:,.0f} tok/s)")
    return tokens


def prove(model, prompt, n_tokens):
    n_prompt = prompt.shape[1]
    cached = timed(model.generate_cached, prompt, n_tokens, "cached")
    uncached = timed(model.generate_uncached, prompt, n_tokens, "uncached")
    exact = min(n_tokens, exact_tokens(model.cfg.context, n_prompt))
    diff = first_difference(cached, uncached)
    if diff is not None and diff < n_prompt + exact:
        sys.exit(f"cached.py: FAILED: cached and uncached differ at position {diff}, "
                 f"inside the first {exact} generated tokens")
    print(f"the first {exact} generated tokens are identical (the uncached loop sees the whole text that far)")
    print(f"after that: no difference in all {len(cached)} positions" if diff is None else
          f"after that: first difference at position {diff} of {len(cached)}")


def drift(model, prompt, name, n_tokens=100):
    """After how many greedy tokens the broken variant parts from the correct one (None: never); the model is left broken."""
    correct = model.generate_cached(prompt, n_tokens)[:, prompt.shape[1]:]
    for block in model.blocks:  # every layer's attention swapped for the broken variant, on the same weights
        block.attn.__class__ = GOTCHAS[name]
    broken = model.generate_cached(prompt, n_tokens)[:, prompt.shape[1]:]
    return first_difference(correct[0].tolist(), broken[0].tolist())


def main():
    ap = Parser(description="KV cache: cached equals uncached inside the window.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--prompt", default="The night was")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--break", dest="broken", choices=sorted(GOTCHAS), help="reproduce a gotcha on purpose")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    check_count("--tokens", args.tokens)
    model, tokenizer = load_pair(args.checkpoint, args.tokenizer, args.device)
    prompt = prompt_ids(tokenizer, args.prompt, model)
    check_kept_tokens(1, prompt.shape[1] + args.tokens, args.device)
    print(f"{args.checkpoint}, prompt {args.prompt!r} ({prompt.shape[1]} tokens), greedy, {args.device}")
    if args.broken is None:
        prove(model, prompt, args.tokens)
        return
    diff = drift(model, prompt, args.broken)
    what = {"rope": "RoPE starts every new token at position 0", "mask": "is_causal=True with one query"}
    verdict = "never drifts" if diff is None else f"drifts from the correct cached output after {diff} tokens"
    print(f"--break {args.broken} ({what[args.broken]}): of 100 greedy tokens, {verdict}")


if __name__ == "__main__":
    run_cli(main)
