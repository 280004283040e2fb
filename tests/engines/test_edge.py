"""engines/edge/cli.py: nothing lost, nothing read forever, one line for every refusal, progress that suits its reader."""
import errno
import glob
import hashlib
import io
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import bpe as bpe_module
from bpe import BPE
from engines.edge import checkpoint, cli, files
from engines.edge.checks import check_knobs
from engines.edge.cli import run_cli, show_progress
from engines.edge.errors import BadInput, BadValue
from engines.edge.files import atomic_write, check_input, check_output
from helpers import ROOT, assert_refused, exit_status, run_main, run_script
from support import command


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_atomic_write_never_writes_through_a_link_or_an_old_temporarys_name(tmp_path):
    victim, linked = tmp_path / "victim.txt", tmp_path / "linked.txt"
    victim.write_text("a user's notes")
    linked.write_text("what the link points at")
    before = {p: sha(p) for p in (victim, linked)}
    (tmp_path / "out.json.tmp").symlink_to(linked)  # the fixed name every writer used to open
    os.rename(victim, tmp_path / ".out.json.tmp")
    with atomic_write(tmp_path / "out.json", "w") as f:
        f.write("new")
    assert (tmp_path / "out.json").read_text() == "new"
    assert sha(linked) == before[linked] and sha(tmp_path / ".out.json.tmp") == before[victim]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.json.tmp", "linked.txt", "out.json", "out.json.tmp"]


def test_atomic_write_replaces_a_link_at_the_target_instead_of_writing_through_it(tmp_path):
    kept = tmp_path / "kept.txt"
    kept.write_text("keep me")
    (tmp_path / "out.txt").symlink_to(kept)
    with atomic_write(tmp_path / "out.txt", "w", force=True) as f:
        f.write("new")
    assert kept.read_text() == "keep me" and not (tmp_path / "out.txt").is_symlink()


def test_force_replaces_only_what_the_command_recognises_as_its_own_then_and_when_it_is_put_in_place(tmp_path):
    ours, out = files.starts_with(b"OURS"), tmp_path / "out.bin"
    out.write_bytes(b"OURS, an earlier run's")
    check_output(out, force=True, ours=ours)
    out.write_bytes(b"a user's notes")  # as if written while the work ran
    refused = f"{out} is not a file this command wrote, so --force does not replace it; move it or choose another name"
    with pytest.raises(BadValue, match=refused):
        with atomic_write(out, force=True, ours=ours) as f:
            f.write(b"OURS, new")
    with pytest.raises(BadValue, match=refused):
        check_output(out, force=True, ours=ours)
    assert out.read_bytes() == b"a user's notes" and os.listdir(tmp_path) == ["out.bin"]
    out.unlink()
    out.symlink_to(tmp_path / "notes.txt")  # a link is replaced, never what it points at
    (tmp_path / "notes.txt").write_text("kept")
    with atomic_write(out, force=True, ours=ours) as f:
        f.write(b"OURS, new")
    assert out.read_bytes() == b"OURS, new" and (tmp_path / "notes.txt").read_text() == "kept"


@pytest.mark.parametrize("failure", [ValueError("disk full"), KeyboardInterrupt()])
def test_a_cut_write_leaves_the_old_file_and_no_temporary(tmp_path, failure):
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    with pytest.raises(type(failure)):
        with atomic_write(out) as f:
            f.write(b"half")
            raise failure
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]


def test_an_interrupt_inside_torch_save_unwinds_as_one_leaving_the_old_file(tmp_path):
    """torch.save's C++ writer says a KeyboardInterrupt raised in its write as a RuntimeError about a position."""
    import torch
    out, calls = tmp_path / "out.pt", []
    out.write_bytes(b"old")

    class Interrupted:  # the signal lands between two of torch.save's writes
        def __init__(self, f):
            self.f = f

        def write(self, data):
            calls.append(data)
            if len(calls) == 2:
                cli.interrupted(signal.SIGINT, None)
            return self.f.write(data)
    with pytest.raises(KeyboardInterrupt) as raised:
        with atomic_write(out) as f:
            torch.save({"w": torch.zeros(10)}, Interrupted(f))
    assert raised.value.__cause__ is None and out.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.pt"]


