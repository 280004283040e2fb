"""A KV cache for the Part 3 GPT, added without retraining, and its proof.

The prompt pass (the post's prefill) runs the whole prompt once and keeps each
layer's keys and values; every later step feeds one token at its true position
and attends to the kept keys. Two details make it exact: RoPE starts at the
token's position (rope_at), and the causal mask applies only when more than
one query is fed (with one query, SDPA's top-left-aligned mask would hide all
keys but the first). The forward asks a cache object where the new keys go and
what to read: LayerCache here (concatenate, keep the last `context`), KVCache
in prefill_clone.py (preallocated, a ring past the window). The post's plain
dict per layer works too (`caches = [{} for _ in model.blocks]`): it is
wrapped in PostCache, which keeps "k" and "v" in the dict in the post's order.

    python cached.py [CHECKPOINT] [--prompt TEXT] [--tokens 600]

generates greedily with and without the cache, asserts the tokens agree as far
as the uncached loop sees the whole text (context - prompt + 1 tokens), and
reports where they first part past it, and where the post's order (attend to
context + 1 keys, then trim) first parts from this repo's (trim, then attend).

    python cached.py --break rope     # RoPE without the offset
    python cached.py --break mask     # is_causal=True on one-query steps

reproduce the two bugs and report after how many of 100 tokens each drifts.
"""
import sys
import time

# first: cli.check_start says in one line what would stop torch from starting
from cli import Parser, check_count, run_cli, with_progress
from errors import BadValue

import torch

from checks import check_kept_tokens, load_checkpoint, prompt_ids, tokenizer_for
# Config too: the series' scripts import it from here (`from cached import CachedGPT, Config`).
from model import GPT, Block, Config, RoPEAttention, check_finite, greedy, in_training, rope_at  # noqa: F401


class LayerCache:
    """One layer's rolling cache: the last `context` keys and values, (B, n_kv_heads, T, head_dim)."""

    def __init__(self, context):
        self.context, self.k, self.v = context, None, None

    def joined(self, k, v):
        """The kept keys and values with the new ones after them."""
        if self.k is None:
            return k, v
        if k.shape[2] > 1:
            raise BadValue("after the prompt pass, feed one token per step")
        return torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)

    def update(self, k, v, start):
        """Keep the new keys and values; return what attention reads, and no mask."""
        k, v = self.joined(k, v)
        # Trim before attending, so no step sees more than `context` keys: that is what training
        # saw and what prefill_clone's ring holds (the post attends to context + 1, then trims).
        self.k, self.v = k[:, :, -self.context:], v[:, :, -self.context:]
        return self.k, self.v, None


class TrimAfter(LayerCache):
    """The post's order: attend to the kept keys plus the new one (context + 1), then trim."""

    def update(self, k, v, start):
        k, v = self.joined(k, v)
        self.k, self.v = k[:, :, -self.context:], v[:, :, -self.context:]
        return k, v, None


class PostCache(TrimAfter):
    """The post's cache: a plain dict per layer holding the kept keys and values as "k" and "v",
    appended and trimmed in the post's order, so its loop and its bench.py's byte count see the dicts they expect."""

    def __init__(self, store, context):
        super().__init__(context)
        self.store, self.k, self.v = store, store.get("k"), store.get("v")

    def update(self, k, v, start):
        attended = super().update(k, v, start)
        self.store["k"], self.store["v"] = self.k, self.v
        return attended


class CachedAttention(RoPEAttention):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.context = cfg.context

    def forward(self, x, cache=None, start=0):
        """With no cache this is Part 3's attention, so model(idx) still works."""
        T = x.shape[1]
        q, k, v = self.heads(x)
        # Gotcha 1: rotate the new tokens at their true positions; from 0, each new token would
        # look like the start of the text, and its distance to every cached key would be wrong.
        q, k = rope_at(q, start), rope_at(k, start)
        mask = None
        if cache is not None:
            if isinstance(cache, dict):  # the post's per-layer dict
                cache = PostCache(cache, self.context)
            # The cache decides where the new keys go and what this step reads.
            k, v, mask = cache.update(k, v, start)
        # Gotcha 2: SDPA's causal mask is aligned top-left; with one query it would hide every
        # key but the first, so mask only the prompt's many queries.
        return self.attend(q, k, v, is_causal=T > 1, attn_mask=mask)


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
        """Run only the new tokens idx (B, T) at positions start..; return the last position's logits (B, vocab).

        caches: one cache per layer (LayerCache objects, the post's dicts, or a prefill_clone.KVCache)."""
        x = self.emb(idx)
        for block, cache in zip(self.blocks, caches):
            x = x + block.attn(block.norm1(x), cache, start)
            x = x + block.mlp(block.norm2(x))
        return self.head(self.norm(x[:, -1]))

    @torch.no_grad()
    def generate_cached(self, idx, n_tokens, pick=greedy, cache=LayerCache):
        """pick(logits, idx) chooses the next token; idx is everything so far."""
        assert not in_training(self), "call model.eval() first: in training mode dropout changes every token"
        caches = [cache(self.cfg.context) for _ in self.blocks]
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


def break_on_purpose(model, name):
    """Swap every layer's attention for a broken variant (same weights, no new ones)."""
    for block in model.blocks:
        block.attn.__class__ = GOTCHAS[name]
    return model


def first_difference(a, b):
    """Index of the first position where two token lists differ, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def exact_tokens(context, n_prompt):
    """How many generated tokens the cache must reproduce exactly: while the uncached loop still
    sees the whole text (prompt + tokens so far <= context), both compute the same thing."""
    return context - min(n_prompt, context) + 1


def load_pair(checkpoint, tokenizer_path, device="cpu"):
    """The model and the tokenizer it was trained with (checks.tokenizer_for says how that is known)."""
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
    if diff is None:
        print(f"after that: no difference in all {len(cached)} positions")
    else:
        print(f"after that: first difference at position {diff} of {len(cached)}")
    post = model.generate_cached(prompt, n_tokens, cache=TrimAfter)[0].tolist()
    diff = first_difference(cached, post)
    where = "never, in" if diff is None else f"at position {diff} of"
    print(f"the post's order (attend to context + 1 keys, then trim) parts from trim-first {where} {len(cached)}")


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
    if args.broken not in (None, *GOTCHAS):
        raise BadValue(f"--break must be one of {sorted(GOTCHAS)}, got {args.broken!r}")
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
