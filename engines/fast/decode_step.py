"""The decode step in a form torch.compile and CUDA graphs accept, compiled or captured once.

GraphCache is the lesson's KVCache with each row's position on the device;
DecodeStep runs model.step on it with no Python state between steps,
compiled ahead of time by AOTInductor (each way worth compiling here, timed
side by side, the fastest kept) or replayed as a CUDA graph.
"""
import contextlib
import copy
import io
import os
import sys
import time
import warnings

from engines.edge.cli import first_line, script_name
from engines.edge.errors import CompileFailed
from engines.edge.files import atomic_write, shown

import torch
import torch.nn as nn

from engines.fast.compile_cache import (KEY_FIELD, check_compile_cache, choice_path, keep_choice, load_package,
                                   package_path, read_choice, step_keys)
from engines.fast.compile_ways import COMPILED_ATTENTION, WAY_FIELDS, check_compiler, compile_ways, way_model
from engines.fast.graph_pick import GraphPick, Knobs
from engines.fast.rope import with_row_attention
from engines.fast.kv_cache import KVCache
from bench import median
from engines.edge.timing import timings


# the torch.compile'd graphs one process may hold for the decode step: a batch size and pick each
JIT_GRAPHS = 64


class GraphCache(KVCache):
    """A KVCache that a graph-safe step can write: one token per row, each row at its own position
    given as a (B,) tensor, nothing read on the host (what an exported program and a CUDA graph need).
    Attention reads the first n slots, n the length of `attended` (the slots' numbers, every slot
    unless set), and a mask hides any slot a row has not written yet: DecodeStep sets n to the slots
    written so far, so a step early in a generation does not read the empty rest."""

    def __init__(self, batch, n_layers, max_len, n_kv_heads, head_dim, context=None, dtype=torch.float32,
                 device="cpu"):
        assert context is None or max_len <= context, "a cache longer than the context"
        super().__init__(batch, n_layers, 0, n_kv_heads, head_dim, context or max_len, dtype, device)
        # KVCache's storage, made here with one slot more than the ring, never written or read: the first
        # n slots are then never the whole storage, which torch.export would otherwise make a case of its
        # own (n == max_len) instead of one compiled step for every n.
        stored = (n_layers, batch, n_kv_heads, max_len + 1, head_dim)
        self.heads_k, self.heads_v = (torch.zeros(stored, dtype=dtype, device=device)[:, :, :, :max_len]
                                      for _ in range(2))
        self.k, self.v = self.heads_k.transpose(2, 3), self.heads_v.transpose(2, 3)
        self.layer_ids, self.rows, self.slots = (torch.arange(n, device=device) for n in (n_layers, batch, max_len))
        self.attended = self.slots

    def insert_kv(self, layer, k, v, start):
        if isinstance(start, int):
            return super().insert_kv(layer, k, v, start)
        B, L, n = k.shape[0], self.heads_k.shape[3], self.attended.shape[0]
        # written through heads_k itself, not a view of one layer: compiled, a write into a view
        # becomes a copy of the whole cache every step
        layer_id, slot = self.layer_ids[layer:layer + 1], start % L
        self.heads_k[layer_id, self.rows, :, slot] = k[:, :, 0]
        self.heads_v[layer_id, self.rows, :, slot] = v[:, :, 0]
        if layer == self.heads_k.shape[0] - 1:
            self.cache_seqlens += 1
        mask = (self.attended <= start.view(B, 1)).view(B, 1, 1, n)
        return self.heads_k[layer][:, :, :n], self.heads_v[layer][:, :, :n], mask


