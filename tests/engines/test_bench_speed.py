"""engines/bench/speed.py and engines/bench/peers.py, through python -m engines.bench: every speed figure measured and present,
each table's columns and the lines under its rows."""
import copy
import json
import math
import re

import pytest
import torch

from engines.bench import __main__ as bench
from helpers import positive_numbers, read_by, run_main
from support import COMPILED_ROWS, command
from engines.bench import peers as bench_peers
from engines.bench import speed as bench_speed
from engines.fast.compile_ways import compiler_missing


@pytest.mark.skipif(bool(compiler_missing("cpu")), reason=str(compiler_missing("cpu")))
def test_quick_json_has_every_figure_positive_and_cuda_marked_skipped(compiled, tmp_path, monkeypatch, capsys):
    out, threads = tmp_path / "bench.json", torch.get_num_threads()
    # conftest's model, whose steps are compiled once for the suite: tables 4 and 6 load them
    monkeypatch.setattr(bench, "untrained_model", lambda device: compiled.model)
    monkeypatch.setenv("XDG_CACHE_HOME", str(compiled.home))
    # one batch, the rows conftest's steps are compiled for: each batch more is two more compiles (tables 4
    # and 6) and three more rounds of every engine
    monkeypatch.setattr(bench, "QUICK", bench.QUICK | {"batches": (COMPILED_ROWS,)})
    try:
        status, stdout, err = run_main(command(bench.main), ["bench", "cpu", "2", "--quick", "--tables", "3,4,5,6", "--tokens",
                                                    "8", "--json", out], monkeypatch, capsys)
    finally:
        torch.set_num_threads(threads)
    assert status == 0, err
    report = json.loads(out.read_text())
    assert report["machine"]["device"] == "cpu" and report["machine"]["threads"] == 2
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["read_bytes_per_s"] > 0
    engines = ("engine", "engine_compiled", "engine_bf16", "engine_int8", "engine_int8_compiled")
    methods = ("no_cache", "cached", *engines)
    parts = {f"{form}_{part}" for form in ("engine_compiled", "engine_int8_compiled")
             for part in ("step_ms", "token_ms", "outside")}
    decode_keys = {"batch", "tokens", "compile_seconds", "int8_compile_seconds", *methods,
                   *(m + "_spread" for m in methods), *read_by(methods), *parts}
    assert len(report["decode"]) == 1 and all(set(r) == decode_keys for r in report["decode"])
    assert [r["batch"] for r in report["kernels"]] == [COMPILED_ROWS]
    for r in report["kernels"]:  # every exact candidate timed
        # --quick leaves out the step compiled each way (a compile a way and a batch)
        assert set(r) == {"batch", "kernels_ms", "chosen", "step_ms_chosen", "step_ms_nn"}
        assert {"nn", "split"} <= set(r["kernels_ms"])
        assert r["kernels_ms"][r["chosen"]] == min(t for t in r["kernels_ms"].values() if t is not None)
    for drift in (report["bf16_drift"], report["int8_drift"]):
        assert drift["weights"] == "holmes.pt" and drift["tokens"] == 16 and 0 < drift["max_logit_difference"] < 1
        assert drift["first_difference"] is None or 0 <= drift["first_difference"] < 16
    assert report["cuda"]["skipped"].startswith("skipped: needs a CUDA device")
    installed = set(bench_peers.PEERS) - set(bench_peers.missing_peers(torch.device("cpu")))  # the serving engines here
    ran = {*engines, *installed}
    columns = {"batch", "tokens", "over_table_4", *ran, *read_by(ran)}
    assert [r["batch"] for r in report["peers"]] == [COMPILED_ROWS] and all(set(r) == columns for r in report["peers"])
    # each Engine form timed in table 6 set beside its own figure in table 4 of this run, the same batch and tokens
    peers, decode = report["peers"][0], report["decode"][0]
    assert peers["over_table_4"] == pytest.approx({name: peers[name] / decode[name] for name in engines})
    assert "over table 4 in this run: engine " in stdout
    drifts = report["peers_drift"]  # where each parts from the float32 Engine, the compiled forms left out
    assert set(drifts) == {"engine_bf16", "engine_int8", *installed}
    assert all(d is None or 0 <= d < 16 for d in drifts.values())
    numbers = dict(positive_numbers({k: report[k] for k in ("decode", "kernels",
                                                            "peers")}))
    # a token's time is the difference of two timings (n tokens less one), below 0 where noise outweighs 8 tokens
    differences = ("_spread", "_token_ms", "_outside")
    assert all(math.isfinite(v) for v in numbers.values())
    assert numbers and {k: v for k, v in numbers.items() if v <= 0 and not k.endswith(differences)} == {}
    assert "compiled: step " in stdout and "int8 compiled: step " in stdout
    assert "5. CUDA" in stdout and "skipped" in stdout


