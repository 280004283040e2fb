"""bench.py: the default run is the post's table, first and alone; every figure is measured and present; its
summed step costs add up to the steps a generation runs."""
import copy
import json
import math
import os
import re

import pytest
import torch

import bench
from cached import load
from engines.compile_ways import compiler_missing
from conftest import COMPILED_ROWS, assert_refused, run_main


def read_by(keys):
    """The keys bench.put_bandwidth adds beside each tok/s figure."""
    return {k + suffix for k in keys for suffix in ("_step_bytes", "_bandwidth_share")}


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
def test_quick_json_has_every_figure_positive_and_cuda_marked_skipped(compiled, tmp_path, monkeypatch, capsys):
    out, threads = tmp_path / "bench.json", torch.get_num_threads()
    # conftest's model, whose steps are compiled once for the suite: tables 4 and 6 load them
    monkeypatch.setattr(bench, "untrained_model", lambda device: compiled.model)
    monkeypatch.setenv("XDG_CACHE_HOME", str(compiled.home))
    # one batch, the rows conftest's steps are compiled for: each batch more is two more compiles (tables 4
    # and 6) and three more rounds of every engine
    monkeypatch.setattr(bench, "QUICK", bench.QUICK | {"batches": (COMPILED_ROWS,)})
    try:
        status, stdout, err = run_main(bench.main, ["bench.py", "cpu", "2", "--quick", "--all", "--whole", "--tokens",
                                                    "8", "--json", out], monkeypatch, capsys)
    finally:
        torch.set_num_threads(threads)
    assert status == 0, err
    report = json.loads(out.read_text())
    assert report["machine"]["device"] == "cpu" and report["machine"]["threads"] == 2
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["read_bytes_per_s"] > 0
    post = report["post"]
    assert post["step_counts"] == [8, 15] and [(r["batch"], r["tokens"]) for r in post["rows"]] == [(COMPILED_ROWS, 8)]
    loops = ("no_cache", "cache", "whole_no_cache", "whole_cache")
    assert all(set(r) == {"batch", "tokens", *loops, *(m + "_spread" for m in loops), *read_by(loops[:2])}
               for r in post["rows"])
    cfg = compiled.model.cfg  # a full window: 2 (k, v) x layers x tokens x d_model x 4 bytes
    full = 2 * cfg.n_layers * cfg.context * cfg.d_model * 4
    assert post["cache"] == {"tokens": cfg.context, "measured_bytes": full, "formula_bytes": full}
    engines = ("engine", "engine_compiled", "engine_bf16", "engine_int8", "engine_int8_compiled")
    methods = ("no_cache", "cached", *engines)
    decode_keys = {"batch", "tokens", "compile_seconds", "int8_compile_seconds", *methods,
                   *(m + "_spread" for m in methods), *read_by(methods)}
    assert len(report["decode"]) == 1 and all(set(r) == decode_keys for r in report["decode"])
    assert [r["config"] for r in report["memory"]] == ["Part 3 (4 heads)", "GQA (4 q heads, 1 kv head)"]
    # the post's figures: 2 x 6 x 256 x 256 x 4 bytes = 3.00 MiB; one kv head of four keeps a quarter
    assert [r["measured_bytes"] for r in report["memory"]] == [3 * 2**20, 3 * 2**20 // 4]
    clone_keys = {"prompt", "n", "tokens", "separate_ms", "clone_ms", "separate_s", "clone_s"}
    assert len(report["prefill_clone"]) == 4 and all(set(r) == clone_keys for r in report["prefill_clone"])
    assert [r["batch"] for r in report["kernels"]] == [COMPILED_ROWS]
    for r in report["kernels"]:  # every exact candidate timed, the lone-row ones only for a lone row
        # --quick leaves out the step compiled each way (a compile a way and a batch)
        assert set(r) == {"batch", "kernels_ms", "chosen", "step_ms_chosen", "step_ms_nn"}
        assert {"nn", "left", "transposed"} <= set(r["kernels_ms"]) and ("twice" in r["kernels_ms"]) == (r["batch"] == 1)
        assert r["kernels_ms"][r["chosen"]] == min(t for t in r["kernels_ms"].values() if t is not None)
    for drift in (report["bf16_drift"], report["int8_drift"]):
        assert drift["weights"] == "holmes.pt" and drift["tokens"] == 16 and 0 < drift["max_logit_difference"] < 1
        assert drift["first_difference"] is None or 0 <= drift["first_difference"] < 16
    assert report["cuda"]["skipped"].startswith("skipped: needs a CUDA device")
    installed = set(bench.PEERS) - set(bench.missing_peers(torch.device("cpu")))  # the serving engines here
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
    numbers = dict(positive_numbers({k: report[k] for k in ("post", "decode", "memory", "prefill_clone", "kernels",
                                                            "peers")}))
    assert numbers and all(v > 0 for k, v in numbers.items() if not k.endswith("_spread")), numbers
    assert "5. CUDA" in stdout and "skipped" in stdout


@pytest.mark.parametrize("args, message", [
    (["gpu"], "unknown device 'gpu'"),
    (["cpu", "0"], f"THREADS must be in 1..{os.cpu_count()} (this machine's cores), got 0"),
    (["cpu", "100000"], f"THREADS must be in 1..{os.cpu_count()} (this machine's cores), got 100000"),
    (["cpu", "--json", ""], "the output path is empty"),
    (["cpu", "--json", "."], "cannot write .: it is a folder"),
    (["cpu", "--fast"], "unrecognized arguments: --fast"),
    (["cpu", "--runs", "2"], "--runs must be at least 3"),
    (["cpu", "--tables", "3,7"], "--tables takes numbers 0 to 6 separated by commas, got '3,7'"),
    (["cpu", "--tables", "0,1", "--all"], "argument --all: not allowed with argument --tables"),
    (["cpu", "--tables", "1", "--whole"], "--whole times table 0's generations whole; add 0 to --tables"),
] + ([] if torch.cuda.is_available() else [(["cuda"], "no CUDA GPU")]))
def test_bad_arguments_get_one_line_and_a_non_zero_exit(args, message, monkeypatch, capsys):
    status, out, err = run_main(bench.main, ["bench.py", *args], monkeypatch, capsys)
    assert status != 0 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_default_run_prints_the_posts_table_first_and_runs_no_other_table(monkeypatch, capsys):
    assert (bench.FULL["batches"], bench.FULL["lengths"]) == ((1, 16), (64, 256, 1024))  # the post's rows
    monkeypatch.setattr(bench, "FULL", bench.FULL | {"batches": (1, 2), "lengths": (8, 12)})  # rows that run fast

    def never(*args, **kwargs):
        raise AssertionError("the default run went beyond the post's table")
    for name in ("engine_forms", "check_compiler", "table_memory", "table_clone", "table_kernels", "table_decode",
                 "table_drift", "table_cuda", "table_peers"):
        monkeypatch.setattr(bench, name, never)
    monkeypatch.setattr(torch, "compile", never)
    status, out, err = run_main(bench.main, ["bench.py"], monkeypatch, capsys)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"bench.py: cpu ({bench.machine(torch.device('cpu'))['cpu']}), "
                               f"{torch.get_num_threads()} thread") and f"torch {torch.__version__}" in lines[0]
    assert re.search(r", memory read \d+\.\d GB/s \(a tensor sum\), ", lines[0]), lines[0]
    assert lines[2].startswith("0. the post's table") and "Summed, not run whole" in out
    header = lines.index("batch tokens   no cache tok/s      cache tok/s  speedup  MB/step no cache %bw cache %bw")
    # tok/s twice, the speedup, MB a cached step reads, each loop's share of the bandwidth
    row = re.compile(r"\s*(\d+)\s+(\d+)\s+[\d,]+ ±\s*\d+%\s+[\d,]+ ±\s*\d+%\s+\d+\.\dx"
                     r"\s+\d+\.\d\s+\d+\.\d%\s+\d+\.\d%")
    rows = [row.fullmatch(line) for line in lines[header + 1:header + 5]]
    assert [r and r.groups() for r in rows] == [("1", "8"), ("1", "12"), ("2", "8"), ("2", "12")]
    assert lines[header + 5:] == ["", "cache at 256 tokens, batch 1: 3.00 MiB measured (2 x 6 layers x 256 tokens "
                                  "x 256 d_model x 4 bytes = 3.00 MiB)"]


