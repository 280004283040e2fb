"""decode_step.DecodeStep(compile=True): compiled once, kept on disk under what makes it valid, loaded after.

A loaded step gives the eager tokens; a second Engine loads without compiling; any change to what
the step was compiled for is another key; a damaged or foreign package is said, left and compiled anew.
"""
import copy
import os
import shutil
import sys
import types

import pytest
import torch

from engines.fast import compile_cache
from engines.fast import compile_ways
from engines.fast import decode_step
from engines.serving import runner
from cached import GOTCHAS, CachedGPT
from engines.edge.cli import run_cli
from engines.fast.decode_step import DecodeStep, GraphCache
from engines.fast.engine import FastEngine
from engines.serving.engine import ServingEngine
from engines.fast.compile_ways import compiler_missing
from helpers import run_main
from support import AS_SET, COMPILED, COMPILED_ROWS, TIMED_WAYS, command, compiled_model
from engines.edge.errors import CompileFailed
from model import Config
from prefill_clone import Engine
from engines.fast.kv_cache import KVCache

pytestmark = pytest.mark.skipif(bool(compiler_missing("cpu")), reason=str(compiler_missing("cpu")))

SMALL, small, B = COMPILED, compiled_model, COMPILED_ROWS  # B: the rows the kept step was compiled for
PROMPT = [5, 17, 300, 42, 9]
# inductor's plain settings, one way: the tests check what is kept and loaded, and compiling with the
# autotuner costs a minute or more a batch here (conftest.compile_ahead compiles each way as set, once)
LIGHT = {"cpu": {"plain": {}}}


@pytest.fixture
def kept(compiled):
    """conftest's model, its step compiled for B rows into a folder of its own: (model, folder, engine)."""
    return compiled.model, compiled.folder, compiled.f32


@pytest.fixture
def kept_every_way(every_way_compiled):
    """kept, once conftest.compile_ahead has kept every way's step too."""
    return every_way_compiled.model, every_way_compiled.folder, every_way_compiled.f32


@pytest.fixture
def light(monkeypatch):
    monkeypatch.setattr(compile_ways, "COMPILE_WAYS", LIGHT)


def never_compile(monkeypatch):
    def compiled(*args, **kwargs):
        raise AssertionError("compiled, where a kept step should have been loaded")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compiled)


def step_key(model, cache, options):
    """The key a step compiled with `options` is kept under."""
    return compile_cache.step_keys(model, cache, {None: options}, pick=())[None]  # FastEngine's, greedy


GREEDY = (dict(temperature=0),)  # where compiling is stubbed or ways are many: only the greedy step is kept


def assert_eager_tokens(engine, model, batch, cases=(dict(temperature=0), dict(temperature=1.0, seed=3))):
    for knobs in cases:  # to the end of the context
        eager = Engine(model).generate_batch(PROMPT, batch, max_tokens=SMALL.context - len(PROMPT), **knobs)[0]
        assert engine.generate_batch(PROMPT, batch, max_tokens=SMALL.context - len(PROMPT), **knobs)[0] == eager


def test_a_compiled_step_writes_the_callers_cache_and_gives_the_eager_tokens(kept):
    model, folder, engine = kept
    step = engine.steps[B, ()]
    assert step.package.startswith(str(folder))
    assert_eager_tokens(engine, model, B)


def test_one_compile_per_batch_serves_every_prompt_and_length(kept):
    model, _, engine = kept
    # the last past the window, where the ring's reference is the lesson's loop on the ring, eager (test_kv_cache)
    for prompt, n in ((PROMPT, 12), (PROMPT[:3], 5), (PROMPT[:1], SMALL.context + 8)):
        for knobs in (dict(temperature=0), dict(temperature=1.0, seed=3)):
            eager = FastEngine(model, kernel="nn").generate_batch(prompt, B, max_tokens=n, **knobs)[0]
            assert engine.generate_batch(prompt, B, max_tokens=n, **knobs)[0] == eager
    assert list(engine.compile_seconds) == list(engine.steps) == [(B, ()), (B, ("temperature",))]


