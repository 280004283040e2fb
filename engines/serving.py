"""Continuous batching on the lesson's model: requests join and leave at any step, with a prefix cache.

Each request admitted has a row of the cache to itself (engines/row_cache.py). Each step() runs the
decode step, one token for every running row, each at its own position: DecodeStep, the graph-safe step
FastEngine runs, compiled (or loaded from the compile cache) with compile=True. Beside it, within a
budget of prefill_chunk tokens, the next chunk of each prompt being prefilled runs into its row, chunks
of about one length in one forward of the lesson's CachedGPT.step, so a long prompt never stalls the rows
already decoding. A prompt's full blocks that an earlier request computed (the same tokens from the
start: a chat's earlier turns, a shared system prompt) are copied into its row from the prefix cache,
not computed again (engines/blocks.py); the prompt's last token always runs, for the logits of the
first new token.

Exact: each request's tokens are those of prefill_clone.Engine for that request alone, whatever else
runs: its own generator seeded with its seed (the Engine's row 0), its knobs, picked by the Engine's own
pick (sampling.pick) from the same history, ended by the Engine's own stop rule. The window: a request
is refused unless its prompt and max_tokens fit the model's context, inside which every path computes
the same thing (docs/serving_engine.md says why, and what the tests prove).

Single-threaded by design: submit, cancel and step must be called from one thread (a server runs step()
in a loop of its own and passes each Event to its client).

    engine = ServingEngine(model, tokenizer, max_rows=16, block_size=16, cache_blocks=None, prefill_chunk=128,
                           compile=False)
    engine.submit(Request("a", tokenizer.encode("The night was"), max_tokens=20, seed=0, temperature=0.8))
    while engine.has_work():
        for event in engine.step():
            print(event.request_id, event.text, event.finish_reason)
"""
import heapq
from collections import deque
from dataclasses import dataclass, field

from cli import check_count
from errors import BadValue

import torch

from checks import check_request
from engines.blocks import PrefixCache, block_digest, blocks_per_row, digests_of
from engines.decode_step import DecodeStep, GraphCache
from engines.row_cache import BlockStore, decode_batches, first_rows, prompt_step
from engines.rope import with_row_attention
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
    """One request: its tokens (prompt, then new ones), knobs, generator, row of the cache and the digests of
    that row's full blocks. tokens and n_prompt are what prefill_clone's stop rule reads of a row."""

    def __init__(self, request, tokens, seed, knobs, stop_ids, stop_texts, stops_at, vocab, block_size, device):
        self.id, self.max_tokens, self.knobs = request.id, request.max_tokens, knobs
        self.tokens, self.n_prompt = list(tokens), len(tokens)
        self.generator = torch.Generator(device).manual_seed(seed)
        self.stop_ids, self.stops_at, self.text = stop_ids, stops_at, TextStream(vocab, stop_texts)
        self.prompt_digests = digests_of(self.tokens, block_size)
        self.row, self.digests = None, []  # its row of the cache; the digests of the row's leading full blocks
        self.computed = self.cached = 0  # positions whose keys are in its row; of them, copied from the prefix cache

    def event(self, token, text, finish_reason):
        return Event(self.id, token, text, finish_reason, self.n_prompt, self.cached, len(self.tokens) - self.n_prompt)


