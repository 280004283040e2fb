"""What every script shares at its command line: a checked start, one-line errors, a progress line.

Not part of the model: cached.py and the rest import it so that what would stop a
script before its main is said in one line (check_start), bad input (errors.BadInput)
ends as one line on stderr and exit status 1 (run_cli), arguments are checked
once, and long work shows how far it is without flooding a log. Files at the
edge, inputs and outputs that never lose anything, are files.py's.
"""
import argparse
import errno
import importlib.util
import operator
import os
import signal
import sys
import time

from errors import BadInput, BadValue


def first_line(error):
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "no reason given")


def refuse_to_start(reason):
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    sys.exit(f"{name}: error: {reason}")


def check_start():
    """What would stop a script before its main, said in one line: a working folder that is gone, standard
    output closed, a package of requirements.txt that is missing, a TORCH_LOGS torch does not know. Run once, by importing this module,
    which every script does before torch (and before any module of this repo, each of which may import it)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        refuse_to_start("the working folder no longer exists; cd into one that does and run again")
    if sys.stdout is None:  # started with standard output closed (>&-): every print would vanish
        refuse_to_start("cannot write to standard output: it is closed; give it a place (> FILE, or a terminal)")
    for module in ("torch", "regex", "numpy"):
        if importlib.util.find_spec(module) is None:
            refuse_to_start(f"cannot import {module}; pip install -r requirements.txt")
    try:
        import torch  # noqa: F401  here, so that its refusal of a setting is one line
    except ValueError as e:
        if "TORCH_LOGS" not in str(e):
            raise
        refuse_to_start(f"TORCH_LOGS={os.environ.get('TORCH_LOGS', '')!r} is not a setting torch knows; "
                        "unset it, or see TORCH_LOGS=help")


check_start()

import torch  # noqa: E402  checked by check_start


class Parser(argparse.ArgumentParser):
    """argparse whose complaints are one line and a non-zero exit, like every other error here."""

    def error(self, message):
        sys.exit(f"{self.prog}: error: {message} (see --help)")


def interrupted(signum, frame):
    raise KeyboardInterrupt


class WatchedStdout:
    """sys.stdout as it was, keeping the OSError a write or flush raised: a print that fails is then
    said as standard output's failure, not as a bare errno."""

    failed = None

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError as e:
            self.failed = e
            raise

    def flush(self):
        try:
            self.stream.flush()
        except OSError as e:
            self.failed = e
            raise

    def __getattr__(self, name):
        return getattr(self.stream, name)


def run_cli(main):
    """Run a script's main; bad input (a BadInput) becomes one line on stderr and exit status 1, and any
    other exception, a bug, keeps its traceback.

    SIGTERM is turned into KeyboardInterrupt, so a killed run unwinds like Ctrl-C: every
    atomic_write in progress removes its temporary file on the way out. Standard output is
    flushed before the end (stdout_failed says how a failed write to it ends).
    """
    name = os.path.basename(sys.argv[0])
    signal.signal(signal.SIGTERM, interrupted)
    stdout = sys.stdout = WatchedStdout(sys.stdout)
    try:
        try:
            main()
        finally:
            if sys.stdout is stdout:
                sys.stdout = stdout.stream
        stdout.flush()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(f"{name}: interrupted; nothing half-written was left behind")
    except BadInput as e:
        sys.exit(f"{name}: error: {e}")
    except OSError as e:
        if e is not stdout.failed:
            raise
        stdout_failed(name, e)
    except (MemoryError, RuntimeError) as e:
        # under a process memory limit torch's allocator raises RuntimeError, not MemoryError
        if isinstance(e, RuntimeError) and not any(s in str(e) for s in ("allocate", "out of memory")):
            raise
        sys.exit(f"{name}: error: out of memory; ask for fewer rows or tokens, or a smaller model")
    except SystemExit:  # --help, or a script's own exit: what it printed must still reach the reader
        try:
            stdout.flush()
        except OSError as e:
            stdout_failed(name, e)
        raise