@pytest.mark.parametrize("context", [1, 2, 5])
def test_one_exported_step_serves_every_slot_count_as_the_eager_step(context):
    # 1: a ring whose one length is exported as a constant; 2: the fewest slots whose number varies
    torch.manual_seed(0)
    model = CachedGPT(Config(vocab_size=64, d_model=16, n_heads=2, n_layers=1, context=context)).eval()
    with torch.inference_mode():
        cache = GraphCache.for_model(model, 2, context)
        step = DecodeStep(model, cache)  # eager: what the exported program must compute
        program = step.exported(LIGHT["cpu"]["plain"]).module()
        cache.heads_k.normal_(generator=torch.Generator().manual_seed(1))
        cache.heads_v.normal_(generator=torch.Generator().manual_seed(2))
        cache.cache_seqlens.copy_(torch.tensor([context - 1, context + 3]))  # a row at the ring's end, one past it
        for n in range(1, context + 1):
            cache.attended = cache.slots[:n]
            exported = step._rehearse(lambda: program(*step._inputs()))
            eager = step._rehearse(step._step)
            for got, want in zip(exported, eager):
                torch.testing.assert_close(got, want)


def test_a_second_engine_loads_each_kept_step_without_compiling(kept, light,
                                                                                         monkeypatch, capsys):
    model, folder, first = kept
    never_compile(monkeypatch)
    kept_bytes = open(first.steps[B, ()].package, "rb").read()
    engine = FastEngine(model, compile=True, compile_cache=folder)
    engine.prepare(B)
    step = engine.steps[B, ()]
    assert step.loaded and step.package == first.steps[B, ()].package
    assert f"for {B} rows: loaded from {step.package}" in capsys.readouterr().err
    assert_eager_tokens(engine, model, B)
    assert open(step.package, "rb").read() == kept_bytes


def test_a_kept_step_loads_without_a_compiler_and_a_compile_is_refused(kept, light,
                                                                                             monkeypatch, inductor_cxx):
    model, folder, _ = kept
    inductor_cxx("no-such-c++")
    never_compile(monkeypatch)
    engine = FastEngine(model, compile=True, compile_cache=folder)
    assert_eager_tokens(engine, model, B)
    assert engine.steps[B, ()].loaded
    with pytest.raises(ValueError, match=r"^compiling on the CPU needs the C\+\+ compiler inductor builds its kernels "
                                         r"with \(no-such-c\+\+\).*, or run without compiling \(no compiled step is "
                                         r"kept at .*decode-step-\w+\.pt2\)$") as refused:
        engine.prepare(2)  # no step kept for two rows
    assert len(str(refused.value).splitlines()) == 1


def test_every_part_of_what_a_step_is_compiled_for_is_in_its_key(monkeypatch):
    model = small()
    cache = KVCache.for_model(model, 1, SMALL.context)
    key = step_key(model, cache, LIGHT["cpu"]["plain"])
    assert step_key(small(), KVCache.for_model(model, 1, SMALL.context), {}) == key  # the same, made again

    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.blocks[1].mlp[2].weight[3, 5] += 1e-3  # one weight, a little
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    broken = copy.deepcopy(model)
    for block in broken.blocks:
        block.attn.__class__ = GOTCHAS["rope"]
    others = {
        "weights": step_key(changed, cache, {}),
        "batch": step_key(model, KVCache.for_model(model, 3, SMALL.context), {}),
        "dtype": step_key(bf16, KVCache.for_model(bf16, 1, SMALL.context), {}),
        "model class": step_key(broken, cache, {}),
        "options": step_key(model, cache, {"freezing": True}),
        "linears as dot products": step_key(model, cache, {"linears": "dot_products"}),
        "attention as math": step_key(model, cache, {"attention": "math"}),
    }
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    others["torch"] = step_key(model, cache, {})
    monkeypatch.undo()
    monkeypatch.setattr(compile_cache, "machine_name", lambda device: "another CPU | avx2")
    others["machine"] = step_key(model, cache, {})
    monkeypatch.undo()
    sources = compile_cache.step_sources(model, cache)
    monkeypatch.setattr(compile_cache, "step_sources", lambda *args: {**sources, "model.py": "edited"})
    others["source"] = step_key(model, cache, {})
    assert len({key, *others.values()}) == 1 + len(others), others
    assert {"model.py", "cached.py", "kv_cache.py", "decode_step.py", "matmul.py", "row_cache.py"} <= set(sources)