def test_a_finished_write_is_an_ordinary_file_not_a_private_one(tmp_path):
    with atomic_write(tmp_path / "out.txt", "w") as f:
        f.write("x")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out.txt").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("make, force, message", [
    (lambda d: "", False, "the output path is empty"),
    (lambda d: d, True, "is a folder; give a file name"),
    (lambda d: d / "missing" / "x.pt", True, "the folder .*missing does not exist"),
    (lambda d: (d / "x.pt").write_bytes(b"mine") and d / "x.pt", False, "x.pt already exists; pass --force"),
    (lambda d: (d / "x.pt").symlink_to(d / "nowhere") or d / "x.pt", False, "x.pt already exists"),
    (lambda d: "/dev/null", True, "/dev/null: it is not a regular file"),  # as root, replacing it is possible
    (lambda d: (d / "f").write_text("a file") and d / "f" / "x.pt", True, "x.pt: .*/f is not a folder"),
    (lambda d: (os.mkfifo(d / "p"), (d / "l").symlink_to(d / "p")) and d / "l" / "x.pt", True, "/l is not a folder"),
])
def test_outputs_are_checked_before_any_work(tmp_path, make, force, message):
    with pytest.raises(ValueError, match=message):
        check_output(make(tmp_path), force)


def test_a_path_with_a_newline_is_quoted_so_the_message_stays_one_line(tmp_path):
    odd = tmp_path / "x\n.pt"
    odd.write_bytes(b"mine")
    with pytest.raises(ValueError) as refused:
        check_output(odd)
    assert str(refused.value) == f"{str(odd)!r} already exists; pass --force to replace it"


@pytest.mark.parametrize("read, content", [
    (lambda path: check_input(path, "checkpoint", 2**20), None),  # missing
    (lambda path: check_input(path, "checkpoint", 2**20), "folder"),
    (lambda path: check_input(path, "checkpoint", 1), b"too long"),
    (lambda path: checkpoint.load_checkpoint(path), b"not a checkpoint"),
    (BPE.load, b"{not json"),
    (bpe_module.read_corpus, b"\xff not UTF-8"),
], ids=["missing", "folder", "too-large", "checkpoint", "tokenizer", "corpus"])
def test_every_message_naming_an_input_path_quotes_a_newline_in_it(tmp_path, read, content):
    odd = tmp_path / "x\ny"
    if content == "folder":
        odd.mkdir()
    elif content is not None:
        odd.write_bytes(content)
    with pytest.raises((ValueError, BadInput)) as refused:
        read(odd)
    assert repr(str(odd)) in str(refused.value) and len(str(refused.value).splitlines()) == 1


def test_a_write_without_force_lands_where_nothing_stands_and_leaves_nothing_else(tmp_path):
    with atomic_write(tmp_path / "new.txt", "w") as f:
        f.write("new")
    assert (tmp_path / "new.txt").read_text() == "new" and os.listdir(tmp_path) == ["new.txt"]


def test_an_unwritable_folder_is_found_by_trying_not_by_asking(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")
    monkeypatch.setattr(files.tempfile, "mkstemp", refuse)
    with pytest.raises(BadInput, match="is not writable .Read-only file system."):
        check_output(tmp_path / "x.pt")


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "nope", "not found"),
    (lambda d: d, "is a folder"),
    (lambda d: os.mkfifo(d / "fifo") or d / "fifo", "is not a regular file"),
    (lambda d: "/dev/zero", "is not a regular file"),
    (lambda d: (d / "big").write_bytes(b"x" * 2048) and d / "big", "more than the"),
    (lambda d: "", "give a file path"),
])
def test_inputs_are_bounded_regular_files(tmp_path, make, message):
    with pytest.raises(BadInput, match=message):
        check_input(make(tmp_path), "input", max_bytes=1024)


@pytest.mark.parametrize("error, message", [
    (BadValue("a bad knob"), "prog.py: error: a bad knob"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
     "prog.py: error: out of memory; ask for fewer rows or tokens, or a smaller model"),
    (MemoryError(), "prog.py: error: out of memory"),
    (KeyboardInterrupt(), "prog.py: interrupted; nothing half-written was left behind"),
])
def test_run_cli_makes_each_failure_one_line_and_exit_1(monkeypatch, capsys, error, message):
    def main():
        raise error
    monkeypatch.setattr(sys, "argv", ["prog.py"])
    with pytest.raises(SystemExit) as exit:
        run_cli(main)
    assert str(exit.value.code).startswith(message) and "\n" not in str(exit.value.code)