class StepProgram(nn.Module):
    """model.step as a function of the cache's tensors, what torch.export needs: a tensor the step only
    held would be exported as a constant of the program, and its writes would land in a copy. With a
    pick (engines/fast/graph_pick.py), the program picks each row's next token too: (logits, tokens)."""

    def __init__(self, model, cache, pick=None):
        super().__init__()
        self.model, self.cache, self.pick = model, cache, pick

    def forward(self, token, heads_k, heads_v, cache_seqlens, attended, *knobs):
        cache = copy.copy(self.cache)  # the same cache, its stored tensors the program's inputs
        cache.heads_k, cache.heads_v, cache.cache_seqlens, cache.attended = heads_k, heads_v, cache_seqlens, attended
        cache.k, cache.v = heads_k.transpose(2, 3), heads_v.transpose(2, 3)
        # a row the pick marked -1 (its scores not finite) is fed on as token 0, where steps run ahead of their
        # tokens being taken (FastEngine.generate_batch): its tokens are never taken, the mark is raised first
        token = token.clamp(min=0)
        logits = self.model.step(token, cache, cache_seqlens.long())
        return logits if self.pick is None else (logits, self.pick(logits, token, *knobs))


def say(message):
    print(f"{script_name() or 'python'}: {message}", file=sys.stderr)


def as_close_as_eager(got, want, dtype):
    """Whether a compiled program's output is its eager forward's: compiled and eager sum in other orders, so as
    close as two float32 forwards are, or a few steps of a narrower dtype."""
    share = 1e-3 if dtype == torch.float32 else 5e-2
    return (got - want).abs().max().item() <= share * max(1.0, want.abs().max().item())


def kept_or_compiled(exported, options, key, folder, what, name, device):
    """(runner, package path, whether it was loaded) for a program AOTInductor compiles with inductor's `options`
    from exported() (a torch.export program) under `key` (compile_cache.step_keys): loaded where a package is kept
    in folder for the key, else compiled and kept there. what, name: the program and its way, for the messages."""
    path = package_path(folder, key)
    if os.path.lexists(path):
        runner, unusable = load_package(path, key)
        if runner is not None:
            say(f"{what}: loaded from {shown(path)}")
            return runner, path, True
        say(f"{what}: {shown(path)} cannot be used ({unusable}); compiling anew and leaving that "
            "file as it is (delete it to keep the new one there)")
    # a kept program loads without a C++ compiler; only compiling needs one
    check_compiler(device, f"or run without compiling (no compiled step is kept at {shown(path)})")
    say(f"{what}: compiling (a minute or so), to keep in {shown(path)}")
    package = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        # raised by torch.export and by inductor's autotuner about their own internals
        warnings.filterwarnings("ignore", "TypedStorage is deprecated")
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        try:
            torch._inductor.aoti_compile_and_package(
                exported(), package_path=package, inductor_configs={**options, "aot_inductor.metadata": {KEY_FIELD: key}})
        except Exception as e:  # a C++ build that breaks, an autotuner that fails: said, never a traceback
            raise CompileFailed(f"{what}, compiled {name!r}, failed inside inductor ({first_line(e)}); run "
                                "without compiling, or see that the C++ compiler works") from None
    try:
        with atomic_write(path) as f:
            f.write(package.getbuffer())
    except FileExistsError:  # another run kept this key's package first, or a file unusable here is there
        pass
    runner, unusable = load_package(package, key)
    if runner is None:
        raise RuntimeError(f"{what} was compiled but cannot be loaded ({unusable})")
    return runner, path, False