class ServingEngine:
    """max_rows: requests admitted at once (decoding or prefilling), a row of the full window each.
    block_size: positions a block of the prefix cache holds. cache_blocks: the prefix cache's blocks, its
    memory budget (engines.blocks.blocks_for_bytes turns bytes into it); default: as many as the rows hold.
    prefill_chunk: prompt tokens computed a step, beside the decoding rows. compile, compile_cache: the
    decode step compiled ahead of time (DecodeStep), loaded from compile_cache where it is kept already.
    fixed_shapes: a prompt fed a token a step through the decode step, every step all max_rows rows over
    the whole window, so a row's logits are bit-identical whatever else runs (batch invariance, tested);
    it costs a step for every prompt token and the whole window's reads in every step."""

    def __init__(self, model, tokenizer, max_rows=16, block_size=16, cache_blocks=None, prefill_chunk=128, *,
                 fixed_shapes=False, compile=False, compile_cache=None):
        self.model, self.tokenizer = model, tokenizer
        self.prompt_model = with_row_attention(model)  # the prompts' chunks, each query masked at its position
        self.lesson = Engine(model, tokenizer)  # its checks, stop rule and pick: the same rules, not copies
        self.max_rows = check_count("max_rows", max_rows, 1)
        self.block_size = check_count("block_size", block_size, 1)
        self.prefill_chunk = check_count("prefill_chunk", prefill_chunk, 1)
        self.fixed_shapes, context = bool(fixed_shapes), model.cfg.context
        cache_blocks = max_rows * blocks_per_row(context, block_size) if cache_blocks is None else cache_blocks
        self.prefix = PrefixCache(check_count("cache_blocks", cache_blocks, 0))
        self.store = BlockStore.for_model(model, cache_blocks, block_size)
        self.rows = GraphCache.for_model(model, max_rows, context)
        # {rows: the decode step over the cache's first rows}, the fewest first (one, max_rows, with fixed_shapes)
        self.steps = {n: DecodeStep(model, first_rows(self.rows, n), compile=compile, compile_cache=compile_cache)
                      for n in ([max_rows] if fixed_shapes else decode_batches(max_rows))}
        self.device = model.emb.weight.device
        self.free_rows = list(range(max_rows))  # a heap: the lowest free row is given first
        self.waiting, self.prefilling, self.running = deque(), [], []
        self.active, self.cancelling = {}, set()
        self.prompt_tokens_computed = self.prompt_tokens_cached = 0  # totals, for a benchmark

    def use_compiled(self, compile_cache=None):
        """From the next step on, run the decode steps compiled (loaded from compile_cache where kept): serve.py's
        engine starts on eager ones. Making each ready runs it on this engine's rows and puts them back as they were,
        so call it between two steps; a compiled step gives each row the eager one's tokens."""
        self.steps = {n: DecodeStep(self.model, first_rows(self.rows, n), compile=True, compile_cache=compile_cache)
                      for n in self.steps}

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
        check_count("max_tokens", request.max_tokens, 1)
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
        """A client that hung up: its row is freed at the next step (which says so in an Event). An id that
        is not queued or running (finished already, or never seen) is ignored."""
        if request_id in self.active:
            self.cancelling.add(request_id)

    def has_work(self):
        return bool(self.waiting or self.prefilling or self.running or self.cancelling)

    @torch.inference_mode()
    def step(self):
        """One decode step for every running row, and a chunk of prefill; the Events of this step."""
        events = [self._drop(self.active[i], "cancelled") for i in sorted(self.cancelling)]
        chunks = self._plan_prefill()  # admits newcomers: with fixed_shapes, their prompts go through the decode step
        decoding = self.prefilling + self.running if self.fixed_shapes else list(self.running)
        picks = []  # (logits, sequence) of each row whose next token is picked now
        if decoding:
            logits = self._decode(decoding)
            picks += [(logits[s.row], s) for s in decoding if s.computed == len(s.tokens) - 1]
            for s in decoding:
                self.prompt_tokens_computed += s.computed < s.n_prompt
                s.computed += 1
        for group in self._by_length(chunks):
            logits = prompt_step(self.prompt_model, self.rows, [(s.row, s.tokens[a:b], a) for s, a, b in group])
            for row, (s, start, end) in zip(logits, group):
                self.prompt_tokens_computed += end - start
                s.computed = end
                if end == s.n_prompt:  # the prompt's last position: its logits give the first new token
                    picks.append((row, s))
        if picks:
            seqs = [s for _, s in picks]
            for s, token in zip(seqs, self._pick(torch.stack([row for row, _ in picks]), seqs)):
                events.append(self._advance(s, token))
        for s in self.prefilling + self.running:
            self._keep_full_blocks(s)
        return events

    def _decode(self, decoding):
        """The decode step over the fewest first rows that hold every decoding row: each decoding row feeds its
        next token at its own position; the others (prefilling, or free) a token at the first position they
        have not written, which the keys that belong there overwrite before anything reads them. Logits
        (rows, vocab)."""
        n = next(n for n in self.steps if n > max(s.row for s in decoding))
        tokens, positions = [0] * n, [0] * n
        for s in self.prefilling + self.running:
            if s.row < n:
                positions[s.row] = s.computed
        for s in decoding:
            tokens[s.row] = s.tokens[s.computed]
        self.rows.cache_seqlens[:n].copy_(torch.tensor(positions))
        last = self.model.cfg.context - 1 if self.fixed_shapes else max(s.computed for s in decoding)
        return self.steps[n](torch.tensor(tokens, device=self.device).view(-1, 1), last)

    @staticmethod
    def _by_length(chunks):
        """The chunks in groups of a forward each: those whose lengths share a power of two above them, so no
        forward pads a chunk to more than twice its length (padding costs its compute; a forward of its own
        costs the operators' fixed time, which on a small model is most of a short chunk's)."""
        groups = {}
        for chunk in chunks:
            groups.setdefault((chunk[2] - chunk[1] - 1).bit_length(), []).append(chunk)
        return groups.values()

    def _plan_prefill(self):
        """(sequence, first, end) prompt positions to compute this step: the prompts already being prefilled
        first, in order, then new ones, admitted while the budget and the rows allow (first come, first
        served: one that must wait holds back those behind it). With fixed_shapes: admissions only."""
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
        return chunks

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
        """s is done: its full blocks are kept in the prefix cache for later prompts, its row freed."""
        for queue in (self.waiting, self.prefilling, self.running):
            if s in queue:
                queue.remove(s)
        if s.row is not None:
            self._keep_full_blocks(s)
            heapq.heappush(self.free_rows, s.row)
            s.row = None
        del self.active[s.id]
        self.cancelling.discard(s.id)
        return s.event(token, text, reason)

    def _keep_full_blocks(self, s):
        """Copy each of s's blocks whose every position's keys are written into the prefix cache, so later
        prompts find it."""
        bs = self.block_size
        for i in range(len(s.digests), s.computed // bs):
            s.digests.append(block_digest(s.digests[-1] if i else b"", s.tokens[i * bs:(i + 1) * bs]))
            block = self.prefix.keep(s.digests)
            if block is not None:
                self.store.save(self.rows, s.row, i, block)
