"""The refusals: what bad input raises, so that cli.run_cli says it in one line and exits 1.

A class here is one that something catches by its type: a BadInput is said in
one line (run_cli), a BadValue is also a ValueError (a served request's 400),
an Appeared a FileExistsError (a kept file another run wrote first), an
EngineFailed a ChildProcessError (an engine's crash in a process of its own).
Any exception that is not a BadInput is a bug, and keeps its traceback.
"""
import functools


class BadInput(Exception):
    """What a user gave (an argument, a path, a file, a request) that this repo cannot honour, in words naming it."""


class BadValue(BadInput, ValueError):
    """An argument, a knob or a value read from a file that is not what it must be; field: the argument's name
    where the check knows it as data (a served request's 400 names it: engines/serving/openai_request.refusal)."""

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


class Appeared(BadInput, FileExistsError):
    """An output that stands where nothing may be replaced."""


class EngineFailed(BadInput, ChildProcessError):
    """A serving engine that crashed or refused, in the process of its own it ran in."""


class CompileFailed(BadInput, RuntimeError):
    """A compile that failed inside torch's compiler: the way is named, and what to do instead."""


def refusing(fn):
    """A lesson function whose ValueErrors are its refusals (the post's mains catch them, as ValueError) with
    those raised as BadValue, the same words: the engines call it at the edge, so run_cli says them in one line."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BadInput:
            raise
        except ValueError as e:
            raise BadValue(str(e)) from None
    return call
