"""What the test files share, defined once: running a script's main in-process as a real run shows it,
one-line refusals, series/train.py's small runs, Part 3's checkpoint format written without model.py, the small
model most tests run, and texts a tokenizer or an exported model must round-trip. Nothing of engines/."""
import contextlib
import functools
import hashlib
import io
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

from model import Config
from series import train as train_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = ("holmes.pt", "series/holmes.csv", "tokenizer.json")

TEXT = (
    "It is a capital mistake to theorize before one has data. Insensibly one begins "
    "to twist facts to suit theories, instead of theories to suit facts. "
    "You see, but you do not observe. The distinction is clear. I'll, we've, they're 42 times!\n\n"
) * 3


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def exit_status(main, argv, monkeypatch):
    """(exit status, the message a real run would print last on stderr) of a script's main run in-process (an
    entry point of engines/ through its run_cli: tests/engines/support.py's cli)."""
    monkeypatch.setattr(sys, "argv", [str(a) for a in argv])
    handler = signal.getsignal(signal.SIGTERM)  # a script may install its own; the test process keeps pytest's
    try:
        main()
        return 0, ""
    except SystemExit as e:  # sys.exit(message) prints the message and exits 1 in a real process
        return (1, f"{e.code}\n") if isinstance(e.code, str) else (e.code or 0, "")
    finally:
        signal.signal(signal.SIGTERM, handler)


def run_main(main, argv, monkeypatch, capsys):
    """A script's main run in-process: (exit status, stdout, stderr as a real run shows them)."""
    status, message = exit_status(main, argv, monkeypatch)
    out, err = capsys.readouterr()
    return status, out, err + message


def run_main_once(main, argv):
    """run_main for a module's fixture, which has no monkeypatch or capsys of its own."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status, message = exit_status(main, argv, patch)
    return status, out.getvalue(), err.getvalue() + message


def run_script(*argv, timeout=120):
    """A command as a user runs it (python ARGV at the repo's root), in a process of its own: (status, stdout,
    stderr). One still running after `timeout` seconds fails the test instead of hanging the suite."""
    try:
        run = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python {' '.join(map(str, argv))} still ran after {timeout} s")
    return run.returncode, run.stdout, run.stderr


def assert_refused(run, message):
    status, out, err = run
    assert status == 1 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def assert_usage_error(run, message):
    """argparse's refusal of a lesson script's flags, as parser.error gives it: status 2, the usage, then one line
    naming what is wrong."""
    status, out, err = run
    assert status == 2 and out == "" and "Traceback" not in err and err.startswith("usage: "), err
    assert ": error: " in err.splitlines()[-1] and message in err.splitlines()[-1], err


def special_input(tmp_path, kind):
    """A path that is not a readable regular file of sensible size."""
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)  # opening it would block until a writer comes
    elif kind == "folder":
        path.mkdir()
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "too-big":
        path.write_bytes(b"x" * 2000)
    return "/dev/zero" if kind == "dev-zero" else path


INPUTS = [
    ("dev-zero", "/dev/zero is not a regular file"), ("link-to-dev-zero", "link-to-dev-zero is not a regular file"),
    ("fifo", "fifo is not a regular file (a pipe or a device?)"), ("folder", "folder is a folder; give a file"),
    ("missing", "missing not found"), ("too-big", "too-big is 0 MiB, more than the 0 MiB"),
]


TOKENIZER = os.path.join(ROOT, "tokenizer.json")
CORPUS = "The game is afoot, Watson! Come, the hansom waits. " * 400
TINY = ["--steps", "1", "--eval-batches", "1"]
RUN_FILES = ("run.pt", "run.csv", "run.resume.pt")


def small_and_fast(monkeypatch):
    """A 2-layer, 64-wide model on batches of two 64-token windows: a step takes milliseconds where
    Part 3's takes seconds on a shared CPU. The recipe and every file are otherwise the same."""
    monkeypatch.setattr(train_module, "Config", functools.partial(Config, d_model=64, n_heads=2, n_layers=2,
                                                                  context=64))
    monkeypatch.setattr(train_module, "BATCH", 2)


def train(tmp_path, *args, monkeypatch, capsys):
    """train.py in-process in tmp_path, on its corpus.txt (CORPUS unless there is one) and the shipped
    tokenizer, writing run.*; a small model and no progress line."""
    monkeypatch.chdir(tmp_path)
    small_and_fast(monkeypatch)
    monkeypatch.setattr(train_module, "show_progress", lambda *args, **kwargs: None)
    if not (tmp_path / "corpus.txt").exists():
        (tmp_path / "corpus.txt").write_text(CORPUS)
    argv = ["train.py", "--corpus", "corpus.txt", "--tokenizer", TOKENIZER, "--out", "run", *args]
    return run_main(train_module.main, argv, monkeypatch, capsys)


