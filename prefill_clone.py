"""nanochat's trick: run the prompt once at batch 1, copy its cache into N rows.

KVCache, the second cache behind cached.py's forward, is nanochat's shape
(n_layers, batch, max_len, n_kv_heads, head_dim), preallocated and written in
place at slot position % max_len: past the window, a ring of the last `context`
positions. Engine runs the prompt once, clones it into N rows (KVCache.prefill)
and lets each row decode on its own: its own first token, seeded generator,
knobs, forced tokens and stop rule. Speed is engines.fast_engine's, from outside.

    python prefill_clone.py [CHECKPOINT] [PROMPT] -n 8 --tokens 60 --seed 0   # N samples, then their speed
"""
import operator
from collections import deque
from dataclasses import dataclass, field

import torch

import sampling
from cached import load_pair
from checks import check_request
from cli import Parser, as_id, run_cli
from errors import BadValue
from model import check_finite
from samples import add_sample_flags, sample_knobs, show_samples


class KVCache:
    def __init__(self, batch, n_layers, max_len, n_kv_heads, head_dim, context=None, dtype=torch.float32,
                 device="cpu"):
        # attention reads every slot of the ring: past the context, keys training never saw together
        assert context is None or max_len <= context, "a cache longer than the context"
        # k, v: nanochat's shape, as views of head-major storage, where each head's keys are one block
        storage = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.heads_k = torch.zeros(storage, dtype=dtype, device=device)
        self.heads_v = torch.zeros(storage, dtype=dtype, device=device)
        self.k, self.v = self.heads_k.transpose(2, 3), self.heads_v.transpose(2, 3)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.context = context or max_len

    @classmethod
    def for_model(cls, model, batch, max_len):
        cfg, w = model.cfg, model.emb.weight
        return cls(batch, cfg.n_layers, max_len, cfg.n_kv_heads, cfg.head_dim, cfg.context, w.dtype, w.device)

    @property
    def shape(self):
        return dict(zip(("n_layers", "batch", "max_len", "n_kv_heads", "head_dim"), self.k.shape))

    def get_pos(self):
        return int(self.cache_seqlens[0])

    def reset(self):
        self.cache_seqlens.zero_()

    def nbytes(self):
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    def __iter__(self):
        """One cache per layer, what CachedGPT.step zips with its blocks."""
        return (LayerView(self, i) for i in range(self.k.shape[0]))

    def insert_kv(self, layer, k, v, start):
        """Write k, v (B, n_kv_heads, T, head_dim) at slot position % max_len (T > 1: the prompt, into an empty
        cache); return the slots written so far, in any order: RoPE has already placed each key."""
        keys, values = self.heads_k[layer], self.heads_v[layer]  # (B, H, max_len, hd)
        T, L = k.shape[2], keys.shape[2]
        if T > 1:
            assert start == 0 and T <= L, "a prompt goes into an empty cache that holds it"
            keys[:, :, :T], values[:, :, :T] = k, v
            keys, values = keys[:, :, :T], values[:, :, :T]
        else:
            assert start < L or L == self.context, "a ring shorter than the context would drop keys still seen"
            keys[:, :, start % L], values[:, :, start % L] = k[:, :, 0], v[:, :, 0]
            keys, values = keys[:, :, :start + 1], values[:, :, :start + 1]
        if layer == self.heads_k.shape[0] - 1:
            self.cache_seqlens += T
        return keys, values

    def prefill(self, other):
        """Copy a batch-1 (or same-batch) cache into every row of this empty one."""
        assert self.get_pos() == 0, "prefill needs an empty cache"
        mine, theirs = self.shape, other.shape
        assert all(mine[d] == theirs[d] for d in ("n_layers", "n_kv_heads", "head_dim")), "caches of other shapes"
        assert theirs["batch"] in (1, mine["batch"]), "the source batch is 1 or this cache's"
        pos = other.get_pos()
        assert pos <= mine["max_len"], "the source holds more positions than this cache"
        self.k[:, :, :pos] = other.k[:, :, :pos]
        self.v[:, :, :pos] = other.v[:, :, :pos]
        self.cache_seqlens.fill_(pos)


@dataclass
class LayerView:
    """Layer `layer` of a KVCache, with the update(k, v, start) that CachedAttention calls."""
    cache: KVCache
    layer: int

    def update(self, k, v, start):
        return self.cache.insert_kv(self.layer, k, v, start)


@torch.inference_mode()
def run_prompt(model, idx, max_len):
    """Run the prompt idx (B, T) once into a new KVCache of max_len positions; return its logits and the cache."""
    cache = KVCache.for_model(model, idx.shape[0], max_len)
    return model.step(idx, cache, 0), cache


def clone_prompt(model, prompt, cache):
    """nanochat's way: one batch-1 run of the prompt, copied into every row of the empty `cache`."""
    logits, one = run_prompt(model, prompt, prompt.shape[1])
    cache.prefill(one)
    return logits.expand(cache.shape["batch"], -1)


@dataclass
class RowState:
    tokens: list
    n_prompt: int
    forced_tokens: deque = field(default_factory=deque)
    completed: bool = False


