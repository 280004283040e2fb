"""The model runner (nano-vllm's ModelRunner): the decode step for B rows on this device, made once and kept,
and the serving engine's plan of a step run on it.

FastEngine, the serving engine and bench ask it for "a step for B rows"; how that step is made fast is
decided here alone, so nothing above it branches on the device:

- a CPU: the graph-safe step eager, or with compile=True compiled ahead of time by AOTInductor (DecodeStep:
  every way worth trying timed, the fastest kept as a package in the compile cache, loaded from there after);
- CUDA: compiled by torch.compile (Triton kernels; nothing kept on disk) and captured as a CUDA graph, one
  a batch size, replayed with no host work, the pick inside the graph. A package is never loaded on CUDA:
  there loading one crashed the process, with no error to catch (docs/speed.md).

The runner holds one cache of max_rows rows of the full window; the step for B rows runs over its first rows,
as many as the smallest of `sizes` that holds B (nano-vllm's 1, 2, 4, 8, 16, then steps of 16): the rows past
B are padding, so a few rows do not pay for all of them, and few steps are made.

    runner = ModelRunner(model, max_rows=16, compile=True)
    step = runner.step(3)                 # over the cache's first 4 rows
    logits = step(tokens, pos)            # tokens (4, 1); each row's position is the cache's cache_seqlens

For the serving engine (decode, prefill, pick): each decoding row is fed its next token at its own position;
the other rows a step runs over (prefilling, or free) are fed a token at the first position they have not
written, which the keys that belong there overwrite before anything reads them. The prompt chunks run into
their rows, those of about one length in one forward of the lesson's CachedGPT.step (row_cache.prompt_step,
each query masked at its own position); where the decode steps are compiled on a CPU, one chunk a call through
its compiled program (row_cache.CompiledChunks). Each sequence's next token is picked as the lesson's Engine
picks it for that request alone: its generator, its knobs, its history.
"""
import copy

import torch

from engines.fast.decode_step import DecodeStep, GraphCache, say
from engines.fast.rope import with_row_attention
from engines.serving.row_cache import CompiledChunks, prompt_step
from model import check_finite


def compiles_in_process(device):
    """Whether compiled steps are made where they run, as torch.compile makes them on CUDA (seconds a size),
    rather than made once as packages kept on disk (a CPU: minutes, best in a process of their own)."""
    return torch.device(device).type == "cuda"


def batch_sizes(max_rows):
    """The row counts a runner makes steps for: 1, 2, 4, 8, 16, then steps of 16, and max_rows, none above it."""
    return sorted({n for n in (1, 2, 4, 8, *range(16, max_rows + 1, 16)) if n < max_rows} | {max_rows})


# a kept time is out of line when a step of fewer rows takes this many times one of more rows', or one of more
# rows this many times its share (their ratio) of one of fewer rows': timed while the machine was busy
OUT_OF_LINE = 1.5


def out_of_line(ms):
    """The sizes whose compiled step's time ({rows: ms a step}) is out of line with the next size's: the slower."""
    sizes, slow = sorted(ms), set()
    for fewer, more in zip(sizes, sizes[1:]):
        if ms[fewer] > OUT_OF_LINE * ms[more]:
            slow.add(fewer)
        elif ms[more] > OUT_OF_LINE * ms[fewer] * more / fewer:
            slow.add(more)
    return sorted(slow)


def first_rows(cache, n):
    """The first n rows of a GraphCache, as a GraphCache of n rows on the same storage: a decode step over it
    reads and writes those rows of `cache`."""
    if n == cache.shape["batch"]:
        return cache
    view = copy.copy(cache)
    view.heads_k, view.heads_v, view.cache_seqlens = cache.heads_k[:, :n], cache.heads_v[:, :n], cache.cache_seqlens[:n]
    view.k, view.v, view.rows = view.heads_k.transpose(2, 3), view.heads_v.transpose(2, 3), cache.rows[:n]
    return view


