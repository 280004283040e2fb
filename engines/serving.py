"""Continuous batching on the lesson's model: requests join and leave at any step, over a paged, prefix-cached KV cache.

Each step() is one forward of CachedGPT.step, the lesson's, on a BlockCache (engines/blocks_cache.py):
one token for every running row, each at its own position, and, within a budget of prefill_chunk
tokens, the next chunk of the prompts being prefilled, so a long prompt never stalls the rows already
decoding. A prompt's full blocks that an earlier request computed (the same tokens from the start: a
chat's earlier turns, a shared system prompt) are reused from the pool, not computed again
(engines/blocks.py); the prompt's last token always runs, for the logits of the first new token.

Exact: each request's tokens are those of prefill_clone.Engine for that request alone, whatever else
runs: its own generator seeded with its seed (the Engine's row 0), its knobs, picked by the Engine's own
pick (sampling.pick) from the same history, ended by the Engine's own stop rule. The window: a request
is refused unless its prompt and max_tokens fit the model's context, inside which every path computes
the same thing (docs/serving_engine.md says why, and what the tests prove).

Single-threaded by design: submit, cancel and step must be called from one thread (a server runs step()
in a loop of its own and passes each Event to its client).

    engine = ServingEngine(model, tokenizer, max_rows=16, block_size=16, cache_blocks=None, prefill_chunk=64)
    engine.submit(Request("a", tokenizer.encode("The night was"), max_tokens=20, seed=0, temperature=0.8))
    while engine.has_work():
        for event in engine.step():
            print(event.request_id, event.text, event.finish_reason)
"""
from collections import deque
from dataclasses import dataclass, field

from errors import BadValue

import torch

from checks import check_request
from engines.blocks import BlockPool, block_digest, blocks_per_row, digests_of
from engines.blocks_cache import BlockCache
from engines.serving_text import TextStream
from model import check_finite
from prefill_clone import Engine


@dataclass
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    penalty: float = 1.0
    stop: list = field(default_factory=list)  # token ids and/or strings


@dataclass
class Event:
    """A token a request made this step (token None: it was cancelled). text: the whole characters it completes;
    finish_reason "stop", "length" or "cancelled" on a request's last event, else None."""
    request_id: str
    token: int | None
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Sequence:
    """One request's row: its tokens (prompt, then new ones), knobs, generator and blocks. tokens and n_prompt
    are what prefill_clone's stop rule reads of a row."""

    def __init__(self, request, tokens, seed, knobs, stop_ids, stop_texts, stops_at, vocab, block_size, device):
        self.id, self.max_tokens, self.knobs = request.id, request.max_tokens, knobs
        self.tokens, self.n_prompt = list(tokens), len(tokens)
        self.generator = torch.Generator(device).manual_seed(seed)
        self.stop_ids, self.stops_at, self.text = stop_ids, stops_at, TextStream(vocab, stop_texts)
        self.prompt_digests = digests_of(self.tokens, block_size)
        self.blocks, self.digests = [], []  # block table; digests of its leading full blocks
        self.computed = self.cached = self.promised = 0  # positions in the cache; of them, reused; blocks reserved

    def event(self, token, text, finish_reason):
        return Event(self.id, token, text, finish_reason, self.n_prompt, self.cached, len(self.tokens) - self.n_prompt)


def whole(name, value, least):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise BadValue(f"{name} must be a whole number >= {least}, got {value!r}")
    return value


