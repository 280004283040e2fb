"""nanochat's KVCache: preallocated, written in place, what a compiled or graphed decode step needs.

Shaped (n_layers, batch, max_len, n_kv_heads, head_dim) as nanochat's, over head-major storage,
written at slot position % max_len: past the window, a ring of the last `context` positions. The
lesson's cache is the post's dict per layer, which grows by torch.cat each step; this one never
allocates after it is made. CachedGPT.step zips its blocks with the cache's layers (LayerView), whose
update(k, v, start) the engines' attention (engines/fast/rope.py's RowAttention) calls.
"""
from dataclasses import dataclass

import torch

from engines.fast.rope import with_row_attention


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
    return with_row_attention(model).step(idx, cache, 0), cache


def clone_prompt(model, prompt, cache):
    """nanochat's way: one batch-1 run of the prompt, copied into every row of the empty `cache`."""
    logits, one = run_prompt(model, prompt, prompt.shape[1])
    cache.prefill(one)
    return logits.expand(cache.shape["batch"], -1)


