"""The prefix cache's bookkeeping: which stored block holds which tokens, least recently used first.

A full block's identity is a hash chain, vLLM's and nano-vllm's: the digest of its parent block's digest
and its own token ids, so two blocks share a digest only when every token up to their end is the same (and
the request's cache_salt, where one is given: the chain's root).
The store's blocks are copies (engines/serving/row_cache.py): a row copies a cached prefix in at admission and
its full blocks out as it writes them, so no row holds a stored block and any of them may be evicted at
any time, the least recently used first, when a new one needs its room. This file never touches a tensor.

    prefix = PrefixCache(n_blocks=64)
    hits = prefix.match(digests_of(prompt, 16))     # the stored blocks of the longest cached prefix
    block = prefix.keep(digests[:i + 1])            # where to store block i (None: known, or no room)
"""
import hashlib
import math
from array import array
from collections import OrderedDict

from engines.edge.checks import cache_bytes


def block_digest(parent, tokens):
    """A full block's identity: its token ids and, through parent (the previous block's digest, b"" for
    the first), every token before them. blake2b of 16 bytes: no two prefixes meet by chance."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_root(cache_salt):
    """The parent of a prompt's first block: b"", or a digest of the request's cache_salt (vLLM's), so that only
    requests with the same salt find each other's blocks."""
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"cache_salt").digest() if cache_salt else b""


def digests_of(tokens, block_size, root=b""):
    """The digest chain of every full block of tokens (a trailing partial block has none), from root."""
    digests, parent = [], root
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
    return nbytes // cache_bytes(model.cfg, 1, block_size, model.emb.weight.element_size())


class PrefixCache:
    """digest -> stored block, least recently used first. A chain is used head last, so that its tail is
    evicted before its head: a head evicted first would leave its tail unreachable (match stops at the
    first miss)."""

    def __init__(self, n_blocks):
        self.n_blocks = n_blocks
        self.blocks = OrderedDict()  # digest -> block, the least recently used first
        self.free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first

    def match(self, digests):
        """The stored blocks of the longest leading run of `digests` known: a prompt's cached prefix."""
        hits = []
        for digest in digests:
            if digest not in self.blocks:
                break
            hits.append(self.blocks[digest])
        self.used(digests[:len(hits)])
        return hits

    def keep(self, chain):
        """The block to store the last block of `chain` (the digests of a row's full blocks so far) in, the
        least recently used one evicted if none is free; None if it is stored already or there is no store."""
        digest = chain[-1]
        if digest in self.blocks or not self.n_blocks:
            self.used(chain)
            return None
        self.blocks[digest] = self.free.pop() if self.free else self.blocks.popitem(last=False)[1]
        self.used(chain)
        return self.blocks[digest]

    def used(self, chain):
        """Make the chain's stored blocks the most recently used, its head the most recent of all."""
        for digest in reversed(chain):
            if digest in self.blocks:
                self.blocks.move_to_end(digest)
