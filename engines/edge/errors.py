"""The refusals: what bad input raises, so that cli.run_cli says it in one line and exits 1.

Each kind is also the standard exception for it (a BadValue is a ValueError, a
NotFound a FileNotFoundError), so a caller may catch those as usual. Any
exception that is not a BadInput is a bug, and keeps its traceback.
"""


class BadInput(Exception):
    """What a user gave (an argument, a file, a request) that this repo cannot honour, in words naming it."""


class BadValue(BadInput, ValueError):
    """An argument, a knob or a value read from a file that is not what it must be."""


class BadPath(BadInput, OSError):
    """A path that cannot be read or written as asked."""


class NotFound(BadPath, FileNotFoundError):
    """An input that is not there."""


class Appeared(BadPath, FileExistsError):
    """An output that stands where nothing may be replaced."""


class EngineFailed(BadInput, ChildProcessError):
    """A serving engine that crashed or refused, in the process of its own it ran in."""


class CompileFailed(BadInput, RuntimeError):
    """A compile that failed inside torch's compiler: the way is named, and what to do instead."""