def test_weights_changed_in_place_are_refused_and_compiled_anew_by_a_new_engine(kept, light,
                                                                                         monkeypatch):
    model, folder, _ = kept
    model = copy.deepcopy(model)  # the same weights: the kept step serves it
    engine = FastEngine(model, compile=True, compile_cache=folder)
    engine.prepare(B)
    assert engine.steps[B, ()].loaded
    with torch.no_grad():
        model.norm.weight.mul_(2)
    with pytest.raises(ValueError, match="weights changed after this Engine was made"):
        engine.generate_batch(PROMPT, B, max_tokens=3)

    compiled = []

    def compiles(*args, **kwargs):  # a new Engine compiles the new weights' step (stopped here, said in one line)
        compiled.append(args)
        raise RuntimeError("stopped by the test")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compiles)
    with pytest.raises(CompileFailed, match=r"failed inside inductor \(stopped by the test\)"):
        FastEngine(model, compile=True, compile_cache=folder).prepare(B)
    assert len(compiled) == 1


def damaged(good, other):
    """What may stand at a package's path, made from a good package's bytes and another key's package."""
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF
    return {"truncated": good[:len(good) // 2], "a flipped bit": bytes(flipped), "not a zip": b"hello",
            "another key's package": other}


@pytest.mark.parametrize("what", ["truncated", "a flipped bit", "not a zip", "another key's package"])
def test_a_damaged_or_foreign_package_is_said_left_alone_and_compiled_anew(
        kept, compiled, light, what, tmp_path, monkeypatch, capsys):
    model, folder, first = kept
    path = tmp_path / first.steps[B, ()].package.rsplit("/", 1)[1]
    good = open(first.steps[B, ()].package, "rb").read()
    int8 = open(compiled.int8.steps[B, ()].package, "rb").read()  # the same rows, int8 weights: another key
    path.write_bytes(damaged(good, int8)[what])
    before = path.read_bytes()

    def compile_again(program, package_path, inductor_configs):  # what compiling this step again makes, at once
        package_path.write(good)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compile_again)
    engine = FastEngine(model, compile=True, compile_cache=tmp_path)
    engine.prepare(B)
    said = [line for line in capsys.readouterr().err.splitlines() if "cannot be used" in line]
    assert len(said) == 1 and said[0].endswith("compiling anew and leaving that file as it is (delete it to keep "
                                               "the new one there)")
    assert not engine.steps[B, ()].loaded and path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary file left behind
    assert_eager_tokens(engine, model, B, GREEDY)


def test_a_package_another_run_kept_while_this_one_compiled_is_left_as_it_is(kept, light, tmp_path, monkeypatch):
    model, folder, first = kept
    good = open(first.steps[B, ()].package, "rb").read()
    path = tmp_path / first.steps[B, ()].package.rsplit("/", 1)[1]

    def compiled(program, package_path, inductor_configs):
        path.write_bytes(good + b"")  # the other run's, renamed into place first
        package_path.write(good)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compiled)
    engine = FastEngine(model, compile=True, compile_cache=tmp_path)
    engine.prepare(B)
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert_eager_tokens(engine, model, B, GREEDY)


def test_a_step_that_computes_something_else_is_refused_in_one_line(kept, light, tmp_path, monkeypatch):
    """A package made for this key that still computes other logits (what neither the key nor the checksums
    can see) is refused on its first, rehearsed step: never run."""
    model, folder, first = kept
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.norm.weight.mul_(2)
    made_for = step_key(first.steps[B, ()].model, first.steps[B, ()].cache, LIGHT["cpu"]["plain"])  # as compiled
    # the other model's key were the first's
    monkeypatch.setattr(decode_step, "step_keys", lambda model, cache, ways, pick: dict.fromkeys(ways, made_for))
    shutil.copy(first.steps[B, ()].package, tmp_path)
    never_compile(monkeypatch)
    with pytest.raises(RuntimeError, match=r"the compiled decode step \(.*\) does not compute what the eager "
                                           r"step does; delete that file and run again") as refused:
        FastEngine(other, compile=True, compile_cache=tmp_path).prepare(B)
    assert len(str(refused.value).splitlines()) == 1


