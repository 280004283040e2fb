"""The paged KV cache's bookkeeping: a pool of fixed-size blocks shared by every row, and the prefix cache.

Each sequence holds a block table (the ids of the blocks its positions live in, position p in block
table[p // block_size] at offset p % block_size); this file decides which blocks those are and never
touches a tensor (engines/blocks_cache.py holds the keys and values). A full block's identity is a hash
chain, vLLM's and nano-vllm's: the digest of its parent block's digest and its own token ids, so two
blocks share a digest only when every token up to their end is the same. Blocks are reference-counted;
one that nobody holds keeps its keys, on a least-recently-used list, and is evicted (its digest
forgotten) only when a fresh block is wanted and none was never used. A sequence reserves at admission
every block it may ever need, so a running row never waits for memory and nothing is ever preempted.

    pool = BlockPool(n_blocks=64, block_size=16)
    hits = pool.match(digests_of(prompt, 16))       # the longest cached run of full blocks
    pool.hold(hits); pool.reserve(n); block = pool.take()
    pool.register(block, digest)                    # once the block's keys are all written
    pool.release(blocks)                            # the sequence is done: its blocks go to the LRU list
"""
import hashlib
import math
from array import array
from collections import OrderedDict

from errors import BadValue


def block_digest(parent, tokens):
    """A full block's identity: its token ids and, through parent (the previous block's digest, b"" for
    the first), every token before them. blake2b of 16 bytes: no two prefixes meet by chance."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def digests_of(tokens, block_size):
    """The digest chain of every full block of tokens (a trailing partial block has none)."""
    digests, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_digest(parent, tokens[start:start + block_size])
        digests.append(parent)
    return digests


def blocks_per_row(context, block_size):
    """The blocks one row at the full window needs."""
    return math.ceil(context / block_size)


def blocks_for_bytes(model, nbytes, block_size=16):
    """How many blocks a memory budget of nbytes holds for this model (keys and values, every layer), for a
    server that takes its cache budget in bytes: ServingEngine(model, tok, cache_blocks=blocks_for_bytes(...))."""
    cfg, w = model.cfg, model.emb.weight
    per_block = 2 * cfg.n_layers * block_size * cfg.n_kv_heads * cfg.head_dim * w.element_size()
    return nbytes // per_block


class BlockPool:
    """Which block is whose: reference counts, the digests of full blocks, the free and the idle lists.

    free: blocks with nothing worth keeping (never used, or unregistered when released).
    idle: registered blocks nobody holds, least recently released first: the prefix cache, evicted from the
    front only when `take` finds no free block. promised: blocks reserved by admitted sequences and not yet
    taken; `available` is what a new sequence may still reserve."""

    def __init__(self, n_blocks, block_size):
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 1:
            raise BadValue(f"the number of cache blocks must be a whole number >= 1, got {n_blocks!r}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.refs = [0] * n_blocks
        self.digest_of = [None] * n_blocks
        self.by_digest = {}
        self.free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.idle = OrderedDict()
        self.promised = 0

    def available(self):
        """Blocks a new sequence could still reserve: free or idle, less those already promised."""
        return len(self.free) + len(self.idle) - self.promised

    def in_use(self):
        """Blocks some sequence holds."""
        return self.n_blocks - len(self.free) - len(self.idle)

    def match(self, digests):
        """The blocks of the longest leading run of `digests` that the pool knows: a prompt's cached prefix."""
        hits = []
        for digest in digests:
            block = self.by_digest.get(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    def idle_among(self, blocks):
        """How many of these blocks nobody holds: holding them takes them off the idle list, out of `available`."""
        return sum(self.refs[b] == 0 for b in blocks)

    def hold(self, blocks):
        """One more holder for each block (a cached prefix reused): an idle block leaves the idle list."""
        for block in blocks:
            if self.refs[block] == 0:
                del self.idle[block]
            self.refs[block] += 1

    def reserve(self, n):
        """Promise n fresh blocks to a sequence being admitted; it takes them one by one as it grows."""
        assert 0 <= n <= self.available(), "admission checks the pool first"
        self.promised += n

    def unreserve(self, n):
        """A finished sequence's promise it never took (it stopped before max_tokens)."""
        assert 0 <= n <= self.promised
        self.promised -= n

    def take(self):
        """A fresh block out of a promise: a free one, else the least recently used idle one, whose
        digest is forgotten (evicted: its keys are about to be overwritten)."""
        assert self.promised > 0, "take only what was reserved"
        self.promised -= 1
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.idle.popitem(last=False)
            del self.by_digest[self.digest_of[block]]
            self.digest_of[block] = None
        self.refs[block] = 1
        return block

    def register(self, block, digest):
        """A held block whose keys are all written: known by its digest from now on, for later prompts. When an
        equal block is already known (two rows computed the same prefix at once), that one stays the cached
        one and this block is freed plainly when released."""
        if self.digest_of[block] is None and digest not in self.by_digest:
            self.digest_of[block], self.by_digest[digest] = digest, block

    def release(self, blocks):
        """One holder fewer for each block. Released last block first, so a chain's tail is evicted before its
        head: a head evicted first would leave its tail unreachable (match stops at the first miss)."""
        for block in reversed(blocks):
            assert self.refs[block] > 0, "released more often than held"
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.digest_of[block] is None:
                    self.free.append(block)
                else:
                    self.idle[block] = None  # the most recently used end
