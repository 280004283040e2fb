"""engines/fast/engine.py: FastEngine gives the lesson's tokens with every kernel, dtype and step form, and its
command refuses what it cannot honour in one line."""
import threading

import pytest
import torch

from bpe import BPE
from cached import CachedGPT
from support import command, ring_gives_a_trim_first_caches_logits_for_600_steps
from helpers import (PROMPT, SMALL, assert_refused, keys_attended, prompts,
                     run_main, small)
from engines.fast import engine as fast_engine
from engines.fast.decode_step import GraphCache
from engines.fast.engine import FastEngine
from engines.fast.matmul import KERNELS
from engines.fast.rope import with_row_attention
from model import Config
from prefill_clone import Engine
from sample_grid import SETTINGS, grid


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-safe step, run eagerly"])
@pytest.mark.parametrize("kernel", ["auto", *KERNELS])
def test_engine_greedy_rows_equal_cached_py_past_the_window_with_every_kernel(kernel, graph):
    model = small()
    expected = model.generate_cached(torch.tensor([PROMPT]), 60)[0, len(PROMPT):].tolist()
    for n in (1, 3):  # a lone row (the lone-row kernels) and several
        engine = FastEngine(model, kernel=kernel, cuda_graph=graph)
        rows, _ = engine.generate_batch(PROMPT, n, max_tokens=60, temperature=0)
        assert rows == [expected] * n


def test_bf16_engine_runs_a_bf16_copy_and_leaves_the_model_as_it_was():
    model = small()
    engine = FastEngine(model, dtype=torch.bfloat16)
    rows, _ = engine.generate_batch(PROMPT, 3, max_tokens=20, temperature=0)
    assert engine.model.emb.weight.dtype == torch.bfloat16 and model.emb.weight.dtype == torch.float32
    assert engine.model.head.weight is engine.model.emb.weight  # still tied
    assert len(rows) == 3 and all(len(r) == 20 and all(0 <= t < 512 for t in r) for r in rows)
    expected = model.generate_cached(torch.tensor([PROMPT]), 20)[0, len(PROMPT):].tolist()
    assert rows[0][:3] == expected[:3]  # a sanity check: bf16 may part later, not at once


@pytest.mark.parametrize("engine, message", [
    (dict(kernel="fast"), "unknown kernel 'fast'; the kernels are"),
    (dict(kernel="mkl", dtype=torch.bfloat16), "kernel 'mkl' does not run on cpu in bfloat16"),
    (dict(kernel="split", compile=True), "inductor picks the compiled step's kernels"),
    (dict(dtype=torch.float16), "float16 runs only on CUDA here; on the CPU use bfloat16"),
    (dict(kernel="mkl", dtype=torch.int8), "kernel 'mkl' does not run on cpu in int8"),
    (dict(kernel="int_mm"), "kernel 'int_mm' does not run on cpu in float32"),
    (dict(dtype="int4"), "dtype must be one of"),
    (dict(dtype=torch.float64), "dtype must be one of"),
])
def test_bad_engine_settings_are_refused_in_one_line(engine, message):
    with pytest.raises(ValueError, match=message) as refused:
        FastEngine(small(), **engine)
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_cli_prints_the_samples_and_one_line_of_timing(dtype, monkeypatch, capsys):
    status, stdout, err = run_main(command(fast_engine.main), ["fast_engine.py", "-n", "2", "--tokens", "4", "--dtype", dtype],
                                   monkeypatch, capsys)
    assert status == 0, err
    assert "--- sample 1 (seed 1)" in stdout and "--- sample 2" not in stdout
    last = stdout.splitlines()[-1]
    assert last.startswith("prompt 21 tokens, 2 samples x 4 tokens: first token in ") and f" threads, {dtype}" in last


def test_the_graph_safe_ring_past_the_window_gives_trim_first_logits():
    ring_gives_a_trim_first_caches_logits_for_600_steps(GraphCache, at_row_positions=True)