def test_summed_step_costs_are_the_steps_a_generation_runs_flat_past_the_window():
    counts = bench.step_counts(1024, 256)
    assert counts == [8, 16, 32, 64, 128, 256] and bench.step_counts(8, 256) == [8, 15]

    def cost(n):  # any cost linear in the count: interpolating between timed counts is then exact
        return 3 + 0.5 * n
    for n_tokens in (8, 64, 256, 1024):
        weights = bench.generation_weights(n_tokens, 256, counts)
        summed = {loop: sum(w * cost(c) for w, c in zip(ws, counts)) for loop, ws in weights.items()}
        # the uncached loop reruns the text so far (at most 256); the cached one keeps it before each step after
        # the prefill, which is timed apart
        assert summed["no_cache"] == pytest.approx(sum(cost(min(8 + j, 256)) for j in range(n_tokens)))
        assert summed["cache"] == pytest.approx(sum(cost(min(7 + j, 256)) for j in range(1, n_tokens)))
    longer, shorter = bench.generation_weights(1024, 256, counts), bench.generation_weights(256, 256, counts)
    for loop in longer:  # every token past the window costs one step at the full window
        assert [a - b for a, b in zip(longer[loop], shorter[loop])] == pytest.approx([0, 0, 0, 0, 0, 768])