class FailingStdout(io.StringIO):
    """A standard output whose `failing` call ("write" or "flush") raises OSError(code)."""

    def __init__(self, failing, code):
        super().__init__()
        self.failing, self.code = failing, code

    def write(self, text):
        if self.failing == "write":
            raise OSError(self.code, os.strerror(self.code))
        return super().write(text)

    def flush(self):
        if self.failing == "flush":
            raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("failing", ["write", "flush"])
@pytest.mark.parametrize("code, status", [
    (errno.EPIPE, 141),
    (errno.ENOSPC, "prog.py: error: cannot write to standard output: No space left on device"),
    (errno.EIO, "prog.py: error: cannot write to standard output: Input/output error"),
])
def test_a_closed_or_failing_stdout_ends_quietly_or_in_one_line(monkeypatch, code, status, failing):
    monkeypatch.setattr(sys, "argv", ["prog.py"])
    monkeypatch.setattr(sys, "stdout", FailingStdout(failing, code))
    with pytest.raises(SystemExit) as exit:
        run_cli(lambda: print("a result"))
    assert exit.value.code == status


def test_an_oserror_of_main_itself_is_not_said_as_stdouts(monkeypatch):
    def main():
        print("a result")
        raise BadInput("cannot write out.pt: No space left on device; nothing was written there")
    monkeypatch.setattr(sys, "argv", ["prog.py"])
    with pytest.raises(SystemExit) as exit:
        run_cli(main)
    assert exit.value.code == "prog.py: error: cannot write out.pt: No space left on device; nothing was written there"


def test_run_cli_says_bad_input_in_one_line_and_a_bug_keeps_its_traceback(monkeypatch):
    def refusing():
        raise BadValue("--tokens must be at least 1, got 0")

    def buggy():
        raise ValueError("a bug: an error that is not a BadInput")
    assert exit_status(command(refusing), ["prog.py"], monkeypatch) == (1, "prog.py: error: --tokens must be at least 1, got 0\n")
    with pytest.raises(ValueError, match="a bug"):
        exit_status(command(buggy), ["prog.py"], monkeypatch)


def test_no_exception_hook_is_installed_by_importing_the_edge():
    assert sys.excepthook is sys.__excepthook__


def test_an_entry_point_started_with_standard_output_closed_says_so_in_one_line():
    """A new interpreter: a standard output closed before it starts (>&-) is the subject. run_cli says it, and
    every entry point of engines/ runs its main through run_cli."""
    run = subprocess.run(f"{sys.executable} -m engines.export --help >&-", shell=True, cwd=ROOT, capture_output=True,
                         text=True)
    assert (run.returncode, run.stderr) == (1, "python -m engines.export: error: cannot write to standard output: it is closed; "
                                               "give it a place (> FILE, or a terminal)\n")
    sources = {path: open(path).read() for path in glob.glob(os.path.join(ROOT, "engines", "**", "*.py"), recursive=True)}
    # vLLM's child runs in the vLLM venv and imports nothing of this repo: its output is a JSON line for its parent
    entry_points = [path for path, source in sources.items() if '\nif __name__ == "__main__":' in source
                    and "from engines.edge" in source]
    assert os.path.join(ROOT, "engines", "serve.py") in entry_points
    assert [path for path in entry_points if not sources[path].rstrip().endswith("run_cli(main)")] == []


