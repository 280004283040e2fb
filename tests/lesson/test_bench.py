"""bench.py: the default run is the post's table, first and alone; every figure is measured and present; its
summed step costs add up to the steps a generation runs."""
import copy
import json
import math
import os
import sys

import pytest
import torch

import bench
import figures
from helpers import PROMPT, assert_refused, run_main, small


@pytest.mark.parametrize("args, message", [
    (["gpu"], "unknown device 'gpu'"),
    (["cpu", "0"], "THREADS must be at least 1, got 0"),
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


def test_more_threads_than_cores_run_and_say_in_one_line_they_oversubscribe(monkeypatch, capsys):
    monkeypatch.setattr(bench, "FULL", bench.FULL | {"batches": (1,), "lengths": (8,)})
    threads = torch.get_num_threads()
    try:
        status, out, err = run_main(bench.main, ["bench.py", "cpu", str(os.cpu_count() + 1), "--runs", "3"],
                                    monkeypatch, capsys)
    finally:
        torch.set_num_threads(threads)
    assert status == 0, err
    said = (f"bench.py: {os.cpu_count() + 1} threads on {os.cpu_count()} cores oversubscribes them: threads take "
            "turns on a core, and the figures show it")
    assert err.splitlines()[0] == said and err.count("oversubscribes") == 1  # progress lines may follow
    assert "0. the post's table" in out


def test_the_default_run_prints_the_posts_table_first_and_runs_no_other_table(tmp_path, monkeypatch, capsys):
    assert (bench.FULL["batches"], bench.FULL["lengths"]) == ((1, 16), (64, 256, 1024))  # the post's rows
    monkeypatch.setattr(bench, "FULL", bench.FULL | {"batches": (1, 2), "lengths": (8, 12)})  # rows that run fast

    def never(*args, **kwargs):
        raise AssertionError("the default run went beyond the post's table")
    for name in ("table_memory", "table_clone"):
        monkeypatch.setattr(bench, name, never)
    monkeypatch.setitem(sys.modules, "engines", None)  # importing anything of the folder would fail
    monkeypatch.setattr(torch, "compile", never)
    status, out, err = run_main(bench.main, ["bench.py", "--json", tmp_path / "bench.json"], monkeypatch, capsys)
    assert status == 0, err
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["tables"] == ["0"] and report["machine"]["cpu"] == figures.machine(torch.device("cpu"))["cpu"]
    rows = report["post"]["rows"]
    assert [(r["batch"], r["tokens"]) for r in rows] == [(1, 8), (1, 12), (2, 8), (2, 12)]
    assert all(r["no_cache"] > 0 and r["cache"] > 0 and 0 < r["cache_bandwidth_share"] for r in rows)
    assert report["post"]["cache"] == {"tokens": 256, "measured_bytes": 3 * 2**20, "formula_bytes": 3 * 2**20}
    lines = out.splitlines()  # printed: the machine first, then the post's table, a line a row, then its cache
    assert lines[0].startswith(f"bench.py: cpu ({report['machine']['cpu']}), {torch.get_num_threads()} thread")
    assert lines[2].startswith("0. the post's table") and "Summed, not run whole" in out
    header = lines.index("batch tokens   no cache tok/s      cache tok/s  speedup  MB/step no cache %bw cache %bw")
    assert [line.split()[:2] for line in lines[header + 1:header + 5]] == [["1", "8"], ["1", "12"], ["2", "8"], ["2", "12"]]
    assert lines[header + 5:] == ["", "cache at 256 tokens, batch 1: 3.00 MiB measured (2 x 6 layers x 256 tokens "
                                  "x 256 d_model x 4 bytes = 3.00 MiB)", "", f"wrote {tmp_path / 'bench.json'}"]


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
    assert 0 < figures.read_bandwidth(torch.device("cpu")) < math.inf


def test_the_clone_and_a_prompt_per_row_fill_the_same_cache():
    from prefill_clone import KVCache, clone_prompt
    model = small()
    a, b = KVCache.for_model(model, 3, 16), KVCache.for_model(model, 3, 16)
    prompt = torch.tensor([PROMPT])
    with torch.inference_mode():
        a_logits, b_logits = clone_prompt(model, prompt, a), bench.prompt_per_row(model, prompt, b)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a_logits, b_logits)
    assert a.get_pos() == b.get_pos() == len(PROMPT) and a_logits.shape == (3, 512)


def test_the_two_fills_side_by_side_give_the_same_rows_or_the_run_stops(monkeypatch):
    from prefill_clone import Engine
    model, device = small(), torch.device("cpu")
    timed = bench.fills_side_by_side(Engine(model), PROMPT, 3, 6, 3, device, temperature=0.9, seed=4)
    assert set(timed) == {"separate", "clone"} and all(len(t) == 2 for t in timed.values())

    def other_rows(model, prompt, cache):  # the clone's cache, but every row's scores pushed to another token
        logits = bench.clone_prompt(model, prompt, cache)
        return logits.index_fill(-1, logits.argmax(-1).unique(), -1e4)
    monkeypatch.setitem(bench.FILLS, "separate", other_rows)
    with pytest.raises(SystemExit, match="the two ways of filling the rows gave different tokens"):
        bench.fills_side_by_side(Engine(model), PROMPT, 3, 6, 3, device, temperature=0)


