"""A KV cache for the Part 3 GPT, added without retraining, and its proof.

Prefill runs the whole prompt once and keeps each layer's keys and values;
every later step feeds one token at its true position and attends to the
kept keys. Two details make it exact: RoPE starts at the token's position
(rope_at), and the causal mask applies only when more than one query is fed
(with one query, SDPA's top-left-aligned mask would hide all keys but the first).

    python cached.py [CHECKPOINT] [--prompt TEXT] [--tokens 600]

generates greedily with and without the cache, asserts the tokens agree inside
the context window and reports where they first part past it.

    python cached.py --break rope     # RoPE without the offset
    python cached.py --break mask     # is_causal=True on one-query steps

reproduce the two bugs and report after how many of 100 tokens each drifts.
"""
import sys
import time
from dataclasses import dataclass

import torch

from bpe import BPE
from model import (
    GPT,
    Block,
    Parser,
    RoPEAttention,
    check_count,
    greedy,
    load_checkpoint,
    rope_cos_sin,
    rotate,
    run_cli,
)


def rope_at(x, start):
    """RoPE for x (..., T, head_dim) whose first row sits at position `start`."""
    positions = torch.arange(start, start + x.shape[-2], device=x.device)
    return rotate(x, *rope_cos_sin(positions, x.shape[-1]))


@dataclass
class LayerCache:
    """One layer's keys and values, (B, n_kv_heads, T, head_dim), T <= context."""
    k: torch.Tensor = None
    v: torch.Tensor = None


class CachedAttention(RoPEAttention):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.context = cfg.context

    def rope(self, x, start):
        return rope_at(x, start)

    def causal(self, n_queries):
        return n_queries > 1

    def forward(self, x, cache=None, start=0):
        q, k, v = self.heads(x)
        q, k = self.rope(q, start), self.rope(k, start)
        if cache is not None:
            if cache.k is not None:
                if x.shape[1] > 1:
                    raise ValueError("after the prefill, feed one token per step")
                k, v = torch.cat((cache.k, k), dim=2), torch.cat((cache.v, v), dim=2)
            cache.k, cache.v = k[:, :, -self.context:], v[:, :, -self.context:]
            k, v = cache.k, cache.v
        return self.attend(q, k, v, is_causal=self.causal(q.shape[2]))


class RopeFromZero(CachedAttention):
    """Gotcha 1: every step's token is rotated as if it sat at position 0."""

    def rope(self, x, start):
        return rope_at(x, 0)


class AlwaysCausal(CachedAttention):
    """Gotcha 2: with one query, is_causal=True lets it see only the first key."""

    def causal(self, n_queries):
        return True


BROKEN = {"rope": RopeFromZero, "mask": AlwaysCausal}


class CachedBlock(Block):
    attention = CachedAttention

    def forward(self, x, cache=None, start=0):
        x = x + self.attn(self.norm1(x), cache, start)
        return x + self.mlp(self.norm2(x))


class CachedGPT(GPT):
    block = CachedBlock
    generate_uncached = GPT.generate

    def step(self, idx, caches, start):
        """Run only the new tokens idx (B, T) at positions start.., return last-position logits."""
        x = self.emb(idx)
        for block, cache in zip(self.blocks, caches):
            x = block(x, cache, start)
        return self.head(self.norm(x[:, -1]))

    @torch.no_grad()
    def generate_cached(self, idx, n_tokens, pick=greedy):
        """Prefill the last `context` prompt tokens at once, then one token a step."""
        check_count("n_tokens", n_tokens)
        caches = [LayerCache() for _ in self.blocks]
        window = idx[:, -self.cfg.context:]
        logits, pos = self.step(window, caches, 0), window.shape[1]
        for _ in range(n_tokens):
            token = pick(logits, idx)
            idx = torch.cat((idx, token), dim=1)
            logits, pos = self.step(token, caches, pos), pos + 1
        return idx


def load(path, device="cpu"):
    return load_checkpoint(path, device, cls=CachedGPT)


def broken_attention(name):
    if name not in BROKEN:
        raise ValueError(f"--break must be one of {sorted(BROKEN)}, got {name!r}")
    return BROKEN[name]


def break_on_purpose(model, name):
    """Swap every layer's attention for a broken variant (same weights, no new ones)."""
    for block in model.blocks:
        block.attn.__class__ = broken_attention(name)
    return model


def first_difference(a, b):
    """Index of the first position where two token lists differ, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def encode_prompt(tokenizer, text, model):
    """The prompt's ids (1, T) on the model's device, each one an id the model knows."""
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("the prompt is empty; give at least one character")
    vocab = model.cfg.vocab_size
    if max(ids) >= vocab:
        raise ValueError(f"the tokenizer gave id {max(ids)}, but the model's vocabulary is 0..{vocab - 1}; "
                         "give the tokenizer this checkpoint was trained with (--tokenizer)")
    return torch.tensor([ids], device=model.emb.weight.device)


def with_progress(model, idx, n_tokens, label):
    """Part 3's uncached loop, one token at a time, with a progress line on stderr."""
    t0 = time.time()
    for i in range(n_tokens):
        idx = model.generate_uncached(idx, 1)
        done = i + 1
        eta = (time.time() - t0) / done * (n_tokens - done)
        print(f"\r{label}: {done}/{n_tokens} tokens, ETA {eta:.0f}s ", end="", file=sys.stderr)
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    return idx


def prove(model, prompt, n_tokens):
    ctx, n_prompt = model.cfg.context, prompt.shape[1]
    t0 = time.time()
    cached = model.generate_cached(prompt, n_tokens)[0].tolist()
    t_cached = time.time() - t0
    t0 = time.time()
    uncached = with_progress(model, prompt, n_tokens, "uncached")[0].tolist()
    t_uncached = time.time() - t0
    print(f"cached:   {n_tokens} tokens in {t_cached:5.1f}s ({n_tokens / t_cached:,.0f} tok/s)")
    print(f"uncached: {n_tokens} tokens in {t_uncached:5.1f}s ({n_tokens / t_uncached:,.0f} tok/s)")
    inside = min(n_tokens, ctx - n_prompt)
    diff = first_difference(cached, uncached)
    if diff is not None and diff < n_prompt + inside:
        sys.exit(f"cached.py: FAILED: cached and uncached differ inside the window, at position {diff}")
    print(f"inside the window: the first {inside} generated tokens are identical")
    if diff is None:
        print(f"past the window: no difference in all {len(cached)} positions")
    else:
        print(f"past the window: first difference at position {diff} of {len(cached)}")


def drift(model, prompt, name, n_tokens=100):
    """After how many greedy tokens the broken variant parts from the correct one (None: never).

    The model is left broken."""
    correct = model.generate_cached(prompt, n_tokens)[:, prompt.shape[1]:]
    broken = break_on_purpose(model, name).generate_cached(prompt, n_tokens)[:, prompt.shape[1]:]
    return first_difference(correct[0].tolist(), broken[0].tolist())


def main():
    ap = Parser(description="KV cache: cached equals uncached inside the window.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--prompt", default="The night was")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--break", dest="broken", metavar="rope|mask", help="reproduce a gotcha on purpose")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.broken is not None:
        broken_attention(args.broken)
    check_count("--tokens", args.tokens)
    model = load(args.checkpoint, args.device)
    prompt = encode_prompt(BPE.load(args.tokenizer), args.prompt, model)
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