class DecodeStep:
    """model.step for one token per row, graph-safe, optionally compiled and/or captured as a CUDA graph.

    Each row's position is read from cache_seqlens on the device and the cache is written in place,
    so a step needs no Python-side state: what an exported program (one graph, the cache's tensors its
    inputs) and a CUDA graph (replayed with no host work, its token a static buffer) both need. The
    slots a step reads, the cache's `attended`, are the program's one input whose size changes: from
    one slot to the whole ring, the same compiled program.

    compile: the step compiled ahead of time by AOTInductor each of the compile_ways for this device and
    batch (or each of `ways` given, {name: options as in COMPILE_WAYS}), each kept as a package in the folder
    compile_cache (default: default_compile_cache()) under its key (step_keys), and loaded from there when a
    package for the same key is kept: no compiling, and no dynamo guards on each step. With more than one way,
    each is timed side by side here and the fastest runs (self.way says which, self.way_ms what each
    took); the times are kept beside the packages (choice_path), so a later step for the same
    packages loads only the faster one. self.loaded says whether every package was loaded,
    self.package where the one that runs is kept, compile_seconds what making the step ready took.
    A package that cannot be loaded, or is not its key's, is said in one line on stderr, left as it
    is, and the step compiled anew; either way the step's first logits are checked against the
    eager step's.
    jit: compile with torch.compile instead (Triton kernels on CUDA, C++ on a CPU), nothing kept on disk:
    CUDA's way, where a loaded package can take the process down. The step then attends to every slot
    (the mask hides those not written), one shape for every step, as a captured graph needs.
    capture (CUDA only): replay a captured graph of the step, the pick inside it.
    pick: the stages of engines/fast/graph_pick.py's GraphPick (() for greedy) to pick each row's next token in
    the same program, by self.knobs: a call then returns (logits, tokens). None: logits only.
    retime: time the compiled ways again though times are kept, and keep the new ones in their place.
    """

    def __init__(self, model, cache, compile=False, capture=False, jit=False, ways=None, compile_cache=None,
                 pick=None, retime=False):
        self.model, self.cache = with_row_attention(model), cache  # each row at its own position
        batch, device = cache.shape["batch"], cache.k.device
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pick = None if pick is None else GraphPick(pick)
        self.knobs = None if pick is None else Knobs(batch, model.cfg.vocab_size, device)
        self.run, self.graph, self.compile_seconds = self._step, None, 0.0
        self.loaded, self.package, self.way, self.way_ms = False, None, None, {}
        # loading a package on CUDA took the process down (torch 2.11, an H200), with no error to catch
        assert jit or not compile or device.type != "cuda", "on CUDA the step compiles with jit, never as a package"
        self.every_slot = jit or capture  # one shape for every step: the mask, not the slots read, moves
        if self.every_slot:
            cache.attended = cache.slots
        if compile:
            started = time.perf_counter()
            # a loaded package prepares its weights on its first calls, in place: not in a timing, nor under
            # autograd, which refuses that for weights that require grad (a checkpoint's, as loaded)
            with torch.no_grad():
                self.run = self._jit_compiled() if jit else self._compiled(ways, check_compile_cache(compile_cache),
                                                                            retime)
                self._rehearse(self.run)
                self._check_against_eager()
            self.compile_seconds = time.perf_counter() - started
        if capture:
            with torch.no_grad():
                self._rehearse(self._capture)

    def _step(self):
        # a row the pick marked -1 (its scores not finite) is fed on as token 0 where steps run ahead of their
        # tokens being taken (FastEngine.generate_batch): its tokens are never taken, the mark is raised first
        token = self.token.clamp(min=0)
        logits = self.model.step(token, self.cache, self.cache.cache_seqlens.long())
        return logits if self.pick is None else (logits, self.pick(logits, token, *self.knobs.tensors()))

    def _jit_compiled(self):
        """The step under torch.compile, one graph with no break (fullgraph) for this batch's one shape.
        Every DecodeStep compiles the same method, each batch and pick a graph of its own: more than dynamo's
        default few, and a step past the limit must fail, not run eager unsaid."""
        compiled = torch.compile(self._step, fullgraph=True, dynamic=False)

        def run():
            with torch._dynamo.config.patch(recompile_limit=JIT_GRAPHS, fail_on_recompile_limit_hit=True):
                return compiled()
        return run

    def _compiled(self, ways, folder, retime=False):
        """The compiled step that runs: the only way, or the fastest of the ways here (retime: timed again, whatever
        times are kept, and the new times kept in their place)."""
        model, cache = self.model, self.cache
        ways = ways or compile_ways(cache.k.device, cache.shape["batch"])
        keys = step_keys(model, cache, ways, None if self.pick is None else self.pick.stages)
        choice = choice_path(folder, list(keys.values()))
        self.way_ms, unusable = read_choice(choice, ways) if len(ways) > 1 and not retime else ({}, None)
        if unusable:
            say(f"the compiled ways' times at {shown(choice)} cannot be used ({unusable}); timing them again and "
                "leaving that file as it is")
        if self.way_ms:  # measured here before, for these very packages: only the faster is loaded
            ways = {name: o for name, o in ways.items() if name == min(self.way_ms, key=self.way_ms.get)}
        made = {}
        for name, options in ways.items():
            try:
                made[name] = self._kept_or_compiled(dict(options), keys[name], folder, name)
            except CompileFailed as e:  # another way may still compile: the run goes on with those that do
                if len(ways) == 1:
                    raise
                say(f"{e}; going on without that way")
        if not made:
            raise CompileFailed(f"the decode step for {cache.shape['batch']} rows failed to compile every way "
                                f"({', '.join(ways)}); run without compiling, or see that the C++ compiler works")
        ways = {name: ways[name] for name in made}
        self.loaded = all(loaded for _, _, loaded in made.values())
        # each runner's own loader: AOTICompiledModel's call parses its input and output specs every step
        outputs = (lambda out: out[0]) if self.pick is None else tuple
        runs = {name: lambda loader=runner.loader: outputs(loader.boxed_run(self._inputs()))
                for name, (runner, _, _) in made.items()}
        if len(runs) > 1:
            self.way_ms = self._time_ways(runs)
            keep_choice(choice, self.way_ms, replace=retime)
        self.way = min(self.way_ms, key=self.way_ms.get) if self.way_ms else next(iter(runs))
        self.package = made[self.way][1]
        if self.way_ms:
            times = ", ".join(f"{name} {ms:.3f} ms" for name, ms in self.way_ms.items())
            measured = "timed here" if len(runs) > 1 else f"as timed here before ({shown(choice)})"
            say(f"the compiled decode step for {cache.shape['batch']} rows, {measured}: {times} a step; "
                f"running {self.way}")
        return runs[self.way]

    def _kept_or_compiled(self, way, key, folder, name="plain"):
        """(runner, package path, whether it was loaded) for the step compiled `way` (a COMPILE_WAYS entry)
        under `key` (its step_keys): loaded where a package is kept for the key, else compiled and kept."""
        options = {option: value for option, value in way.items() if option not in WAY_FIELDS}
        return kept_or_compiled(lambda: self.exported(way), options, key, folder,
                                f"the compiled decode step for {self.cache.shape['batch']} rows", name,
                                self.cache.k.device)

    def exported(self, way):
        """The step as torch.export makes it for `way` (a COMPILE_WAYS entry): one program for every number
        of slots attended, exported at half of them (inductor tunes its kernels for the example's sizes,
        and at all of them it made a step that reads them all)."""
        slots = self.cache.shape["max_len"]
        inputs = self._inputs()
        example = (*inputs[:4], self._half_the_slots(), *inputs[5:])
        attended = {0: torch.export.Dim("attended", min=1, max=slots)} if slots > 1 else None
        knobs = len(inputs) - 5  # the pick's: one *args, which export leaves out where it is empty
        dynamic = (None, None, None, None, attended, *([(None,) * knobs] if knobs else []))
        with COMPILED_ATTENTION[way["attention"]]() if "attention" in way else contextlib.nullcontext():
            return torch.export.export(StepProgram(way_model(self.model, way), self.cache, self.pick), example,
                                       dynamic_shapes=dynamic, strict=False)

    def _time_ways(self, runs, steps=10, rounds=5):
        """{name: ms a step} for each compiled way, timed side by side (timing.timings: a warm-up, which is also
        where a loaded package prepares its weights, then the ways in turns), each step attending to half the
        ring's slots, as one mid-way through a generation that fills it does; the steps write into the cache,
        which is put back after."""
        with self._cache_put_back():
            self.cache.attended = self._half_the_slots()
            seconds = timings({name: lambda run=run: [run() for _ in range(steps)] for name, run in runs.items()},
                              rounds, self.cache.k.device, label="compiled ways:")
        return {name: median(ts) / steps * 1e3 for name, ts in seconds.items()}

    def _half_the_slots(self):
        """The first half of the ring's slots (at least two, if it has them; a length of 1 would make
        torch.export take it for a constant)."""
        slots = self.cache.shape["max_len"]
        return self.cache.slots[:min(slots, max(2, slots // 2))]

    def _inputs(self):
        knobs = [] if self.knobs is None else self.knobs.tensors()
        return [self.token, self.cache.heads_k, self.cache.heads_v, self.cache.cache_seqlens, self.cache.attended,
                *knobs]

    def _check_against_eager(self):
        """Refuse a compiled step whose first step is not the eager one's, in its logits or in the cache it
        wrote (a program whose writes landed in a copy would give the eager logits once, then drift), or,
        with a pick, a token the eager scores do not rank first within that closeness."""
        compiled, eager = self._rehearse(self.run), self._rehearse(self._step)
        made, advice = ((shown(self.package), "; delete that file and run again") if self.package else
                        ("made by torch.compile", ""))
        close = lambda a, b: as_close_as_eager(a, b, self.cache.heads_k.dtype)  # noqa: E731
        tokens = compiled.pop(1) if self.pick is not None else None
        if self.pick is not None:
            eager.pop(1)
        for got, want in zip(compiled, eager):
            if got.shape != want.shape or not close(got.double(), want.double()):
                raise RuntimeError(f"the compiled decode step ({made}) does not compute what the eager step "
                                   f"does{advice}")
        scores = eager[0].double()  # the rehearsal's knobs draw with noise 1: the top score's token
        if tokens is not None and not close(scores.gather(-1, tokens.clamp(min=0)).view(-1), scores.amax(-1)):
            raise RuntimeError(f"the compiled decode step ({made}) does not pick what the eager step does{advice}")

    @contextlib.contextmanager
    def _cache_put_back(self):
        """After the block, the cache as it was before it, the slots it attends to included (rehearsals and
        timings must not count as steps)."""
        live = (self.cache.k, self.cache.v, self.cache.cache_seqlens, *([] if self.knobs is None else [self.knobs.seen]))
        saved, attended = [t.clone() for t in live], self.cache.attended
        try:
            yield live
        finally:
            for t, kept in zip(live, saved):
                t.copy_(kept)
            self.cache.attended = attended

    def _rehearse(self, fn):
        """Run fn, then put the cache back as it was; returns what fn returned (logits, then tokens with a pick)
        and the cache it left."""
        with self._cache_put_back() as live:
            out = fn()
            outs = list(out) if isinstance(out, tuple) else [out]
            return [o.clone() if o is not None else None for o in outs] + [t.clone() for t in live]

    def _capture(self):
        self.cache.attended = self.cache.slots  # captured reading every slot, behind the mask
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up runs, which capture requires, on a side stream
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.run()

    def __call__(self, token, pos):
        """Feed token (B, 1) at position pos, every row's (each row's own lives on the device, in
        cache_seqlens); returns logits (B, vocab), with a pick (logits, tokens (B, 1)). The step attends to
        the slots written by then, pos + 1 or the whole ring, or (every_slot) to every slot behind the mask.
        A captured graph's outputs are copied out: the next replay writes the same buffers, and a caller
        may keep several steps' (FastEngine runs steps ahead of their tokens)."""
        if self.graph is None:
            self.token, self.cache.attended = token, self.cache.slots if self.every_slot else self.cache.slots[:pos + 1]
            return self.run()
        self.token.copy_(token)  # a captured graph reads the tensor it was captured with
        self.graph.replay()
        return self.outputs.clone() if self.pick is None else tuple(out.clone() for out in self.outputs)
