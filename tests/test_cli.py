"""cli.py: nothing lost, nothing read forever, one line for every refusal, progress that suits its reader."""
import hashlib
import io
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

import cached
import cli
from cli import atomic_write, check_input, check_output, run_cli, show_progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_atomic_write_never_writes_through_a_link_or_a_file_named_like_the_old_temporary(tmp_path):
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
    with atomic_write(tmp_path / "out.txt", "w") as f:
        f.write("new")
    assert kept.read_text() == "keep me" and not (tmp_path / "out.txt").is_symlink()


@pytest.mark.parametrize("failure", [ValueError("disk full"), KeyboardInterrupt()])
def test_a_cut_write_leaves_the_old_file_and_no_temporary(tmp_path, failure):
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    with pytest.raises(type(failure)):
        with atomic_write(out) as f:
            f.write(b"half")
            raise failure
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]


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
])
def test_outputs_are_checked_before_any_work(tmp_path, make, force, message):
    with pytest.raises(ValueError, match=message):
        check_output(make(tmp_path), force)


def test_an_unwritable_folder_is_found_by_trying_not_by_asking(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")
    monkeypatch.setattr(cli.tempfile, "mkstemp", refuse)
    with pytest.raises(OSError, match="is not writable .Read-only file system."):
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
    with pytest.raises((ValueError, OSError), match=message):
        check_input(make(tmp_path), "input", max_bytes=1024)


@pytest.mark.parametrize("error, message", [
    (ValueError("a bad knob"), "prog.py: error: a bad knob"),
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


def test_sigterm_mid_write_removes_the_temporary_file_and_ends_in_one_line(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {ROOT!r})
        from cli import atomic_write, run_cli
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


def test_cached_py_logs_a_plain_progress_line_every_ten_seconds_at_most(monkeypatch, capsys):
    """Time is the test's: each reading of the clock moves it on a second, however fast the machine is."""
    clock, log = Clock(), io.StringIO()
    log.isatty = lambda: False

    def tick():
        clock.now += 1.0
        return clock.now
    monkeypatch.setattr(cli.time, "time", tick)
    monkeypatch.setattr(sys, "stderr", log)
    monkeypatch.setattr(sys, "argv", ["cached.py", "--tokens", "60"])
    started = clock.now
    cached.main()
    assert "identical" in capsys.readouterr().out
    lines = log.getvalue().splitlines()
    assert lines and all(re.fullmatch(r"(un)?cached tokens: \d+/60, ETA \d+s", line) for line in lines)
    assert len(lines) <= (clock.now - started) / cli.LOG_EVERY and "\r" not in log.getvalue()
