"""What the engines' tests share: an entry point as its command runs it, and the small model whose
decode step the suite compiles once, ahead (compile_ahead runs in a process of its own: this module imports
nothing of conftest)."""
import os

import torch

from engines.edge.cli import run_cli
from engines.fast import compile_ways
from engines.fast import decode_step
from engines.fast import engine as fast_engine
from engines.serving import engine as serving
from engines.fast.rope import with_row_attention
from helpers import SMALL, small
from model import Config


def save_checkpoint(model, path, step=0):
    """A checkpoint as Part 3 writes it: torch.save of {"model", "config", "step"}, the config Part 3's six fields
    (n_kv_heads too where it is not n_heads), so Part 3's own loader reads it."""
    cfg = model.cfg
    config = {name: getattr(cfg, name) for name in ("vocab_size", "d_model", "n_heads", "n_layers", "context", "dropout")}
    config |= {"n_kv_heads": cfg.n_kv_heads} if cfg.n_kv_heads != cfg.n_heads else {}
    torch.save({"model": model.state_dict(), "config": config, "step": step}, path)


def command(main):
    """An entry point of engines/ as its command line runs it: main through run_cli (one line for a refusal)."""
    return lambda: run_cli(main)


AS_SET = compile_ways.COMPILE_WAYS  # read on import, before one_plain_compile_way
# the ways the tests of timing and choosing compile and time for COMPILED_ROWS rows: one autotuned (frozen) and the
# plain; autotuning costs most of the suite's compiling, and a second autotuned way would prove nothing more
TIMED_WAYS = {"cpu": {name: AS_SET["cpu"][name] for name in ("autotuned", "plain")}}


def plain_ways(ways):
    """compile_ways.COMPILE_WAYS with inductor's plain way only, on every device."""
    return {device: {"plain": {}} for device in ways}


# The model whose decode step the suite compiles: small, so a compile takes seconds, with the shipped
# tokenizer's vocabulary, so the serving engines run it too. Compiling is the suite's costliest work,
# so every step the tests run compiled is compiled once, ahead, and loaded by the tests after.
COMPILED = Config(d_model=64, n_heads=4, n_layers=2, context=32)
COMPILED_ROWS = 3  # more than one: each row at its own position in the cache
# the knobs of the steps the `compiled` fixture loads: float32's greedy and sampled, int8's greedy (its pick is
# float32's); and test_graph_pick's step with every stage of the pick
COMPILED_KNOBS = {torch.float32: ({"temperature": 0}, {"temperature": 1.0}), torch.int8: ({"temperature": 0},)}
EVERY_KNOB = {"top_k": 2, "top_p": 0.5, "penalty": 1.1}


def compiled_model():
    from cached import CachedGPT
    torch.manual_seed(0)
    model = CachedGPT(COMPILED).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10)  # untrained scores are too flat for sampled tokens to say much
    return model


def compile_ahead(folder, plain_kept=None):
    """compiled_model()'s steps compiled into folder, as the tests run them, in two processes (the suite's
    critical path; each on a core the tests leave idle). With plain_kept, the first: COMPILED_KNOBS' steps for
    COMPILED_ROWS rows the plain way (then plain_kept is set: what the `compiled` fixture loads), the step with
    EVERY_KNOB, and for one row float32 the dot-products way. Without, the rest: ServingEngine's steps over
    fewer rows and its prompt chunk's program, and float32 the autotuned way of TIMED_WAYS. `every_way_compiled`
    waits for both."""
    os.nice(19)  # on the cores the tests leave idle: a test's torch threads stall when they must share one
    compile_ways.COMPILE_WAYS = plain_ways(AS_SET)  # as one_plain_compile_way sets them in the suite
    model = compiled_model()
    if plain_kept is None:
        serving.ServingEngine(model, None, max_rows=COMPILED_ROWS, compile=True, compile_cache=folder)  # fewer rows
        compile_one_way(model, folder, COMPILED_ROWS, "autotuned")
        return
    compiled_engines(model, folder)
    plain_kept.set()
    fast_engine.FastEngine(model, compile=True, compile_cache=folder).prepare(COMPILED_ROWS, [EVERY_KNOB])
    compile_one_way(model, folder, 1, compile_ways.DOT_PRODUCTS)


def compiled_engines(model, folder):
    """{dtype: a FastEngine with COMPILED_KNOBS' steps for COMPILED_ROWS rows}, loaded from folder or compiled there."""
    engines = {dtype: fast_engine.FastEngine(model, dtype=dtype, compile=True, compile_cache=folder)
               for dtype in COMPILED_KNOBS}
    for dtype, knobs in COMPILED_KNOBS.items():
        for one in knobs:
            engines[dtype].prepare(COMPILED_ROWS, [one])
    return engines


def compile_one_way(model, folder, rows, way):
    """FastEngine's greedy step for `rows` rows compiled `way` alone, which the tests of the ways load."""
    with torch.inference_mode():
        cache = decode_step.GraphCache.for_model(model, rows, COMPILED.context)
        decode_step.DecodeStep(model, cache, compile=True, ways={way: AS_SET["cpu"][way]}, compile_cache=folder,
                               pick=())


class TrimFirst:
    """The ring's semantics past the window, written plainly: concatenate, keep the last `context`, attend to those."""

    def __init__(self, context):
        self.context, self.k, self.v = context, None, None

    def update(self, k, v, start):
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        self.k, self.v = k[:, :, -self.context:], v[:, :, -self.context:]
        return self.k, self.v


def ring_gives_a_trim_first_caches_logits_for_600_steps(ring, at_row_positions=False):
    """Steps past the window through `ring` (a KVCache class) give TrimFirst's logits; at_row_positions: each
    step at a (B,) tensor of positions, as a graph-safe step runs it."""
    model = with_row_attention(small())
    feed = torch.randint(512, (2, 600), generator=torch.Generator().manual_seed(3))
    ring = ring.for_model(model, 2, SMALL.context)
    with torch.inference_mode():
        logits_ring = model.step(feed[:, :10], ring, 0)
    caches = [TrimFirst(SMALL.context) for _ in model.blocks]
    with torch.inference_mode():
        logits_rolling = model.step(feed[:, :10], caches, 0)
        for t in range(10, 600):
            torch.testing.assert_close(logits_ring, logits_rolling, atol=1e-4, rtol=1e-4)
            logits_ring = model.step(feed[:, t:t + 1], ring, ring.cache_seqlens.long() if at_row_positions else t)
            logits_rolling = model.step(feed[:, t:t + 1], caches, t)
    assert ring.k.shape[2] == SMALL.context and ring.get_pos() == 600
