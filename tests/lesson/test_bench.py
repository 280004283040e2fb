"""bench.py: the post's table, each figure a whole generation timed; the cache's bytes are the post's formula;
the clone and a prompt per row give the same tokens."""
import os

import pytest
import torch

import bench
from helpers import PROMPT, assert_usage_error, run_main, small


@pytest.mark.parametrize("args, message", [
    (["gpu"], "argument device: invalid choice: 'gpu'"),
    (["cpu", "--fast"], "unrecognized arguments: --fast"),
    (["cpu", "--runs", "2"], "--runs must be at least 3"),
    (["cpu", "--tokens", "0"], "--tokens must be at least 1, got 0"),
] + ([] if torch.cuda.is_available() else [(["cuda"], "no CUDA GPU")]))
def test_bad_arguments_are_named_by_argparse(args, message, monkeypatch, capsys):
    assert_usage_error(run_main(bench.main, ["bench.py", *args], monkeypatch, capsys), message)


@pytest.mark.parametrize("threads", ["0", str(os.cpu_count() + 1), "100000"])
def test_threads_beyond_the_cores_are_refused_in_one_line_before_torch_sees_them(threads, monkeypatch, capsys):
    """Before: 100000 threads died of SIGSEGV inside torch."""
    asked = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    assert_usage_error(run_main(bench.main, ["bench.py", "cpu", threads], monkeypatch, capsys),
                       f"THREADS must be in 1..{os.cpu_count()} (this machine's cores), got {threads}")
    assert asked == []


def test_the_run_prints_the_posts_table_then_the_cache_and_the_clone(monkeypatch, capsys):
    assert (bench.FULL["batches"], bench.FULL["lengths"]) == ((1, 16), (64, 256, 1024))  # the post's rows
    status, out, err = run_main(bench.main, ["bench.py", "--quick"], monkeypatch, capsys)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"bench.py: cpu ({bench.cpu_name()}), {torch.get_num_threads()} threads, torch ")
    assert lines[2].startswith("0. the post's table")
    header = lines.index("batch tokens   no cache tok/s      cache tok/s  speedup")
    rows = [line.split() for line in lines[header + 1:header + 5]]
    assert [row[:2] for row in rows] == [["1", "8"], ["1", "16"], ["4", "8"], ["4", "16"]]
    assert all(float(row[2].replace(",", "")) > 0 and row[-1].endswith("x") for row in rows)
    assert lines[header + 6] == ("cache at 256 tokens, batch 1: 3.00 MiB measured (2 x 6 layers x 256 tokens "
                                 "x 256 d_model x 4 bytes = 3.00 MiB)")
    assert "  Part 3 (4 heads)             measured 3.00 MiB, formula 3.00 MiB" in lines
    assert "  GQA (4 q heads, 1 kv head)   measured 0.75 MiB, formula 0.75 MiB" in lines
    assert lines[-1].split()[:2] == ["32", "4"]  # table 2's last row: prompt 32, N 4


def test_a_prompt_per_row_gives_the_clones_rows():
    model = small()
    for knobs in (dict(temperature=0), dict(temperature=0.9, seed=4)):
        assert bench.PromptPerRow(model).generate_batch(PROMPT, 3, max_tokens=6, **knobs) == \
            bench.Engine(model).generate_batch(PROMPT, 3, max_tokens=6, **knobs)