def in_process(path, *args):
    """train.main in `path` with a small model, for module fixtures (no monkeypatch fixture there)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path)
        small_and_fast(mp)
        mp.setattr("sys.argv", ["train.py", "--corpus", "corpus.txt", "--tokenizer", TOKENIZER, *args])
        (path / "corpus.txt").write_text(CORPUS)
        train_module.main()
    return path


def one_line_exit(main, monkeypatch, *argv):
    """Run a script's main in this process; the one-line message it exits with (status 1)."""
    status, message = exit_status(main, argv, monkeypatch)
    assert status == 1 and len(message.splitlines()) == 1 and ": error: " in message, message
    return message.rstrip("\n")


def free_port():
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def copy_run(source, tmp_path, files=("corpus.txt", "data", *RUN_FILES)):
    for name in files:
        if os.path.isdir(source / name):
            shutil.copytree(source / name, tmp_path / name)
        else:
            shutil.copy(source / name, tmp_path / name)


PART3_CONFIG = {"vocab_size": 4096, "d_model": 256, "n_heads": 4, "n_layers": 6, "context": 256, "dropout": 0.1}


def part3_state_dict(cfg, seed=0):
    """Random weights under Part 3's key names, built without model.py."""
    g = torch.Generator().manual_seed(seed)
    d, V = cfg["d_model"], cfg["vocab_size"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    sd = {"emb.weight": w(V, d)}
    for i in range(cfg["n_layers"]):
        p = f"blocks.{i}."
        sd.update({
            p + "norm1.weight": 1 + w(d), p + "norm1.bias": w(d),
            p + "attn.qkv.weight": w(3 * d, d), p + "attn.out.weight": w(d, d),
            p + "norm2.weight": 1 + w(d), p + "norm2.bias": w(d),
            p + "mlp.0.weight": w(4 * d, d), p + "mlp.0.bias": w(4 * d),
            p + "mlp.2.weight": w(d, 4 * d), p + "mlp.2.bias": w(d),
        })
    sd["norm.weight"], sd["norm.bias"] = 1 + w(d), w(d)
    sd["head.weight"] = sd["emb.weight"]
    return sd


# The small model most tests run: two 64-wide blocks and a 32-token window, so a step takes milliseconds
# and a test can run far past the window; its vocabulary holds PROMPT's ids.
SMALL = Config(vocab_size=512, d_model=64, n_heads=4, n_layers=2, context=32)
PROMPT = [5, 17, 300, 42, 9]


def small(cfg=SMALL, seed=0):
    """A CachedGPT of cfg, seeded, in eval mode."""
    from cached import CachedGPT
    torch.manual_seed(seed)
    return CachedGPT(cfg).eval()


def prompts(batch, length, vocab, seed=1):
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def keys_attended(monkeypatch):
    """Record how many keys each SDPA call may attend to (masked-out keys not counted)."""
    import model as model_py
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting(q, k, v, attn_mask=None, **kwargs):
        seen.append(k.shape[-2] if attn_mask is None else int(attn_mask[0].sum()))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(model_py.F, "scaled_dot_product_attention", counting)
    return seen


ODD_TEXTS = [
    "To Sherlock Holmes she is always the woman. \"You have been in Afghanistan, I perceive,\" said he.\n\n    Café, naïve, 1895!",
    "Crème brûlée à la façon de Zoë, señor Müller",
    "東京で会いましょう。北京欢迎你。서울",
    "Thumbs 👍🏽 family 👨‍👩‍👧‍👦 flags 🇬🇧 heart ❤️",
    "e\u0301 combining a\u0308\u0304 marks and Z\u0351\u0364lgo",
    "  two  spaces,   three,\n\n\nnewlines\t\ttabs \r\n end   ",
    "I'll, you've, she's, they're, we'd, I'm, can't, DON'T, o'clock",
    "Numbers 1895, 3.14159, 221B Baker Street; $5 & 10% off!?",
]


def read_by(keys):
    """The keys figures.put_bandwidth adds beside each tok/s figure."""
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


def uncached_choices(model, tokens, n_prompt):
    """The uncached loop's greedy token after each prefix of tokens from n_prompt on, while the window holds them
    all: one causal forward gives the logits every step of generate_uncached computes (each its prefix, whole)."""
    with torch.no_grad():
        return model(tokens[:, :-1])[0][:, n_prompt - 1:].argmax(-1)