def test_an_existing_json_is_kept_unless_forced_and_a_missing_folder_fails_at_once(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.json"
    out.write_text("earlier results")
    run = run_main(bench.main, ["bench.py", "cpu", "--json", out], monkeypatch, capsys)
    assert_refused(run, "already exists; pass --force")
    assert out.read_text() == "earlier results" and run[1] == ""
    run = run_main(bench.main, ["bench.py", "cpu", "--json", tmp_path / "no" / "bench.json"], monkeypatch, capsys)
    assert_refused(run, "does not exist")
    assert run[1] == ""


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
    bench.table_peers(model, engines, torch.device("cpu"), {"lengths": (8,), "batches": (1,)}, 3, 1e10, [], out)
    lines = capsys.readouterr().out.splitlines()
    assert lines.pop() == "      (table 4 did not run batch 1, 8 tokens in this run: nothing to set beside)"
    assert "   transformers: not installed (pip install -r requirements.txt)" in lines
    assert any(line.startswith("   ctranslate2: ") for line in lines)
    assert "   llama_cpp: not installed (pip install -r requirements-serve.txt)" in lines
    header, row, shares = lines[-3].split(), lines[-2].split(), lines[-1]
    assert header == ["batch", "engine", "engine_compiled", "engine_bf16", "transformers", "ctranslate2",
                      "ctranslate2_int8", "llama_cpp", "llama_cpp_q8_0", "compiled/llama_cpp", "int8", "compiled/q8_0"]
    assert row[0] == "1" and row[4:] == ["-"] * 7 and len(row) == len(header) - 1  # "int8 compiled/q8_0": one column
    # under the row, each engine that ran: the MB a step reads and its share of the bandwidth; the others -
    assert re.fullmatch(r"  %bw(\s+\d+\.\d MB\s+\d+%){3}(\s+-){5}", shares), shares
    assert set(out[0]) == {"batch", "tokens", "engine", "engine_compiled", "engine_bf16",
                           *read_by(("engine", "engine_compiled", "engine_bf16"))}


def test_the_bytes_a_step_reads_are_every_weight_once_and_the_cache_it_attends_to():
    from cached import CachedGPT
    from model import Config
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
    assert bench.bytes_per_step(model, 3, 40) == pytest.approx(params * 4 + 3 * per_position * 4 * mean)
    # uncached, a step recomputes its keys: the weights alone, whatever the batch
    assert bench.bytes_per_step(model, 3, 40, cached=False) == params * 4
    # a cache kept in another dtype than the weights (llama.cpp's f16)
    assert bench.bytes_per_step(model, 3, 40, cache_dtype=torch.float16) == pytest.approx(
        params * 4 + 3 * per_position * 2 * mean)
    # in bfloat16, weights and cache both two bytes a value
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert bench.bytes_per_step(half, 3, 40) == pytest.approx(params * 2 + 3 * per_position * 2 * mean)
    # untied, the head reads its own table whole and the lookup reads one row of the embedding per row
    model.head.weight = torch.nn.Parameter(model.emb.weight.detach().clone())
    assert bench.bytes_per_step(model, 3, 40) == pytest.approx((params + 3 * d) * 4 + 3 * per_position * 4 * mean)


def test_the_bandwidth_measure_is_a_positive_finite_rate():
    assert 0 < bench.read_bandwidth(torch.device("cpu")) < math.inf


def test_every_row_of_the_decode_table_has_its_bytes_and_share_of_the_bandwidth_under_it(capsys):
    from cached import CachedGPT
    from engines.fast_engine import FastEngine
    from model import Config
    model = CachedGPT(Config(vocab_size=256, d_model=64, n_heads=4, n_layers=2, context=32)).eval()
    # the compiled column's place taken by the same graph-safe step run eagerly: no compile in a test
    engines = {"engine": FastEngine(model), "engine_compiled": FastEngine(model, cuda_graph=True),
               "engine_bf16": FastEngine(model, dtype=torch.bfloat16), "engine_int8": FastEngine(model, dtype=torch.int8),
               "engine_int8_compiled": FastEngine(model, dtype=torch.int8, cuda_graph=True)}
    out = []
    bench.table_decode(model, engines, torch.device("cpu"), {"lengths": (8,), "batches": (1, 2)}, 3, 1e10, out)
    lines = capsys.readouterr().out.splitlines()
    rows = [i for i, line in enumerate(lines) if re.match(r"\s+[12]\s+8\s+[\d,]+ ±", line)]
    assert len(rows) == 2
    for i in rows:  # the two loops and five forms, each its MB a step and its share
        assert re.fullmatch(r"\s+MB %bw(\s+\d+\.\d MB\s+\d+%){7}", lines[i + 1]), lines[i + 1]
    methods = ("no_cache", "cached", *engines)
    for row in out:
        assert read_by(methods) <= set(row)
        # each share is the row's own figure: bytes a step x steps a second (tok/s over the batch) over the bandwidth
        for m in methods:
            assert row[m + "_bandwidth_share"] == pytest.approx(row[m + "_step_bytes"] * row[m] / row["batch"] / 1e10)
        # bfloat16 reads half of what float32 does; the uncached loop reads no cache
        assert row["engine_bf16_step_bytes"] == pytest.approx(row["engine_step_bytes"] / 2)
        # int8 weights read a quarter of float32's (and a scale a row); the cache stays float32
        assert row["engine_int8_step_bytes"] < row["engine_step_bytes"] / 2
        assert row["no_cache_step_bytes"] < row["cached_step_bytes"] == row["engine_step_bytes"]


SMALL = dict(vocab_size=512, d_model=64, n_heads=4, n_layers=2, context=32)
PROMPT = [5, 17, 300, 42, 9]


def small_model():
    from cached import CachedGPT
    from model import Config
    torch.manual_seed(0)
    return CachedGPT(Config(**SMALL)).eval()


def test_the_clone_and_a_prompt_per_row_fill_the_same_cache():
    from prefill_clone import KVCache, clone_prompt
    model = small_model()
    a, b = KVCache.for_model(model, 3, 16), KVCache.for_model(model, 3, 16)
    prompt = torch.tensor([PROMPT])
    with torch.inference_mode():
        a_logits, b_logits = clone_prompt(model, prompt, a), bench.prompt_per_row(model, prompt, b)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a_logits, b_logits)
    assert a.get_pos() == b.get_pos() == len(PROMPT) and a_logits.shape == (3, 512)


