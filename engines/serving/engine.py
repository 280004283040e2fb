"""Continuous batching on the lesson's model: requests join and leave at any step, with a prefix cache.

nano-vllm's shape: each request is a Sequence (engines/serving/sequence.py); each step the Scheduler
(engines/serving/scheduler.py) plans which rows decode a token and which prompt chunks run, within a token budget,
admitting newcomers into free rows with their cached prefix copied in; the ModelRunner
(engines/serving/runner.py) runs the plan on the device, the decode step the step runner's (engines/serving/runner.py:
the graph-safe step FastEngine runs, compiled with compile=True: on a CPU loaded from the compile cache where
kept, on CUDA captured as a graph), and picks each sequence's next token; this engine takes the tokens, says
them in Events and ends the requests that are done.

Exact: each request's tokens are those of prefill_clone.Engine for that request alone, whatever else
runs: its own generator seeded with its seed (the Engine's row 0), its knobs, picked by the Engine's own
pick (sampling.pick) from the same history, ended by the Engine's own stop rule. The window: a request
is refused unless its prompt and max_tokens fit the model's context (checks.check_request, served=True), inside
which every path computes the same thing (docs/serving_engine.md says why, and what the tests prove).

Single-threaded by design: submit, cancel and step must be called from one thread (a server runs step()
in a loop of its own and passes each Event to its client).

    engine = ServingEngine(model, tokenizer, max_rows=16, block_size=16, cache_blocks=None, prefill_chunk=128,
                           compile=False)
    engine.submit(Request("a", tokenizer.encode("The night was"), max_tokens=20, seed=0, temperature=0.8))
    while engine.has_work():
        for event in engine.step():
            print(event.request_id, event.text, event.finish_reason)
"""
import time

from engines.edge.cli import check_count
from engines.edge.errors import BadValue

import torch

from engines.edge.checks import check_request
from engines.serving.blocks import blocks_per_row
from engines.serving.scheduler import Scheduler
from engines.serving.sequence import Request, Sequence
from engines.serving.runner import ModelRunner
from prefill_clone import Engine, stop_rule


SERVED_DTYPES = ("float32", "bfloat16", "float16")  # the weights and cache served in; float16 on CUDA only


class StepClock:
    """Where the engine's steps spend their time, for a breakdown (bench_serving reads it through /health): each
    phase of step() in all (timed on the host: on CUDA a phase's kernels may run on into the next one's time, the
    pick's copy of the tokens waiting for them), and the steps that decode, with prompt chunks beside or without,
    [steps, seconds] each."""
    PHASES = ("schedule", "decode", "prefill", "pick", "events and blocks")

    def __init__(self):
        self.steps, self.seconds = 0, dict.fromkeys(self.PHASES, 0.0)
        self.decoding = {"decode only": [0, 0.0], "with prefill": [0, 0.0]}

    def start(self):
        self.steps += 1
        self.started = self.last = time.perf_counter()

    def timed(self, phase, work, *args):
        """work(*args), its seconds added to the phase (and the bookkeeping since the last phase to the last)."""
        out = work(*args)
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now
        return out

    def stop(self, plan):
        now = time.perf_counter()
        self.seconds["events and blocks"] += now - self.last
        if plan.decoding:  # what a decoding row waited for its token
            kind = self.decoding["with prefill" if plan.chunks else "decode only"]
            kind[0], kind[1] = kind[0] + 1, kind[1] + now - self.started


