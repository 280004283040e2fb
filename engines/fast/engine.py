"""prefill_clone's Engine with its decode step made fast from outside, as gpt-fast applies torch.compile.

The fastest exact matrix multiply measured here (engines/fast/matmul.py), a compiled
or CUDA-graph decode step (engines/fast/decode_step.py), bfloat16 or int8 weights
(engines/fast/int8.py): the model and the lesson's Engine know nothing of it.

    python -m engines.fast.engine [CHECKPOINT] [PROMPT] -n 8 --tokens 60 --seed 0 [--compile] [--dtype int8]

prints N samples from one prompt pass, then the time to the first token and
the tokens a second; the same samples as python prefill_clone.py.
"""
import copy
import sys
import time

from engines.edge.cli import Parser, as_id, check_count, device_from, run_cli
from engines.edge.errors import BadValue, refusing

import torch

import sampling
from engines.edge.checkpoint import load_pair
from engines.edge.checks import check_cache, check_knobs, check_request, check_seeds, prompt_ids
from engines.fast.compile_cache import check_compile_cache
from engines.fast.graph_pick import stages_for
from engines.fast.int8 import quantized
from engines.fast.matmul import choose, kernel_named, with_kernel
from engines.serving.runner import ModelRunner
import model as lesson
from engines.fast.kv_cache import KVCache, clone_prompt
from engines.fast.rope import with_row_attention
from bench import sync
from engines.edge.cli import show_progress
from engines.edge.timing import measure
import prefill_clone
from prefill_clone import Engine

check_finite = refusing(lesson.check_finite)  # the lesson's refusal, said in one line by run_cli


# the steps generate_batch runs back to back: enough that the Python after them is a small share of theirs,
# few enough that the scores kept for their finiteness check stay small
AHEAD = 16

# int8: the Linears' weights and their input rows (Int8Linear), the cache float32
DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "int8")}


