"""The Part 3 GPT: pre-norm blocks, RoPE attention, a head tied to the embedding.

Module names, state-dict keys, init and checkpoint format are Part 3's, so a
Part 3 checkpoint loads here with strict=True. One addition: Config.n_kv_heads
(grouped-query attention), which defaults to n_heads and then changes nothing.

    python model.py

prints the parameter budget and checks that the untrained loss is close to
ln(vocab_size), as it must be for a model that has learnt nothing yet.
"""
import argparse
import math
import os
import sys
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must divide by n_heads ({self.n_heads}) "
                f"and n_heads by n_kv_heads ({self.n_kv_heads})"
            )

    @property
    def head_dim(self):
        return self.d_model // self.n_heads


def rope_frequencies(head_dim, device=None):
    """inv[j] = 10000^(-2j / head_dim), in float32."""
    return 10000 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def rope_cos_sin(positions, head_dim):
    """cos and sin of angle[t, j] = t * inv[j]."""
    angle = positions.float()[:, None] * rope_frequencies(head_dim, positions.device)[None, :]
    return angle.cos(), angle.sin()


def rotate(x, cos, sin):
    """Rotate the interleaved channel pairs (2j, 2j+1) of x (..., T, head_dim)."""
    x0, x1 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def rope(x):
    """RoPE with positions 0..T-1, the only positions Part 3 ever uses."""
    T = x.shape[-2]
    return rotate(x, *rope_cos_sin(torch.arange(T, device=x.device), x.shape[-1]))


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
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def attend(self, q, k, v, is_causal, attn_mask=None):
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        B, H, T, hd = y.shape
        return self.out(y.transpose(1, 2).reshape(B, T, H * hd))

    def forward(self, x):
        q, k, v = self.heads(x)
        return self.attend(rope(q), rope(k), v, is_causal=True)


class Block(nn.Module):
    attention = RoPEAttention

    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.norm1 = nn.LayerNorm(d)
        self.attn = self.attention(cfg)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(cfg.dropout))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def greedy(logits, idx):
    """The pick that always takes the highest score."""
    return logits.argmax(dim=-1, keepdim=True)


class GPT(nn.Module):
    block = Block

    def __init__(self, cfg=None):
        super().__init__()
        self.cfg = cfg = cfg or Config()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self.block(cfg) for _ in range(cfg.n_layers))
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
        if idx.shape[1] > self.cfg.context:
            raise ValueError(f"{idx.shape[1]} tokens exceed the context of {self.cfg.context}; crop the input")
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, n_tokens, pick=greedy):
        """Part 3's loop: rerun the last `context` tokens for every new token."""
        check_count("n_tokens", n_tokens)
        for _ in range(n_tokens):
            logits, _ = self(idx[:, -self.cfg.context:])
            idx = torch.cat((idx, pick(logits[:, -1], idx)), dim=1)
        return idx


def check_count(name, n):
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {n!r}")


def device_from(name):
    """A torch.device for 'cpu', 'cuda' or 'cuda:N', refusing what this machine lacks."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU here; use 'cpu'")
        return torch.device(name)
    raise ValueError(f"unknown device {name!r}; use 'cpu' or 'cuda'")


def read_checkpoint(path):
    """The checkpoint's dict, loaded as data (weights_only), or a one-line error."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path} not found; pass a Part 3 .pt file or train one") from None
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not a loadable checkpoint ({first_line})") from None
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("model"), dict) and isinstance(ckpt.get("config"), dict)):
        raise ValueError(f"{path} is not a Part 3 checkpoint: expected a dict with 'model' (state dict) and 'config'")
    return ckpt


def config_from(d, path="checkpoint"):
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{path}: unknown config field {unknown[0]!r}; known fields are {sorted(known)}")
    return Config(**d)


def load_checkpoint(path, device="cpu", cls=GPT):
    """A model from a Part 3 checkpoint, in eval mode on `device`."""
    device = device_from(device) if isinstance(device, str) else device
    ckpt = read_checkpoint(path)
    model = cls(config_from(ckpt["config"], path))
    expected, given = model.state_dict(), ckpt["model"]
    for key, tensor in expected.items():
        if key not in given:
            raise ValueError(f"{path}: weight {key!r} is missing; is this a Part 3 checkpoint?")
        if tuple(given[key].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{path}: weight {key!r} has shape {tuple(given[key].shape)} "
                f"but the config needs {tuple(tensor.shape)}"
            )
    extra = sorted(set(given) - set(expected))
    if extra:
        raise ValueError(f"{path}: unexpected weight {extra[0]!r}; is this a Part 3 checkpoint?")
    model.load_state_dict(given, strict=True)
    return model.to(device).eval()


def save_checkpoint(model, path, step):
    torch.save({"model": model.state_dict(), "config": asdict(model.cfg), "step": step}, path)


class Parser(argparse.ArgumentParser):
    """argparse whose complaints are one line and a non-zero exit, like every other error here."""

    def error(self, message):
        sys.exit(f"{self.prog}: error: {message} (see --help)")


def run_cli(main):
    """Run a script's main; bad input becomes one line on stderr and exit status 1."""
    try:
        main()
    except (ValueError, OSError) as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")


def main():
    torch.manual_seed(1337)
    model = GPT()
    cfg = model.cfg
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    rows = [
        ("token embedding (tied to the head)", model.emb.weight.numel()),
        (f"{cfg.n_layers} blocks x {per_block:,}", per_block * cfg.n_layers),
        ("final LayerNorm", sum(p.numel() for p in model.norm.parameters())),
    ]
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