def test_the_two_fills_side_by_side_give_the_same_rows_or_the_run_stops(monkeypatch):
    from prefill_clone import Engine
    model, device = small_model(), torch.device("cpu")
    timed = bench.fills_side_by_side(Engine(model), PROMPT, 3, 6, 3, device, temperature=0.9, seed=4)
    assert set(timed) == {"separate", "clone"} and all(len(t) == 2 for t in timed.values())

    def other_rows(model, prompt, cache):  # the clone's cache, but every row's scores pushed to another token
        logits = bench.clone_prompt(model, prompt, cache)
        return logits.index_fill(-1, logits.argmax(-1).unique(), -1e4)
    monkeypatch.setitem(bench.FILLS, "separate", other_rows)
    with pytest.raises(SystemExit, match="the two ways of filling the rows gave different tokens"):
        bench.fills_side_by_side(Engine(model), PROMPT, 3, 6, 3, device, temperature=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_drift_from_float32_on_the_trained_weights_is_reported_and_bounded(dtype):
    """bf16 copies every weight, int8 keeps each weight within half a step of its row's 255; on the shipped
    weights neither moves a score by a whole logit, and greedy keeps float32's first tokens."""
    model = load("holmes.pt")
    drift = bench.dtype_drift(model, dtype, bench.drift_prompt(model), 64)
    assert 0 < drift["max_logit_difference"] < 1
    assert drift["first_difference"] is None or drift["first_difference"] >= 4
