"""bench.py: every figure is measured and present; the CUDA-graph path's logic holds on the CPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

import bench
from kernels import compiler_missing



def positive_numbers(node, path="report"):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from positive_numbers(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from positive_numbers(v, f"{path}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, node


@pytest.mark.skipif(bool(compiler_missing("cpu")), reason=str(compiler_missing("cpu")))
def test_quick_json_has_every_figure_positive_and_cuda_marked_skipped(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "bench.py", "cpu", "2", "--quick", "--tokens", "8", "--json", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["machine"]["device"] == "cpu" and report["machine"]["threads"] == 2
    assert report["machine"]["torch"] == torch.__version__
    methods = ("no_cache", "cached", "engine", "engine_compiled", "engine_bf16")
    decode_keys = {"batch", "tokens", "compile_seconds", *methods, *(m + "_spread" for m in methods)}
    assert len(report["decode"]) == 2 and all(set(r) == decode_keys for r in report["decode"])
    assert [r["config"] for r in report["memory"]] == ["Part 3 (4 heads)", "GQA (4 q heads, 1 kv head)"]
    # the post's figures: 2 x 6 x 256 x 256 x 4 bytes = 3.00 MiB; one kv head of four keeps a quarter
    assert [r["measured_bytes"] for r in report["memory"]] == [3 * 2**20, 3 * 2**20 // 4]
    assert len(report["prefill_clone"]) == 4 and all(set(r) == {"prompt", "n", "separate_ms", "clone_ms"}
                                                     for r in report["prefill_clone"])
    assert [r["batch"] for r in report["kernels"]] == [1, 4]
    for r in report["kernels"]:  # every exact candidate timed, the lone-row ones only for a lone row
        # --quick leaves out the batch-1 step compiled both ways (two more compiles)
        assert set(r) == {"batch", "kernels_ms", "chosen", "step_ms_chosen", "step_ms_nn"}
        assert {"nn", "left", "transposed"} <= set(r["kernels_ms"]) and ("twice" in r["kernels_ms"]) == (r["batch"] == 1)
        assert r["kernels_ms"][r["chosen"]] == min(t for t in r["kernels_ms"].values() if t is not None)
    drift = report["bf16_drift"]
    assert drift["weights"] == "holmes.pt" and drift["tokens"] == 16 and 0 < drift["max_logit_difference"] < 1
    assert drift["first_difference"] is None or 0 <= drift["first_difference"] < 16
    assert report["cuda"]["skipped"].startswith("skipped: needs a CUDA device")
    installed = set(bench.PEERS) - set(bench.missing_peers(torch.device("cpu")))  # the serving engines here
    columns = {"batch", "tokens", "engine", "engine_compiled", "engine_bf16", *installed}
    assert [r["batch"] for r in report["peers"]] == [1, 4] and all(set(r) == columns for r in report["peers"])
    numbers = dict(positive_numbers({k: report[k] for k in ("decode", "memory", "prefill_clone", "kernels", "peers")}))
    assert numbers and all(v > 0 for k, v in numbers.items() if not k.endswith("_spread")), numbers
    assert "5. CUDA" in run.stdout and "skipped" in run.stdout


@pytest.mark.parametrize("args, message", [
    (["gpu"], "unknown device 'gpu'"),
    (["cpu", "0"], f"THREADS must be in 1..{os.cpu_count()} (this machine's cores), got 0"),
    (["cpu", "100000"], f"THREADS must be in 1..{os.cpu_count()} (this machine's cores), got 100000"),
    (["cpu", "--json", ""], "the output path is empty"),
    (["cpu", "--json", "."], "cannot write .: it is a folder"),
    (["cpu", "--fast"], "unrecognized arguments: --fast"),
    (["cpu", "--runs", "2"], "--runs must be at least 3"),
    (["cpu", "--tables", "3,7"], "--tables takes numbers 1 to 6 separated by commas, got '3,7'"),
] + ([] if torch.cuda.is_available() else [(["cuda"], "no CUDA GPU")]))
def test_bad_arguments_get_one_line_and_a_non_zero_exit(args, message):
    run = subprocess.run([sys.executable, "bench.py", *args], capture_output=True, text=True)
    assert run.returncode != 0
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_an_existing_json_is_kept_unless_forced_and_a_missing_folder_fails_at_once(tmp_path):
    out = tmp_path / "bench.json"
    out.write_text("earlier results")
    run = subprocess.run([sys.executable, "bench.py", "cpu", "--json", str(out)], capture_output=True, text=True)
    assert run.returncode == 1 and "already exists; pass --force" in run.stderr and "Traceback" not in run.stderr
    assert out.read_text() == "earlier results" and run.stdout == ""
    missing = tmp_path / "no" / "bench.json"
    run = subprocess.run([sys.executable, "bench.py", "cpu", "--json", str(missing)], capture_output=True, text=True)
    assert run.returncode == 1 and "does not exist" in run.stderr and run.stdout == ""


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
    bench.table_peers(model, engines, torch.device("cpu"), {"lengths": (8,), "batches": (1,)}, 3, out)
    lines = capsys.readouterr().out.splitlines()
    assert "   transformers: not installed (pip install -r requirements.txt)" in lines
    assert any(line.startswith("   ctranslate2: ") for line in lines)
    assert "   llama_cpp: not installed (pip install -r requirements-serve.txt)" in lines
    header, row = lines[-2].split(), lines[-1].split()
    assert header == ["batch", "engine", "engine_compiled", "engine_bf16", "transformers", "ctranslate2", "llama_cpp",
                      "compiled/llama_cpp"]
    assert row[0] == "1" and row[4:] == ["-", "-", "-", "-"] and len(row) == len(header)
    assert set(out[0]) == {"batch", "tokens", "engine", "engine_compiled", "engine_bf16"}
