"""nanochat's trick: prefill the prompt once at batch 1, copy it into N rows.

The cache here is preallocated once, shaped like nanochat's KVCache
(n_layers, batch, max_len, n_kv_heads, head_dim); each decode step writes
its keys and values in place at slot position % max_len, so past the
context window it is a ring that holds exactly the last `context` positions,
and multiplies its few rows by each weight matrix as W @ rows.T (project).
Engine.generate runs one batch-1 prefill (cached.py's), clones it into a
batch-N cache and lets every row sample on its own: its own first token (not
one broadcast to all rows, as in nanochat), its own seeded generator, its own
knobs, forced tokens and stop conditions.

    python prefill_clone.py [CHECKPOINT] [PROMPT] -n 8 --tokens 60 --seed 0

prints N samples, then time to first token and total time for the clone
path against N separate prefills of the same prompt, measured side by side.
"""
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bpe import BPE
from cached import LayerCache, encode_prompt, load
from model import Parser, check_count, rope_frequencies, run_cli
from sampling import check_knobs, draw

KNOBS = ["temperature", "top_k", "top_p", "penalty"]
DEFAULT_PROMPT = ("To Sherlock Holmes she is always the woman. I have seldom heard him mention her "
                  "under any other name.")


class KVCache:
    def __init__(self, batch, n_layers, max_len, n_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
        # nanochat's shape, (n_layers, batch, max_len, n_kv_heads, head_dim), as a view of
        # head-major storage: each head's keys are then one contiguous block, which is what
        # attention reads every step (2x faster at batch 16 on a CPU than position-major).
        storage = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(storage, dtype=dtype, device=device).transpose(2, 3)
        self.v = torch.zeros(storage, dtype=dtype, device=device).transpose(2, 3)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(batch, device=device)
        self.slots = torch.arange(max_len, device=device)
        self.inv_freq = rope_frequencies(head_dim, device)

    @classmethod
    def for_model(cls, model, batch, max_len):
        cfg, w = model.cfg, model.emb.weight
        return cls(batch, cfg.n_layers, max_len, cfg.n_kv_heads, cfg.head_dim, w.dtype, w.device)

    @property
    def shape(self):
        return dict(zip(("n_layers", "batch", "max_len", "n_kv_heads", "head_dim"), self.k.shape))

    def get_pos(self):
        return int(self.cache_seqlens[0])

    def reset(self):
        self.cache_seqlens.zero_()

    def nbytes(self):
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    def write_prompt(self, layer_caches):
        """Copy the keys and values a cached.py prefill left, (B, H, T, hd) per layer."""
        T = layer_caches[0].k.shape[2]
        if T > self.shape["max_len"]:
            raise ValueError(f"a prompt of {T} tokens is longer than the cache ({self.shape['max_len']} positions)")
        for i, c in enumerate(layer_caches):
            self.k[i, :, :T] = c.k.transpose(1, 2)
            self.v[i, :, :T] = c.v.transpose(1, 2)
        self.cache_seqlens.fill_(T)

    def prefill(self, other):
        """Copy a batch-1 (or same-batch) cache into every row of this empty one."""
        if bool(self.cache_seqlens.any()):
            raise ValueError(f"prefill needs an empty cache, this one holds {self.get_pos()} positions; reset() it")
        mine, theirs = self.shape, other.shape
        for dim in ("n_layers", "n_kv_heads", "head_dim"):
            if mine[dim] != theirs[dim]:
                raise ValueError(f"prefill: {dim} differs, {theirs[dim]} in the source, {mine[dim]} here")
        pos = other.get_pos()
        if pos > mine["max_len"]:
            raise ValueError(f"prefill: the source holds {pos} positions, more than max_len {mine['max_len']} here")
        if theirs["batch"] not in (1, mine["batch"]):
            raise ValueError(f"prefill: source batch {theirs['batch']} must be 1 or {mine['batch']}")
        self.k[:, :, :pos] = other.k[:, :, :pos]
        self.v[:, :, :pos] = other.v[:, :, :pos]
        self.cache_seqlens.fill_(pos)


@torch.inference_mode()
def prefill(model, idx, max_len):
    """Run the prompt idx (B, T) once with cached.py and move its keys into a new KVCache."""
    layer_caches = [LayerCache() for _ in model.blocks]
    logits = model.step(idx, layer_caches, 0)
    cache = KVCache.for_model(model, idx.shape[0], max_len)
    cache.write_prompt(layer_caches)
    return logits, cache


def project(layer, rows):
    """layer(rows) for the few rows (B, in) of a decode step, as W @ rows.T; returns (B, out).

    The same product as nn.Linear's rows @ W.T, in the order MKL runs fastest on the CPU
    measured in the README (an AMD EPYC): the weights on the left. A lone row on the CPU goes
    in as two copies of itself: there MKL's one-column kernel (gemv) is far slower than its
    two-column one (gemm), though both read the weights once. bench.py's table 3 times these
    matmuls against nn.Linear's.
    """
    w, b = layer.weight, layer.bias
    lone_on_cpu = rows.shape[0] == 1 and rows.is_cpu
    cols = (torch.cat((rows, rows)) if lone_on_cpu else rows).T
    out = w @ cols if b is None else torch.addmm(b[:, None], w, cols)
    return out[:, :rows.shape[0]].T


@torch.inference_mode()
def decode_step(model, token, cache, pos=None):
    """Feed one token per row (B, 1) at each row's position; write k, v in place; return logits (B, vocab).

    pos: the position being fed, the same for every row, when the caller knows it; attention then
    reads just the slots written so far, unmasked. With pos=None nothing here reads a Python-side
    position (what a CUDA graph needs): each row's position comes from cache_seqlens on the device,
    and attention reads every slot and masks the unwritten ones.
    """
    cfg = model.cfg
    B, H, Hkv, hd, L = token.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cache.slots.shape[0]
    if pos is None:
        at = cache.cache_seqlens.long().view(B, 1, 1)
        slot = (cache.rows, at.view(B) % L)
        keys, values = cache.k, cache.v
        seen = (cache.slots <= at).view(B, 1, 1, L)
    else:
        at, slot = pos, (slice(None), pos % L)
        keys, values, seen = cache.k[:, :, :pos + 1], cache.v[:, :, :pos + 1], None
    # RoPE as one complex multiply per layer: pair (2j, 2j+1) is x[2j] + i x[2j+1], turned by angle
    angle = at * cache.inv_freq
    turn = torch.complex(angle.cos(), angle.sin())
    x = model.emb(token[:, 0])
    for i, block in enumerate(model.blocks):
        attn = block.attn
        qkv = project(attn.qkv, block.norm1(x)).contiguous()  # view_as_complex needs unit stride
        qk, v = qkv.split([cfg.d_model + attn.kv_width, attn.kv_width], dim=-1)
        qk = torch.view_as_complex(qk.reshape(B, H + Hkv, hd // 2, 2)) * turn
        q, k = torch.view_as_real(qk).view(B, H + Hkv, hd).split([H, Hkv], dim=1)
        cache.k[i][slot] = k
        cache.v[i][slot] = v.view(B, Hkv, hd)
        y = F.scaled_dot_product_attention(q[:, :, None], keys[i].transpose(1, 2), values[i].transpose(1, 2),
                                           attn_mask=seen, enable_gqa=Hkv != H)
        x = x + project(attn.out, y.view(B, cfg.d_model))
        x = x + project(block.mlp[2], block.mlp[1](project(block.mlp[0], block.norm2(x))))
    cache.cache_seqlens += 1
    return project(model.head, model.norm(x))


def cache_len(model, n_prompt, n_tokens):
    """nanochat sizes the cache to prompt + max_tokens; past the window it is a ring of `context`."""
    ctx = model.cfg.context
    if n_prompt > ctx:
        raise ValueError(f"a prompt of {n_prompt} tokens is longer than the cache (context {ctx}); trim it")
    return ctx if n_tokens is None else min(ctx, n_prompt + n_tokens)


@torch.inference_mode()
def generate_prealloc(model, idx, n_tokens, pick):
    """generate_cached's contract on the preallocated cache: idx (B, T) in, idx plus n_tokens out."""
    check_count("n_tokens", n_tokens)
    window = idx[:, -model.cfg.context:]
    logits, cache = prefill(model, window, cache_len(model, window.shape[1], n_tokens))
    out = torch.empty(idx.shape[0], idx.shape[1] + n_tokens, dtype=idx.dtype, device=idx.device)
    out[:, :idx.shape[1]] = idx
    pos = window.shape[1]
    for t in range(idx.shape[1], out.shape[1]):
        out[:, t:t + 1] = pick(logits, out[:, :t])
        logits, pos = decode_step(model, out[:, t:t + 1], cache, pos), pos + 1
    return out


@dataclass
class RowState:
    tokens: list
    n_prompt: int
    forced_tokens: deque = field(default_factory=deque)
    completed: bool = False


class Engine:
    def __init__(self, model, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        self.rows = []

    def _row_settings(self, num_samples, seed, knobs):
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a whole number >= 1, got {num_samples!r}")
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed + i for i in range(num_samples)]
        settings = knobs.pop("settings", None)
        if settings is not None and knobs:
            raise ValueError(f"give the knobs either shared ({sorted(knobs)}) or per row in settings, not both")
        settings = [knobs] * num_samples if settings is None else list(settings)
        for name, got in (("seed", seeds), ("settings", settings)):
            if len(got) != num_samples:
                raise ValueError(f"{name} is a list of {len(got)}, but num_samples is {num_samples}")
        for s in settings:
            unknown = sorted(set(s) - set(KNOBS))
            if unknown:
                raise ValueError(f"unknown sampling knob {unknown[0]!r}; the knobs are {KNOBS}")
            check_knobs(**s)
        device = self.model.emb.weight.device
        return [torch.Generator(device).manual_seed(s) for s in seeds], settings

    def _check_id(self, token, what):
        vocab = self.model.cfg.vocab_size
        if not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"{what} {token!r} is outside the vocabulary 0..{vocab - 1}")

    def _stop_rule(self, stop):
        stops = [] if stop is None else list(stop) if isinstance(stop, (list, tuple)) else [stop]
        ids = {s for s in stops if isinstance(s, int)}
        texts = [s for s in stops if isinstance(s, str)]
        for s in ids:
            self._check_id(s, "stop token id")
        if texts and self.tokenizer is None:
            raise ValueError("stop strings need Engine(model, tokenizer)")

        def stops_at(row, token):
            new = row.tokens[row.n_prompt:]
            return token in ids or any(t in self.tokenizer.decode(new[-16:]) for t in texts)
        return stops_at

    def sample(self, logits, history, generators, settings):
        if all(s.get("temperature", 1.0) == 0 for s in settings) and all(s == settings[0] for s in settings):
            return draw(logits, history=history, **settings[0])
        return torch.cat([draw(logits[i:i + 1], history=history[i:i + 1], generator=g, **s)
                          for i, (g, s) in enumerate(zip(generators, settings))])

    @torch.inference_mode()
    def generate(self, tokens, num_samples=1, max_tokens=None, seed=42, stop=None, forced=None, **knobs):
        """Yield (token_column, token_masks) each step: mask 1 sampled, 0 forced, None once a row completed.

        knobs are sampling.pick's, checked once here, shared by all rows or settings=[{...}, ...] one per row.
        forced=[[ids], ...] queues tokens a row takes before it samples; self.rows[i].forced_tokens
        can be appended to between steps.
        """
        if not tokens:
            raise ValueError("the prompt is empty; give at least one token")
        for token in tokens:
            self._check_id(token, "prompt token")
        if max_tokens is not None:
            check_count("max_tokens", max_tokens)
        generators, settings = self._row_settings(num_samples, seed, knobs)
        stops_at = self._stop_rule(stop)
        self.rows = [RowState(list(tokens), len(tokens), deque(f)) for f in (forced or [[]] * num_samples)]
        if len(self.rows) != num_samples:
            raise ValueError(f"forced is a list of {len(self.rows)}, but num_samples is {num_samples}")
        device = self.model.emb.weight.device
        prompt = torch.tensor([tokens], device=device)
        logits, cache = cloned_prefill(self.model, prompt, num_samples, cache_len(self.model, len(tokens), max_tokens))
        history = prompt.expand(num_samples, -1)
        n = 0
        while max_tokens is None or n < max_tokens:
            sampled = self.sample(logits, history, generators, settings)[:, 0].tolist()
            column, masks = [], []
            for i, (row, token) in enumerate(zip(self.rows, sampled)):
                if row.completed:
                    column.append(None)
                    masks.append(None)
                    continue
                is_forced = bool(row.forced_tokens)
                if is_forced:
                    token = row.forced_tokens.popleft()
                    self._check_id(token, f"forced token for row {i}:")
                row.tokens.append(token)
                row.completed = stops_at(row, token)
                column.append(token)
                masks.append(0 if is_forced else 1)
            yield column, masks
            n += 1
            if all(row.completed for row in self.rows):
                return
            feed = torch.tensor([[row.tokens[-1]] for row in self.rows], device=device)
            history = torch.cat((history, feed), dim=1)
            logits = decode_step(self.model, feed, cache, len(tokens) + n - 1)

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """Run generate to the end; return each row's new tokens and their masks."""
        results, masks = [[] for _ in range(num_samples)], [[] for _ in range(num_samples)]
        for column, column_masks in self.generate(tokens, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if token is not None:
                    results[i].append(token)
                    masks[i].append(mask)
        return results, masks


def cloned_prefill(model, prompt, n, max_len):
    """One batch-1 prefill, copied into every row of a batch-n cache."""
    logits, one = prefill(model, prompt, prompt.shape[1])
    cache = KVCache.for_model(model, n, max_len)
    cache.prefill(one)
    return logits.expand(n, -1), cache


def separate_prefills(model, prompt, n, max_len):
    """The naive path: each of the n rows runs its own prefill of the same prompt."""
    cache = KVCache.for_model(model, n, max_len)
    for i in range(n):
        logits, one = prefill(model, prompt, prompt.shape[1])
        cache.k[:, i, :prompt.shape[1]], cache.v[:, i, :prompt.shape[1]] = one.k[:, 0], one.v[:, 0]
    cache.cache_seqlens.fill_(prompt.shape[1])
    return logits.expand(n, -1), cache


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def timed_generation(model, prompt, n, n_tokens, first, seed=0, **knobs):
    """(time to first token, total time, tokens (n, n_tokens)) for one way of prefilling n rows."""
    check_knobs(**knobs)
    device = prompt.device
    g = torch.Generator(device).manual_seed(seed)
    sync(device)
    t0 = time.perf_counter()
    logits, cache = first(model, prompt, n, cache_len(model, prompt.shape[1], n_tokens))
    tokens = [draw(logits, generator=g, **knobs)]
    sync(device)
    ttft = time.perf_counter() - t0
    for pos in range(prompt.shape[1], prompt.shape[1] + n_tokens - 1):
        tokens.append(draw(decode_step(model, tokens[-1], cache, pos), generator=g, **knobs))
    sync(device)
    return ttft, time.perf_counter() - t0, torch.cat(tokens, dim=1)


def median(xs):
    return sorted(xs)[len(xs) // 2]


def main():
    ap = Parser(description="One prefill, N samples: nanochat's prefill-and-clone trick.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    ap.add_argument("-n", type=int, default=8, help="number of samples")
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.n < 1:
        raise ValueError(f"-n must be at least 1, got {args.n}")
    check_count("--tokens", args.tokens)
    check_knobs(temperature=args.temperature, top_p=args.top_p)
    model = load(args.checkpoint, args.device)
    tokenizer = BPE.load(args.tokenizer)
    tokens = encode_prompt(tokenizer, args.prompt, model)[0].tolist()
    engine = Engine(model, tokenizer)
    knobs = dict(temperature=args.temperature, top_p=args.top_p)

    rows, _ = engine.generate_batch(tokens, args.n, max_tokens=args.tokens, seed=args.seed, **knobs)
    for i, row in enumerate(rows):
        print(f"--- sample {i} (seed {args.seed + i})")
        print(tokenizer.decode(tokens + row))

    prompt = torch.tensor([tokens], device=model.emb.weight.device)
    runs = {name: [timed_generation(model, prompt, args.n, max(args.tokens, 1), first, args.seed, **knobs)
                   for _ in range(3)]
            for name, first in (("separate", separate_prefills), ("clone", cloned_prefill))}
    assert torch.equal(runs["separate"][0][2], runs["clone"][0][2]), "both paths must give the same tokens"
    (sep_ttft, sep_total), (clone_ttft, clone_total) = (
        (median([r[0] for r in rs]), median([r[1] for r in rs])) for rs in runs.values())
    print(f"\nprompt {len(tokens)} tokens, {args.n} samples x {args.tokens} tokens, {args.device}, "
          f"{torch.get_num_threads()} threads, median of 3 (same tokens from both paths):")
    print(f"{'':24}{'first token':>12}{'total':>10}")
    print(f"{f'{args.n} separate prefills':24}{sep_ttft * 1e3:>9.1f} ms{sep_total:>8.2f} s")
    print(f"{'1 prefill + clone':24}{clone_ttft * 1e3:>9.1f} ms{clone_total:>8.2f} s")
    print(f"{'speedup':24}{sep_ttft / clone_ttft:>11.1f}x{sep_total / clone_total:>9.2f}x")

if __name__ == "__main__":
    run_cli(main)