def test_sigterm_mid_write_removes_the_temporary_file_and_ends_in_one_line(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {ROOT!r})
        from engines.edge.cli import run_cli
        from engines.edge.files import atomic_write
        def main():
            with atomic_write({str(tmp_path / 'out.bin')!r}) as f:
                f.write(b"half")
                print("writing", flush=True)
                time.sleep(30)
        run_cli(main)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "writing\n"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1 and err.strip() == "-c: interrupted; nothing half-written was left behind"
    assert os.listdir(tmp_path) == []


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("tty", [True, False])
@pytest.mark.parametrize("seconds", [1.5, 6.0, 60.0])
def test_progress_redraws_a_terminal_a_few_times_a_second_and_a_log_every_ten(monkeypatch, tty, seconds):
    """600 steps over `seconds`: a terminal gets at most 4 redraws a second after the first 2 s, then a
    clear; a file or pipe gets at most one plain line per 10 s and never a carriage return."""
    stream, clock = io.StringIO(), Clock()
    stream.isatty = lambda: tty
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(cli.time, "time", clock)
    started, writes = clock.now, 0
    for done in range(1, 601):
        clock.now = started + seconds * done / 600
        before = stream.tell()
        show_progress("tokens", done, 600, started)
        writes += stream.tell() != before
    text = stream.getvalue()
    visible = max(0.0, seconds - cli.QUIET_FOR)
    if tty:
        assert writes <= visible / cli.REDRAW_EVERY + 2
        assert (writes > 0) == (seconds > cli.QUIET_FOR) and "\n" not in text
        assert text == "" or text.endswith("\r" + " " * 79 + "\r")  # cleared when done
        assert seconds < 10 or "ETA" in text
    else:
        assert "\r" not in text and writes == text.count("\n") <= seconds / cli.LOG_EVERY
        assert (writes > 0) == (seconds > cli.LOG_EVERY)


def test_what_check_output_accepts_atomic_write_can_write(tmp_path):
    path = tmp_path / ("n" * 250)  # a legal name whose temporary, named after all of it, would not be
    check_output(path)
    with atomic_write(path) as f:
        f.write(b"kept")
    assert path.read_bytes() == b"kept" and os.listdir(tmp_path) == [path.name]


def exported_with_a_fifo(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    os.mkfifo(tmp_path / "hf" / "tokenizer.json")
    return tmp_path / "hf", "exported file " + str(tmp_path / "hf" / "tokenizer.json")


@pytest.mark.parametrize("argv, fifo", [
    (["engines.serve", "--api-key-file"], lambda d: os.mkfifo(d / "key") or (d / "key", f"--api-key-file {d / 'key'}")),
    (["engines.export", "--check"], exported_with_a_fifo),
])
def test_a_fifo_where_a_command_reads_a_file_is_refused_in_one_line_without_being_opened(argv, fifo, tmp_path):
    """Before: the server never started and never said why; transformers waited on the folder's FIFO."""
    path, named = fifo(tmp_path)
    assert_refused(run_script("-m", *argv, path), f"{named} is not a regular file (a pipe or a device?)")


@pytest.mark.parametrize("tool, flags", [("bench.__main__", ["cpu"]), ("serving.check", ["--threads"]),
                                         ("bench.serving", ["--threads"])])
@pytest.mark.parametrize("threads", ["0", str(os.cpu_count() + 1), "100000", "two"])
def test_every_thread_count_past_the_cores_is_refused_in_one_line_before_torch_sees_it(tool, flags, threads,
                                                                                        monkeypatch, capsys):
    """Before: 100000 threads died of SIGSEGV inside torch."""
    import importlib
    import torch
    main, asked = importlib.import_module(f"engines.{tool}").main, []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    assert_refused(run_main(command(main), [tool, *flags, threads], monkeypatch, capsys),
                   f"threads must be a whole number in 1..{os.cpu_count()} (this machine's cores), got {threads!r}")
    assert asked == []


def test_export_without_transformers_names_the_requirements_file_in_one_line(monkeypatch, capsys):
    import importlib.util

    from engines.export import __main__ as export
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert_refused(run_main(command(export.main), ["export"], monkeypatch, capsys),
                   "export: error: python -m engines.export needs transformers; pip install -r engines/requirements.txt")


@pytest.mark.parametrize("knobs, message", [
    ({"temperature": -0.1}, "temperature must be 0"),
    ({"temperature": 1e-38}, "temperature must be 0 .greedy. or at least"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"penalty": float("inf")}, "penalty must be a finite number"),
    ({"temperature": 10**400}, "temperature must be a finite number, got 1000000000"),  # past float's range
    ({"top_k": 2.0}, "top_k must be a whole number"),
    ({"top_k": -1}, "top_k must be a whole number >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"penalty": 0.0}, r"penalty must be in \[0.0001, 10000\]"),
    ({"penalty": 1e-300}, r"penalty must be in \[0.0001, 10000\]"),
])
def test_bad_knobs_are_refused_by_name_in_one_line(knobs, message):
    with pytest.raises(ValueError, match=message) as refused:
        check_knobs(**knobs)
    assert len(str(refused.value).splitlines()) == 1
