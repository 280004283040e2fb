"""The serving engine's KV cache: a row of the full window for each request admitted, and a store of blocks.

The rows are one GraphCache (engines/fast/decode_step.py) of max_rows rows: the cache the graph-safe decode
step writes, each row at its own position (engines/serving/runner.py's steps run over its first rows). The
prompts' chunks of a step are computed into their rows, those of about one length in one forward
(PromptRows), or one chunk a call through a compiled program (CompiledChunks). The store holds full blocks of keys and values copied out of the rows
(BlockStore), the prefix cache's tensors; engines/serving/blocks.py says which block holds which tokens. A new
request's cached prefix is copied into its row, so a row is its request's alone: nothing is shared between
rows, and no block a row reads can be evicted under it.

    rows = GraphCache.for_model(model, max_rows, model.cfg.context)
    store = BlockStore.for_model(model, n_blocks=64, block_size=16)
    store.load(rows, row, blocks)                    # a cached prefix into a row
    logits = prompt_step(model, rows, [(row, ids, start)])   # prompt chunks, each at positions start..
    store.save(rows, row, index, block)              # the row's full block `index`, kept
"""
import torch
import torch.nn as nn

from engines.fast.compile_cache import check_compile_cache, step_keys
from engines.fast.decode_step import as_close_as_eager, kept_or_compiled
from engines.fast.rope import with_row_attention
from engines.fast.kv_cache import LayerView




class PromptRows:
    """Rows of a GraphCache as the cache model.step runs prompt chunks on, a chunk a row, all in one forward.
    Row i of the forward is chunk i right-aligned behind padding, so every row's last token is its chunk's
    last (model.step's logits): the padding takes the positions before the chunk's, and only the chunks'
    own keys are written. Each query attends to its row's slots up to its own position (a padding query
    sees slot 0 at least, so that its softmax, never used, is not 0 / 0)."""

    def __init__(self, cache, rows, starts, lengths):
        device, T = cache.heads_k.device, max(lengths)
        self.cache, self.rows = cache, torch.tensor(rows, device=device)
        written = [(i, T - n + j, start + j) for i, (start, n) in enumerate(zip(starts, lengths)) for j in range(n)]
        self.chunk, self.column, self.position = (torch.tensor(x, device=device) for x in zip(*written))
        self.row = self.rows[self.chunk]
        positions = torch.tensor([start - (T - n) for start, n in zip(starts, lengths)], device=device)
        self.first = positions  # each row's first position, the padding's: model.step's start
        self.end = max(start + n for start, n in zip(starts, lengths))
        slots = torch.arange(self.end, device=device)
        queries = (positions[:, None] + torch.arange(T, device=device))[:, :, None]
        self.mask = ((slots <= queries) | (slots == 0)).view(len(rows), 1, T, self.end)

    def __iter__(self):
        return (LayerView(self, i) for i in range(self.cache.heads_k.shape[0]))

    def insert_kv(self, layer, k, v, start):
        keys, values = self.cache.heads_k[layer], self.cache.heads_v[layer]  # (rows, heads, slots, head_dim)
        keys[self.row, :, self.position] = k[self.chunk, :, self.column]
        values[self.row, :, self.position] = v[self.chunk, :, self.column]
        return keys[self.rows, :, :self.end], values[self.rows, :, :self.end], self.mask


def prompt_step(model, cache, chunks):
    """Run prompt chunks [(row, ids, start)], each its prompt's tokens ids at positions start.., into their
    rows of cache, in one forward of model (engines.fast.rope.with_row_attention's); the logits of each chunk's last token
    (len(chunks), vocab)."""
    rows, ids, starts = zip(*chunks)
    T = max(map(len, ids))
    tokens = torch.tensor([[0] * (T - len(chunk)) + list(chunk) for chunk in ids], device=cache.heads_k.device)
    view = PromptRows(cache, rows, starts, [len(chunk) for chunk in ids])
    return model.step(tokens, view, view.first)


