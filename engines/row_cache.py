"""The serving engine's KV cache: a row of the full window for each request admitted, and a store of blocks.

The rows are one GraphCache (engines/decode_step.py) of max_rows rows: the cache the graph-safe decode step
writes, each row at its own position, so serving decodes on the very step FastEngine compiles (and loads
the same compiled package for max_rows rows); a step over fewer rows runs on its first rows (first_rows). A prompt is computed into its row in chunks, each a forward
of its own at batch 1 (RowPrompt). The store holds full blocks of keys and values copied out of the rows
(BlockStore), the prefix cache's tensors; engines/blocks.py says which block holds which tokens. A new
request's cached prefix is copied into its row, so a row is its request's alone: nothing is shared between
rows, and no block a row reads can be evicted under it.

    rows = GraphCache.for_model(model, max_rows, model.cfg.context)
    store = BlockStore.for_model(model, n_blocks=64, block_size=16)
    store.load(rows, row, blocks)                    # a cached prefix into a row
    logits = prompt_step(model, rows, row, ids, start)   # a prompt chunk, positions start..
    store.save(rows, row, index, block)              # the row's full block `index`, kept
"""
import contextlib
import copy

import torch
import torch.nn.functional as F

from prefill_clone import LayerView


def decode_batches(max_rows):
    """The row counts the decode step is made for: the powers of two below max_rows, and max_rows. A step
    runs the fewest that hold every decoding row (rows are given lowest first), so a few requests do not
    pay for a full batch."""
    return sorted({2 ** i for i in range(max_rows.bit_length()) if 2 ** i < max_rows} | {max_rows})


def first_rows(cache, n):
    """The first n rows of a GraphCache, as a GraphCache of n rows on the same storage: a decode step over it
    reads and writes those rows of `cache`."""
    if n == cache.shape["batch"]:
        return cache
    view = copy.copy(cache)
    view.heads_k, view.heads_v, view.cache_seqlens = cache.heads_k[:, :n], cache.heads_v[:, :n], cache.cache_seqlens[:n]
    view.k, view.v, view.rows = view.heads_k.transpose(2, 3), view.heads_v.transpose(2, 3), cache.rows[:n]
    return view


class ExplicitMask(torch.overrides.TorchFunctionMode):
    """While on, an attention given a mask ignores is_causal: the mask says exactly what each query sees.
    cached.py passes is_causal=T > 1, right for a prompt into an empty cache, where SDPA's top-left mask
    is causal; a chunk that follows cached positions needs a mask aligned to its own positions instead,
    which SDPA refuses beside is_causal. The model's own code is unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is not None:
            kwargs["is_causal"] = False
        return func(*args, **kwargs)


class RowPrompt:
    """Row `row` of a GraphCache as the cache model.step runs a prompt chunk (1, T) on, at positions
    start..start+T-1: the chunk's keys written into the row's slots, and attention reading the row's
    first start+T slots, each query those up to its own position (from position 0, the lesson's
    prefill exactly: no mask, is_causal)."""

    def __init__(self, cache, row):
        self.cache, self.row = cache, row

    def __iter__(self):
        return (LayerView(self, i) for i in range(self.cache.heads_k.shape[0]))

    def insert_kv(self, layer, k, v, start):
        T, end = k.shape[2], start + k.shape[2]
        keys, values = (t[layer, self.row:self.row + 1] for t in (self.cache.heads_k, self.cache.heads_v))
        assert end <= keys.shape[2], "a request is refused unless it fits the window"
        keys[:, :, start:end], values[:, :, start:end] = k, v
        mask = None
        if start:
            mask = (torch.arange(end, device=k.device) <= torch.arange(start, end, device=k.device)[:, None])
            mask = mask.view(1, 1, T, end)
        return keys[:, :, :end], values[:, :, :end], mask


def prompt_step(model, cache, row, ids, start):
    """Run prompt tokens ids (a list) at positions start.. into row `row` of cache; the last one's logits (vocab,)."""
    tokens = torch.tensor([ids], device=cache.heads_k.device)
    with ExplicitMask() if start and len(ids) > 1 else contextlib.nullcontext():
        return model.step(tokens, RowPrompt(cache, row), start)[0]


class BlockStore:
    """The prefix cache's keys and values: n_blocks blocks of block_size positions, every layer, each
    (n_layers, n_kv_heads, block_size, head_dim), copied out of a row and back into another."""

    def __init__(self, n_blocks, block_size, n_layers, n_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
        self.k = torch.zeros(n_blocks, n_layers, n_kv_heads, block_size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.block_size = block_size

    @classmethod
    def for_model(cls, model, n_blocks, block_size):
        cfg, w = model.cfg, model.emb.weight
        return cls(n_blocks, block_size, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, w.dtype, w.device)

    def nbytes(self):
        return self.k.nbytes + self.v.nbytes

    def save(self, rows, row, index, block):
        """Keep the keys and values of the row's positions in its block `index` as stored block `block`."""
        bs = self.block_size
        self.k[block] = rows.heads_k[:, row, :, index * bs:(index + 1) * bs]
        self.v[block] = rows.heads_v[:, row, :, index * bs:(index + 1) * bs]

    def load(self, rows, row, blocks):
        """Copy stored blocks, in order, into the row's first len(blocks) * block_size positions."""
        n, ids = len(blocks) * self.block_size, torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        for stored, kept in ((self.k, rows.heads_k), (self.v, rows.heads_v)):
            layers, heads, _, head_dim = kept[:, row].shape
            kept[:, row, :, :n] = stored[ids].permute(1, 2, 0, 3, 4).reshape(layers, heads, n, head_dim)
