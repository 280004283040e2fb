"""train.py follows Part 3's recipe, writes Part 3 checkpoints and resumes a cut-short run, or refuses in one line."""
import csv
import math
import os
import re
import signal
import stat
import struct
import time
import zipfile

import numpy as np
import pytest
import torch

from series import train as train_module
from bpe import BPE
from cached import load
from model import GPT
from helpers import (CORPUS, ROOT, RUN_FILES, TINY, TOKENIZER, assert_refused, copy_run, in_process, run_main, sha256,
                     small_and_fast, special_input, train)
from series.train import lr_at


class Killed(BaseException):
    """kill -9: nothing after it runs (not even main's handling)."""


@pytest.fixture(scope="module")
def killed_after_last_step(tmp_path_factory):
    """A 1-step run killed after its step's files were written, before it finished and removed its
    resume file, to copy: corpus.txt, data/ (its ids), run.pt, run.csv, run.resume.pt."""
    def killed(*args):
        raise Killed
    path = tmp_path_factory.mktemp("killed")
    with pytest.MonkeyPatch.context() as mp, pytest.raises(Killed):
        mp.setattr(train_module, "log_line", killed)  # the line written after the step's files
        in_process(path, "--out", "run", *TINY)
    return path


@pytest.fixture(scope="module")
def uncut(tmp_path_factory):
    """A 2-step run evaluated after each step: what a cut and resumed run must end as."""
    return in_process(tmp_path_factory.mktemp("uncut"), "--out", "run", "--steps", "2", "--eval-every", "1",
                      "--eval-batches", "1")


def leftovers(tmp_path):
    """Temporary files anywhere under tmp_path."""
    return [name for _, _, names in os.walk(tmp_path) for name in names if "tmp" in name]


def test_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_at(0, 1500, 1e-3) == pytest.approx(1e-3 / 150)
    assert lr_at(149, 1500, 1e-3) == pytest.approx(1e-3)
    assert lr_at(150, 1500, 1e-3) == pytest.approx(1e-3)
    assert lr_at(1500, 1500, 1e-3) == pytest.approx(1e-4)
    assert lr_at(199, 5000, 1e-3) == pytest.approx(1e-3)
    mid = 150 + (1500 - 150) / 2
    assert lr_at(mid, 1500, 1e-3) == pytest.approx(1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi / 2))))


def test_a_run_writes_a_part3_checkpoint_its_tokenizer_record_and_a_csv(finished,
                                                                                         killed_after_last_step):
    ckpt = torch.load(finished / "run.pt", weights_only=True)
    assert set(ckpt) == {"model", "config", "step", "tokenizer"} and ckpt["step"] == 1
    assert ckpt["tokenizer"] == BPE.load(TOKENIZER).record()
    assert set(ckpt["config"]) == {"vocab_size", "d_model", "n_heads", "n_layers", "context", "dropout"}
    load(finished / "run.pt")  # as every script loads a checkpoint: weights_only, Part 3's Config, strict
    rows = list(csv.DictReader(open(finished / "run.csv")))
    assert [r["step"] for r in rows] == ["1"]
    assert list(rows[0]) == ["step", "train_loss", "val_loss", "tokens_per_sec", "elapsed_sec"]
    state = torch.load(killed_after_last_step / "run.resume.pt", weights_only=True)
    assert state["step"] == 1 and state["run"]["--lr"] == 1e-3 and state["run"]["--steps"] == 1
    assert state["run"]["--tokenizer"] == BPE.load(TOKENIZER).record()["sha256"]


def test_a_finished_run_removes_its_resume_file_and_a_cut_one_keeps_it(finished, killed_after_last_step):
    assert sorted(os.listdir(finished)) == ["corpus.txt", "data", "run.csv", "run.pt"]
    assert sorted(os.listdir(killed_after_last_step)) == ["corpus.txt", "data", *sorted(RUN_FILES)]