def test_a_compile_cache_that_cannot_be_a_folder_is_refused_before_any_read(
        tmp_path, monkeypatch):
    taken = tmp_path / "a file"
    taken.write_text("mine")
    monkeypatch.setattr(sys, "argv", ["fast_engine.py", "no-such.pt", "--compile", "--compile-cache", str(taken)])
    from engines.fast import engine as fast_engine
    with pytest.raises(SystemExit) as exit:
        run_cli(fast_engine.main)
    assert exit.value.code == (f"fast_engine.py: error: cannot make the compile cache folder {taken} (File exists); "
                               "name another with --compile-cache")
    assert taken.read_text() == "mine"


def test_each_way_is_timed_the_fastest_runs_and_later_steps_load_only_it(
        kept_every_way, monkeypatch):
    monkeypatch.setattr(compile_ways, "COMPILE_WAYS", AS_SET)
    every = compile_ways.compile_ways(torch.device("cpu"), B)
    # dot products are not worth compiling for B rows: each row would read every weight again
    assert compile_ways.DOT_PRODUCTS not in every and B > AS_SET["cpu"][compile_ways.DOT_PRODUCTS]["max_rows"]
    assert compile_ways.ATTENTION_AS_MATH in every and compile_ways.ATTENTION_AS_MATH in compile_ways.compile_ways(
        torch.device("cpu"), 1)
    monkeypatch.setattr(compile_ways, "COMPILE_WAYS", TIMED_WAYS)  # two of them, one autotuned
    ways = compile_ways.compile_ways(torch.device("cpu"), B)
    model, folder, _ = kept_every_way  # conftest.compile_ahead kept a package for each of those ways there
    engine = FastEngine(model, compile=True, compile_cache=folder)
    engine.prepare(B)
    step = engine.steps[B, ()]
    assert set(step.way_ms) == set(ways) and len(ways) > 1
    assert step.way == min(step.way_ms, key=step.way_ms.get)
    assert_eager_tokens(engine, model, B, GREEDY)
    keys = [step_key(step.model, step.cache, o) for o in ways.values()]  # as compiled
    choice = compile_cache.choice_path(str(folder), keys)
    never_compile(monkeypatch)
    monkeypatch.setattr(decode_step.DecodeStep, "_time_ways", lambda *args: pytest.fail("timed again"))
    loaded = []
    monkeypatch.setattr(decode_step, "load_package", lambda path, key, real=compile_cache.load_package: (
        loaded.append(path) or real(path, key)))
    for faster in ways:  # whichever was measured faster here is the only one loaded, and runs
        os.remove(choice)
        compile_cache.keep_choice(choice, {name: 1.0 if name == faster else 2.0 for name in ways})
        engine = FastEngine(model, compile=True, compile_cache=folder)
        engine.prepare(B)
        step = engine.steps[B, ()]
        package = compile_cache.package_path(str(folder), step_key(step.model, step.cache, ways[faster]))
        assert engine.steps[B, ()].way == faster and engine.steps[B, ()].package == package and loaded[-1:] == [package]
        assert_eager_tokens(engine, model, B, GREEDY)
        loaded.clear()
    with open(choice, "w") as f:
        f.write("{not json")  # unreadable: timed again, and left as it is
    monkeypatch.undo()
    monkeypatch.setattr(compile_ways, "COMPILE_WAYS", TIMED_WAYS)
    engine = FastEngine(model, compile=True, compile_cache=folder)
    engine.prepare(B)
    assert engine.steps[B, ()].loaded and set(engine.steps[B, ()].way_ms) == set(ways)
    assert open(choice).read() == "{not json"