def test_the_peers_table_names_each_missing_engine_and_keeps_its_column(monkeypatch, capsys):
    import importlib.util

    from cached import CachedGPT
    from model import Config
    from prefill_clone import Engine
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("gguf", "llama_cpp") or (
        name == "transformers") else real(name, *a))
    model = CachedGPT(Config(d_model=64, n_heads=4, n_layers=2, context=32)).eval()
    engines = {"engine": Engine(model), "engine_compiled": Engine(model), "engine_bf16": Engine(model)}  # no compile
    out = []
    bench_peers.table_peers(model, engines, torch.device("cpu"), {"lengths": (8,), "batches": (1,)}, 3, 1e10, [], out)
    lines = capsys.readouterr().out.splitlines()
    assert lines.pop() == "      (table 4 did not run batch 1, 8 tokens in this run: nothing to set beside)"
    assert "   transformers: not installed (pip install -r engines/requirements.txt)" in lines
    assert any(line.startswith("   ctranslate2: ") for line in lines)
    assert "   llama_cpp: not installed (pip install -r engines/requirements.txt)" in lines
    header, row, shares = lines[-3].split(), lines[-2].split(), lines[-1]
    assert header == ["batch", "engine", "engine_compiled", "engine_bf16", "transformers", "ctranslate2",
                      "ctranslate2_int8", "llama_cpp", "llama_cpp_q8_0", "compiled/llama_cpp", "int8", "compiled/q8_0"]
    assert row[0] == "1" and row[4:] == ["-"] * 7 and len(row) == len(header) - 1  # "int8 compiled/q8_0": one column
    # under the row, each engine that ran: the MB a step reads and its share of the bandwidth; the others -
    assert re.fullmatch(r"  %bw(\s+\d+\.\d MB\s+\d+%){3}(\s+-){5}", shares), shares
    assert set(out[0]) == {"batch", "tokens", "engine", "engine_compiled", "engine_bf16",
                           *read_by(("engine", "engine_compiled", "engine_bf16"))}


