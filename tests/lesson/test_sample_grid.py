"""sample_grid.py: eight settings as eight rows of one prefill, each what it gives alone, the same every run."""
import subprocess
import sys

import pytest
import torch

import sample_grid
from bpe import BPE
from helpers import run_main
from prefill_clone import Engine
from sample_grid import SETTINGS, grid


def test_two_runs_print_the_same_text_under_every_setting(monkeypatch, capsys):
    status, stdout, err = run_main(sample_grid.main, ["sample_grid.py", "--tokens", "12"], monkeypatch, capsys)
    other = subprocess.run([sys.executable, "sample_grid.py", "--tokens", "12"], capture_output=True, text=True)
    assert (status, other.returncode) == (0, 0), err + other.stderr
    assert stdout == other.stdout  # and in another process
    assert [line[4:] for line in stdout.splitlines() if line.startswith("=== ")] == list(SETTINGS)


def test_each_row_of_the_grid_equals_that_setting_run_alone(shipped):
    model = shipped
    tokens = BPE.load("tokenizer.json").encode("Holmes")
    rows = grid(Engine(model), tokens, 20, seed=1)
    for name, knobs in SETTINGS.items():
        alone, _ = Engine(model).generate_batch(tokens, 1, max_tokens=20, seed=1, **knobs)
        assert rows[name] == alone[0], name


def test_settings_really_differ_and_greedy_is_cached_py_greedy(shipped):
    model, tokens = shipped, BPE.load("tokenizer.json").encode("Holmes")
    rows = grid(Engine(model), tokens, 40, seed=1)
    assert len({tuple(r) for r in rows.values()}) == len(SETTINGS)
    assert rows["greedy"] == model.generate_cached(torch.tensor([tokens]), 40)[0, len(tokens):].tolist()


@pytest.mark.parametrize("args, status, message", [
    (["holmes.pt", ""], 1, "the prompt is empty; give at least one character"),
    (["missing.pt"], 1, "no checkpoint at 'missing.pt'; pass a Part 3 .pt file"),
    (["--tokens", "-3"], 2, "--tokens must be in 0..100000 and --seed in 0..2**63 - 1, got -3 and 1"),  # argparse's
])
def test_bad_arguments_get_one_line(args, status, message, monkeypatch, capsys):
    code, out, err = run_main(sample_grid.main, ["sample_grid.py", *args], monkeypatch, capsys)
    assert code == status and out == "" and "Traceback" not in err, err
    lines = err.strip().splitlines()  # argparse's usage comes before its one line
    assert lines[-1] == f"sample_grid.py: error: {message}" and (len(lines) == 1 or lines[0].startswith("usage: ")), err