def test_a_graph_safe_step_past_the_window_attends_exactly_context_keys(monkeypatch):
    model, feed = small(), prompts(1, 50, SMALL.vocab_size)
    cache = GraphCache.for_model(model, 1, SMALL.context)
    model = with_row_attention(model)
    with torch.inference_mode():
        model.step(feed[:, :10], cache, 0)
        seen = keys_attended(monkeypatch)
        for t in range(10, 50):
            model.step(feed[:, t:t + 1], cache, torch.tensor([t]))  # each row's position on the device
    assert seen[::SMALL.n_layers] == [min(t + 1, SMALL.context) for t in range(10, 50)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_lower_precision_grid_gives_eight_rows_and_float32s_greedy_start(dtype, shipped):
    model, tokens = shipped, BPE.load("tokenizer.json").encode("Holmes")
    rows = grid(FastEngine(model, dtype=dtype), tokens, 10, seed=1)
    assert list(rows) == list(SETTINGS) and all(len(r) == 10 for r in rows.values())
    assert rows["greedy"][:3] == grid(Engine(model), tokens, 3, seed=1)["greedy"]


@pytest.mark.parametrize("args, message", [
    (["--dtype", "float16"], "float16 runs only on CUDA here; on the CPU use bfloat16"),
    (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
])
def test_hostile_cli_input_gets_one_line_naming_it_and_exit_1(args, message, monkeypatch, capsys):
    run = run_main(command(fast_engine.main), ["fast_engine.py", *args], monkeypatch, capsys)
    assert_refused(run, "fast_engine.py: error: ")
    assert message in run[2] and run[1] == ""


def test_the_weights_checksum_sees_a_swap_inside_an_unaligned_parameter():
    p = torch.nn.Parameter(torch.randn(41)[1:].view(10, 4))  # a view one float32 into its storage
    before = fast_engine.checksum(p)
    with torch.no_grad():
        p[0, [0, 2]] = p[0, [2, 0]].clone()
    assert fast_engine.checksum(p) != before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("change", ["in place through .data", "a new tensor assigned to .data",
                                    "two neighbours swapped", "two values of a row swapped",
                                    "two values of a column swapped", "in place, tracked"])
def test_weights_changed_any_way_after_the_engine_was_made_are_refused(dtype, change):
    model = small()
    engine = FastEngine(model, dtype=dtype)
    engine.generate_batch(PROMPT, 2, max_tokens=3, temperature=0)
    w = model.blocks[0].mlp[0].weight
    with torch.no_grad():
        if change == "in place through .data":
            w.data.mul_(1.01)
        elif change == "a new tensor assigned to .data":
            w.data = w.data * 1.01
        elif change == "two neighbours swapped":  # one 64-bit word of the checksum's
            w.data[0, :2] = w.data[0, :2].flip(0).clone()
        elif change == "two values of a row swapped":  # the same half of two words of one row
            w.data[0, [0, 2]] = w.data[0, [2, 0]].clone()
        elif change == "two values of a column swapped":
            w.data[[0, 5], 1] = w.data[[5, 0], 1].clone()
        else:
            w.mul_(1.01)
    with pytest.raises(ValueError, match="the model's weights changed after this Engine was made"):
        engine.generate_batch(PROMPT, 2, max_tokens=3, temperature=0)


TINY = Config(vocab_size=300, d_model=32, n_heads=2, n_layers=1, context=16)


def test_a_fast_engine_refuses_a_model_with_a_block_in_training_mode():
    model = CachedGPT(TINY).eval()
    model.blocks[-1].train()
    with pytest.raises(ValueError, match="call model.eval.. first"):
        FastEngine(model).generate_batch([1, 2], 1, max_tokens=3)


def test_a_bfloat16_engine_refuses_once_the_models_weights_change():
    model = CachedGPT(TINY).eval()
    engine = FastEngine(model, dtype=torch.bfloat16)
    engine.generate_batch([1, 2], 1, max_tokens=3, temperature=0)
    with torch.no_grad():
        model.head.weight.mul_(2)
    with pytest.raises(ValueError, match="the model's weights changed after this Engine was made"):
        engine.generate_batch([1, 2], 1, max_tokens=3, temperature=0)


def test_two_engines_in_two_threads_leave_the_model_as_it_was():
    model = CachedGPT(TINY).eval()
    alone = Engine(model).generate_batch([1, 2], 2, max_tokens=8, temperature=0)[0]
    results = []

    def run(kernel):
        results.append(FastEngine(model, kernel=kernel).generate_batch([1, 2], 2, max_tokens=8, temperature=0)[0])
    threads = [threading.Thread(target=run, args=(k,)) for k in ("nn", "split")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [alone, alone]
    assert all(type(m) is torch.nn.Linear for m in model.modules() if "Linear" in type(m).__name__)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_a_dtype_slower_than_float32_here_is_said_in_one_line_and_a_faster_one_is_not(dtype):
    def measured(ratio):  # the times are the test's: float32's generation 1 s, the dtype's `ratio` s
        return lambda fns, runs, device: {d: (ratio if d == dtype else 1.0, 0.0) for d in fns}
    note = fast_engine.slower_than_float32(small(), dtype, 4, measure=measured(2.0))
    name = str(dtype).removeprefix("torch.")
    assert note == (f"{name} decodes slower than float32 on this CPU and torch, measured now: 32 against 64 tok/s "
                    "eager at 4 rows; it saves memory here, not time")
    assert fast_engine.slower_than_float32(small(), dtype, 4, measure=measured(0.5)) is None
    assert fast_engine.slower_than_float32(small(), torch.float32, 4) is None
