"""peers.isolated: an engine runs in a process of its own, so its native crash is one error, never this process's end."""
import os
import signal
import subprocess
import sys

import pytest

from engines.export import peers
from children import refuse, segfault
from helpers import ROOT


def test_a_native_crash_comes_back_as_one_error_naming_the_engine_and_the_signal():
    with pytest.raises(ChildProcessError) as crash:
        peers.isolated("a deliberate crash", segfault)
    assert str(crash.value) == "a deliberate crash crashed (signal SIGSEGV) in a process of its own"
    assert peers.isolated("the next engine", os.getpid) != os.getpid()  # and this process goes on


def test_an_abort_is_named_too():
    with pytest.raises(ChildProcessError, match=r"\(signal SIGABRT\)"):
        peers.isolated("an aborting engine", os.abort)


def test_the_engines_result_and_its_own_errors_come_back_as_they_are():
    assert peers.isolated("an engine", sorted, [3, 1, 2]) == [1, 2, 3]
    with pytest.raises(ValueError, match="^no such model$"):
        peers.isolated("an engine", refuse, "no such model")


def test_an_engine_that_exits_is_named_with_its_status():
    with pytest.raises(ChildProcessError, match=r"\(exit status 3\)"):
        peers.isolated("an exiting engine", os._exit, 3)


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_to_the_process_group_while_an_engine_runs_ends_in_the_parents_one_line(sent):
    """Before: Ctrl-C during the export's GGUF check printed llama.cpp's child's KeyboardInterrupt traceback."""
    script = ("from engines.edge.cli import run_cli; from engines.export import peers; import children; "
              "run_cli(lambda: peers.isolated('an engine', children.ready_then_wait))")
    run = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)},
                           start_new_session=True)  # a group of its own, as a terminal's job
    try:
        assert run.stdout.readline() == "ready\n"  # the engine runs in its child
        os.killpg(run.pid, sent)  # what a terminal's Ctrl-C does (SIGINT), or kill -TERM -PGID
        out, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 1 and err == "\n-c: interrupted; nothing half-written was left behind\n", err
