"""peers.isolated: an engine runs in a process of its own, so its native crash is one error, never this process's end."""
import os

import pytest

from engines.export import peers
from children import refuse, segfault


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
