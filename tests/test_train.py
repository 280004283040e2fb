"""train.py follows Part 3's recipe, writes Part 3 checkpoints and resumes a cut-short run."""
import csv
import math
import os
import subprocess
import sys

import pytest
import torch

import train as train_module
from cli import check_output
from model import load_checkpoint
from train import lr_at

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(tmp_path, *args):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--corpus", str(tmp_path / "corpus.txt"),
           "--tokenizer", os.path.join(ROOT, "tokenizer.json"), "--out", "run", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)


def test_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_at(0, 1500, 1e-3) == pytest.approx(1e-3 / 150)
    assert lr_at(149, 1500, 1e-3) == pytest.approx(1e-3)
    assert lr_at(150, 1500, 1e-3) == pytest.approx(1e-3)
    assert lr_at(1500, 1500, 1e-3) == pytest.approx(1e-4)
    assert lr_at(199, 5000, 1e-3) == pytest.approx(1e-3)
    mid = 150 + (1500 - 150) / 2
    assert lr_at(mid, 1500, 1e-3) == pytest.approx(1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi / 2))))


def test_short_run_writes_part3_checkpoint_and_csv_then_resumes(tmp_path):
    (tmp_path / "corpus.txt").write_text("The game is afoot, Watson! Come, the hansom waits. " * 400)
    first = train(tmp_path, "--steps", "1", "--eval-batches", "1")
    assert first.returncode == 0, first.stderr
    assert os.listdir(tmp_path / "data")
    ckpt = torch.load(tmp_path / "run.pt", weights_only=True)
    assert set(ckpt) == {"model", "config", "step"} and ckpt["step"] == 1
    load_checkpoint(tmp_path / "run.pt")

    second = train(tmp_path, "--steps", "2", "--eval-batches", "1", "--resume")
    assert second.returncode == 0, second.stderr
    assert "resuming at step 1" in second.stderr
    rows = list(csv.DictReader(open(tmp_path / "run.csv")))
    assert [r["step"] for r in rows] == ["1", "2"]
    assert list(rows[0]) == ["step", "train_loss", "val_loss", "tokens_per_sec", "elapsed_sec"]
    assert torch.load(tmp_path / "run.resume.pt", weights_only=True)["step"] == 2


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--device", "gpu"], "unknown device 'gpu'"),
])
def test_bad_arguments_get_a_one_line_error(tmp_path, args, message):
    (tmp_path / "corpus.txt").write_text("x")
    run = train(tmp_path, *args)
    assert run.returncode != 0
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_missing_corpus_gets_a_one_line_error(tmp_path):
    run = train(tmp_path)
    assert run.returncode != 0
    corpus = tmp_path / "corpus.txt"
    assert run.stderr.strip() == f"train.py: error: corpus {corpus} not found; pass --corpus PATH to a UTF-8 text file"


def test_a_run_cut_short_and_resumed_ends_exactly_where_an_uncut_run_ends(tmp_path, monkeypatch):
    (tmp_path / "corpus.txt").write_text("The game is afoot, Watson! Come, the hansom waits. " * 400)
    monkeypatch.chdir(tmp_path)
    common = ["--corpus", "corpus.txt", "--tokenizer", os.path.join(ROOT, "tokenizer.json"),
              "--steps", "2", "--eval-every", "1", "--eval-batches", "1"]

    def run(out, *extra):
        monkeypatch.setattr(sys, "argv", ["train.py", *common, "--out", out, *extra])
        train_module.main()

    run("uncut")
    real_batch, calls = train_module.batch, []

    def batch_then_cut(*args):
        calls.append(1)
        if len(calls) == 4:  # step 2's batch, after step 1's and its evaluation's two
            raise KeyboardInterrupt
        return real_batch(*args)
    monkeypatch.setattr(train_module, "batch", batch_then_cut)
    with pytest.raises(KeyboardInterrupt):
        run("cut")
    monkeypatch.setattr(train_module, "batch", real_batch)
    assert torch.load("cut.resume.pt", weights_only=True)["step"] == 1
    run("cut", "--resume")

    def losses(name):
        return [(r["step"], r["train_loss"], r["val_loss"]) for r in csv.DictReader(open(f"{name}.csv"))]
    assert losses("cut") == losses("uncut") and len(losses("cut")) == 2
    uncut, cut = (torch.load(f"{name}.pt", weights_only=True)["model"] for name in ("uncut", "cut"))
    assert all(torch.equal(uncut[k], cut[k]) for k in uncut)


def test_existing_outputs_are_kept_unless_forced_and_the_shipped_ones_never_touched(tmp_path):
    (tmp_path / "corpus.txt").write_text("The game is afoot, Watson! Come, the hansom waits. " * 400)
    (tmp_path / "run.pt").write_bytes(b"my checkpoint")
    run = train(tmp_path, "--steps", "1")
    assert run.returncode == 1 and "run.pt already exists; pass --force" in run.stderr
    assert (tmp_path / "run.pt").read_bytes() == b"my checkpoint" and not (tmp_path / "run.csv").exists()
    shipped = {name: open(os.path.join(ROOT, name), "rb").read() for name in ("holmes.pt", "holmes.csv")}
    run = subprocess.run([sys.executable, "train.py", "--corpus", str(tmp_path / "corpus.txt"), "--steps", "1"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 1 and "holmes.pt already exists" in run.stderr
    assert all(open(os.path.join(ROOT, n), "rb").read() == b for n, b in shipped.items())


def test_force_lets_a_file_be_replaced_and_a_missing_folder_is_named(tmp_path):
    (tmp_path / "run.pt").write_bytes(b"old")
    check_output(tmp_path / "run.pt", force=True)
    check_output(tmp_path / "new.pt", force=False)
    with pytest.raises(ValueError, match="run.pt already exists; pass --force"):
        check_output(tmp_path / "run.pt", force=False)
    with pytest.raises(ValueError, match="the folder .*missing does not exist"):
        check_output(tmp_path / "missing" / "run.pt", force=True)


@pytest.mark.parametrize("corpus, message", [
    ("", "gives 0 tokens; at least 2,580 are needed"),
    ("Tiny corpus. " * 20, "tokens; at least 2,580 are needed"),
])
def test_an_empty_or_tiny_corpus_is_refused_before_any_file_is_written(tmp_path, corpus, message):
    (tmp_path / "corpus.txt").write_text(corpus)
    run = train(tmp_path, "--steps", "1")
    assert run.returncode == 1 and message in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "run.csv").exists() and not (tmp_path / "run.pt").exists()


@pytest.mark.parametrize("resume", [None, b"not a resume file", "wrong keys"])
def test_a_missing_or_corrupt_resume_file_gets_one_line(tmp_path, resume):
    (tmp_path / "corpus.txt").write_text("The game is afoot, Watson! Come, the hansom waits. " * 400)
    if resume == "wrong keys":
        torch.save({"model": {}}, tmp_path / "run.resume.pt")
    elif resume is not None:
        (tmp_path / "run.resume.pt").write_bytes(resume)
    run = train(tmp_path, "--steps", "2", "--resume")
    assert run.returncode == 1 and "--resume: " in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
