"""The lesson's attention with each row at its own positions: what a graph-safe step and serving's prompt chunks need.

A graph-safe decode step (GraphCache) and serving's prompt chunks (row_cache.PromptRows) hold rows at
different positions, given as a (B,) tensor on the device, where nothing may be read on the host. They
rotate with the lesson's own RoPE tables (model.rope_freqs, model.rotate) at those positions, and attend
with the mask their cache gives, which places each query at its own position.
"""
import copy

import torch

from cached import CachedAttention
from model import rope_at, rope_freqs, rotate


def rope_rows(x, starts):
    """model.rope_at for x (B, heads, T, head_dim) with row b's first position at starts[b]."""
    T, d = x.shape[-2], x.shape[-1]
    positions = (starts.view(-1, 1, 1, 1) + torch.arange(T, device=x.device)[:, None]).float()
    return rotate(x, positions * rope_freqs(d, x.device))


class RowAttention(CachedAttention):
    """CachedAttention at a (B,) tensor of starts, attending through the mask its cache gives (SDPA's own
    causal mask is aligned to the top left, not to each row's positions)."""

    def forward(self, x, cache=None, start=0):
        if cache is None or isinstance(cache, dict):  # Part 3's attention, or the post's cache: the lesson's forward
            return super().forward(x, cache, start)
        q, k, v = self.heads(x)
        if isinstance(start, int):  # every row at one position (a prompt pass): the lesson's rope_at and rule
            k, v = cache.update(rope_at(k, start), v, start)
            return self.attend(rope_at(q, start), k, v, is_causal=x.shape[1] > 1)
        q, k = rope_rows(q, start), rope_rows(k, start)
        k, v, mask = cache.update(k, v, start)
        return self.attend(q, k, v, is_causal=False, attn_mask=mask)


def with_row_attention(module):
    """A copy of the module tree whose attention layers are RowAttention; the parameters are the model's
    own, and the model is left as it was."""
    tree = copy.copy(module)
    if isinstance(module, CachedAttention) and type(module) is not RowAttention:
        assert type(module) in (CachedAttention, RowAttention), "a variant of the attention would lose what it changes"
        tree.__class__ = RowAttention
    tree._modules = {name: with_row_attention(child) for name, child in module._modules.items()}
    return tree