def stdout_failed(name, error):
    """A reader that went away (`| head`, a closed pipe) ends the run silently with status 141, what a
    shell reports for a tool SIGPIPE ended; a full disk or another write error is one line. Either way
    standard output then points at the null device, so the flush at exit cannot complain again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout with no descriptor (a test's capture)
        pass
    if error.errno == errno.EPIPE:
        sys.exit(141)
    sys.exit(f"{name}: error: cannot write to standard output: {error.strerror or error}")


DTYPE_NAMES = ("float32", "bfloat16", "float16", "int8")  # what --dtype may say; engines/fast_engine.py runs each


def add_speed_flags(ap):
    """--compile, --compile-cache and --dtype, for the scripts that can run engines.fast_engine's FastEngine."""
    ap.add_argument("--compile", action="store_true",
                    help="run the decode step compiled (a minute or so the first time, then loaded from the cache)")
    ap.add_argument("--compile-cache", metavar="DIR", default=None,
                    help="where compiled decode steps are kept (default: $XDG_CACHE_HOME/tiny-gpt or ~/.cache/tiny-gpt)")
    ap.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                    help="weights and cache (float16: CUDA; int8: the Linears' weights, one scale per output channel, "
                         "and their input rows, one scale a row, multiplied in int8)")


def check_count(name, n):
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise BadValue(f"{name} must be a whole number >= 0, got {n!r}")


def check_least(name, value, least):
    if not value >= least:  # a NaN too
        raise BadValue(f"{name} must be at least {least}, got {value}")


def as_id(token, what, limit, within="the vocabulary"):
    """An integer-like (int, numpy or 0-d tensor integer; not a bool) in 0..limit-1, as an int."""
    try:
        if isinstance(token, bool) or (isinstance(token, torch.Tensor) and token.dtype == torch.bool):
            raise TypeError
        token = operator.index(token)
    except TypeError:
        raise BadValue(f"{what} {token!r} is not an integer id") from None
    if not 0 <= token < limit:
        raise BadValue(f"{what} {token!r} is outside {within} 0..{limit - 1}")
    return token


def device_from(name):
    """A torch.device for 'cpu', 'cuda' or 'cuda:N', refusing what this machine lacks."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise BadValue(f"device {name!r} asked for, but torch sees no CUDA GPU here; use 'cpu'")
        if torch.device(name).index is not None and torch.device(name).index >= torch.cuda.device_count():
            raise BadValue(f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
        return torch.device(name)
    raise BadValue(f"unknown device {name!r}; use 'cpu' or 'cuda'")


def free_memory(device):
    """Bytes this process may still allocate on `device`: the GPU's free memory, or the memory the system
    says is available (Linux's MemAvailable, else free pages); None where the system does not say."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # native Windows has no sysconf
        return None


def check_fits(nbytes, what, device):
    """Refuse, before allocating, what would take more than half of the memory `device` has available."""
    have = free_memory(device)
    if have is not None and nbytes > have // 2:
        kind = "GPU memory" if torch.device(device).type == "cuda" else "memory"
        raise BadValue(f"{what} needs {nbytes / 2**30:.1f} GiB, more than half of this machine's "
                         f"{have / 2**30:.1f} GiB of available {kind}; ask for fewer rows or tokens")


PROGRESS = {"started": None, "shown": 0.0, "drawn": False}
QUIET_FOR = 2.0  # seconds of work that need no progress line at all
REDRAW_EVERY = 0.25  # a terminal line, redrawn at most this often
LOG_EVERY = 10.0  # a plain line in a log file or pipe, at most this often


def show_progress(label, done, total, started, note=""):
    """How far `done` of `total` is, with an ETA, on stderr: one function for every script.

    In a terminal, one line that updates a few times a second and is cleared once
    done == total. In a file or a pipe (a CI log, docker logs), a plain line every
    LOG_EVERY seconds. Work shorter than QUIET_FOR seconds shows nothing.
    """
    now, state = time.time(), PROGRESS
    if state["started"] != started:
        state.update(started=started, shown=started, drawn=False)
    tty = sys.stderr.isatty()
    if done >= total:
        if state["drawn"] and tty:
            print("\r" + " " * 79 + "\r", end="", file=sys.stderr, flush=True)
        state.update(started=None, drawn=False)
        return
    elapsed = now - started
    if elapsed < QUIET_FOR or now - state["shown"] < (REDRAW_EVERY if tty else LOG_EVERY):
        return
    eta = elapsed / max(done, 1) * (total - done)
    line = f"{label}: {done:,}/{total:,}{', ' + note if note else ''}, ETA {eta:.0f}s"
    print(f"\r{line[:78]} " if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
    state.update(shown=now, drawn=True)


def with_progress(fn, total, label):
    """fn, showing on stderr how many of its `total` calls have begun (show_progress)."""
    started, done = time.time(), 0

    def counted(*args):
        nonlocal done
        done += 1
        show_progress(label, done, total, started)
        return fn(*args)
    return counted