class Engine:
    """N rows from one prompt: the prompt run once and cloned (fill: or bench.prompt_per_row), then a step a token."""

    def __init__(self, model, tokenizer=None, fill=clone_prompt):
        self.model, self.tokenizer, self.fill = model, tokenizer, fill
        self.rows, self.busy = [], False

    def cache_len(self, n_prompt, max_tokens):
        """nanochat sizes the cache to prompt + max_tokens; past the window it is a ring of `context`."""
        return min(self.model.cfg.context, n_prompt + max_tokens)

    def decoder(self, batch, max_len):
        """An empty cache of `batch` rows and the decode step that writes it."""
        cache = KVCache.for_model(self.model, batch, max_len)
        return cache, lambda token, pos: self.model.step(token, cache, pos)

    def generate(self, tokens, num_samples=1, max_tokens=None, seed=42, stop=None, forced=None, **knobs):
        """Yield (token_column, token_masks) each step: mask 1 sampled, 0 forced, None once a row completed.

        knobs are sampling.pick's, shared or settings=[{...}, ...] one a row; row i draws with seed + i (or
        seed[i]); forced=[[ids], ...] queues tokens a row takes first (self.rows[i].forced_tokens, between
        steps too). Every argument is checked here, before the first step (checks.check_request)."""
        request = check_request(self, tokens, num_samples, max_tokens, seed, stop, forced, knobs)
        device = self.model.emb.weight.device
        generators = [torch.Generator(device).manual_seed(s) for s in request.seeds]
        rows = [RowState(list(request.tokens), len(request.tokens), deque(f)) for f in request.forced]
        stops_at = self.stop_rule(request.stop_ids, request.stop_texts)
        return self._run(rows, generators, request.settings, stops_at, max_tokens)

    def stop_rule(self, ids, texts):
        def stops_at(row, token):
            # a stop text of L bytes first appears ending in the newest token, within the last L tokens' bytes
            new = row.tokens[row.n_prompt:]
            return token in ids or any(t in b"".join(self.tokenizer.vocab[i] for i in new[-len(t):]) for t in texts)
        return stops_at

    def pick(self, logits, history, generators, settings):
        """One token per row (B,), each row with its own knobs and generator: what it would get alone."""
        return torch.cat([sampling.pick(logits[i:i + 1], history=None if history is None else history[i:i + 1],
                                        generator=[g], **knobs) for i, (g, knobs) in enumerate(zip(generators, settings))])

    def take(self, rows, picked, stops_at):
        """Each row takes its picked token, or its next forced one; a completed row takes nothing (None)."""
        column, masks = [], []
        for i, (row, token) in enumerate(zip(rows, picked)):
            if row.completed:
                column.append(None)
                masks.append(None)
                continue
            is_forced = bool(row.forced_tokens)
            if is_forced:  # checked here too: forced_tokens may have been appended to between steps
                token = as_id(row.forced_tokens.popleft(), f"forced token for row {i}:", self.model.cfg.vocab_size)
            row.tokens.append(token)
            row.completed = stops_at(row, token)
            column.append(token)
            masks.append(0 if is_forced else 1)
        return column, masks

    @torch.inference_mode()
    def _run(self, rows, generators, settings, stops_at, max_tokens):
        if self.busy:
            raise BadValue("this Engine is already generating; finish or close that generator, or use another Engine")
        self.busy, self.rows = True, rows
        try:
            if max_tokens:
                yield from self.decode(rows, generators, settings, stops_at, max_tokens)
        finally:
            self.busy = False

    def decode(self, rows, generators, settings, stops_at, max_tokens):
        """The prompt run once, then a pick and a decode step a token; yields each step's (column, masks)."""
        device = self.model.emb.weight.device
        prompt = torch.tensor([rows[0].tokens], device=device)
        cache, step = self.decoder(len(rows), self.cache_len(prompt.shape[1], max_tokens))
        logits = self.fill(self.model, prompt, cache)
        # only the repetition penalty reads the tokens so far; keep them only for it
        history = prompt.expand(len(rows), -1) if any(s.get("penalty", 1.0) != 1.0 for s in settings) else None
        pos = prompt.shape[1]
        for n in range(1, max_tokens + 1):
            picked = self.pick(check_finite(logits, n - 1), history, generators, settings).tolist()
            column, masks = self.take(rows, picked, stops_at)
            yield column, masks
            if n == max_tokens or all(row.completed for row in rows):
                return  # no step for the last token: nothing would read its logits
            feed = torch.tensor([[row.tokens[-1]] for row in rows], device=device)
            history = None if history is None else torch.cat((history, feed), dim=1)
            logits = step(feed, pos)
            pos += 1

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """Run generate to the end; return each row's new tokens and their masks."""
        steps = self.generate(tokens, num_samples, **kwargs)  # every input checked before the first step
        n = operator.index(num_samples)
        results, masks = [[] for _ in range(n)], [[] for _ in range(n)]
        for column, column_masks in steps:
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if token is not None:
                    results[i].append(token)
                    masks[i].append(mask)
        return results, masks


def main():
    ap = Parser(description="One prompt pass, N samples: nanochat's prefill-and-clone trick.")
    add_sample_flags(ap)
    args = ap.parse_args()
    knobs = sample_knobs(args)
    model, tokenizer = load_pair(args.checkpoint, args.tokenizer, args.device)
    show_samples(Engine(model, tokenizer), tokenizer, args, knobs)


if __name__ == "__main__":
    run_cli(main)