class ServingEngine:
    """max_rows: requests admitted at once (decoding or prefilling). block_size: positions a block holds.
    cache_blocks: the pool's size, the memory budget (engines.blocks.blocks_for_bytes turns bytes into it);
    default: room for every row at the full window, and as much again kept for the prefix cache.
    prefill_chunk: prompt tokens computed a step, beside the decoding rows. fixed_shapes: every forward
    max_rows + prefill_chunk rows (padded) over the whole window, so a row's logits are bit-identical
    whatever else runs (batch invariance, tested), and the step has one shape to compile; it costs the
    padding's work (on a 2-core CPU, serving the shipped model 4 to 7 times slower: docs/serving_engine.md)."""

    def __init__(self, model, tokenizer, max_rows=16, block_size=16, cache_blocks=None, prefill_chunk=64, *,
                 fixed_shapes=False):
        self.model, self.tokenizer = model, tokenizer
        self.lesson = Engine(model, tokenizer)  # its checks, stop rule and pick: the same rules, not copies
        self.max_rows = whole("max_rows", max_rows, 1)
        self.block_size = whole("block_size", block_size, 1)
        self.prefill_chunk = whole("prefill_chunk", prefill_chunk, 1)
        self.per_row, self.fixed_shapes = blocks_per_row(model.cfg.context, block_size), bool(fixed_shapes)
        cache_blocks = 2 * max_rows * self.per_row if cache_blocks is None else cache_blocks
        whole("cache_blocks", cache_blocks, self.per_row)  # fewer could never hold one request at the full window
        self.pool = BlockPool(cache_blocks, block_size)
        self.cache = BlockCache.for_model(model, cache_blocks, block_size)
        self.device = model.emb.weight.device
        self.waiting, self.prefilling, self.running = deque(), [], []
        self.active, self.cancelling = {}, set()
        self.prompt_tokens_computed = self.prompt_tokens_cached = 0  # totals, for a benchmark

    def submit(self, request):
        """Queue a request; every field is checked here, before it is queued (errors.BadValue, one line)."""
        if not isinstance(request, Request):
            raise BadValue(f"submit takes an engines.serving.Request, got a {type(request).__name__}")
        if not isinstance(request.id, str) or not request.id:
            raise BadValue(f"a request's id must be a non-empty string, got {request.id!r}")
        if request.id in self.active:
            raise BadValue(f"request id {request.id!r} is already queued or running; give each request its own")
        knobs = dict(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                     penalty=request.penalty)
        tokens, seeds, settings, stop_ids, stop_texts, _ = check_request(
            self.lesson, request.prompt, 1, request.max_tokens, request.seed, request.stop, None, knobs)
        whole("max_tokens", request.max_tokens, 1)
        context = self.model.cfg.context
        if len(tokens) + request.max_tokens > context:
            room = context - len(tokens)
            raise BadValue(f"a prompt of {len(tokens)} tokens plus max_tokens {request.max_tokens} is more than the "
                           f"{context} positions this model attends to; " + (
                               f"shorten the prompt or ask for at most {room} tokens" if room else
                               f"shorten the prompt to at most {context - 1} tokens"))
        vocab = None if self.tokenizer is None else self.tokenizer.vocab
        sequence = Sequence(request, tokens, seeds[0], settings[0], stop_ids, stop_texts,
                            self.lesson.stop_rule(stop_ids, stop_texts), vocab, self.block_size, self.device)
        self.waiting.append(sequence)
        self.active[request.id] = sequence

    def cancel(self, request_id):
        """A client that hung up: its row and blocks are freed at the next step (which says so in an Event).
        An id that is not queued or running (finished already, or never seen) is ignored."""
        if request_id in self.active:
            self.cancelling.add(request_id)

    def has_work(self):
        return bool(self.waiting or self.prefilling or self.running or self.cancelling)

    @torch.inference_mode()
    def step(self):
        """One forward: every running row's next token, and a chunk of prefill; the Events of this step."""
        events = [self._drop(self.active[i], "cancelled") for i in sorted(self.cancelling)]
        decoding, chunks = list(self.running), self._plan_prefill()
        if not decoding and not chunks:
            return events
        rows = [(s, s.computed) for s in decoding] + [(s, p) for s, start, end in chunks for p in range(start, end)]
        for s, position in rows:
            self._grow(s, position + 1)
        logits = self._forward(rows)
        pickers, row = [(i, s) for i, s in enumerate(decoding)], len(decoding)
        for s, start, end in chunks:
            row += end - start
            self.prompt_tokens_computed += end - start
            if end == s.n_prompt:  # the prompt's last position: its logits give the first new token
                pickers.append((row - 1, s))
        for s, position in rows:
            s.computed = position + 1
        if pickers:
            seqs = [s for _, s in pickers]
            for s, token in zip(seqs, self._pick(logits[[i for i, _ in pickers]], seqs)):
                events.append(self._advance(s, token))
        for s in self.prefilling + self.running:
            self._register_full_blocks(s)
        return events

    def _plan_prefill(self):
        """(sequence, first, end) prompt positions to compute this step: the prompts already being prefilled
        first, in order, then new ones, admitted while the budget, the rows and the pool allow (first come,
        first served: one that must wait holds back those behind it)."""
        budget, chunks = self.prefill_chunk, []
        for s in self.prefilling:
            take = min(budget, s.n_prompt - s.computed)
            if take:
                chunks.append((s, s.computed, s.computed + take))
                budget -= take
        # full blocks some prompt computes now: a newcomer whose next block is one of them waits a step and reuses it
        pending = {d for s in self.prefilling for d in s.prompt_digests[s.computed // self.block_size:]}
        while budget and self.waiting and len(self.prefilling) + len(self.running) < self.max_rows:
            s = self.waiting[0]
            if not self._admit(s, pending):
                break
            self.waiting.popleft()
            self.prefilling.append(s)
            take = min(budget, s.n_prompt - s.computed)
            chunks.append((s, s.computed, s.computed + take))
            budget -= take
            pending.update(s.prompt_digests[s.computed // self.block_size:])
        return chunks

    def _admit(self, s, pending):
        """Give s the longest cached prefix of its prompt and reserve every block it may need; False if it must wait."""
        bs = self.block_size
        hits = self.pool.match(s.prompt_digests)
        if len(hits) < len(s.prompt_digests) and s.prompt_digests[len(hits)] in pending:
            return False
        # A prompt cached in full (nano-vllm's crash) still runs its last token, for its logits: in a copy
        # of the last block, as the cached block is shared and keeps the keys it has.
        copy = len(hits) * bs == s.n_prompt
        need = -(-(s.n_prompt + s.max_tokens - 1) // bs) - len(hits) + copy  # the last token is never fed
        if copy and self.pool.available() - self.pool.idle_among(hits) < need:
            hits, copy = hits[:-1], False  # no room to hold the cached block while it is copied: recompute it
        if self.pool.available() - self.pool.idle_among(hits) < need:
            return False
        self.pool.hold(hits)
        self.pool.reserve(need)
        s.blocks, s.digests, s.promised, s.computed = list(hits), s.prompt_digests[:len(hits)], need, len(hits) * bs
        if copy:
            s.blocks[-1] = self._take(s)
            self.cache.copy_block(hits[-1], s.blocks[-1])
            self.pool.release(hits[-1:])
            s.digests.pop()
            s.computed -= 1
        s.cached = s.computed
        self.prompt_tokens_cached += s.cached
        return True

    def _take(self, s):
        s.promised -= 1
        return self.pool.take()

    def _grow(self, s, positions):
        """Blocks enough for s's first `positions` positions, from its reservation."""
        while len(s.blocks) * self.block_size < positions:
            s.blocks.append(self._take(s))

    def _forward(self, rows):
        """model.step on one token a row, each at its own position, reading through its sequence's block table;
        with fixed_shapes, padded with rows that write to the spare block and are never read."""
        width = self.per_row if self.fixed_shapes else max(len(s.blocks) for s, _ in rows)
        pad = self.max_rows + self.prefill_chunk - len(rows) if self.fixed_shapes else 0
        spare = self.cache.spare
        tables = [s.blocks + [spare] * (width - len(s.blocks)) for s, _ in rows] + [[spare] * width] * pad
        positions = torch.tensor([p for _, p in rows] + [0] * pad, device=self.device)
        tokens = torch.tensor([[s.tokens[p]] for s, p in rows] + [[0]] * pad, device=self.device)
        self.cache.set_rows(torch.tensor(tables, device=self.device), positions)
        return self.model.step(tokens, self.cache, positions)[:len(rows)]

    def _pick(self, logits, seqs):
        """One token per sequence, as the Engine picks it for that request alone: rows without a repetition
        penalty in one call of its pick (which groups equal knobs and gives each row its own generator), each
        penalized row with its own history, the prompt and its tokens so far."""
        check_finite(logits, min(len(s.tokens) - s.n_prompt for s in seqs))
        picked = [None] * len(seqs)
        plain = [i for i, s in enumerate(seqs) if s.knobs["penalty"] == 1.0]
        if plain:
            tokens = self.lesson.pick(logits[plain], None, [seqs[i].generator for i in plain],
                                      [seqs[i].knobs for i in plain])
            for i, token in zip(plain, tokens.tolist()):
                picked[i] = token
        for i, s in enumerate(seqs):
            if picked[i] is None:
                history = torch.tensor([s.tokens], device=self.device)
                picked[i] = self.lesson.pick(logits[i:i + 1], history, [s.generator], [s.knobs]).item()
        return picked

    def _advance(self, s, token):
        """s takes its new token: the Event, and the row's end if this was its last."""
        s.tokens.append(token)
        if s.stops_at(s, token):
            return self._drop(s, "stop", token, s.text.push(token, stop_id=token in s.stop_ids))
        if len(s.tokens) - s.n_prompt == s.max_tokens:
            return self._drop(s, "length", token, s.text.push(token, stop_id=False))
        if s in self.prefilling:
            self.prefilling.remove(s)
            self.running.append(s)
        return s.event(token, s.text.push(token), None)

    def _drop(self, s, reason, token=None, text=""):
        """s is done: its full blocks stay cached for later prompts, the rest of its blocks go back to the pool."""
        for queue in (self.waiting, self.prefilling, self.running):
            if s in queue:
                queue.remove(s)
        self._register_full_blocks(s)
        self.pool.release(s.blocks)
        self.pool.unreserve(s.promised)
        s.blocks, s.promised = [], 0
        del self.active[s.id]
        self.cancelling.discard(s.id)
        return s.event(token, text, reason)

    def _register_full_blocks(self, s):
        """Give each of s's blocks whose every position's keys are written its digest, so later prompts find it."""
        bs = self.block_size
        for i in range(len(s.digests), s.computed // bs):
            s.digests.append(block_digest(s.digests[-1] if i else b"", s.tokens[i * bs:(i + 1) * bs]))
            self.pool.register(s.blocks[i], s.digests[-1])