def test_after_a_finished_run_each_refusal_names_a_way_on_that_works(tmp_path, finished, monkeypatch, capsys):
    copy_run(finished, tmp_path, ["corpus.txt", "data", "run.pt", "run.csv"])
    again = train(tmp_path, *TINY, monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(again, "python -m series.train: error: 'run.pt' already exists; pass --force to replace it, "
                          "or --out NAME for a new run\n")
    resumed = train(tmp_path, *TINY, "--resume", monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(resumed, "python -m series.train: error: --resume: there is no cut-short run to go on from ('run.resume.pt' not "
                            "found; a run that finishes removes it); to train again, pass --force instead of "
                            "--resume to replace run.pt, or --out NAME\n")
    assert train(tmp_path, *TINY, "--out", "second", monkeypatch=monkeypatch, capsys=capsys)[0] == 0
    assert train(tmp_path, *TINY, "--force", monkeypatch=monkeypatch, capsys=capsys)[0] == 0


def cut_at_step_2_batch(monkeypatch):
    real_batch, calls = train_module.batch, []

    def batch_then_cut(*args):
        calls.append(1)
        if len(calls) == 4:  # step 2's batch, after step 1's and its evaluation's two
            raise KeyboardInterrupt
        return real_batch(*args)
    monkeypatch.setattr(train_module, "batch", batch_then_cut)


def killed_after_step_2_log_row(monkeypatch):
    real_save = torch.save

    def save(obj, f):
        if "optimizer" in obj and obj["step"] == 2:  # step 2's row and checkpoint are written, its resume file not
            raise Killed
        real_save(obj, f)
    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("cut", [cut_at_step_2_batch, killed_after_step_2_log_row])
def test_a_run_cut_short_and_resumed_ends_exactly_where_an_uncut_run_ends(tmp_path, monkeypatch, uncut, cut):
    (tmp_path / "corpus.txt").write_text(CORPUS)
    monkeypatch.chdir(tmp_path)
    small_and_fast(monkeypatch)
    args = ["--corpus", "corpus.txt", "--tokenizer", TOKENIZER, "--steps", "2", "--eval-every", "1",
            "--eval-batches", "1", "--out", "run"]
    with monkeypatch.context() as m:
        cut(m)
        m.setattr("sys.argv", ["train.py", *args])
        with pytest.raises((SystemExit, Killed)):
            train_module.main()
    assert torch.load("run.resume.pt", weights_only=True)["step"] == 1
    monkeypatch.setattr("sys.argv", ["train.py", *args, "--resume"])
    train_module.main()

    def losses(folder):
        return [(r["step"], r["train_loss"], r["val_loss"]) for r in csv.DictReader(open(folder / "run.csv"))]
    assert losses(tmp_path) == losses(uncut) and len(losses(tmp_path)) == 2
    ours, theirs = (torch.load(folder / "run.pt", weights_only=True)["model"] for folder in (tmp_path, uncut))
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def other_corpus(tmp_path):
    (tmp_path / "other.txt").write_text(CORPUS.replace("Watson", "Holmes"))


def other_tokenizer(tmp_path):
    """A tokenizer of the model's size, other merges: the size check passes, the run's record does not."""
    BPE([(i // 256, i % 256) for i in range(4096 - 256)]).save(tmp_path / "small.json")


def renamed_run(tmp_path):
    for name in RUN_FILES:
        os.rename(tmp_path / name, tmp_path / name.replace("run", "renamed"))


@pytest.mark.parametrize("change, prepare, message", [
    (["--lr", "0.002"], None, "--lr is 0.002 here but the run being resumed used 0.001"),
    (["--steps", "2"], None, "--steps is 2 here but the run being resumed used 1"),
    (["--eval-every", "2"], None, "--eval-every is 2 here but the run being resumed used 250"),
    (["--eval-batches", "2"], None, "--eval-batches is 2 here but the run being resumed used 1"),
    (["--bf16"], None, "--bf16 is True here but the run being resumed used False"),
    (["--corpus", "other.txt"], other_corpus, "--corpus 'other.txt' is not the file the run being resumed used"),
    (["--tokenizer", "small.json"], other_tokenizer, "--tokenizer 'small.json' is not the file the run being resumed"),
    (["--out", "renamed"], renamed_run, "--out is renamed here but the run being resumed used run"),
], ids=["lr", "steps", "eval-every", "eval-batches", "bf16", "corpus", "tokenizer", "out"])
def test_a_resume_of_another_run_is_refused_naming_the_first_difference(
        tmp_path, killed_after_last_step, change, prepare, message, monkeypatch, capsys, shipped_unchanged):
    copy_run(killed_after_last_step, tmp_path)
    if prepare:
        prepare(tmp_path)
    victims = {name: sha256(tmp_path / name) for name in os.listdir(tmp_path) if name.endswith((".pt", ".csv"))}
    assert_refused(train(tmp_path, *TINY, "--resume", *change, monkeypatch=monkeypatch, capsys=capsys),
                   f"python -m series.train: error: --resume: {message}")
    assert {name: sha256(tmp_path / name) for name in victims} == victims


def test_the_same_corpus_under_another_name_resumes(tmp_path, killed_after_last_step, monkeypatch, capsys):
    copy_run(killed_after_last_step, tmp_path)
    os.rename(tmp_path / "corpus.txt", tmp_path / "moved.txt")
    status, _, err = train(tmp_path, *TINY, "--resume", "--corpus", "moved.txt", monkeypatch=monkeypatch,
                           capsys=capsys)
    assert status == 0 and "resuming at step 1" in err and "checkpoint run.pt" in err, err


def nan_at_forward(n):
    """GPT.forward whose loss is NaN from its n-th call on."""
    real, calls = GPT.forward, []

    def forward(self, idx, targets=None):
        logits, loss = real(self, idx, targets)
        calls.append(1)
        return logits, (loss * math.nan if len(calls) >= n and loss is not None else loss)
    return forward


@pytest.mark.parametrize("args, nan_from, message", [
    (["--lr", "1e6"], None, "the evaluated train loss is nan at step 1, so the run stops there; try a smaller --lr"),
    (["--resume"], 1, "the loss is nan at step 2, so the run stops there"),
    (["--resume"], 3, "the val loss is nan at step 2, so the run stops there"),
], ids=["diverges", "nan-loss-after-a-good-step", "nan-val-loss"])
def test_a_loss_that_is_not_finite_stops_the_run_and_keeps_the_last_good_files(
        tmp_path, finished, args, nan_from, message, monkeypatch, capsys, shipped_unchanged):
    copy_run(finished, tmp_path, ["corpus.txt", "data"])  # ids cached: no "tokenized" line
    two_steps = ["--steps", "2", "--eval-every", "1", "--eval-batches", "1"]
    if nan_from:  # run.* hold step 1 of a run cut at step 2; the resumed step 2's NaN must leave them as they are
        with monkeypatch.context() as m:
            cut_at_step_2_batch(m)
            assert train(tmp_path, *two_steps, monkeypatch=m, capsys=capsys)[0] == 1
        monkeypatch.setattr(GPT, "forward", nan_at_forward(nan_from))
    before = {name: sha256(tmp_path / name) for name in RUN_FILES if (tmp_path / name).exists()}
    assert len(before) == (3 if nan_from else 0)
    status, out, err = train(tmp_path, *two_steps, *args, monkeypatch=monkeypatch, capsys=capsys)
    if nan_from:
        assert err.startswith("resuming at step 1 ("), err
        err = err.split("\n", 1)[1]
    assert_refused((status, out, err), message)
    assert "best val loss" not in err
    assert {name: sha256(tmp_path / name) for name in RUN_FILES if (tmp_path / name).exists()} == before


def forbid_tokenizing(monkeypatch):
    def encode(*args):
        raise AssertionError("the outputs should have been checked before tokenizing")
    monkeypatch.setattr(BPE, "encode", encode)


def make(tmp_path, kind):
    """What stands in the way of an output, as `kind` says."""
    if kind == "pt-folder":
        (tmp_path / "run.pt").mkdir()
    elif kind.endswith("-exists"):
        (tmp_path / kind.replace("-exists", "")).write_bytes(b"someone's run")
    elif kind == "data-file":
        (tmp_path / "data").write_bytes(b"someone's data")
    elif kind == "data-read-only":
        (tmp_path / "data").symlink_to("/sys")  # a folder nobody may create files in, root included


@pytest.mark.parametrize("out, kind, message", [
    ("", None, "--out '' names no run"),
    ("runs/", None, "--out 'runs/' names no run"),
    ("missing/run", None, "cannot write files in 'missing': No such file or directory"),
    ("/sys/run", None, "cannot write files in '/sys': "),
    ("run", "pt-folder", "cannot write 'run.pt': it is not a regular file (a folder, "),
    ("run", "run.csv-exists", "'run.csv' already exists; pass --force to replace it, or --out NAME for a new run\n"),
    ("run", "run.resume.pt-exists", "'run.resume.pt' already exists; pass --force to replace it, or --out NAME for "
                                    "a new run, or --resume to go on from the cut-short run in 'run.resume.pt'\n"),
    ("run", "data-file", "'data' is not a folder, but train.py caches token ids in data/; move it away"),
    ("run", "data-read-only", "cannot write files in 'data': "),
], ids=["empty", "folder", "missing-folder", "read-only-folder", "pt-is-a-folder", "csv-exists", "resume-exists",
        "data-is-a-file", "data-read-only"])
def test_an_output_that_cannot_or_must_not_be_written_is_refused_before_tokenizing(
        tmp_path, out, kind, message, monkeypatch, capsys, shipped_unchanged):
    if kind:
        make(tmp_path, kind)
    victims = {name: sha256(tmp_path / name) for name in os.listdir(tmp_path) if (tmp_path / name).is_file()}
    forbid_tokenizing(monkeypatch)
    assert_refused(train(tmp_path, *TINY, "--out", out, monkeypatch=monkeypatch, capsys=capsys), message)
    assert {name: sha256(tmp_path / name) for name in victims} == victims
    assert not any((tmp_path / name).is_file() for name in RUN_FILES if name not in victims)
    assert not leftovers(tmp_path)


def test_a_file_that_appears_while_a_run_writes_is_never_replaced(tmp_path):
    with pytest.raises(FileExistsError), train_module.atomic_write(tmp_path / "run.csv", False, "w") as f:
        f.write("this run's log")
        (tmp_path / "run.csv").write_text("someone's")
    assert (tmp_path / "run.csv").read_text() == "someone's" and not leftovers(tmp_path)


def test_force_never_replaces_a_file_the_run_reads(tmp_path, monkeypatch, capsys):
    (tmp_path / "run.csv").write_text(CORPUS)  # a corpus named like the run's log
    forbid_tokenizing(monkeypatch)
    run = train(tmp_path, *TINY, "--corpus", "run.csv", "--force", monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(run, "would write 'run.csv', which this run reads; give another name")
    assert (tmp_path / "run.csv").read_text() == CORPUS


@pytest.mark.parametrize("victim", RUN_FILES)
def test_force_replaces_only_the_files_a_run_wrote(tmp_path, killed_after_last_step, victim, monkeypatch, capsys):
    """Before: --force replaced a user's run.csv (or run.pt) whatever it held."""
    copy_run(killed_after_last_step, tmp_path)
    (tmp_path / victim).write_text("step,notes\n1,a user's own table\n")
    before = {name: sha256(tmp_path / name) for name in RUN_FILES}
    forbid_tokenizing(monkeypatch)
    run = train(tmp_path, *TINY, "--force", monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(run, f"python -m series.train: error: '{victim}' is not a file this command wrote; move it or choose another --out")
    assert {name: sha256(tmp_path / name) for name in RUN_FILES} == before


def test_the_shipped_run_is_never_replaced(monkeypatch, capsys, shipped_unchanged, tmp_path):
    (tmp_path / "corpus.txt").write_text(CORPUS)
    had_data = os.path.exists(os.path.join(ROOT, "data"))
    forbid_tokenizing(monkeypatch)
    monkeypatch.chdir(ROOT)
    run = run_main(train_module.main, ["train.py", "--corpus", tmp_path / "corpus.txt", *TINY], monkeypatch, capsys)
    assert_refused(run, "'holmes.pt' already exists; pass --force")
    assert os.path.exists(os.path.join(ROOT, "data")) == had_data


def sigterm(*args, **kwargs):
    """What `kill PID` does to a run: main's handler turns it into KeyboardInterrupt right here."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    raise AssertionError("SIGTERM did not interrupt")


def write_then_sigterm(f, *args):
    f.write(b"half a file" if "b" in getattr(f, "mode", "b") else "half a file")
    sigterm()


def interrupt(monkeypatch, where):
    if where == "tokenizing":
        monkeypatch.setattr(train_module.np, "save", lambda f, ids: write_then_sigterm(f))
    elif where == "csv":
        monkeypatch.setattr(train_module.csv, "writer", lambda f: type("W", (), {"writerows": lambda s, r: write_then_sigterm(f)})())
    elif where in ("checkpoint", "resume"):
        real_save = torch.save

        def save(obj, f):
            if ("optimizer" in obj) == (where == "resume"):
                write_then_sigterm(f)
            real_save(obj, f)
        monkeypatch.setattr(torch, "save", save)
    elif where.startswith("inside"):  # the signal lands in torch.save's own writing, between two of its writes
        real_save = torch.save

        def save(obj, f):
            if ("optimizer" in obj) == (where == "inside resume"):
                write, calls = f.write, []
                f.write = lambda data: calls.append(data) or (len(calls) == 2 and sigterm()) or write(data)
            real_save(obj, f)
        monkeypatch.setattr(torch, "save", save)
    else:
        monkeypatch.setattr(train_module, "batch", sigterm)


@pytest.mark.parametrize("where, victim", [
    ("tokenizing", None), ("step", None), ("csv", "run.csv"), ("checkpoint", "run.pt"), ("resume", "run.resume.pt"),
    ("inside checkpoint", "run.pt"), ("inside resume", "run.resume.pt"),  # before: torch's 25-line traceback
])
def test_sigterm_mid_run_leaves_no_temporary_file_and_one_line(tmp_path, killed_after_last_step, where, victim,
                                                              monkeypatch, capsys, shipped_unchanged):
    copy_run(killed_after_last_step, tmp_path,
             ["corpus.txt", *RUN_FILES] + (["data"] if where != "tokenizing" else []))
    before = {name: sha256(tmp_path / name) for name in RUN_FILES}
    interrupt(monkeypatch, where)
    status, _, err = train(tmp_path, *TINY, "--force", monkeypatch=monkeypatch, capsys=capsys)
    assert status == 1 and err.strip() == "python -m series.train: interrupted; nothing half-written was left behind", err
    assert not leftovers(tmp_path)
    if victim:
        assert sha256(tmp_path / victim) == before[victim]


def test_progress_is_one_terminal_line_and_evaluations_stay_plain_lines(tmp_path, finished, monkeypatch, capsys):
    copy_run(finished, tmp_path, ["corpus.txt", "data"])
    calls = []
    monkeypatch.setattr(train_module, "show_progress", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.chdir(tmp_path)
    small_and_fast(monkeypatch)
    argv = ["train.py", "--corpus", "corpus.txt", "--tokenizer", TOKENIZER, "--out", "run", "--steps", "2",
            "--eval-every", "2", "--eval-batches", "1"]
    status, _, err = run_main(train_module.main, argv, monkeypatch, capsys)
    assert status == 0, err
    assert [args[:2] for args, _ in calls] == [(1, 2), (2, 2), (2, 2)]
    notes = [args[2] for args, _ in calls[:2]]
    assert all(re.fullmatch(r"loss \d+\.\d{3}, [\d,]+ tok/s, ETA [\d,]+s", note) for note in notes), notes
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 2 and lines[0].startswith("step 2: train ")
    assert lines[1].startswith("best val loss ") and lines[1].endswith("; checkpoint run.pt, log run.csv")


@pytest.mark.parametrize("kind", ["dev-zero", "link-to-dev-zero", "fifo", "folder", "missing", "too-big", "not-utf8"])
@pytest.mark.parametrize("flag", ["--corpus", "--tokenizer"])
def test_a_corpus_or_tokenizer_that_is_not_a_bounded_regular_file_is_refused(
        tmp_path, flag, kind, monkeypatch, capsys, shipped_unchanged):
    monkeypatch.setattr("bpe.MAX_CORPUS_BYTES" if flag == "--corpus" else "bpe.MAX_TOKENIZER_BYTES", 1000)
    if kind == "not-utf8":
        (tmp_path / kind).write_bytes(b"Watso\xff" * 10)
    path = str(tmp_path / kind if kind == "not-utf8" else special_input(tmp_path, kind))
    why = {"too-big": "is larger than 1,000 bytes", "not-utf8": "is not UTF-8 (invalid start byte at byte 5)"
           if flag == "--corpus" else "is not valid JSON"}.get(kind, "is not a file")  # a pipe or a device too
    run = train(tmp_path, *TINY, flag, path, monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(run, f"{path!r} {why}")
    assert run[2].startswith("python -m series.train: error: ") and not any((tmp_path / name).exists() for name in RUN_FILES)


@pytest.mark.parametrize("corpus, message", [
    ("", "gives 0 bytes; at least 660 tokens are needed for the last 10% to hold one validation window"),
    ("Tiny corpus. " * 20, "gives 260 bytes; at least 660 tokens are needed"),
    ("Holmes " * 150, "tokens; at least 660 tokens are needed"),  # enough bytes, too few tokens
])
def test_an_empty_or_tiny_corpus_is_refused_before_anything_is_printed_or_cached(tmp_path, corpus, message, monkeypatch,
                                                                               capsys, shipped_unchanged):
    (tmp_path / "corpus.txt").write_text(corpus)
    assert_refused(train(tmp_path, *TINY, monkeypatch=monkeypatch, capsys=capsys), message)
    data = tmp_path / "data"  # the id cache's folder, made when the outputs are checked, holds nothing
    assert set(os.listdir(tmp_path)) <= {"corpus.txt", "data"} and not (data.exists() and os.listdir(data))


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps, --eval-every and --eval-batches must be at least 1"),
    (["--lr", "inf"], "--lr must be a finite number above 0, got inf"),
    (["--lr", "nan"], "--lr must be a finite number above 0, got nan"),
    (["--lr", "0"], "--lr must be a finite number above 0, got 0.0"),
    (["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
])
def test_bad_arguments_are_refused_by_argparse(tmp_path, args, message, monkeypatch, capsys, shipped_unchanged):
    status, _, err = train(tmp_path, *args, monkeypatch=monkeypatch, capsys=capsys)
    assert status == 2 and err.startswith("usage: python -m series.train ") and f"python -m series.train: error: {message}" in err, err
    assert os.listdir(tmp_path) == ["corpus.txt"]


def test_missing_corpus_gets_a_one_line_error(tmp_path, monkeypatch, capsys):
    status, _, err = train(tmp_path, "--corpus", "missing.txt", monkeypatch=monkeypatch, capsys=capsys)
    assert status == 1
    assert err == "python -m series.train: error: corpus 'missing.txt' is not a file; pass --corpus PATH to a UTF-8 text file\n"


@pytest.mark.parametrize("resume", [None, b"not a resume file", "wrong keys", "no identity", "no csv"])
def test_a_missing_or_corrupt_resume_file_gets_one_line(tmp_path, killed_after_last_step, resume, monkeypatch,
                                                        capsys, shipped_unchanged):
    copy_run(killed_after_last_step, tmp_path)
    state = torch.load(tmp_path / "run.resume.pt", weights_only=True)
    if resume is None:
        os.remove(tmp_path / "run.resume.pt")
    elif resume == "wrong keys":
        torch.save({"model": {}}, tmp_path / "run.resume.pt")
    elif resume == "no identity":  # an older train.py's: which run it belongs to is unknown
        torch.save({k: v for k, v in state.items() if k != "run"}, tmp_path / "run.resume.pt")
    elif resume == "no csv":
        os.remove(tmp_path / "run.csv")
    else:
        (tmp_path / "run.resume.pt").write_bytes(resume)
    victims = {name: sha256(tmp_path / name) for name in RUN_FILES if (tmp_path / name).exists()}
    assert_refused(train(tmp_path, *TINY, "--resume", monkeypatch=monkeypatch, capsys=capsys), "--resume: ")
    assert {name: sha256(tmp_path / name) for name in victims} == victims


@pytest.mark.parametrize("key, value", [
    ("step", "2"), ("step", -1), ("step", True), ("best_val", float("nan")), ("best_val", "low"),
    ("elapsed", float("inf")), ("generator", [1, 2]), ("generator", torch.zeros(3)), ("model", None), ("run", 1),
], ids=["step-str", "step-negative", "step-bool", "best-nan", "best-str", "elapsed-inf", "generator-list",
        "generator-float", "model-none", "run-int"])
def test_a_resume_file_value_of_the_wrong_kind_is_refused_naming_the_file(
        tmp_path, killed_after_last_step, key, value, monkeypatch, capsys, shipped_unchanged):
    copy_run(killed_after_last_step, tmp_path)
    state = torch.load(tmp_path / "run.resume.pt", weights_only=True)
    torch.save({**state, key: value}, tmp_path / "run.resume.pt")
    assert_refused(train(tmp_path, *TINY, "--resume", monkeypatch=monkeypatch, capsys=capsys),
                   f"python -m series.train: error: --resume: 'run.resume.pt' holds {key!r} = ")


def damage_cache(path, how):
    ids = np.load(path)
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:-len(ids)])
    elif how == "not-npy":
        path.write_bytes(b"not numpy")
    elif how == "int64":
        np.save(path, ids.astype(np.int64))
    elif how == "out-of-range":
        ids[0] = 4096
        np.save(path, ids)
    else:
        np.save(path, ids.reshape(1, -1))


@pytest.mark.parametrize("how", ["truncated", "not-npy", "int64", "out-of-range", "two-dimensional"])
def test_a_damaged_id_cache_is_refused_naming_the_file(tmp_path, finished, how, monkeypatch, capsys):
    copy_run(finished, tmp_path, ["corpus.txt", "data"])
    (cache,) = (tmp_path / "data").iterdir()
    damage_cache(cache, how)
    assert_refused(train(tmp_path, *TINY, monkeypatch=monkeypatch, capsys=capsys),
                   f"python -m series.train: error: the token id cache data/{cache.name} ")


@pytest.mark.parametrize("vocab", [300, 5000], ids=["smaller", "larger"])
def test_a_tokenizer_of_another_vocabulary_size_is_refused_before_training(tmp_path, vocab, monkeypatch, capsys):
    tokenizer = BPE([(i // 256, i % 256) for i in range(vocab - 256)])  # two-byte tokens
    tokenizer.save(tmp_path / "tok.json")
    forbid_tokenizing(monkeypatch)
    run = train(tmp_path, *TINY, "--tokenizer", str(tmp_path / "tok.json"), monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(run, f"has {vocab:,} tokens but the model's vocabulary is 4,096; pass a tokenizer trained with")
    assert not any((tmp_path / name).exists() for name in RUN_FILES)


def damage_archive(path, how):
    """A resume file torch would still load: one bit of a weight flipped, or a compressed entry added."""
    if how == "flipped-bit":
        with zipfile.ZipFile(path) as archive:
            entry = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 64)
        with open(path, "r+b") as f:  # the entry's bytes follow its 30-byte local header, name and extra field
            f.seek(entry.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", f.read(4))
            f.seek(entry.header_offset + 30 + name_length + extra_length + 32)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
    else:
        with zipfile.ZipFile(path, "a") as archive:  # inside the archive's own folder, where torch reads entries
            folder = archive.namelist()[0].split("/")[0]
            archive.writestr(f"{folder}/extra", b"\0" * 100_000, compress_type=zipfile.ZIP_DEFLATED)


@pytest.mark.parametrize("how, message", [("flipped-bit", "fails its checksum"), ("deflated-entry", "is compressed")])
def test_a_damaged_or_repacked_resume_file_is_refused_before_it_is_loaded(
        tmp_path, killed_after_last_step, how, message, monkeypatch, capsys, shipped_unchanged):
    copy_run(killed_after_last_step, tmp_path)
    damage_archive(tmp_path / "run.resume.pt", how)
    victims = {name: sha256(tmp_path / name) for name in RUN_FILES}
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("torch.load read a damaged file"))
    run = train(tmp_path, *TINY, "--resume", monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(run, "python -m series.train: error: --resume: 'run.resume.pt'")
    assert message in run[2] and "start again without --resume" in run[2]
    assert {name: sha256(tmp_path / name) for name in RUN_FILES} == victims


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_optimizer_moments_of_another_shape_are_refused_before_any_step(
        tmp_path, killed_after_last_step, moment, monkeypatch, capsys, shipped_unchanged):
    copy_run(killed_after_last_step, tmp_path)
    state = torch.load(tmp_path / "run.resume.pt", weights_only=True)
    state["optimizer"]["state"][0][moment] = torch.zeros(3)  # loads into the optimizer, but no step can use it
    torch.save(state, tmp_path / "run.resume.pt")
    victims = {name: sha256(tmp_path / name) for name in RUN_FILES if (tmp_path / name).exists()}
    assert_refused(train(tmp_path, *TINY, "--resume", monkeypatch=monkeypatch, capsys=capsys),
                   "python -m series.train: error: --resume: 'run.resume.pt' does not fit this run (its optimizer's moments")
    assert {name: sha256(tmp_path / name) for name in victims} == victims


def test_a_name_the_output_check_accepts_is_one_every_save_can_write(tmp_path, monkeypatch, capsys):
    # NAME.resume.pt just fits the folder's 255-byte limit; a temporary named after all of it would not
    name = "r" * (255 - len(".resume.pt"))
    status, out, err = train(tmp_path, *TINY, "--out", name, monkeypatch=monkeypatch, capsys=capsys)
    assert status == 0, err
    assert (tmp_path / f"{name}.pt").is_file() and (tmp_path / f"{name}.csv").is_file()
    assert not leftovers(tmp_path)


def test_a_name_too_long_for_the_folder_is_refused_before_tokenizing_naming_it(tmp_path, monkeypatch, capsys):
    name = "r" * (256 - len(".resume.pt"))  # NAME.pt fits; NAME.resume.pt is one byte too long
    forbid_tokenizing(monkeypatch)
    run = train(tmp_path, *TINY, "--out", name, monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(run, f"cannot write '{name}.resume.pt': File name too long")
    assert ".tmp" not in run[2] and os.listdir(tmp_path) == ["corpus.txt"]


def test_a_runs_files_are_ordinary_files_not_private_ones(finished):
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ("run.pt", "run.csv"):
        assert stat.S_IMODE(os.stat(finished / name).st_mode) == 0o666 & ~umask, name  # as open() makes a file
