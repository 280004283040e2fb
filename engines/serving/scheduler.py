"""The serving engine's scheduler (nano-vllm's Scheduler): what each step decodes and prefills, and the rows' blocks.

Each step every running sequence decodes a token, and beside them, within a budget of prefill_chunk tokens,
the next chunk of each prompt being prefilled runs: the prompts already started first, in order, then new
ones, admitted while the budget and the rows allow (first come, first served: one that must wait holds back
those behind it), so a long prompt never stalls the rows already decoding. An admitted sequence holds a row
of the cache to itself, the lowest free one. The longest prefix of its prompt whose full blocks an earlier
sequence computed (the same tokens from the start: a chat's earlier turns, a shared system prompt) is copied
into its row from the prefix cache (engines/serving/blocks.py says which stored block holds which tokens,
engines/serving/row_cache.py's BlockStore holds them), not computed again; the prompt's last token always runs, for
the logits of its first new token. Every full block a row completes is kept for later prompts.
fixed_shapes: no chunks; a prompt is fed a token a step through the decode step, with every admitted row.
"""
import heapq
from collections import deque
from dataclasses import dataclass

from engines.serving.blocks import PrefixCache, block_digest
from engines.serving.row_cache import BlockStore


@dataclass
class Plan:
    """One step's work: the sequences decoding a token, each at its own position; the prompt chunks
    (sequence, first, end) to compute; the sequences holding a row (whose positions the decode step reads)."""
    decoding: list
    chunks: list
    holding: list


class Scheduler:
    def __init__(self, model, rows, block_size, cache_blocks, prefill_chunk, fixed_shapes):
        self.rows, self.block_size, self.prefill_chunk, self.fixed_shapes = rows, block_size, prefill_chunk, fixed_shapes
        self.prefix = PrefixCache(cache_blocks)
        self.store = BlockStore.for_model(model, cache_blocks, block_size)
        self.free_rows = list(range(rows.shape["batch"]))  # a heap: the lowest free row is given first
        self.waiting, self.prefilling, self.running = deque(), [], []
        self.prompt_tokens_computed = self.prompt_tokens_cached = 0  # totals, for a benchmark

    def has_work(self):
        return bool(self.waiting or self.prefilling or self.running)

    def schedule(self):
        """This step's Plan; admits the newcomers it prefills (with fixed_shapes, every newcomer a row takes)."""
        budget, chunks = self.prefill_chunk, []
        for s in [] if self.fixed_shapes else self.prefilling:
            take = min(budget, s.n_prompt - s.computed)
            if take:
                chunks.append((s, s.computed, s.computed + take))
                budget -= take
        # full blocks some prompt computes now: a newcomer whose next block is one of them waits a step and reuses it
        pending = {d for s in self.prefilling for d in s.prompt_digests[s.computed // self.block_size:]}
        while (budget or self.fixed_shapes) and self.waiting and self.free_rows:
            s = self.waiting[0]
            if not self._admit(s, pending):
                break
            self.waiting.popleft()
            self.prefilling.append(s)
            pending.update(s.prompt_digests[s.computed // self.block_size:])
            if not self.fixed_shapes:
                take = min(budget, s.n_prompt - s.computed)
                chunks.append((s, s.computed, s.computed + take))
                budget -= take
        holding = self.prefilling + self.running
        return Plan(holding if self.fixed_shapes else list(self.running), chunks, holding)

    def ran(self, plan):
        """The plan's positions are computed: the sequences whose next token is picked now, in the plan's order."""
        picking = [s for s in plan.decoding if s.computed == len(s.tokens) - 1]
        for s in plan.decoding:
            self.prompt_tokens_computed += s.computed < s.n_prompt
            s.computed += 1
        for s, start, end in plan.chunks:
            self.prompt_tokens_computed += end - start
            s.computed = end
            if end == s.n_prompt:  # the prompt's last position: its logits give the first new token
                picking.append(s)
        return picking

    def keep_full_blocks(self):
        for s in self.prefilling + self.running:
            self._keep_full_blocks(s)

    def started(self, s):
        """s took its first new token: from now on it decodes."""
        if s in self.prefilling:
            self.prefilling.remove(s)
            self.running.append(s)

    def finish(self, s):
        """s is done: its full blocks are kept in the prefix cache for later prompts, its row freed."""
        for queue in (self.waiting, self.prefilling, self.running):
            if s in queue:
                queue.remove(s)
        if s.row is not None:
            self._keep_full_blocks(s)
            heapq.heappush(self.free_rows, s.row)
            s.row = None

    def _admit(self, s, pending):
        """Give s a row and copy the longest cached prefix of its prompt into it; False if it must wait."""
        hits = self.prefix.match(s.prompt_digests)
        if len(hits) < len(s.prompt_digests) and s.prompt_digests[len(hits)] in pending:
            return False
        s.row = heapq.heappop(self.free_rows)
        self.store.load(self.rows, s.row, hits)
        s.digests, s.computed = s.prompt_digests[:len(hits)], len(hits) * self.block_size
        # a prompt cached in full (nano-vllm's crash) still runs its last token, for its logits
        s.computed = s.cached = min(s.computed, s.n_prompt - 1)
        self.prompt_tokens_cached += s.cached
        return True

    def _keep_full_blocks(self, s):
        """Copy each of s's blocks whose every position's keys are written into the prefix cache, so later
        prompts find it."""
        bs = self.block_size
        for i in range(len(s.digests), s.computed // bs):
            s.digests.append(block_digest(s.digests[-1] if i else s.root, s.tokens[i * bs:(i + 1) * bs]))
            block = self.prefix.keep(s.digests)
            if block is not None:
                self.store.save(self.rows, s.row, i, block)
