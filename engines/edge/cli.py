"""What every script shares at its command line: one-line errors (run_cli), checked arguments, a progress line."""
import argparse
import errno
import ipaddress
import operator
import os
import signal
import sys
import time

import torch

from engines.edge.errors import BadInput, BadValue


def first_line(error):
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "no reason given")


def script_name():
    """The name a script's messages start with: its file's, or for a module run as python -m MODULE (a package:
    its __main__.py), that command."""
    name, spec = os.path.basename(sys.argv[0]), getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None or os.path.basename(spec.origin or "") != name:
        return name
    return f"python -m {spec.parent if name == '__main__.py' else spec.name}"


class Parser(argparse.ArgumentParser):
    """argparse whose complaints are one line and a non-zero exit, like every other error here."""

    def __init__(self, **kwargs):
        super().__init__(prog=script_name(), **kwargs)

    def error(self, message):
        sys.exit(f"{self.prog}: error: {message} (see --help)")


STDOUT_FAILURES = (errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT)  # a gone reader, a full disk


def interrupted(signum, frame):
    raise KeyboardInterrupt


def run_cli(main):
    """Run a script's main; bad input (a BadInput) becomes one line on stderr and exit status 1, any other
    exception, a bug, keeps its traceback. SIGTERM unwinds like Ctrl-C, so every atomic_write in progress
    removes its temporary file. (SIGPIPE stays ignored, as Python sets it: at its default, a client gone
    from python -m engines.serve's socket would end the server.)"""
    name = script_name()
    if sys.stdout is None:  # started with standard output closed (>&-): every print would vanish
        sys.exit(f"{name}: error: cannot write to standard output: it is closed; give it a place (> FILE, or a terminal)")
    signal.signal(signal.SIGTERM, interrupted)
    try:
        try:
            main()
        finally:
            sys.stdout.flush()  # what main printed, before its end is said
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one while this is said would cut it off
        print(file=sys.stderr)
        sys.exit(f"{name}: interrupted; nothing half-written was left behind")
    except BadInput as e:  # the lesson's refusals among them: the engines raise them again as BadValue (refusing)
        sys.exit(f"{name}: error: {e}")
    except OSError as e:
        # a write failure without a file name: standard output's (a file of main's fails as a BadInput)
        if e.filename is not None or e.errno not in STDOUT_FAILURES:
            raise
        try:  # standard output points at the null device from here, so the flush at exit cannot complain again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout with no descriptor (a test's capture)
            pass
        if e.errno == errno.EPIPE:  # a reader that went away (| head): silent, the status a shell gives SIGPIPE
            sys.exit(141)
        sys.exit(f"{name}: error: cannot write to standard output: {e.strerror or e}")
    except (MemoryError, RuntimeError) as e:
        # under a process memory limit torch's allocator raises RuntimeError, not MemoryError
        if isinstance(e, RuntimeError) and not any(s in str(e) for s in ("allocate", "out of memory")):
            raise
        sys.exit(f"{name}: error: out of memory; ask for fewer rows or tokens, or a smaller model")


def thread_count(text):
    """argparse's type of every thread count: 1 up to this machine's cores (far past them torch dies of SIGSEGV)."""
    cores = os.cpu_count() or 1
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= cores:
        raise argparse.ArgumentTypeError(f"threads must be a whole number in 1..{cores} (this machine's cores), "
                                         f"got {text!r}")
    return n


def check_count(name, n, least=0):
    """n, a whole number (not a bool) >= least."""
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise BadValue(f"{name} must be a whole number >= {least}, got {n!r}", name)
    return n


def check_least(name, value, least):
    if not value >= least:  # a NaN too
        raise BadValue(f"{name} must be at least {least}, got {value}", name)


def check_within(name, value, least, most):
    if not least <= value <= most:  # a NaN too
        raise BadValue(f"{name} must be in {least}..{most}, got {value}", name)


def as_id(token, what, limit, within="the vocabulary", field=None):
    """An integer-like (int, numpy or 0-d tensor integer; not a bool) in 0..limit-1, as an int; field: its BadValue's."""
    try:
        if isinstance(token, bool) or (isinstance(token, torch.Tensor) and token.dtype == torch.bool):
            raise TypeError
        token = operator.index(token)
    except TypeError:
        raise BadValue(f"{what} {token!r} is not an integer id", field) from None
    if not 0 <= token < limit:
        raise BadValue(f"{what} {token!r} is outside {within} 0..{limit - 1}", field)
    return token


def is_loopback(host):
    """Whether --host listens on this machine alone."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


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
    """Bytes `device` may still give: the GPU's free memory, or Linux's MemAvailable (None elsewhere)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_fits(nbytes, what, device):
    """Refuse, before allocating, what would take more than half of the memory `device` has available."""
    have = free_memory(device)
    if have is not None and nbytes > have // 2:
        kind = "GPU memory" if torch.device(device).type == "cuda" else "memory"
        raise BadValue(f"{what} needs {nbytes / 2**30:.1f} GiB, more than half of this machine's "
                       f"{have / 2**30:.1f} GiB of available {kind}; ask for fewer rows or tokens")


PROGRESS = {"started": None, "shown": 0.0}  # the run a line is shown for, and when it last was
QUIET_FOR, REDRAW_EVERY, LOG_EVERY = 2.0, 0.25, 10.0  # seconds: work with no line; a terminal's redraws; a log's lines


def show_progress(label, done, total, started):
    """How far `done` of `total` is, with an ETA, on stderr: in a terminal one line redrawn a few times a second
    and cleared at the end; in a log file, a pipe or `docker logs` a plain line every LOG_EVERY seconds.
    (tqdm redraws with a carriage return in a log too, one endless line there; rich's live display draws
    nothing there until the end: neither keeps issue 18's plain lines.)"""
    now, tty, state = time.time(), sys.stderr.isatty(), PROGRESS
    if state["started"] != started:
        state.update(started=started, shown=started)
    if done >= total:
        if tty and state["shown"] != started:  # a line was drawn: clear it
            print("\r" + " " * 79 + "\r", end="", file=sys.stderr, flush=True)
        state["started"] = None
    elif now - started >= QUIET_FOR and now - state["shown"] >= (REDRAW_EVERY if tty else LOG_EVERY):
        line = f"{label}: {done:,}/{total:,}, ETA {(now - started) / max(done, 1) * (total - done):.0f}s"
        print(f"\r{line[:78]} " if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
        state["shown"] = now