class ChunkRow:
    """One row's prompt chunk as a compiled program writes it: the chunk's keys at positions start.. of row `row`
    (tensors), written through the cache's own tensors (compiled, a write into a view of them becomes a copy of
    the whole cache), each query attending to the row's every slot behind a mask that keeps those after it."""

    def __init__(self, heads_k, heads_v, row, start, length):
        self.heads_k, self.heads_v, self.row = heads_k, heads_v, row
        self.layer_ids = torch.arange(heads_k.shape[0], device=heads_k.device)
        self.positions = start + torch.arange(length, device=heads_k.device)
        slots = torch.arange(heads_k.shape[3], device=heads_k.device)
        self.mask = (slots <= self.positions[:, None]).view(1, 1, length, -1)

    def __iter__(self):
        return (LayerView(self, i) for i in range(self.heads_k.shape[0]))

    def insert_kv(self, layer, k, v, start):
        layer_id = self.layer_ids[layer:layer + 1]
        self.heads_k[layer_id, self.row, :, self.positions] = k[0].transpose(0, 1)
        self.heads_v[layer_id, self.row, :, self.positions] = v[0].transpose(0, 1)
        return self.heads_k[layer][self.row], self.heads_v[layer][self.row], self.mask


class ChunkProgram(nn.Module):
    """prompt_step for one chunk as a function of the cache's tensors, what torch.export needs (DecodeStep's
    StepProgram for the other half of a step): tokens (1, T) at positions start.. of row `row` ((1,) tensors)."""

    def __init__(self, model):
        super().__init__()
        self.model = with_row_attention(model)

    def forward(self, tokens, heads_k, heads_v, row, start):
        return self.model.step(tokens, ChunkRow(heads_k, heads_v, row, start, tokens.shape[1]), start)


# the weights frozen into the program, as the decode step's "autotuned" way does (without the autotuner, which
# a dynamic length leaves nothing to tune for): inductor's plain way costs milliseconds a call on a small model
CHUNK_OPTIONS = {"freezing": True}


class CompiledChunks:
    """prompt_step's chunks, one at a time, through ChunkProgram exported once with the chunk's length a dynamic
    dimension (2 to the context: a length of 1 would be taken for a constant, and runs eager) and compiled by
    AOTInductor, kept in compile_cache under a key of all it is compiled for and loaded from there after (a CPU's
    way; on CUDA a package is never loaded: engines/serving/runner.py). Its first call is checked against the eager
    forward's logits and keys."""

    def __init__(self, model, rows, compile_cache):
        self.model, self.rows, self.eager = model, rows, with_row_attention(model)
        key = step_keys(self.eager, rows, {"chunk": CHUNK_OPTIONS | {"program": "prompt chunk"}})["chunk"]
        program, context = ChunkProgram(model), model.cfg.context
        length = torch.export.Dim("length", min=2, max=context)
        example = (torch.zeros(1, 2, dtype=torch.long, device=rows.heads_k.device), rows.heads_k, rows.heads_v,
                   *self._at(0, 0))
        exported = lambda: torch.export.export(program, example, dynamic_shapes=({1: length}, None, None, None, None),  # noqa: E731
                                               strict=False)
        self.runner = kept_or_compiled(exported, CHUNK_OPTIONS, key, check_compile_cache(compile_cache),
                                       "the compiled prompt chunk", "chunk", rows.heads_k.device)[0]
        self._check_against_eager()

    def _at(self, row, start):
        device = self.rows.heads_k.device
        return torch.tensor([row], device=device), torch.tensor([start], device=device)

    def __call__(self, row, ids, start):
        """The logits of the chunk's last token (1, vocab), its keys written into the row at start.."""
        if len(ids) == 1:
            return prompt_step(self.eager, self.rows, [(row, ids, start)])
        tokens = torch.tensor([ids], device=self.rows.heads_k.device)
        return self.runner(tokens, self.rows.heads_k, self.rows.heads_v, *self._at(row, start))

    def _check_against_eager(self):
        """Refuse a program whose first chunk's logits or keys are not the eager forward's (as_close_as_eager); row 0
        is put back as it was."""
        kept = self.rows.heads_k[:, 0].clone(), self.rows.heads_v[:, 0].clone()
        ids = list(range(1, 9))
        with torch.no_grad():
            want, keys = prompt_step(self.eager, self.rows, [(0, ids, 0)]), self.rows.heads_k[:, 0, :, :8].clone()
            got = self(0, ids, 0)
            dtype = self.rows.heads_k.dtype
            ok = as_close_as_eager(got, want, dtype) and as_close_as_eager(self.rows.heads_k[:, 0, :, :8], keys, dtype)
            self.rows.heads_k[:, 0], self.rows.heads_v[:, 0] = kept
        if not ok:
            raise RuntimeError("the compiled prompt chunk does not compute what the eager forward does; delete its "
                               "package in the compile cache and run again")


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