def test_kept_times_out_of_line_with_the_next_sizes_are_timed_again_and_replaced(kept_every_way, monkeypatch):
    """A choice timed while the machine was busy does not hold for good: a size whose kept time is out of line with
    the next size's is timed again when a runner makes its steps, and the new times kept in place of the old."""
    assert runner.out_of_line({8: 2.7, 16: 15.8}) == [16] and runner.out_of_line({4: 9.0, 8: 3.0}) == [4]
    assert runner.out_of_line({1: 0.67, 2: 0.9, 4: 1.22, 8: 3.0, 16: 4.38}) == []
    monkeypatch.setattr(compile_ways, "COMPILE_WAYS", TIMED_WAYS)
    model, folder, _ = kept_every_way
    step = runner.ModelRunner(model, B, [B], compile=True, compile_cache=folder).step(B, ())  # FastEngine's, greedy
    ways = compile_ways.compile_ways(torch.device("cpu"), B)
    choice = compile_cache.choice_path(str(folder), [step_key(step.model, step.cache, o) for o in ways.values()])
    busy = {name: 500.0 for name in ways}  # every way's time, as a busy machine took them
    compile_cache.keep_choice(choice, busy, replace=True)
    assert runner.ModelRunner(model, B, [B], compile=True, compile_cache=folder).step(B, ()).way_ms == busy  # read
    monkeypatch.setattr(runner, "out_of_line", lambda times: list(times))  # as if B's were out of line
    timed = {name: float(i + 1) for i, name in enumerate(ways)}  # what timing them again measured (no clock read)
    monkeypatch.setattr(DecodeStep, "_time_ways", lambda self, runs: dict(timed) if set(runs) == set(ways) else None)
    retimed = runner.ModelRunner(model, B, [B], compile=True, compile_cache=folder).made(()).kept[B, ()]
    assert retimed.way_ms == timed and retimed.way == min(timed, key=timed.get)
    assert compile_cache.read_choice(choice, ways) == (timed, None)


def test_int8_weights_are_compiled_every_way_float32_ones_are_frozen_included(tmp_path, monkeypatch):
    # an int8 weight reaches torch._int_mm as it is: frozen, the program keeps it int8
    class EveryWayAsked(Exception):
        pass

    asked = []
    def ask(self, way, key, folder, name):
        asked.append(way)
        return types.SimpleNamespace(loader=None), None, False

    def time_ways(self, runs):
        raise EveryWayAsked
    monkeypatch.setattr(compile_ways, "COMPILE_WAYS", AS_SET)
    monkeypatch.setattr(DecodeStep, "_kept_or_compiled", ask)
    monkeypatch.setattr(DecodeStep, "_time_ways", time_ways)
    ways = {}
    for dtype in (torch.float32, torch.int8):
        with pytest.raises(EveryWayAsked):
            FastEngine(small(), dtype=dtype, compile=True, compile_cache=tmp_path).prepare(B)
        ways[dtype], asked = asked, []
    assert len(ways[torch.float32]) > 1 and any(way.get("freezing") for way in ways[torch.float32])
    assert ways[torch.int8] == ways[torch.float32]


def test_one_rows_step_compiled_as_dot_products_gives_the_eager_tokens(kept_every_way, monkeypatch):
    model, folder, _ = kept_every_way  # conftest.compile_ahead kept that step there
    monkeypatch.setattr(compile_ways, "COMPILE_WAYS", {"cpu": {compile_ways.DOT_PRODUCTS: AS_SET["cpu"][compile_ways.DOT_PRODUCTS]}})
    engine = FastEngine(model, compile=True, compile_cache=folder)
    engine.prepare(1)
    assert engine.steps[1, ()].way == compile_ways.DOT_PRODUCTS
    assert_eager_tokens(engine, model, 1, GREEDY)  # the way computes the scores; the sampled pick is tested apart


@pytest.mark.parametrize("kind", ["fifo", "folder", "huge"])
def test_a_kept_package_that_is_not_a_bounded_regular_file_is_said_and_never_opened(tmp_path, monkeypatch, kind):
    path = str(tmp_path / "decode-step-x.pt2")
    if kind == "fifo":
        os.mkfifo(path)  # opened, it would hang the load
    elif kind == "folder":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.truncate(compile_cache.MAX_PACKAGE_BYTES + 1)  # sparse: no disk spent
    monkeypatch.setattr(compile_cache.zipfile, "ZipFile", lambda *a: pytest.fail("opened"))
    runner, why = compile_cache.load_package(path, "key")
    assert runner is None and why in ("it is not a regular file",
                                      f"it is {2**32 + 1:,} bytes, more than the {2**32:,} such a file can be")