class ModelRunner:
    """Decode steps over the first rows of one cache (self.cache, max_rows rows of the model's context), one per
    size and pick, made on first ask and kept (self.kept[size, stages]).

    compile: the step compiled (on a CPU: AOTInductor's packages, kept in compile_cache and loaded from there);
    jit: torch.compile instead of packages, CUDA's way (default: on CUDA); a CPU takes it only when asked, as
    the tests do to run CUDA's code without a GPU. On CUDA every step is also captured as a graph.
    lesson: the lesson's Engine whose pick a serving engine's tokens are picked with; fixed_shapes: every decode step
    over all max_rows rows at the last position (a check's way of running one step shape). on_logits: None, or a
    callable (logits, sequences) given the scores each step's tokens are picked from (engines/serving/check.py)."""

    def __init__(self, model, max_rows, sizes=None, compile=False, compile_cache=None, jit=None, lesson=None,
                 fixed_shapes=False):
        self.model, self.lesson, self.fixed_shapes = model, lesson, fixed_shapes
        self.cache = GraphCache.for_model(model, max_rows, model.cfg.context)
        device = self.cache.k.device
        self.sizes = sorted(sizes or batch_sizes(max_rows))
        assert self.sizes[-1] == self.cache.shape["batch"], "the largest size is the cache's rows"
        self.compile, self.compile_cache = compile, compile_cache
        self.jit = compiles_in_process(device) if jit is None else jit
        self.capture = device.type == "cuda"
        self.kept = {}
        self.prompt_model = with_row_attention(model)  # the prompts' chunks, each query masked at its position
        self.device, self.on_logits = device, None
        self.chunks = self.compiled_chunks() if lesson is not None else None  # the serving engine's prompt chunks

    def size_for(self, rows):
        return next(n for n in self.sizes if n >= rows)

    def step(self, rows, stages=None, retime=False):
        """The decode step for `rows` rows: over the first size_for(rows) rows of the cache, with the pick's stages
        (engines/fast/graph_pick.py; None: logits only); retime: made again, its compiled ways timed again."""
        key = self.size_for(rows), stages
        if key not in self.kept or retime:
            self.kept[key] = DecodeStep(self.model, first_rows(self.cache, key[0]), self.compile, self.capture,
                                         self.jit, compile_cache=self.compile_cache, pick=stages, retime=retime)
        return self.kept[key]

    def made(self, stages=None):
        """The runner with a step made for each size (with the pick's stages), so that compiling (or capturing) is
        no step's work. A size
        whose compiled ways' kept times are out of line with the next size's (out_of_line: timed while the
        machine was busy, a choice that would otherwise hold for good) is timed again, once."""
        steps = {n: self.step(n, stages) for n in self.sizes}
        times = {n: min(step.way_ms.values()) for n, step in steps.items() if step.way_ms}
        for n in out_of_line(times):
            say(f"the compiled decode step for {n} rows: its kept time ({times[n]:.3f} ms) is out of line with "
                f"the other sizes' ({', '.join(f'{k} rows {ms:.3f}' for k, ms in times.items() if k != n)}); "
                "timing its ways again")
            self.step(n, stages, retime=True)
        return self

    def use_compiled(self, compile_cache=None):
        """From the next step on, run the decode steps compiled (loaded from compile_cache where kept). Making each
        ready runs it on the rows and puts them back as they were, so call it between two steps."""
        self.compile, self.compile_cache, self.kept = True, compile_cache, {}
        self.chunks = self.compiled_chunks()
        return self.made()

    def compiled_chunks(self):
        """The prompt chunks compiled (row_cache.CompiledChunks) where the decode steps are compiled on a CPU; None:
        eager, as on CUDA, where compiled programs are made in the process and never kept as packages."""
        if not self.compile or self.fixed_shapes or compiles_in_process(self.device):
            return None
        return CompiledChunks(self.model, self.cache, self.compile_cache)

    def decode(self, plan):
        """{sequence: the scores its next token is picked from} for the plan's decoding rows: the decode step over
        the fewest first rows that hold every one of them."""
        if not plan.decoding:
            return {}
        step = self.step(max(s.row for s in plan.decoding) + 1)
        n = step.cache.shape["batch"]
        tokens, positions = [0] * n, [0] * n
        for s in plan.holding:
            if s.row < n:
                positions[s.row] = s.computed
        for s in plan.decoding:
            tokens[s.row] = s.tokens[s.computed]
        self.cache.cache_seqlens[:n].copy_(torch.tensor(positions))
        last = self.model.cfg.context - 1 if self.fixed_shapes else max(s.computed for s in plan.decoding)
        logits = step(torch.tensor(tokens, device=self.device).view(-1, 1), last)
        return {s: logits[s.row] for s in plan.decoding}

    def prefill(self, plan):
        """{sequence: the scores of its chunk's last token} for the plan's prompt chunks."""
        if self.chunks is not None:  # compiled: a chunk a call
            return {s: self.chunks(s.row, s.tokens[a:b], a)[0] for s, a, b in plan.chunks}
        scores = {}
        for group in self._by_length(plan.chunks):
            logits = prompt_step(self.prompt_model, self.cache, [(s.row, s.tokens[a:b], a) for s, a, b in group])
            scores.update((s, row) for (s, _, _), row in zip(group, logits))
        return scores

    @staticmethod
    def _by_length(chunks):
        """The chunks in groups of a forward each: those whose lengths share a power of two above them, so no
        forward pads a chunk to more than twice its length (padding costs its compute; a forward of its own
        costs the operators' fixed time, which on a small model is most of a short chunk's)."""
        groups = {}
        for chunk in chunks:
            groups.setdefault((chunk[2] - chunk[1] - 1).bit_length(), []).append(chunk)
        return groups.values()

    def pick(self, scores, seqs):
        """One token for each of seqs from its scores ({sequence: scores}), as the Engine picks it for that request
        alone: rows without a repetition penalty in one call of its pick (which groups equal knobs and gives each
        row its own generator), each penalized row with its own history, the prompt and its tokens so far."""
        if not seqs:
            return []
        logits = torch.stack([scores[s] for s in seqs])
        check_finite(logits, min(len(s.tokens) - s.n_prompt for s in seqs))
        if self.on_logits is not None:
            self.on_logits(logits, seqs)
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
