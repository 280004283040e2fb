"""The Part 3 GPT: pre-norm blocks, RoPE attention, a head tied to the embedding.

Module names, state-dict keys, init and checkpoint format are Part 3's, so a
Part 3 checkpoint loads here with strict=True, and what save_checkpoint writes
loads in Part 3's own code. Two additions that change nothing unless asked
for: Config.n_kv_heads (grouped-query attention; default n_heads) and
Linear's switchable matmul kernel (linear_kernel(); default off: nn.Linear).
The one RoPE, rope_at(x, start), serves Part 3 (start=0) and every cached step.

    python model.py

prints the parameter budget and checks that the untrained loss is close to
ln(vocab_size), as it must be for a model that has learnt nothing yet.
"""
import functools
import math
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import sampling
from checks import check_knobs
from cli import Parser, atomic_write, check_count, check_fits, check_input, device_from


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
        sizes = {f: getattr(self, f) for f in ("vocab_size", "d_model", "n_heads", "n_layers", "context", "n_kv_heads")}
        bad = next((f for f, v in sizes.items() if type(v) is not int or v < 1), None)
        if bad:
            raise ValueError(f"config {bad} is {sizes[bad]!r}; expected a whole number >= 1")
        if type(self.dropout) not in (int, float) or not 0 <= self.dropout < 1:
            raise ValueError(f"config dropout is {self.dropout!r}; expected a number in [0, 1)")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must divide by n_heads ({self.n_heads}) "
                f"and n_heads by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim d_model / n_heads = {self.head_dim} is odd; RoPE turns channel pairs")

    @property
    def head_dim(self):
        return self.d_model // self.n_heads


def rope_at(x, start):
    """RoPE for x (B, heads, T, head_dim) whose first row sits at position `start`.

    Channel pair (2j, 2j+1) is turned by angle t * 10000^(-2j / head_dim) for position t, in
    float32: out[2j] = x[2j] cos - x[2j+1] sin, out[2j+1] = x[2j] sin + x[2j+1] cos, written as
    x * cos + (x with each pair swapped) * (-sin, sin): plain float arithmetic, which torch.compile
    fuses (complex numbers it cannot). `start` is an int, or one start per row (a (B,) tensor)
    when rows sit at different positions, as in a CUDA-graph decode step. Part 3 uses start=0.
    """
    T, hd = x.shape[-2], x.shape[-1]
    if isinstance(start, int):
        cos, sin = rope_table(start, T, hd, x.device)
    else:
        positions = (start.view(-1, 1) + torch.arange(T, device=x.device)).float()
        cos, sin = (t[:, None] for t in rotations(positions[..., None] * frequencies(hd, x.device)))
    pairs = x.float()
    swapped = pairs.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (pairs * cos + swapped * sin).type_as(x)


def frequencies(head_dim, device):
    return 10000 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def rotations(angles):
    """cos and (-sin, sin) of angles (..., T, head_dim / 2), each repeated for both channels of a pair."""
    sin = angles.sin()
    return angles.cos().repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


@functools.lru_cache(maxsize=8)
def rope_table(start, T, head_dim, device):
    """rotations() for positions start..start+T-1, kept: the 2 x n_layers calls of one step share it."""
    with torch.inference_mode(False):  # plain tensors, so training can use them after generation made them
        freqs = frequencies(head_dim, device)
        # Gotcha 1: the angles begin at the token's true position, not at 0
        angles = torch.arange(start, start + T, dtype=torch.float32, device=device)[:, None] * freqs
        return rotations(angles)


class Linear(nn.Linear):
    """nn.Linear, whose product can be handed to another kernel while one is switched on (linear_kernel()).

    A kernel is fn(layer, rows) -> rows @ W.T + b for rows (R, in_features), or None to leave those
    rows to nn.Linear. kernels.py holds the candidates; prefill_clone.Engine switches on the one it
    measured fastest, only around its decode steps. Off (None), this is nn.Linear.
    """
    kernel = None

    def forward(self, x):
        if Linear.kernel is not None:
            out = Linear.kernel(self, x.reshape(-1, x.shape[-1]))
            if out is not None:
                return out.view(*x.shape[:-1], -1)
        return super().forward(x)


