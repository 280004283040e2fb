"""The Part 3 GPT: pre-norm blocks, RoPE attention, a head tied to the embedding.

Module names, state-dict keys, init and checkpoint format are Part 3's, so a Part 3
checkpoint loads with strict=True and what this repo writes loads in Part 3's code.
One addition changes nothing unless asked for: Config.n_kv_heads (grouped-query
attention). The one RoPE, rope_at(x, start), serves Part 3 (start=0) and every
cached step. Nothing here is about speed: engines/ applies that from outside.

    python model.py     # the parameter budget; the untrained loss is close to ln(vocab_size)
"""
import argparse
import math
import os
import pickle
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import sampling


@dataclass
class Config:
    vocab_size: int = 4096
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 6
    context: int = 256
    dropout: float = 0.1
    n_kv_heads: int = 0  # 0 means n_heads: plain multi-head attention, as in Part 3

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads

    @property
    def head_dim(self):
        return self.d_model // self.n_heads

    @property
    def n_weights(self):
        """How many weights GPT(self) has (the head tied to the embedding counted once), known before it is built.
        int() first: a checkpoint's config is any plain data, and '6' * 10**10 would build a 10 GB string."""
        V, d, L, H, kv = (int(getattr(self, f)) for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads"))
        return V * d + L * (10 * d * d + 2 * d * kv * (d // H) + 9 * d) + 2 * d


def read_checkpoint(path):
    """A Part 3 checkpoint's dict and its Config, read as data: weights_only=True loads tensors and plain data,
    never code, and a config describing more weights than the file has bytes is refused before anything is built."""
    try:
        with warnings.catch_warnings(action="ignore"):  # torch's note on the pickle protocol: the refusal is one line
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's own message ends by suggesting weights_only=False, which runs the code
        raise ValueError("Weights only load failed: it is not a torch.save file, or it holds code or objects that "
                         "are not plain tensors, which are never loaded") from None
    cfg = Config(**ckpt["config"])
    if cfg.n_weights > os.path.getsize(path):  # a weight takes a byte at least
        raise ValueError(f"the model its config describes has {cfg.n_weights:,} weights, more than the "
                         f"{os.path.getsize(path):,} bytes of the file hold")
    return ckpt, cfg


def rope_freqs(head_dim, device=None):
    """RoPE's angle per position for each channel pair: 10000 ** (-2j / head_dim)."""
    return 10000 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def rotate(x, angles):
    """x (..., T, head_dim) with each channel pair (2j, 2j+1) turned by angles (..., T, head_dim / 2), in float32."""
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


def rope_at(x, start):
    """Part 2's RoPE for x (B, heads, T, head_dim), its first row at position `start`, not 0."""
    T, freqs = x.shape[-2], rope_freqs(x.shape[-1], x.device)
    # Gotcha 1: the angles begin at the token's true position, not at 0
    angles = torch.arange(start, start + T, dtype=torch.float32, device=x.device)[:, None] * freqs
    return rotate(x, angles)


class RoPEAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.kv_width = cfg.n_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * self.kv_width, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def heads(self, x):
        """q (B, n_heads, T, hd), k and v (B, n_kv_heads, T, hd); nothing rotated yet."""
        B, T, d = x.shape
        q, k, v = self.qkv(x).split([d, self.kv_width, self.kv_width], dim=-1)
        return tuple(t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))

    def attend(self, q, k, v, is_causal, attn_mask=None):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                           dropout_p=self.dropout if self.training else 0.0,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        B, H, T, hd = y.shape
        return self.out(y.transpose(1, 2).reshape(B, T, H * hd))

    def forward(self, x):
        q, k, v = self.heads(x)
        return self.attend(rope_at(q, 0), rope_at(k, 0), v, is_causal=True)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.norm1 = nn.LayerNorm(d)
        self.attn = RoPEAttention(cfg)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(cfg.dropout))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def greedy(logits, idx):
    """The pick that always takes the highest score: one id per row, (B,)."""
    return logits.argmax(dim=-1)


def in_training(model):
    """Whether any part of the model is in training mode, where dropout changes every token."""
    return any(m.training for m in model.modules())


def check_finite(logits, n):
    """Stop at the step whose scores are NaN or infinite: no token can be chosen honestly from them."""
    if not torch.isfinite(logits.abs().amax()):  # one reduction: NaN and infinity both survive abs().amax()
        raise ValueError(f"the model's scores for new token {n} are NaN or infinite (its weights overflow); "
                         "no token can be chosen from them")
    return logits


class GPT(nn.Module):
    def __init__(self, cfg=None):
        super().__init__()
        self.cfg = cfg = cfg or Config()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.emb.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("attn.out.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        assert idx.shape[1] <= self.cfg.context, "more tokens than the context: crop the input"
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    def generate(self, idx, n_tokens, temperature=0.8, *, pick=None):
        """Part 3's sampling, from torch's global generator (the same seed gives Part 3's tokens); pick(logits,
        idx), when given, chooses instead, as in generate_uncached."""
        assert temperature == 0 or 1e-4 <= temperature < math.inf, "temperature is 0 (greedy) or finite, >= 1e-4"
        if pick is None:  # Part 3's draw (and temperature 0 the argmax), from torch's global generator
            pick = lambda logits, idx: sampling.pick(logits, temperature)  # noqa: E731
        return self.generate_uncached(idx, n_tokens, pick)

    @torch.no_grad()
    def generate_uncached(self, idx, n_tokens, pick=greedy):
        """Part 3's loop: rerun the last `context` tokens for every new token."""
        assert not in_training(self), "call model.eval() first: in training mode dropout changes every token"
        for n in range(n_tokens):
            logits, _ = self(idx[:, -self.cfg.context:])
            idx = torch.cat((idx, pick(check_finite(logits[:, -1], n), idx)[:, None]), dim=1)
        return idx


def main():
    argparse.ArgumentParser(description="Print the Part 3 GPT's parameter budget and check that its untrained loss is close to "
                       "ln(vocab_size). Takes no arguments.").parse_args()
    torch.manual_seed(1337)
    model = GPT()
    cfg, per_block = model.cfg, sum(p.numel() for p in model.blocks[0].parameters())
    rows = [("token embedding (tied to the head)", model.emb.weight.numel()),
            (f"{cfg.n_layers} blocks x {per_block:,}", per_block * cfg.n_layers),
            ("final LayerNorm", sum(p.numel() for p in model.norm.parameters()))]
    for name, n in rows:
        print(f"{name:<36} {n:>10,}")
    total = sum(p.numel() for p in model.parameters())
    print(f"{'total (tied matrix counted once)':<36} {total:>10,}")
    assert total == sum(n for _, n in rows)

    idx = torch.randint(cfg.vocab_size, (8, cfg.context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, loss = model.eval()(idx[:, :-1], idx[:, 1:])
    expected = math.log(cfg.vocab_size)
    print(f"untrained loss {loss.item():.3f}, ln({cfg.vocab_size}) = {expected:.3f}")
    if abs(loss.item() - expected) > 0.15:
        sys.exit(f"model.py: error: untrained loss {loss.item():.3f} is far from ln(vocab) {expected:.3f}")


if __name__ == "__main__":
    main()