def check_dtype(dtype, device):
    """One of DTYPES (a name or the torch.dtype); float16 only on CUDA, where it has fast kernels."""
    dtype = DTYPES.get(dtype, dtype)
    if dtype not in DTYPES.values():
        raise BadValue(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if dtype == torch.float16 and device.type != "cuda":
        raise BadValue("float16 runs only on CUDA here; on the CPU use bfloat16")
    return dtype


def speed_flags(args):
    """The Engine's compile, compile cache and dtype from those flags, all checked before any checkpoint is read."""
    device = device_from(args.device)
    cache = check_compile_cache(args.compile_cache) if args.compile else args.compile_cache
    return dict(compile=args.compile, compile_cache=cache, dtype=check_dtype(args.dtype, device))


def slower_than_float32(model, dtype, rows, runs=3, measure=measure):
    """On a CPU, a line saying that `dtype` decodes slower than float32 here, or None: measured now, each
    Engine's eager tokens a second at `rows` rows (the median of `runs`, in turns), so that int8 or bfloat16
    eager is never a silent slowdown where the torch and the CPU (no VNNI, no AMX) do not pay for it. (A
    compiled step is timed where it is made, every way, and the times are printed.)"""
    if dtype == torch.float32 or model.emb.weight.device.type != "cpu":
        return None
    engines = {d: FastEngine(model, dtype=d) for d in (torch.float32, dtype)}  # each with its fastest kernel
    fns = {d: lambda e=e: e.generate_batch([0] * 8, rows, max_tokens=16, temperature=0) for d, e in engines.items()}
    speed = {d: rows * 16 / seconds for d, (seconds, _) in measure(fns, runs, model.emb.weight.device).items()}
    name = str(dtype).removeprefix("torch.")
    return None if speed[dtype] >= speed[torch.float32] else (
        f"{name} decodes slower than float32 on this CPU and torch, measured now: {speed[dtype]:,.0f} against "
        f"{speed[torch.float32]:,.0f} tok/s eager at {rows} row{'s' * (rows != 1)}; it saves memory here, not time")


BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer view of each element size


def checksum(p):
    """The sums of p's bits, laid out as its rows (its first dimension) of 64-bit words: each row's sum and
    each column's. A change of one value moves its row's sum; a swap of two moves their rows' sums, or, in
    one row, their columns' sums, or, in one word, that word. Two reductions that only read (a copy or a
    difference of the weights would write as much again, and cost it)."""
    grid = p.detach().reshape(len(p) if p.dim() else 1, -1)
    # rows of whole words that start at a word (a parameter may be a view into a larger tensor), else each
    # value widened: a small tensor, such as a bias or a norm's weight
    in_words = grid.shape[1] * p.element_size() % 8 == 0 and grid.storage_offset() * p.element_size() % 8 == 0
    words = grid.view(torch.int64) if in_words else grid.view(BITS[p.element_size()]).long()
    return words.sum(1).tolist(), words.sum(0).tolist()


def weights_state(model):
    """What the model's weights are now: each tensor, where its data lives, its version counter and a checksum
    of its values' bits (checksum()). The checksum is what notices a write through p.data, in place or a new
    tensor assigned, as older training and EMA code does: it moves neither the tensor nor its version counter."""
    return [(p, p.data_ptr(), 0 if p.is_inference() else p._version, checksum(p)) for p in model.parameters()]


class FastEngine(Engine):
    """prefill_clone's Engine with its decode step made fast from outside.

    kernel: the decode steps' matrix multiply: "auto" measures the exact candidates once per batch size
    where this runs and keeps the fastest (self.chosen says which); a name fixes it. compile: the
    graph-safe decode step made fast by the step runner (engines/serving/runner.py: on a CPU compiled ahead of
    time and kept in the folder compile_cache, so a later Engine with the same weights loads it in
    seconds; on CUDA compiled by torch.compile and captured as a CUDA graph), once per batch size; its
    cache is the full context, so one step serves every prompt and length. cuda_graph: the graph-safe step
    without compiling (on CUDA captured as a graph, on a CPU run eagerly). A kept step picks the next tokens
    too (engines/fast/graph_pick.py: the same tokens, the knobs in the program, made for the knobs a generation
    uses), so a token costs little more than its step. self.steps[batch, stages] is each step,
    self.compile_seconds[batch, stages] what making it ready took.
    dtype: float32, or bfloat16 (float16 on CUDA) for a copy of the weights and the cache; int8 for
    int8 copies of the Linear weights, quantized here, once (quantized()), their input rows quantized as
    they come, with the embedding and the cache float32, the kernel chosen among INT8_KERNELS.
    """

    def __init__(self, model, tokenizer=None, kernel="auto", compile=False, dtype=torch.float32, cuda_graph=False,
                 compile_cache=None):
        device = model.emb.weight.device
        dtype = check_dtype(dtype, device)
        if kernel != "auto":
            kernel_named(kernel, device, dtype)
            if compile:
                raise BadValue(f"kernel {kernel!r} with compile=True: inductor picks the compiled step's kernels; "
                                 "leave kernel='auto'")
        if dtype == torch.int8:
            ready = quantized(model)
        else:
            ready = model if model.emb.weight.dtype == dtype else copy.deepcopy(model).to(dtype)
        super().__init__(with_row_attention(ready), tokenizer)  # the attention that writes a KVCache in place
        self.busy = False
        # a bfloat16 or int8 copy, or a compiled step with frozen weights, would keep running the weights of now
        self.source, self.weights = model, weights_state(model)
        self.kernel, self.compile, self.cuda_graph, self.dtype = kernel, compile, cuda_graph, dtype
        self.compile_cache = compile_cache
        # a compiled or graphed step is made once per batch and kept by a runner of its own; its cache holds
        # the full context and it reads the slots written so far (a graph: all of them, behind a mask), so
        # one of them serves every prompt and length
        self.keeps_step = compile or cuda_graph
        self.chosen, self.kernel_models, self.runners = {}, {}, {}  # keyed by batch
        self.steps, self.compile_seconds = {}, {}  # keyed by (batch, the pick's stages or None)
        self.ahead = 1  # the compiled steps decode runs before their tokens are taken (generate_batch sets it)

    def kernel_model(self, batch):
        """self.model with its products run by the kernel measured fastest for `batch` rows (or fixed)."""
        if batch not in self.kernel_models:
            self.chosen[batch] = choose(self.model, batch)[0] if self.kernel == "auto" else self.kernel
            name, device = self.chosen[batch], self.model.emb.weight.device
            self.kernel_models[batch] = self.model if name == "nn" else with_kernel(
                self.model, kernel_named(name, device, self.dtype))
        return self.kernel_models[batch]

    def cache_len(self, n_prompt, max_tokens):
        """nanochat sizes the cache to prompt + max_tokens; past the window it is a ring of `context`. A kept step's
        cache is the full context, so one step serves every prompt and length."""
        return self.model.cfg.context if self.keeps_step else min(self.model.cfg.context, n_prompt + max_tokens)

    def start(self, tokens, num_samples, max_tokens, seed, stop, forced, knobs):
        """The lesson's start, every argument checked first (checks.check_request)."""
        request = check_request(self, tokens, num_samples, max_tokens, seed, stop, forced, knobs)
        stops = list(request.stop_ids) + [text.decode() for text in request.stop_texts]
        return super().start(request.tokens, len(request.seeds), max_tokens, list(request.seeds), stops,
                             request.forced, {"settings": request.settings})

    def generate(self, tokens, num_samples=1, max_tokens=None, seed=42, stop=None, forced=None, **knobs):
        """The lesson's generate through this Engine's prefill and pick, or, with a kept step, decode below;
        one generation at a time (the rows, the kept step's cache are this Engine's)."""
        if self.keeps_step and max_tokens:
            loop = self.decode(*self.start(tokens, num_samples, max_tokens, seed, stop, forced, knobs), max_tokens)
        else:
            loop = super().generate(tokens, num_samples, max_tokens, seed, stop, forced, **knobs)
        return self.one_at_a_time(loop)

    def take(self, rows, picked, stops_at):
        """The lesson's take, a forced id checked when it is used (forced_tokens may be appended to between steps)."""
        for i, row in enumerate(rows):
            if row.forced_tokens and not row.completed:
                row.forced_tokens[0] = as_id(row.forced_tokens[0], f"forced token for row {i}:", self.model.cfg.vocab_size)
        return super().take(rows, picked, stops_at)

    def one_at_a_time(self, loop):
        if self.busy:
            raise BadValue("this Engine is already generating; finish or close that generator, or use another Engine")
        self.busy = True
        try:
            yield from loop
        finally:
            self.busy = False

    def prefill(self, prompt, n_rows, max_tokens):
        """The prompt cloned into a KVCache of n_rows rows, and the lesson's decode step that writes it, its
        products by the kernel chosen."""
        self.check_unchanged()
        model, cache = self.kernel_model(n_rows), KVCache.for_model(self.model, n_rows, self.cache_len(
            prompt.shape[1], max_tokens))
        return clone_prompt(self.model, prompt, cache), lambda token, pos: model.step(token, cache, pos)

    def kept_step(self, batch, stages):
        """The graph-safe step for `batch` rows picking with the pick's stages, made once by the step runner for
        `batch` and kept; the steps for one batch share its cache of the full context."""
        if (batch, stages) not in self.steps:
            if batch not in self.runners:
                model = self.model if self.compile else self.kernel_model(batch)
                self.runners[batch] = ModelRunner(model, batch, [batch], self.compile, self.compile_cache)
            step = self.runners[batch].step(batch, stages)
            self.steps[batch, stages], self.compile_seconds[batch, stages] = step, step.compile_seconds
        return self.steps[batch, stages]

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """The lesson's generate_batch. Its caller cannot act between steps, so where no stop and no forced token
        is asked for (nothing a step's token decides for the next), decode runs the steps AHEAD at a time."""
        self.ahead = AHEAD if kwargs.get("stop") is None and kwargs.get("forced") is None else 1
        try:
            return super().generate_batch(tokens, num_samples, **kwargs)
        finally:
            self.ahead = 1

    @torch.inference_mode()  # as the lesson's generate runs, which this takes the place of
    def decode(self, rows, generators, settings, stops_at, max_tokens):
        """The lesson's decode loop, or, where the compiled step picks: each step feeds the tokens the last
        one picked, with no pick, tensor or check outside it but the rows' bookkeeping (take) and each
        drawing row's noise from its generator. The first token is the lesson's pick from the prompt's
        scores; a forced token is fed in place of the pick. With self.ahead above 1 (generate_batch) the steps
        run that many back to back before their tokens are taken, one after the other as each step's would
        be: the same tokens, and the Python between steps, which costs more there than its lines suggest
        (a step leaves the CPU's caches cold), once for all of them."""
        self.check_unchanged()
        device = self.model.emb.weight.device
        step = self.kept_step(len(rows), stages_for(settings, self.model.cfg.vocab_size))
        step.cache.reset()
        prompt = torch.tensor([rows[0].tokens], device=device)
        logits = clone_prompt(self.model, prompt, step.cache)
        step.knobs.set(settings, rows[0].tokens)
        history = prompt.expand(len(rows), -1) if any(s.get("penalty", 1.0) != 1.0 for s in settings) else None
        tokens = self.pick(check_finite(logits, 0), history, generators, settings).view(-1, 1)
        pos, n = prompt.shape[1], 0
        scores, picks = [logits], [tokens]  # the steps' scores and tokens not taken yet
        while True:
            for logits, picked in zip(scores, zip(*torch.cat(picks, 1).tolist())):
                n += 1
                if min(picked) < 0:  # the step marks a row whose scores are not finite
                    check_finite(logits, n - 1)
                column, masks = self.take(rows, picked, stops_at)
                yield column, masks
                if n == max_tokens or all(row.completed for row in rows):
                    return
            if 0 in masks:
                tokens = torch.tensor([[row.tokens[-1]] for row in rows], device=device)
            scores, picks = [], []
            while len(picks) < min(self.ahead, max_tokens - n):  # the next steps, back to back
                step.knobs.draw(generators)
                logits, tokens = step(tokens, pos)
                pos += 1
                scores.append(logits)
                picks.append(tokens)

    def pick(self, logits, history, generators, settings):
        """The Engine's pick, all rows in one call where they share their knobs (as they mostly do): the
        same tokens, without a group's gather and scatter, which cost more than the pick at one row."""
        if any(knobs != settings[0] for knobs in settings):
            return super().pick(logits, history, generators, settings)
        return sampling.pick(logits, history=history, generator=generators, **settings[0])

    def check_unchanged(self):
        """Refuse to run once the model's weights changed after this Engine was made, however they changed:
        its bfloat16 or int8 copy, a compiled step with the weights frozen in, or a kernel's reordered copy
        would go on running the old ones (or a mix)."""
        now = weights_state(self.source)
        if len(now) != len(self.weights) or any(a[0] is not b[0] or a[1:] != b[1:] for a, b in zip(self.weights, now)):
            raise BadValue("the model's weights changed after this Engine was made (its decode step or its copy "
                             "holds the old ones); make a new Engine for the new weights")

    @torch.inference_mode()
    def prepare(self, batch, settings=({"temperature": 0},)):
        """Do now what the first generate of `batch` rows with these knobs (one dict for all, or one a row;
        default greedy) would do before its first token: measure the matrix multiplies, or make the kept
        decode step (compiling takes a minute or so, loading a kept one seconds). Returns the seconds
        making the compiled step ready took, 0 if not compiled; a script calls it before anything it
        times or shows an ETA for."""
        settings = list(settings)  # checked as the smallest generate of `batch` rows with these knobs would be
        knobs = dict(settings[0]) if len(settings) == 1 else {"settings": settings}
        settings = check_request(self, [0], batch, 1, 0, None, None, knobs)[2]
        if not self.keeps_step:
            self.kernel_model(batch)
            return 0.0
        stages = stages_for(settings, self.model.cfg.vocab_size)
        self.kept_step(batch, stages)
        return self.compile_seconds[batch, stages]


def sample_knobs(args):
    """The knobs of a run of N samples (prefill_clone.flags), its -n, --seed and --tokens checked first."""
    check_count("-n", args.n, 1)
    check_seeds(args.seed, args.n, "--seed")
    check_count("--tokens", args.tokens, 1)
    knobs = dict(temperature=args.temperature, top_p=args.top_p)
    check_knobs(**knobs)
    return knobs


def timed_generation(engine, tokens, n, n_tokens, **kwargs):
    """(time to first token, total time, rows) for Engine.generate run to the end, its progress on stderr."""
    device = engine.model.emb.weight.device
    sync(device)
    t0, started = time.perf_counter(), time.time()
    rows, ttft = [[] for _ in range(n)], None
    for step, (column, _) in enumerate(engine.generate(tokens, n, max_tokens=n_tokens, **kwargs), 1):
        ttft = ttft or time.perf_counter() - t0
        show_progress("tokens", step, n_tokens, started)
        for row, token in zip(rows, column):
            row.append(token)
    sync(device)
    return ttft, time.perf_counter() - t0, rows


def main():
    ap = prefill_clone.flags(Parser(description="One prompt pass, N samples, the decode step made fast: "
                                                "prefill_clone.py on FastEngine."))
    ap.add_argument("--compile", action="store_true",
                    help="run the decode step compiled (a minute or so the first time, then loaded from the cache)")
    ap.add_argument("--compile-cache", metavar="DIR", default=None,
                    help="where compiled decode steps are kept (default: $XDG_CACHE_HOME/tiny-gpt or ~/.cache/tiny-gpt)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES,
                    help="weights and cache (float16: CUDA; int8: the Linears' weights, one scale per output channel, "
                         "and their input rows, one scale a row, multiplied in int8)")
    args = ap.parse_args()
    knobs, speed = sample_knobs(args), speed_flags(args)
    model, tokenizer = load_pair(args.checkpoint, args.tokenizer, args.device)
    if not args.compile and (note := slower_than_float32(model, speed["dtype"], args.n)):  # compiled: timed, said
        print(f"engine: {note}", file=sys.stderr)
    engine = FastEngine(model, tokenizer, **speed)
    tokens = prompt_ids(tokenizer, args.prompt, model)[0].tolist()
    check_cache(model, args.n, engine.cache_len(len(tokens), args.tokens))  # before anything allocates it
    seconds = engine.prepare(args.n, [knobs])  # compiling (or measuring the kernels) first: no timing or ETA holds it
    engine.generate_batch(tokens, 1, max_tokens=1, seed=args.seed, **knobs)  # warm: a GPU's start-up is no token's
    ttft, seconds_all, rows = timed_generation(engine, tokens, args.n, args.tokens, seed=args.seed, **knobs)
    for i, row in enumerate(rows):
        print(f"--- sample {i} (seed {args.seed + i})")
        print(tokenizer.decode(tokens + row))
    ready = f"; the compiled decode step ready in {seconds:.1f} s before" if args.compile else ""
    print(f"\nprompt {len(tokens)} tokens, {args.n} samples x {args.tokens} tokens: first token in "
          f"{ttft * 1e3:.1f} ms, {args.n * args.tokens / seconds_all:,.0f} tok/s ({args.device}, "
          f"{torch.get_num_threads()} threads, {args.dtype}{ready})")


if __name__ == "__main__":
    run_cli(main)
