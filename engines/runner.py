"""The step runner: the decode step for B rows on this device, made once and kept (nano-vllm's ModelRunner).

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

    runner = StepRunner(model, max_rows=16, compile=True)
    step = runner.step(3)                 # over the cache's first 4 rows
    logits = step(tokens, pos)            # tokens (4, 1); each row's position is the cache's cache_seqlens
"""
import copy

import torch

from engines.decode_step import DecodeStep, GraphCache, say


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


class StepRunner:
    """Decode steps over the first rows of one cache (self.cache, max_rows rows of the model's context), one per
    size and pick, made on first ask and kept (self.kept[size, stages]).

    compile: the step compiled (on a CPU: AOTInductor's packages, kept in compile_cache and loaded from there);
    jit: torch.compile instead of packages, CUDA's way (default: on CUDA); a CPU takes it only when asked, as
    the tests do to run CUDA's code without a GPU. On CUDA every step is also captured as a graph.
    cache: an existing GraphCache to run on (a runner of compiled steps taking over from one of eager steps)."""

    def __init__(self, model, max_rows, sizes=None, compile=False, compile_cache=None, jit=None, cache=None):
        self.model = model
        self.cache = cache if cache is not None else GraphCache.for_model(model, max_rows, model.cfg.context)
        device = self.cache.k.device
        self.sizes = sorted(sizes or batch_sizes(max_rows))
        assert self.sizes[-1] == self.cache.shape["batch"], "the largest size is the cache's rows"
        self.compile, self.compile_cache = compile, compile_cache
        self.jit = compiles_in_process(device) if jit is None else jit
        self.capture = device.type == "cuda"
        self.kept = {}

    def size_for(self, rows):
        return next(n for n in self.sizes if n >= rows)

    def step(self, rows, stages=None, retime=False):
        """The decode step for `rows` rows: over the first size_for(rows) rows of the cache, with the pick's stages
        (engines/graph_pick.py; None: logits only); retime: made again, its compiled ways timed again."""
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