@pytest.mark.parametrize("content, why", [
    (None, "it is not a regular file"),
    ('{"a": true, "b": 1.0}', "it is not each way's milliseconds"),
    ('{"a": 1e-310, "b": 1.0}', "it is not each way's milliseconds"),
    ('{"a": 1.0, "b": 1e300}', "it is not each way's milliseconds"),
    ('{"a": 1.0}', "it is not each way's milliseconds"),
    ("[" * 50000, "it is not JSON"),
    (" " * (compile_cache.MAX_CHOICE_BYTES + 1), "more than the 65,536 such a file can be"),
])
def test_a_ways_timing_file_is_read_back_as_input_and_a_bad_one_is_named(tmp_path, content, why):
    path = str(tmp_path / "decode-step-ways-x.json")
    if content is None:
        os.mkfifo(path)
    else:
        with open(path, "w") as f:
            f.write(content)
    kept, unusable = compile_cache.read_choice(path, {"a": {}, "b": {}})
    assert kept == {} and why in unusable
    with open(path, "w") if content is not None else open(os.devnull, "w") as f:
        f.write('{"a": 0.5, "b": 2}')
    if content is not None:
        assert compile_cache.read_choice(path, {"a": {}, "b": {}}) == ({"a": 0.5, "b": 2}, None)


def test_a_relative_xdg_cache_home_is_ignored_as_the_spec_says(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert compile_cache.default_compile_cache() == os.path.join(os.path.expanduser("~"), ".cache", "tiny-gpt")
    monkeypatch.setenv("XDG_CACHE_HOME", "/abs/cache")
    assert compile_cache.default_compile_cache() == "/abs/cache/tiny-gpt"


def inductor_breaks(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CppCompileError: C++ compile error\nCommand: g++ ... (and pages more)")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)


def test_a_compile_that_fails_inside_inductor_ends_in_one_line_naming_the_way(tmp_path, monkeypatch, capsys, light):
    inductor_breaks(monkeypatch)
    with pytest.raises(CompileFailed) as refused:
        FastEngine(small(), compile=True, compile_cache=tmp_path).prepare(B)
    assert str(refused.value) == (f"the compiled decode step for {B} rows, compiled 'plain', failed inside inductor "
                                  "(CppCompileError: C++ compile error); run without compiling, or see that the C++ "
                                  "compiler works")
    from engines.fast import engine as fast_engine
    capsys.readouterr()
    status, out, err = run_main(command(fast_engine.main), ["fast_engine.py", "--compile", "--compile-cache", str(tmp_path),
                                                   "-n", "1"], monkeypatch, capsys)
    assert status == 1 and out == "" and "Traceback" not in err  # the line before it says what was being compiled
    assert err.splitlines()[-1].startswith("fast_engine.py: error: the compiled decode step for 1 rows, compiled "
                                           "'plain', failed inside inductor (CppCompileError: C++ compile error)")


def test_a_way_that_fails_to_compile_is_said_and_the_run_goes_on_with_the_others(kept, monkeypatch, capsys):
    model, folder, _ = kept
    inductor_breaks(monkeypatch)  # the plain way is kept for B rows; the other, kept nowhere, must compile and fails
    monkeypatch.setattr(compile_ways, "COMPILE_WAYS", {"cpu": {"plain": {}, "unfused": {"epilogue_fusion": False}}})
    engine = FastEngine(model, compile=True, compile_cache=folder)
    engine.prepare(B)
    assert engine.steps[B, ()].way == "plain"
    assert "compiled 'unfused', failed inside inductor (CppCompileError: C++ compile error); run without " \
           "compiling, or see that the C++ compiler works; going on without that way" in capsys.readouterr().err
    assert_eager_tokens(engine, model, B)


def test_loading_kept_steps_leaves_the_cache_out_of_autograd(every_way_compiled):
    """A step made ready is rehearsed against the eager step, which writes the cache in place: under autograd, for
    a checkpoint's weights as loaded (they require grad), that left the cache in autograd's graph, and the next
    step made on the same cache refused to write it (serve.py's second start died so)."""
    model = compiled_model()
    assert all(p.requires_grad for p in model.parameters())
    engine = ServingEngine(model, None, max_rows=COMPILED_ROWS, compile=True, compile_cache=every_way_compiled.folder)
    assert all(step.loaded for step in engine.runner.kept.values()) and len(engine.runner.kept) > 1
    assert not engine.runner.cache.heads_k.requires_grad and not engine.runner.cache.heads_v.requires_grad
