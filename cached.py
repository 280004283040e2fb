"""A KV cache for the Part 3 GPT, added without retraining, and its proof. The prompt runs once and leaves each
layer's keys and values in the post's dict; each later step feeds one token at its true position.

    python cached.py [CHECKPOINT] [--prompt TEXT] [--tokens 600]   # cached equals uncached inside the window
    python cached.py --break rope|mask     # Gotcha 1 or 2 on purpose: after how many of 100 tokens it drifts
"""
import argparse
import os
import pickle
import sys
import warnings

import torch

from bpe import BPE
from model import GPT, Config, RoPEAttention, check_finite, greedy, in_training, rope_at  # noqa: F401 (the series')


class CachedAttention(RoPEAttention):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.context = cfg.context

    def forward(self, x, cache=None, start=0):
        """With no cache this is Part 3's attention, so model(idx) still works."""
        T = x.shape[1]
        q, k, v = self.heads(x)
        # Gotcha 1: rotate the new tokens at their true positions; from 0, each would look like the text's start
        q, k = rope_at(q, start), rope_at(k, start)
        if cache is not None:
            if "k" in cache:
                assert T == 1, "after the prompt, feed one token at a time"
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            # keep the last `context`; this step still attends to all it has (context + 1 past the window)
            cache["k"], cache["v"] = k[:, :, -self.context:], v[:, :, -self.context:]
        # Gotcha 2: SDPA's causal mask is aligned top-left: one query would see only the first key
        return self.attend(q, k, v, is_causal=T > 1)


class RopeFromZero(CachedAttention):
    """RoPE starts every new token at position 0: Gotcha 1 on purpose, each token rotated as if it came first."""
    def forward(self, x, cache=None, start=0):
        return super().forward(x, cache, 0)


class AlwaysCausal(CachedAttention):
    """is_causal=True with one query: Gotcha 2 on purpose, that query then sees only the first key."""
    def attend(self, q, k, v, is_causal, attn_mask=None):
        return super().attend(q, k, v, True, attn_mask)


GOTCHAS = {"rope": RopeFromZero, "mask": AlwaysCausal}  # --break NAME: the same weights, a broken attention


class CachedGPT(GPT):
    def __init__(self, cfg=None, attention=CachedAttention):
        super().__init__(cfg)
        for block in self.blocks:  # same parameter names, so Part 3 checkpoints load
            cached = attention(self.cfg)
            cached.load_state_dict(block.attn.state_dict())  # and Part 3's init: the same untrained model
            block.attn = cached

    def step(self, idx, caches, start):
        """Run only the new tokens idx (B, T) at positions start..; the last position's logits (B, vocab)."""
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
    """A Part 3 checkpoint as a CachedGPT in eval mode, read as data (weights_only=True), strictly; else ValueError."""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO or a device would block torch.load for good
        raise ValueError(f"checkpoint {path!r} is not a regular file (a folder, a pipe or a device); "
                         "pass a Part 3 .pt file")
    try:
        with warnings.catch_warnings(action="ignore"):  # torch's aside on the pickle protocol: one line says it all
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model = CachedGPT(Config(**ckpt["config"]))
        model.load_state_dict(ckpt["model"])
        # series.train's record of the tokenizer it trained with (Part 3's checkpoints have none): tokenize checks it
        model.checkpoint, model.trained_with = path, ckpt.get("tokenizer")
    except FileNotFoundError:
        raise ValueError(f"no checkpoint at {path!r}; pass a Part 3 .pt file") from None
    except Exception as e:  # whatever torch.load, Config or load_state_dict says of a file that is not Part 3's
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        if isinstance(e, pickle.UnpicklingError):  # torch's message would suggest weights_only=False: running code
            reason = "not a torch.save file, or one holding code or objects besides tensors and plain data"
        raise ValueError(f"{path!r} is not a loadable Part 3 checkpoint ({reason})") from None
    return model.to(device).eval()


def tokenize(path, text, model):
    """Part 1's tokenizer (refused unless its vocabulary is the model's, and its merges those the checkpoint records,
    where it records them) and the prompt's last `context` ids (1, T)."""
    tokenizer, vocab = BPE.load(path), model.cfg.vocab_size
    if tokenizer.vocab_size != vocab:
        raise ValueError(f"{path!r} has {tokenizer.vocab_size} tokens but the model a vocabulary of {vocab}; "
                         "give the tokenizer it was trained with (--tokenizer)")
    record = getattr(model, "trained_with", None)
    if record is not None and (not isinstance(record, dict) or record.get("sha256") != tokenizer.record()["sha256"]):
        raise ValueError(f"{path!r} is not the tokenizer {model.checkpoint!r} was trained with (their merges differ); "
                         "give that one with --tokenizer")
    if not (ids := tokenizer.encode(text)[-model.cfg.context:]):
        raise ValueError("the prompt is empty; give at least one character")
    return tokenizer, torch.tensor([ids], device=model.emb.weight.device)


def first_difference(a, b):
    """Index of the first position where two token lists differ, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def prove(model, prompt, n_tokens):
    cached = model.generate_cached(prompt, n_tokens)[0].tolist()
    uncached = model.generate_uncached(prompt, n_tokens)[0].tolist()  # the speed of each: bench.py
    # the tokens the uncached loop makes while it sees the whole text: those must be the same
    exact = min(n_tokens, model.cfg.context - prompt.shape[1] + 1)
    if (diff := first_difference(cached, uncached)) is not None and diff < prompt.shape[1] + exact:
        sys.exit(f"cached.py: FAILED: cached and uncached differ at position {diff}, inside the first {exact} tokens")
    print(f"the first {exact} generated tokens are identical (the uncached loop sees the whole text that far)")
    print(f"after that: no difference in all {len(cached)} positions" if diff is None else
          f"after that: first difference at position {diff} of {len(cached)}")


def main():
    ap = argparse.ArgumentParser(description="KV cache: cached equals uncached inside the window.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--prompt", default="The night was")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--break", dest="broken", choices=sorted(GOTCHAS), help="reproduce a gotcha on purpose")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if not 0 <= args.tokens <= 100_000:
        ap.error(f"--tokens must be in 0..100000, got {args.tokens}")
    try:
        model = load(args.checkpoint, args.device)
        prompt = tokenize(args.tokenizer, args.prompt, model)[1]
        print(f"{args.checkpoint}, prompt {args.prompt!r} ({prompt.shape[1]} tokens), greedy, {args.device}")
        if args.broken is None:
            return prove(model, prompt, args.tokens)
        broken = CachedGPT(model.cfg, GOTCHAS[args.broken]).to(args.device).eval()
        broken.load_state_dict(model.state_dict())
        right, wrong = (m.generate_cached(prompt, 100)[0, prompt.shape[1]:].tolist() for m in (model, broken))
        diff = first_difference(right, wrong)
    except ValueError as e:
        sys.exit(f"cached.py: error: {e}")
    verdict = "never drifts" if diff is None else f"drifts from the correct cached output after {diff} tokens"
    print(f"--break {args.broken} ({GOTCHAS[args.broken].__doc__.split(':')[0]}): of 100 greedy tokens, {verdict}")


if __name__ == "__main__":
    main()