@contextmanager
def linear_kernel(kernel):
    """Run the model's Linear layers through kernel(layer, rows) (None: as nn.Linear) inside the block."""
    before, Linear.kernel = Linear.kernel, kernel
    try:
        yield
    finally:
        Linear.kernel = before


class RoPEAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.kv_width = cfg.n_kv_heads * cfg.head_dim
        self.qkv = Linear(cfg.d_model, cfg.d_model + 2 * self.kv_width, bias=False)
        self.out = Linear(cfg.d_model, cfg.d_model, bias=False)
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
        return self.attend(rope_at(q, 0), rope_at(k, 0), v, is_causal=True)


class Block(nn.Module):
    attention = RoPEAttention

    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.norm1 = nn.LayerNorm(d)
        self.attn = self.attention(cfg)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(Linear(d, 4 * d), nn.GELU(), Linear(4 * d, d), nn.Dropout(cfg.dropout))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def greedy(logits, idx):
    """The pick that always takes the highest score: one id per row, (B,)."""
    return logits.argmax(dim=-1)


def check_finite(logits, n):
    """Stop at the step whose scores are NaN or infinite: no token can be chosen honestly from them."""
    if not torch.isfinite(logits.abs().amax()):  # one reduction: NaN and infinity both survive abs().amax()
        raise ValueError(f"the model's scores for new token {n} are NaN or infinite (its weights overflow); "
                         "no token can be chosen from them")
    return logits


class GPT(nn.Module):
    block = Block

    def __init__(self, cfg=None):
        super().__init__()
        self.cfg = cfg = cfg or Config()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self.block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
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

    def generate(self, idx, n_tokens, temperature=0.8, *, pick=None):
        """Part 3's sampling: each token drawn from softmax(scores / temperature) with torch's global
        generator, so the same torch.manual_seed gives Part 3's tokens. pick(logits, idx), when given,
        chooses instead (temperature is then unused), as in generate_uncached."""
        if pick is None:
            check_knobs(temperature=temperature)
            pick = lambda logits, _: sampling.pick(logits, temperature)
        return self.generate_uncached(idx, n_tokens, pick)

    @torch.no_grad()
    def generate_uncached(self, idx, n_tokens, pick=greedy):
        """Part 3's loop: rerun the last `context` tokens for every new token."""
        check_count("n_tokens", n_tokens)
        for n in range(n_tokens):
            logits, _ = self(idx[:, -self.cfg.context:])
            idx = torch.cat((idx, pick(check_finite(logits[:, -1], n), idx)[:, None]), dim=1)
        return idx


MAX_CHECKPOINT_BYTES = 2**34  # 16 GiB: a model this repo can run on a laptop is far smaller


def read_checkpoint(path):
    """The checkpoint's dict, loaded as data (weights_only), or a one-line error."""
    check_input(path, "checkpoint", MAX_CHECKPOINT_BYTES, "pass a Part 3 .pt file or train one")
    check_fits(os.path.getsize(path), f"checkpoint {path}", "cpu")
    try:
        with warnings.catch_warnings():  # torch's pickle-protocol warning would break the one-line error
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if "Weights only load failed" in str(e):
            raise ValueError(f"{path} is not a plain-tensor checkpoint: it is not a torch.save file, or it holds "
                             "code or objects that are not plain tensors and must not be loaded") from None
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not a loadable checkpoint ({first_line})") from None
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("model"), dict) and isinstance(ckpt.get("config"), dict)):
        raise ValueError(f"{path} is not a Part 3 checkpoint: expected a dict with 'model' (state dict) and 'config'")
    for part in ("model", "config"):
        odd = next((k for k in ckpt[part] if not isinstance(k, str)), None)
        if odd is not None:
            raise ValueError(f"{path}: its {part} dict has a key {odd!r} that is not a name; "
                             "is this a Part 3 checkpoint?")
    return ckpt


PART3_FIELDS = ("vocab_size", "d_model", "n_heads", "n_layers", "context", "dropout")
MODULE_BYTES = 2**16  # what the Python objects of one block cost beyond its weights, roughly


