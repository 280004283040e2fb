"""Files at the edge: an input is a bounded regular file, and an output never loses anything.

Only regular files are ever replaced, and only when told (--force, --resume),
judged again when the finished file is put in place; every write goes through a
new temporary file beside the target, renamed into place (atomic_write).

The engines' one atomic write. The lesson's (inside bpe.BPE.save) and series/train.py's stay their own,
as those files import nothing of engines/; this one adds what the engines' outputs need beyond them: a
failed write said as one line naming the path, --force judged again when the file is put in place, and
only regular files ever replaced.
"""
import errno
import io
import os
import stat
import tempfile
from contextlib import contextmanager

from engines.edge.errors import Appeared, BadInput, BadValue


def check_input(path, what, max_bytes, hint=""):
    """A path to read: an existing regular file of at most max_bytes, never a FIFO or a device that
    would block or never end. Returns its size."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise BadValue(f"{what}: give a file path, got {path!r}")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise BadInput(f"{what} {shown(path)} not found{'; ' + hint if hint else ''}") from None
    if stat.S_ISDIR(info.st_mode):
        raise BadValue(f"{what} {shown(path)} is a folder; give a file")
    if not stat.S_ISREG(info.st_mode):
        raise BadValue(f"{what} {shown(path)} is not a regular file (a pipe or a device?); give a file")
    if info.st_size > max_bytes:
        raise BadValue(f"{what} {shown(path)} is {info.st_size / 2**20:,.0f} MiB, more than the "
                         f"{max_bytes / 2**20:,.0f} MiB such a file can sensibly be")
    return info.st_size


def check_input_folder(folder, what, max_bytes):
    """A folder another program reads (an export, for vLLM or transformers): each file in it as check_input has
    it, since a FIFO there would block that reader for good. Sub-folders are left to the reader."""
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not os.path.isdir(os.path.join(folder, name)):
            check_input(os.path.join(folder, name), what, max_bytes)


def shown(path):
    """A path as one line of a message: as it is, or quoted where it holds a newline or another control."""
    path = os.fspath(path)
    return path if path.isprintable() else repr(path)


def check_replaceable(path):
    """What stands at `path` may be replaced by a file: nothing, a regular file, or a link (dangling, or to a
    regular file: the link is replaced, never written through). A folder, a device or a pipe never is."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except NotADirectoryError:  # a file, a pipe or a link to one where the path needs a folder
        raise BadValue(f"cannot write {shown(path)}: {shown(os.path.dirname(path))} is not a folder; "
                         "give a path in a folder") from None
    except OSError as e:  # a name longer than the filesystem holds, a loop of links
        raise BadInput(f"cannot write {shown(path)}: {e.strerror}; give another name") from None
    if stat.S_ISDIR(mode):
        raise BadValue(f"cannot write {shown(path)}: it is a folder; give a file name")
    if not stat.S_ISREG(mode):
        raise BadValue(f"cannot write {shown(path)}: it is not a regular file (a device, a pipe or a link to "
                         "one), and only files are ever replaced; give a file path")


def starts_with(magic):
    """An `ours` test for check_output and place: a file this command wrote begins with `magic`."""
    def ours(path):
        try:
            with open(path, "rb") as f:
                return f.read(len(magic)) == magic
        except OSError:
            return False
    return ours


def check_ours(path, ours, flag="--force"):
    """With force, a regular file at `path` is replaced only where `ours(path)` knows it for this command's own
    output: a user's document is never lost (a link is replaced, never what it points at)."""
    if ours is not None and os.path.isfile(path) and not os.path.islink(path) and not ours(path):
        raise BadValue(f"{shown(path)} is not a file this command wrote, so {flag} does not replace it; "
                       "move it or choose another name")


def check_output(path, force=False, flag="--force", inputs=(), ours=None):
    """Before any long work: `path` can be written, and replaces nothing unless told (`flag`), and then only
    what `ours` recognises (check_ours). Whatever the flags, refuses an empty path, a folder, a device or a
    pipe, one of the script's own `inputs`, and a missing or unwritable folder (tried by making atomic_write's
    temporary file there, the one test that also holds for root and read-only mounts)."""
    path = os.fspath(path)
    if not path:
        raise BadValue("the output path is empty; give a file name")
    check_replaceable(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise BadValue(f"cannot write {shown(path)}: the folder {shown(folder)} does not exist")
    for given in inputs:
        if os.path.exists(path) and os.path.exists(given) and os.path.samefile(given, path):
            raise BadValue(f"cannot write {shown(path)}: it is {shown(given)}, which this run reads; "
                             "give another name")
    if os.path.lexists(path) and not force:
        raise BadValue(f"{shown(path)} already exists; pass {flag} to replace it")
    check_ours(path, ours, flag)
    try:
        fd, probe = temporary_beside(path)  # the very file atomic_write will make first
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        why = "is not writable" if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "holds no new file"
        raise BadInput(f"cannot write {shown(path)}: the folder {shown(folder)} {why} ({e.strerror})") from None
    return path


def temporary_beside(path):
    """A new, private, empty file beside `path` (O_EXCL), for a write to be renamed into place."""
    folder = os.path.dirname(os.path.abspath(path))
    # a part of the name, not all of it: a name near the folder's limit must leave room for the marks
    return tempfile.mkstemp(prefix=f".{os.path.basename(path)[:40]}.", suffix=".tmp", dir=folder)


def place(done, path, force, ours=None):
    """Rename the finished file `done` to `path`, judging what stands there at that moment: with force,
    what check_replaceable and check_ours allow is replaced; without, the name is taken with O_EXCL first,
    which fails if anything appeared there while the work ran."""
    if force:
        check_replaceable(path)
        check_ours(path, ours)
    else:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            raise Appeared(appeared(path)) from None
    try:
        os.replace(done, path)
    except BaseException:
        if not force:
            os.unlink(path)
        raise


def appeared(path):
    return (f"{shown(path)} appeared while this ran and is left as it was; nothing was written there "
            "(pass --force to replace it, or give another name)")


class WriteFailures(io.FileIO):
    """A file that keeps the OSError a write raised, for writers that swallow it (torch.save's is
    a RuntimeError about a position)."""

    failed = None

    def write(self, data):
        try:
            return super().write(data)
        except OSError as e:
            self.failed = e
            raise


@contextmanager
def atomic_write(path, mode="wb", force=False, ours=None, **open_args):
    """Write `path` (mode "w" or "wb") through a new temporary file beside it (O_EXCL: never through a
    file or a link), removed if the body fails or is interrupted, then put in place (place). A write that
    fails (a full disk, ulimit -f) is one BadInput naming `path`, whatever the writer made of it."""
    path = os.fspath(path)
    fd, tmp = temporary_beside(path)
    raw = WriteFailures(fd, "wb")
    try:
        try:
            f = io.BufferedWriter(raw)
            if "b" not in mode:
                f = io.TextIOWrapper(f, **open_args)
                f.mode = mode  # as open() gives it
            with f:
                yield f
        except Exception as e:
            if isinstance(e.__context__, KeyboardInterrupt):  # Ctrl-C or SIGTERM inside torch.save's C++ writer
                raise KeyboardInterrupt from None
            failed = raw.failed or (e if isinstance(e, OSError) else None)
            if failed is None:
                raise
            raise BadInput(f"cannot write {shown(path)}: {failed.strerror or failed}; "
                          "nothing was written there") from None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the result is an ordinary file
        place(tmp, path, force, ours)
    except BaseException:
        raw.close()
        os.unlink(tmp)
        raise