def test_every_decode_table_row_has_its_bytes_and_bandwidth_share(capsys):
    from cached import CachedGPT
    from engines.fast.engine import FastEngine
    from model import Config
    model = CachedGPT(Config(vocab_size=256, d_model=64, n_heads=4, n_layers=2, context=32)).eval()
    # the compiled column's place taken by the same graph-safe step run eagerly: no compile in a test
    engines = {"engine": FastEngine(model), "engine_compiled": FastEngine(model, cuda_graph=True),
               "engine_bf16": FastEngine(model, dtype=torch.bfloat16), "engine_int8": FastEngine(model, dtype=torch.int8),
               "engine_int8_compiled": FastEngine(model, dtype=torch.int8, cuda_graph=True)}
    out = []
    bench_speed.table_decode(model, engines, torch.device("cpu"), {"lengths": (8,), "batches": (1, 2)}, 3, 1e10, out)
    lines = capsys.readouterr().out.splitlines()
    rows = [i for i, line in enumerate(lines) if re.match(r"\s+[12]\s+8\s+[\d,]+ ±", line)]
    assert len(rows) == 2
    for i in rows:  # the two loops and five forms, each its MB a step and its share
        assert re.fullmatch(r"\s+MB %bw(\s+\d+\.\d MB\s+\d+%){7}", lines[i + 1]), lines[i + 1]
    methods = ("no_cache", "cached", *engines)
    for row in out:
        assert read_by(methods) <= set(row)
        # bfloat16 reads half of what float32 does; the uncached loop reads no cache
        assert row["engine_bf16_step_bytes"] == pytest.approx(row["engine_step_bytes"] / 2)
        # int8 weights read a quarter of float32's (and a scale a row); the cache stays float32
        assert row["engine_int8_step_bytes"] < row["engine_step_bytes"] / 2
        assert row["no_cache_step_bytes"] < row["cached_step_bytes"] == row["engine_step_bytes"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_drift_from_float32_on_the_trained_weights_is_reported_and_bounded(dtype, shipped):
    """bf16 copies every weight, int8 keeps each weight within half a step of its row's 255; on the shipped
    weights neither moves a score by a whole logit, and greedy keeps float32's first tokens."""
    model = shipped
    drift = bench_speed.dtype_drift(model, dtype, bench_speed.drift_prompt(model), 64)
    assert 0 < drift["max_logit_difference"] < 1
    assert drift["first_difference"] is None or drift["first_difference"] >= 4


def test_the_bytes_a_step_reads_are_every_weight_once_and_the_cache_it_attends_to():
    from cached import CachedGPT
    from model import Config
    from engines.bench import figures
    d, vocab, layers, kv_width = 64, 128, 2, 32  # two kv heads of four: grouped-query, a half-width cache
    model = CachedGPT(Config(vocab_size=vocab, d_model=d, n_heads=4, n_kv_heads=2, n_layers=layers, context=32)).eval()
    # the embedding, tied to the head; per block two norms (weight and bias), qkv and out (no bias), the MLP's two
    # layers (with bias); the final norm
    params = vocab * d + layers * (2 * d + d * (d + 2 * kv_width) + d * d + 2 * d + (d * 4 * d + 4 * d)
                                   + (4 * d * d + d)) + 2 * d
    # 40 tokens from an 8-token prompt in a 32-token window: the steps attend to 8, 9, ..., 31 positions (the
    # prefill, then one more each step), then to the full window for the last 16
    positions = list(range(8, 32)) + [32] * 16
    per_position = 2 * layers * kv_width  # keys and values of every layer, one row, one position, in values
    mean = sum(positions) / len(positions)
    assert figures.bytes_per_step(model, 3, 40) == pytest.approx(params * 4 + 3 * per_position * 4 * mean)
    # uncached, a step recomputes its keys: the weights alone, whatever the batch
    assert figures.bytes_per_step(model, 3, 40, cached=False) == params * 4
    # a cache kept in another dtype than the weights (llama.cpp's f16)
    assert figures.bytes_per_step(model, 3, 40, cache_dtype=torch.float16) == pytest.approx(
        params * 4 + 3 * per_position * 2 * mean)
    # in bfloat16, weights and cache both two bytes a value
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert figures.bytes_per_step(half, 3, 40) == pytest.approx(params * 2 + 3 * per_position * 2 * mean)
    # untied, the head reads its own table whole and the lookup reads one row of the embedding per row
    model.head.weight = torch.nn.Parameter(model.emb.weight.detach().clone())
    assert figures.bytes_per_step(model, 3, 40) == pytest.approx((params + 3 * d) * 4 + 3 * per_position * 4 * mean)


def test_the_bandwidth_measure_is_a_positive_finite_rate():
    from engines.bench import figures
    assert 0 < figures.read_bandwidth(torch.device("cpu")) < math.inf