class ServingEngine:
    """max_rows: requests admitted at once (decoding or prefilling), a row of the full window each.
    block_size: positions a block of the prefix cache holds. cache_blocks: the prefix cache's blocks, its
    memory budget (engines.serving.blocks.blocks_for_bytes turns bytes into it); default: as many as the rows hold.
    prefill_chunk: prompt tokens computed a step, beside the decoding rows. compile, compile_cache: the
    decode step compiled (the step runner's), on a CPU loaded from compile_cache where it is kept already.
    fixed_shapes: a prompt fed a token a step through the decode step, every step all max_rows rows over
    the whole window, so a row's logits are bit-identical whatever else runs (batch invariance, tested);
    it costs a step for every prompt token and the whole window's reads in every step.
    self.runner.on_logits: a hook given the logits each step's tokens are picked from (ModelRunner)."""

    def __init__(self, model, tokenizer, max_rows=16, block_size=16, cache_blocks=None, prefill_chunk=128, *,
                 fixed_shapes=False, compile=False, compile_cache=None):
        self.model, self.tokenizer = model, tokenizer
        self.lesson = Engine(model, tokenizer)  # its checks, stop rule and pick: the same rules, not copies
        self.max_rows = check_count("max_rows", max_rows, 1)
        self.block_size = check_count("block_size", block_size, 1)
        check_count("prefill_chunk", prefill_chunk, 1)
        blocks = max_rows * blocks_per_row(model.cfg.context, block_size) if cache_blocks is None else cache_blocks
        self.runner = ModelRunner(model, max_rows, [max_rows] if fixed_shapes else None, compile, compile_cache,
                                  lesson=self.lesson, fixed_shapes=bool(fixed_shapes)).made()
        self.scheduler = Scheduler(model, self.runner.cache, block_size, check_count("cache_blocks", blocks, 0),
                                   prefill_chunk, bool(fixed_shapes))
        self.active, self.cancelling = {}, set()
        self.clock = StepClock()

    def use_compiled(self, compile_cache=None):
        """From the next step on, run the decode steps compiled (loaded from compile_cache where kept): serve.py's
        engine starts on eager ones; call it between two steps. A compiled step gives each row the eager one's
        tokens."""
        self.runner.use_compiled(compile_cache)

    def submit(self, request):
        """Queue a request; every field is checked here, before it is queued (errors.BadValue, one line)."""
        if not isinstance(request, Request):
            raise BadValue(f"submit takes an engines.serving.engine.Request, got a {type(request).__name__}")
        if not isinstance(request.id, str) or not request.id:
            raise BadValue(f"a request's id must be a non-empty string, got {request.id!r}")
        if request.id in self.active:
            raise BadValue(f"request id {request.id!r} is already queued or running; give each request its own")
        knobs = dict(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                     penalty=request.penalty)
        tokens, seeds, settings, stop_ids, stop_texts, _ = check_request(
            self.lesson, request.prompt, 1, request.max_tokens, request.seed, request.stop, None, knobs, served=True)
        vocab = None if self.tokenizer is None else self.tokenizer.vocab
        sequence = Sequence(request, tokens, seeds[0], settings[0], stop_ids, stop_texts,
                            stop_rule(self.lesson.tokenizer, stop_ids, stop_texts), vocab, self.block_size, self.runner.device)
        self.scheduler.waiting.append(sequence)
        self.active[request.id] = sequence

    def cancel(self, request_id):
        """A client that hung up: its row is freed at the next step (which says so in an Event). An id that
        is not queued or running (finished already, or never seen) is ignored."""
        if request_id in self.active:
            self.cancelling.add(request_id)

    def has_work(self):
        return self.scheduler.has_work() or bool(self.cancelling)

    @torch.inference_mode()
    def step(self):
        """One decode step for every running row, and a chunk of prefill; the Events of this step."""
        self.clock.start()
        events = [self._finish(self.active[i], "cancelled") for i in sorted(self.cancelling)]
        plan = self.clock.timed("schedule", self.scheduler.schedule)  # admits newcomers
        scores = self.clock.timed("decode", self.runner.decode, plan)
        scores |= self.clock.timed("prefill", self.runner.prefill, plan)
        picking = self.scheduler.ran(plan)  # the sequences whose next token is picked from this step's scores
        tokens = self.clock.timed("pick", self.runner.pick, scores, picking)
        events += [self._advance(s, token) for s, token in zip(picking, tokens)]
        self.scheduler.keep_full_blocks()
        self.clock.stop(plan)
        return events

    def _advance(self, s, token):
        """s takes its new token: the Event, and the request's end if this was its last."""
        s.tokens.append(token)
        if s.stops_at(s, token):
            return self._finish(s, "stop", token, s.text.push(token, stop_id=token in s.stop_ids))
        if len(s.tokens) - s.n_prompt == s.max_tokens:
            return self._finish(s, "length", token, s.text.push(token, stop_id=False))
        self.scheduler.started(s)
        return s.event(token, s.text.push(token), None)

    def _finish(self, s, reason, token=None, text=""):
        self.scheduler.finish(s)
        del self.active[s.id]
        self.cancelling.discard(s.id)
        return s.event(token, text, reason)