def parameter_count(cfg):
    """The weights a Config asks for (tied head counted once), computed without building anything."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    block = d * (d + 2 * kv) + d * d + 2 * (4 * d * d) + 4 * d + d + 4 * d
    return cfg.vocab_size * d + cfg.n_layers * block + 2 * d


def config_from(d, path="checkpoint"):
    """A Config from a checkpoint's config dict: known fields only, and a model that fits memory."""
    known = [f.name for f in fields(Config)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown config field {unknown[0]!r}; known fields are {known}")
    try:
        cfg = Config(**d)  # Config checks every value by name
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    check_fits(4 * parameter_count(cfg) + MODULE_BYTES * cfg.n_layers,
               f"{path}: the model its config describes ({cfg.n_layers} layers of width {cfg.d_model}, "
               f"vocabulary {cfg.vocab_size})", "cpu")
    return cfg


def check_weights(given, expected, path):
    """Every weight the model needs, a dense finite float tensor of the right shape, and no other."""
    for key, want in expected.items():
        got = given.get(key)
        if got is None:
            raise ValueError(f"{path}: weight {key!r} is missing; is this a Part 3 checkpoint?")
        if not isinstance(got, torch.Tensor):
            raise ValueError(f"{path}: weight {key!r} is a {type(got).__name__}, not a tensor")
        if got.layout != torch.strided or got.is_meta:
            raise ValueError(f"{path}: weight {key!r} is a {got.layout} {got.device.type} tensor; "
                             "a checkpoint holds dense tensors with values")
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"{path}: weight {key!r} has shape {tuple(got.shape)} "
                             f"but the config needs {tuple(want.shape)}")
        if not got.is_floating_point() or not torch.isfinite(got).all():
            raise ValueError(f"{path}: weight {key!r} holds NaN, infinite or non-float values; "
                             "this checkpoint cannot give meaningful output")
    extra = sorted(set(given) - set(expected))
    if extra:
        raise ValueError(f"{path}: unexpected weight {extra[0]!r}; is this a Part 3 checkpoint?")


def load_checkpoint(path, device="cpu", cls=GPT):
    """A model from a Part 3 checkpoint, in eval mode on `device`; config and weights checked
    (against a model built on the meta device, which allocates nothing) before anything is built."""
    device = device_from(device) if isinstance(device, str) else device
    ckpt = read_checkpoint(path)
    cfg = config_from(ckpt["config"], path)
    with torch.device("meta"):
        expected = cls(cfg).state_dict()
    check_weights(ckpt["model"], expected, path)
    model = cls(cfg)
    model.load_state_dict(ckpt["model"], strict=True)
    model.trained_with = ckpt.get("tokenizer")  # what save_checkpoint recorded of the tokenizer, if anything
    return model.to(device).eval()


def part3_config(cfg):
    """The config dict a checkpoint holds: Part 3's six fields, n_kv_heads only when it is not n_heads,
    so Part 3's own loader (Config(**ckpt["config"]) on a six-field dataclass) reads what this repo writes."""
    d = {name: getattr(cfg, name) for name in PART3_FIELDS}
    return d | ({"n_kv_heads": cfg.n_kv_heads} if cfg.n_kv_heads != cfg.n_heads else {})


def save_checkpoint(model, path, step, tokenizer=None, force=False):
    """Part 3's checkpoint format, through a new temporary file and a rename, so a cut run leaves no half file.

    tokenizer: what bpe.BPE.record() says of the tokenizer it was trained with; kept beside
    the config, not in it, so Part 3's loader still reads the file. An existing file at `path` is
    replaced only with force."""
    ckpt = {"model": model.state_dict(), "config": part3_config(model.cfg), "step": step}
    with atomic_write(path, force=force) as f:
        torch.save(ckpt | ({"tokenizer": tokenizer} if tokenizer else {}), f)


def main():
    Parser(description="Print the Part 3 GPT's parameter budget and check that its untrained loss is close to "
                       "ln(vocab_size). Takes no arguments.").parse_args()
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
