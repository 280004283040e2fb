"""The paged KV cache's tensors: every layer's keys and values in one pool of blocks, read through block tables.

BlockCache is a third cache behind cached.py's one forward (after cached.LayerCache and
prefill_clone.KVCache): CachedGPT.step(tokens, cache, positions) with tokens (N, 1), one token a row, and
positions (N,) each row's own. A row is a decoding sequence's next token or one token of a prompt being
prefilled, so one forward serves both, and a prompt chunk's tokens see each other: every layer writes all
rows' keys first, then reads. Each row reads its sequence's keys through its block table (a gather) and a
mask hides every position after its own (a slot not yet written, or another row's future).

    cache = BlockCache.for_model(model, n_blocks=64, block_size=16)
    cache.set_rows(tables, positions)           # tables (N, blocks) of block ids, positions (N,)
    logits = model.step(tokens, cache, positions)

Past the pool's blocks is one more, the spare: table entries past a row's blocks point at it (never
attended to: they lie after the row's position), and rows that only pad a batch to a fixed shape write
their keys there.
"""
import torch

from prefill_clone import LayerView


class BlockCache:
    def __init__(self, n_layers, n_blocks, block_size, n_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
        # one slot a row, flat: (layer, block * block_size + offset, head, channel). Head-minor, so a
        # block's gathered slots lie next to each other and the (N, L, heads, hd) gather needs no copy to
        # become what attention reads, its transpose (N, heads, L, hd).
        slots = (n_blocks + 1) * block_size
        self.k = torch.zeros(n_layers, slots, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.block_size, self.spare = block_size, n_blocks
        self.offsets = torch.arange(block_size, device=device)
        self.write = self.read = self.mask = None

    @classmethod
    def for_model(cls, model, n_blocks, block_size):
        cfg, w = model.cfg, model.emb.weight
        return cls(cfg.n_layers, n_blocks, block_size, cfg.n_kv_heads, cfg.head_dim, w.dtype, w.device)

    def nbytes(self):
        return self.k.nbytes + self.v.nbytes

    def copy_block(self, source, target):
        """Copy one block's keys and values, every layer (copy on write: a shared block a row must write into)."""
        bs = self.block_size
        self.k[:, target * bs:(target + 1) * bs] = self.k[:, source * bs:(source + 1) * bs]
        self.v[:, target * bs:(target + 1) * bs] = self.v[:, source * bs:(source + 1) * bs]

    def set_rows(self, tables, positions):
        """This step's rows: tables (N, n) the block ids each row reads through (padded with self.spare),
        positions (N,) where each row's token sits. Each row writes its key at its own position's slot and
        attends to its positions 0..its own: the slots of L = n * block_size positions, the rest masked."""
        N, n = tables.shape
        slots = (tables[:, :, None] * self.block_size + self.offsets).view(N, n * self.block_size)  # (N, L)
        self.read = slots
        self.write = slots.gather(1, positions.view(N, 1))[:, 0]
        seen = torch.arange(n * self.block_size, device=positions.device) <= positions.view(N, 1)
        self.mask = seen.view(N, 1, 1, n * self.block_size)

    def __iter__(self):
        """One cache per layer, what CachedGPT.step zips with its blocks (prefill_clone's LayerView)."""
        return (LayerView(self, i) for i in range(self.k.shape[0]))

    def insert_kv(self, layer, k, v, start):
        """Write k, v (N, n_kv_heads, 1, head_dim) at each row's slot; return what attention reads: each
        row's keys and values in position order (N, n_kv_heads, L, head_dim) and the mask of those it sees."""
        assert k.shape[2] == 1, "one token a row: a prompt is fed as rows, one token each"
        # index_copy_ and index_select, not k[layer, slots]: that indexing path took 200 times as long here
        self.k[layer].index_copy_(0, self.write, k[:, :, 0])
        self.v[layer].index_copy_(0, self.write, v[:, :, 0])
        N, L = self.read.shape
        keys = self.k[layer].index_select(0, self.read.view(-1)).view(N, L, *self.k.shape[2:]).transpose(1, 2)
        values = self.v[layer].index_select(0, self.read.view(-1)).view(N, L, *self.v.shape[2:]).transpose(1, 2)
        return keys, values, self.mask
