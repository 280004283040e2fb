"""Where compiled decode steps are kept, under a key of everything that makes one valid, and read back.

A package (AOTInductor's .pt2) is kept in the compile cache folder under the
sha256 of the weights, the model's config and classes, the cache's shape and
dtype, the device, the machine, torch's version, the way's options and the
code compiled; the measured times of several ways are kept beside the
packages, so a later run loads only the fastest.
"""
import contextlib
import hashlib
import inspect
import json
import logging
import os
import platform
import stat
import zipfile

from engines.edge.cli import first_line
from engines.edge.files import atomic_write, check_output, shown
from engines.edge.errors import BadInput

import torch


MAX_PACKAGE_BYTES = 2**32  # a compiled step of a model this repo runs is far smaller
MAX_CHOICE_BYTES = 2**16  # a few ways' milliseconds
MS_RANGE = (1e-6, 1e6)  # a step's milliseconds as measured: a nanosecond to a quarter of an hour


def default_compile_cache():
    """Where compiled decode steps are kept unless told: $XDG_CACHE_HOME/tiny-gpt, else ~/.cache/tiny-gpt. A
    relative XDG_CACHE_HOME is ignored, as the XDG spec says (it would move with the working folder)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return os.path.join(xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache"), "tiny-gpt")


def unreadable(path, max_bytes):
    """Why the kept file at `path` is not one to open, or None: what is read back is input too, so only a
    regular file of bounded size is opened (a pipe would hang the read, a device never end it)."""
    try:
        info = os.stat(path)
    except OSError as e:
        return e.strerror
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_size > max_bytes:
        return f"it is {info.st_size:,} bytes, more than the {max_bytes:,} such a file can be"
    return None


def check_compile_cache(folder=None):
    """The compile cache folder as an absolute path (the default if None), made if missing and writable."""
    folder = os.path.abspath(folder or default_compile_cache())
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot make the compile cache folder {shown(folder)} ({e.strerror}); "
                      "name another with --compile-cache") from None
    check_output(os.path.join(folder, "decode-step.pt2"), force=True)  # the folder is writable
    return folder


def machine_name(device):
    """What a compiled step is built for: the CPU as /proc/cpuinfo names it, model and instruction-set flags
    (C++ built on one CPU may use instructions another lacks), and the GPU where it runs on one."""
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n")[0]
    except OSError:
        first_cpu = ""
    fields = dict(map(str.strip, line.split(":", 1)) for line in first_cpu.splitlines() if ":" in line)
    named = [fields[k] for k in ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")
             if k in fields]
    cpu = " | ".join(named) or f"{platform.machine()} {platform.processor()}"
    if device.type != "cuda":
        return cpu
    return f"{cpu} | {torch.cuda.get_device_name(device)} sm{torch.cuda.get_device_capability(device)}"


def weights_digest(model):
    """sha256 of every weight's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


# the files of engines/ whose code a compiled step runs, or which decide how it is exported and keyed
STEP_CODE = ("fast/compile_cache.py", "fast/compile_ways.py", "fast/decode_step.py", "fast/graph_pick.py",
             "fast/int8.py", "fast/matmul.py", "serving/row_cache.py")


def step_sources(model, cache):
    """{file name: sha256} of the code a step runs outside torch (torch's own is its version): the files of
    the model's and the cache's classes and of their bases, and STEP_CODE: StepProgram, what a way may
    export in the model's place (its products, its attention), and this key itself."""
    classes = {c for obj in (*model.modules(), cache) for c in type(obj).__mro__}
    files = {inspect.getfile(c) for c in classes if c.__module__.partition(".")[0] not in ("torch", "builtins")}
    sources = {}
    engines = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in sorted(files | {os.path.join(engines, name) for name in STEP_CODE}):
        with open(path, "rb") as f:
            sources[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return sources


def step_keys(model, cache, ways, pick=None):
    """{way: what the step compiled that way is valid for, as one sha256}: the weights, the model's config
    and classes, the cache's shape, strides (a cache may be rows of a larger one) and dtype, the device and
    the machine, torch's version, the way (its
    options, the Linears' product among them), the pick's stages compiled in (None: none) and the code
    compiled. Any of them changed, the key is another and the step is compiled anew. All but the way are read once for every way (the weights'
    hash reads them all)."""
    parts = dict(weights=weights_digest(model), config=repr(getattr(model, "cfg", None)),
                 modules=[f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()],
                 cache=cache.shape, strides=[cache.heads_k.stride(), cache.heads_v.stride()],
                 dtype=str(cache.heads_k.dtype), device=str(cache.heads_k.device),
                 machine=machine_name(cache.heads_k.device), torch=torch.__version__,
                 pick=pick, sources=step_sources(model, cache))
    return {name: hashlib.sha256(json.dumps(parts | {"options": options}, sort_keys=True, default=repr).encode())
            .hexdigest() for name, options in ways.items()}


KEY_FIELD = "tiny_gpt_step_key"  # the key a package was compiled for, in its own metadata


def package_path(folder, key):
    return os.path.join(folder, f"decode-step-{key[:40]}.pt2")


def load_package(package, key):
    """The compiled step in `package` (a path or a buffer), or why it cannot serve for `key`: a damaged file
    (its zip checksums; a flipped bit in the weights would otherwise load and run), or a package made for
    another key (another model's, or another batch's, renamed)."""
    if isinstance(package, str) and (why := unreadable(package, MAX_PACKAGE_BYTES)):
        return None, why
    try:
        if damaged := zipfile.ZipFile(package).testzip():
            return None, f"{damaged} inside it is damaged"
        # torch warns "outdated pt2 file" on any file it cannot open; the reason is said here instead
        with warnings_off("torch._inductor.package.package"):
            runner = torch._inductor.aoti_load_package(package)
        made_for = runner.get_metadata().get(KEY_FIELD)
    except (OSError, RuntimeError, ValueError, zipfile.BadZipFile) as e:
        return None, first_line(e)
    if made_for != key:
        return None, "it was compiled for other weights, code, batch or machine"
    return runner, None


@contextlib.contextmanager
def warnings_off(logger_name):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def choice_path(folder, keys):
    """Where the measured times of the compiled ways whose packages have these keys are kept."""
    return os.path.join(folder, f"decode-step-ways-{hashlib.sha256(' '.join(keys).encode()).hexdigest()[:40]}.json")


def read_choice(path, ways):
    """({way: ms a step} as measured here before for these packages, None), or ({}, why it cannot be used)
    where none is kept or it is not one: a file that is not a bounded regular file, not JSON, not every way's
    milliseconds as a number in MS_RANGE (a boolean is not a number of milliseconds). The ways are then
    timed again, and the file left as it is."""
    if not os.path.lexists(path):
        return {}, None
    if why := unreadable(path, MAX_CHOICE_BYTES):
        return {}, why
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError, RecursionError):
        return {}, "it is not JSON"
    good = isinstance(kept, dict) and set(kept) == set(ways) and all(
        type(ms) in (int, float) and MS_RANGE[0] <= ms <= MS_RANGE[1] for ms in kept.values())
    return (kept, None) if good else ({}, f"it is not each way's milliseconds in {MS_RANGE[0]:g}..{MS_RANGE[1]:g}")


def keep_choice(path, way_ms, replace=False):
    """Keep the ways' times at path; replace: put them in place of the times kept there (timed again)."""
    try:
        with atomic_write(path, "w", force=replace) as f:
            json.dump(way_ms, f)
    except FileExistsError:  # another run kept its own measurement first, or an unreadable file is there
        pass
