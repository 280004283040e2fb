"""The Engine's decode step made fast, exactly: the fastest matrix multiply measured here, or compiled.

A decode step multiplies a few rows by each of the model's 25 weight matrices
(4 per block, and the head). Every kernel here computes what nn.Linear does,
rows @ W.T + b, but which one is fastest depends on the CPU's BLAS and the
number of rows: feeding a lone row twice won on an AMD EPYC and lost on an
Intel Xeon. So nothing is hard-coded: choose() times every candidate that
runs on this device, dtype and batch, refuses any whose output is not
nn.Linear's (within 1e-5 in float32), and keeps the fastest, once per
(batch, device, dtype, shapes); int8 weights (gpt-fast's weight-only scheme,
one scale per output channel) have candidates of their own, measured alike.
DecodeStep is the same step in a form torch.compile and CUDA graphs accept (no
Python state, the cache written in place), compiled or captured once. FastEngine is prefill_clone's Engine with
all of this applied from outside, as gpt-fast applies torch.compile in its
main: the model and the lesson's Engine know nothing of it.

    python kernels.py [cpu|cuda] [--batches 1 16]

prints what each candidate took for one step's 25 multiplies and which won.
"""
import contextlib
import copy
import functools
import hashlib
import inspect
import io
import json
import logging
import os
import platform
import shutil
import sys
import types
import time
import warnings
import weakref
import zipfile

# before torch: cli.startup_failure makes a failing import one line
from cli import Parser, atomic_write, check_fits, check_output, device_from, first_line, run_cli, shown

import torch
import torch.nn as nn
import torch.nn.functional as F

import sampling
from checks import check_request
from prefill_clone import Engine, KVCache, clone_prompt


def sync(device):
    """Wait for the GPU's queued work, so a timing covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PREPARED = weakref.WeakKeyDictionary()  # layer -> {kernel name: (weight version, reordered weight)}


def prepared(layer, name, reorder):
    """layer.weight reordered for a kernel (transposed, packed), kept until the weight changes."""
    kept = PREPARED.setdefault(layer, {})
    w = layer.weight
    version = (w.data_ptr(), 0 if w.is_inference() else w._version)  # inference tensors keep no version
    if name not in kept or kept[name][0] != version:
        kept[name] = (version, reorder(layer.weight.detach()))
    return kept[name][1]


def times(weight_first, layer, cols):
    """W @ cols (+ b as a column): the product with the weights on the left, (out, R)."""
    if layer.bias is None:
        return weight_first @ cols
    return torch.addmm(layer.bias[:, None], weight_first, cols)


def nn_linear(layer, rows):
    return F.linear(rows, layer.weight, layer.bias)


def weights_left(layer, rows):
    return times(layer.weight, layer, rows.T).T.contiguous()


def lone_row_twice(layer, rows):
    """A lone row fed as two, W @ [x; x].T: a BLAS may run a 2-column product faster than a 1-column one."""
    if rows.shape[0] != 1:
        return None
    return times(layer.weight, layer, torch.cat((rows, rows)).T)[:, 0][None].contiguous()


def transposed(layer, rows):
    """rows @ W.T with W.T kept contiguous, (in, out): a plain product, no transpose for the BLAS to handle."""
    wt = prepared(layer, "transposed", lambda w: w.T.contiguous())
    return rows @ wt if layer.bias is None else torch.addmm(layer.bias, rows, wt)


def matrix_vector(layer, rows):
    """A lone row as a matrix-vector product (torch.mv, BLAS gemv)."""
    if rows.shape[0] != 1:
        return None
    if layer.bias is None:
        return torch.mv(layer.weight, rows[0])[None]
    return torch.addmv(layer.bias, layer.weight, rows[0])[None]


def mkl_packed(layer, rows):
    """MKL's packed product (what inductor's freezing uses for float32): the weight packed for this row count."""
    n = rows.shape[0]
    packed = prepared(layer, f"mkl {n}", lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, n))
    return torch.ops.mkl._mkl_linear(rows, packed, layer.weight, layer.bias, n)


def onednn_packed(layer, rows):
    """oneDNN's linear on a weight reordered once into its own blocked layout."""
    n = rows.shape[0]
    packed = prepared(layer, f"onednn {n}", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, n))
    return torch.ops.mkldnn._linear_pointwise(rows, packed, layer.bias, "none", [], "")


def split_rows(layer, rows):
    """W cut into blocks of output rows, one product per block in one torch.bmm, which runs the blocks on
    all cores: a BLAS multiplies a few rows by a small matrix on one core, so the others sit idle."""
    w = layer.weight
    # about two blocks a core, so none waits on one slow block; a count that divides the rows, so every block is whole
    parts = max(p for p in range(1, 2 * torch.get_num_threads() + 1) if w.shape[0] % p == 0)
    blocks, cols = w.view(parts, -1, w.shape[1]), rows.T.expand(parts, -1, -1)
    out = torch.bmm(blocks, cols) if layer.bias is None else torch.baddbmm(layer.bias.view(parts, -1, 1), blocks, cols)
    return out.view(w.shape[0], -1).T.contiguous()


KERNELS = {"nn": nn_linear, "left": weights_left, "twice": lone_row_twice, "transposed": transposed,
           "mv": matrix_vector, "mkl": mkl_packed, "onednn": onednn_packed, "split": split_rows}


def quantize_per_channel(weight):
    """gpt-fast's weight-only int8: symmetric, one float32 scale per output channel (row of W), so that
    W is close to int8 x scale, each value within half a scale step (the row's largest maps to 127.5,
    kept at 127 or -128)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.5).clamp(min=torch.finfo(torch.float32).eps)
    return torch.clamp(torch.round(w / scales[:, None]), -128, 127).to(torch.int8), scales


def plus_bias(layer, out):
    return out if layer.bias is None else out + layer.bias


def dequantized(layer, rows):
    """gpt-fast's WeightOnlyInt8Linear product: the int8 weight made float, multiplied, each column scaled."""
    return plus_bias(layer, F.linear(rows, layer.weight.to(rows.dtype)) * layer.scales)


def int8pack(layer, rows):
    """ATen's weight-only int8 product (aten._weight_int8pack_mm): the int8 weight read as it is, never made float."""
    return plus_bias(layer, torch.ops.aten._weight_int8pack_mm(rows, layer.weight, layer.scales))


INT8_KERNELS = {"dequantize": dequantized, "int8pack": int8pack}


def dot_products(layer, rows):
    """Each output as the dot product of its weight row with the input row, written as a multiply and a
    sum. Compiled, inductor makes it one loop per output that reads each weight once (an int8 one as it
    is); eager, it would first make the whole (rows, out, in) product, so it is compiled only (the
    "dot products" way of COMPILE_WAYS), and only for one row: each further row reads every weight again."""
    out = (rows[:, None, :] * layer.weight).sum(-1)
    return plus_bias(layer, out * layer.scales if isinstance(layer, Int8Linear) else out)


class Int8Linear(nn.Module):
    """An nn.Linear with its weight quantized once (quantize_per_channel): int8 weight, float32 scales
    and the layer's own float32 bias; rows and products stay float32."""

    def __init__(self, layer):
        super().__init__()
        weight, scales = quantize_per_channel(layer.weight)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.bias, self.in_features, self.out_features = layer.bias, layer.in_features, layer.out_features

    def forward(self, x):
        return dequantized(self, x)


def quantized(module):
    """A copy of the module tree whose nn.Linear layers hold int8 weights (Int8Linear), the rest the
    model's own. The head is quantized like every other Linear; the embedding it is tied to stays float32,
    so a token's lookup is exact and only the products read int8."""
    return replacing_linears(module, Int8Linear)


@functools.cache
def int8pack_runs(device):
    """Whether this torch has aten._weight_int8pack_mm on this device and it gives dequantized()'s product."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    gen = torch.Generator(device).manual_seed(0)  # not torch's global one, which sampling draws from
    weight, rows = (torch.randn(shape, generator=gen, device=device) for shape in ((48, 64), (3, 64)))
    layer = Int8Linear(types.SimpleNamespace(weight=weight, bias=None, in_features=64, out_features=48))
    try:
        return exact(int8pack, [layer], [rows], dequantized)
    except (RuntimeError, NotImplementedError):  # declared, but with no kernel for this device
        return False


class KernelLinear(nn.Module):
    """An nn.Linear whose product kernel(layer, rows) computes, on the layer's own weights (None: nn.Linear's)."""

    def __init__(self, layer, kernel):
        super().__init__()
        self.layer, self.kernel = layer, kernel

    def forward(self, x):
        out = self.kernel(self.layer, x.reshape(-1, x.shape[-1]))
        return self.layer(x) if out is None else out.view(*x.shape[:-1], -1)


def with_kernel(module, kernel):
    """A copy of the module tree whose nn.Linear (or Int8Linear) layers run through `kernel`. Only the tree
    is copied: the parameters are the model's own, so the copy computes with its weights as they are now,
    and the model itself is left as it was (two Engines in two threads never see each other's kernel)."""
    return replacing_linears(module, lambda layer: KernelLinear(layer, kernel))


def replacing_linears(module, replace):
    """A copy of the module tree with replace(layer) in place of each nn.Linear (or Int8Linear) layer,
    in the layer's mode (a new module starts in training mode, which the Engine refuses)."""
    if isinstance(module, (nn.Linear, Int8Linear)):
        return replace(module).train(module.training)
    tree = copy.copy(module)
    tree._modules = {name: replacing_linears(child, replace) for name, child in module._modules.items()}
    return tree


def runs_here(name, device, dtype):
    """Whether a kernel exists for this device and dtype (the packed ones are CPU libraries; int8
    weights have kernels of their own)."""
    if (dtype == torch.int8) != (name in INT8_KERNELS):
        return False
    if name == "int8pack":
        return int8pack_runs(device)
    if name == "mkl":
        return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
    if name == "onednn":
        bf16 = dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()  # needs AVX-512 or AVX-NE
        return device.type == "cpu" and (dtype == torch.float32 or bf16) and torch.backends.mkldnn.is_available()
    return True


def kernel_named(name, device, dtype):
    """The kernel called `name`, refused in one line if unknown or not available here."""
    every = KERNELS | INT8_KERNELS
    if name not in every:
        raise ValueError(f"unknown kernel {name!r}; the kernels are {list(KERNELS)} ({list(INT8_KERNELS)} for "
                         "int8), or 'auto' to measure them")
    if not runs_here(name, device, dtype):
        raise ValueError(f"kernel {name!r} does not run on {device.type} in {str(dtype).removeprefix('torch.')}")
    return every[name]


def tolerance(dtype):
    """How far a kernel may be from nn.Linear: 1e-5 in float32, one rounding step in a half type."""
    return 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps


def exact(kernel, layers, inputs, reference=nn_linear):
    """Whether kernel gives the reference's output (nn.Linear's, or dequantized()'s for int8 weights) on
    every layer (relative to the output's size)."""
    for layer, rows in zip(layers, inputs):
        got, want = kernel(layer, rows), reference(layer, rows)
        if got is None:  # a lone-row kernel leaves other row counts to nn.Linear
            continue
        tol = tolerance(want.dtype) * max(1.0, want.abs().max().item())
        if got.shape != want.shape or not (got - want).abs().max().item() <= tol:
            return False
    return True


@torch.inference_mode()
def time_kernels(layers, batch, rounds=5):
    """{name: seconds for one step's products at `batch` rows, or None if not exact}, every candidate here."""
    w = layers[0].weight
    int8 = w.dtype == torch.int8  # int8 weights multiply float32 rows
    candidates, reference = (INT8_KERNELS, dequantized) if int8 else (KERNELS, nn_linear)
    gen = torch.Generator(w.device).manual_seed(0)
    rows_dtype = torch.float32 if int8 else w.dtype
    inputs = [torch.randn(batch, layer.in_features, generator=gen, device=w.device).to(rows_dtype) for layer in layers]
    names = [n for n in candidates if runs_here(n, w.device, w.dtype)
             and (batch == 1 or n not in ("twice", "mv"))]  # the lone-row kernels would only be nn.Linear again
    exact_ones = [n for n in names if exact(candidates[n], layers, inputs, reference)]
    timed = least_disturbed({n: lambda kernel=candidates[n]: [kernel(layer, rows) for layer, rows in zip(layers, inputs)]
                             for n in exact_ones}, w.device, rounds)
    return {n: timed.get(n) for n in names}


def least_disturbed(fns, device, rounds, calls=1):
    """{name: seconds a call} for each fn, the fns taking turns for `rounds` rounds of `calls` calls and
    each one's least disturbed round kept: on a busy machine a median still carries the neighbours'
    load, and they load every candidate alike only if the candidates take turns."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(device)
            best[name] = min(best[name], (time.perf_counter() - started) / calls)
    return best


CHOSEN = {}  # (batch, device, dtype, weight shapes) -> (name, {name: seconds or None})


def choose(model, batch):
    """The fastest exact kernel for `batch` rows on this model's device and dtype, and what was measured."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, Int8Linear))]
    w = layers[0].weight
    key = (batch, w.device, w.dtype, tuple(tuple(layer.weight.shape) for layer in layers))
    if key not in CHOSEN:
        measured = time_kernels(layers, batch)
        exact_ones = [n for n, t in measured.items() if t is not None]
        # none exact: this model's products overflow (inf or NaN) in every kernel, nn.Linear's own included,
        # and nn.Linear is then what the model itself computes (the measured dict shows none was exact)
        winner = min(exact_ones, key=measured.get) if exact_ones else "nn"
        for layer in layers:  # the losers' reordered weights go; the winner remakes its own on first use
            PREPARED.pop(layer, None)
        CHOSEN[key] = winner, measured
    return CHOSEN[key]


# int8: the weights only (Int8Linear), the activations and the cache float32
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def check_dtype(dtype, device):
    """One of DTYPES (a name or the torch.dtype); float16 only on CUDA, where it has fast kernels."""
    dtype = DTYPES.get(dtype, dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if dtype == torch.float16 and device.type != "cuda":
        raise ValueError("float16 runs only on CUDA here; on the CPU use bfloat16")
    return dtype



def add_speed_flags(ap):
    """--compile, --compile-cache and --dtype, for the scripts that run the Engine."""
    ap.add_argument("--compile", action="store_true",
                    help="run the decode step compiled (a minute or so the first time, then loaded from the cache)")
    ap.add_argument("--compile-cache", metavar="DIR", default=None,
                    help=f"where compiled decode steps are kept (default: {shown(default_compile_cache())})")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES),
                    help="weights and cache (float16: CUDA; int8: the weights only, one scale per output channel)")


def speed_flags(args):
    """The Engine's compile, compile cache and dtype from those flags, all checked before any checkpoint is read."""
    device = device_from(args.device)
    cache = check_compile_cache(args.compile_cache) if args.compile else args.compile_cache
    return dict(compile=args.compile, compile_cache=cache, dtype=check_dtype(args.dtype, device))


def compiler_missing(device):
    """Why torch.compile cannot run on `device` here, or None. On a CPU inductor builds its kernels with
    the first C++ compiler of its config.cpp.cxx that runs: $CXX if set, else g++ (clang++ on a Mac)."""
    if torch.device(device).type != "cpu":
        return None
    names = torch._inductor.config.cpp.cxx
    names = [names] if isinstance(names, str) else [name for name in names if name]
    if any(shutil.which(name) for name in names):
        return None
    return (f"compiling on the CPU needs the C++ compiler inductor builds its kernels with ({' or '.join(names)}), "
            "and there is none here; install one (apt-get install g++) or name one in CXX")


def check_compiler(device, otherwise="or leave out --compile"):
    if reason := compiler_missing(device):
        raise ValueError(f"{reason}, {otherwise}")


# The ways a decode step is compiled, and the one kept is measured where it runs: "autotuned" freezes the
# weights into the graph as constants, which lets max_autotune try its own C++ matrix multiplies (weights
# packed, every core used) against ATen's, timed where it compiles (the last two options keep the
# autotuner's tables off stderr; int8 weights are not frozen, compile_ways says why); "plain" is inductor's
# default, ATen's multiplies on the weights as they are; "dot products" exports every nn.Linear as
# dot_products, and its two options keep inductor from computing the input (a layer norm, say) again inside
# every output's loop: it is stored once and read; "autotuned, attention as math" is autotuned with the
# attention exported as its arithmetic (attention_as_math), which inductor fuses with the rest, where ATen's
# flash attention for one query per row costs more than the arithmetic. Besides inductor's options, a way
# may name the product its Linears are exported with ("linears", one of COMPILED_LINEARS), its attention
# ("attention": "math") and the rows it is worth compiling for ("min_rows", "max_rows": past one row, dot
# products are several times slower; at one row, they beat every other product). Which way is fastest
# depends on the CPU and the rows, so DecodeStep compiles (or loads) each and times them side by side on the
# machine it runs on (bench.py table 3 shows the figures). AOTInductor calls the graph from C++.
COMPILED_LINEARS = {"dot_products": dot_products}
WAY_FIELDS = ("linears", "attention", "min_rows", "max_rows")  # a way's own; the rest are inductor's options
DOT_PRODUCTS, ATTENTION_AS_MATH = "dot products", "autotuned, attention as math"
AUTOTUNED = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
             "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
COMPILE_WAYS = {"cpu": {"autotuned": AUTOTUNED,
                        "plain": {},
                        DOT_PRODUCTS: {"linears": "dot_products", "max_rows": 1,
                                       "realize_cpu_opcount_threshold": 0, "realize_reads_threshold": 1},
                        ATTENTION_AS_MATH: {**AUTOTUNED, "attention": "math", "min_rows": 2}},
                "cuda": {"plain": {}}}


def compile_ways(device, batch, int8=False):
    """COMPILE_WAYS for this device that are worth compiling for `batch` rows. For int8 weights, each way
    without freezing: frozen, inductor folds each weight's dequantization into a float32 copy kept in the
    program, which then reads four times the bytes, the float32 step with int8's rounding."""
    ways = {name: way for name, way in COMPILE_WAYS[device.type].items()
            if way.get("min_rows", 1) <= batch <= way.get("max_rows", batch)}
    if int8:
        ways = {name: {option: value for option, value in way.items() if option != "freezing"}
                for name, way in ways.items()}
    return ways


def way_model(model, way):
    """The model as `way` (a COMPILE_WAYS entry) is compiled: its Linears as the way's "linears", if it names them."""
    return with_kernel(model, COMPILED_LINEARS[way["linears"]]) if "linears" in way else model


def attention_as_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention for the decode step (no dropout, no causal mask) as its arithmetic:
    softmax(q k^T / sqrt(d), masked) v."""
    assert dropout_p == 0 and not is_causal, "the decode step's attention: one query a row, no dropout"
    if enable_gqa and k.shape[1] != q.shape[1]:  # each key head serves a group of query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(-1) @ v


class AttentionAsMath(torch.overrides.TorchFunctionMode):
    """While on (in this thread only), F.scaled_dot_product_attention runs as attention_as_math: how a way
    with "attention": "math" exports the step, the model's own code unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return attention_as_math(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


COMPILED_ATTENTION = {"math": AttentionAsMath}


def weights_state(model):
    """The model's weight tensors and how often each was changed in place (inference tensors cannot be)."""
    return [(p, 0 if p.is_inference() else p._version) for p in model.parameters()]


def default_compile_cache():
    """Where compiled decode steps are kept unless told: $XDG_CACHE_HOME/tiny-gpt, else ~/.cache/tiny-gpt."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                        "tiny-gpt")


def check_compile_cache(folder=None):
    """The compile cache folder as an absolute path (the default if None), made if missing and writable."""
    folder = os.path.abspath(folder or default_compile_cache())
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot make the compile cache folder {shown(folder)} ({e.strerror}); "
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


def step_sources(model, cache):
    """{file name: sha256} of the code a step runs outside torch (torch's own is its version): the files of
    the model's and the cache's classes and of their bases, and this one, whose StepProgram is exported."""
    classes = {c for obj in (*model.modules(), cache) for c in type(obj).__mro__}
    files = {inspect.getfile(c) for c in classes if c.__module__.partition(".")[0] not in ("torch", "builtins")}
    sources = {}
    for path in sorted(files | {__file__}):
        with open(path, "rb") as f:
            sources[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return sources


def step_keys(model, cache, ways):
    """{way: what the step compiled that way is valid for, as one sha256}: the weights, the model's config
    and classes, the cache's shape and dtype, the device and the machine, torch's version, the way (its
    options, the Linears' product among them) and the code compiled. Any of them changed, the key is
    another and the step is compiled anew. All but the way are read once for every way (the weights'
    hash reads them all)."""
    parts = dict(weights=weights_digest(model), config=repr(getattr(model, "cfg", None)),
                 modules=[f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()],
                 cache=cache.shape, dtype=str(cache.heads_k.dtype), device=str(cache.heads_k.device),
                 machine=machine_name(cache.heads_k.device), torch=torch.__version__,
                 sources=step_sources(model, cache))
    return {name: hashlib.sha256(json.dumps(parts | {"options": options}, sort_keys=True, default=repr).encode())
            .hexdigest() for name, options in ways.items()}


def step_key(model, cache, options):
    return step_keys(model, cache, {None: options})[None]


KEY_FIELD = "tiny_gpt_step_key"  # the key a package was compiled for, in its own metadata


def package_path(folder, key):
    return os.path.join(folder, f"decode-step-{key[:40]}.pt2")


def load_package(package, key):
    """The compiled step in `package` (a path or a buffer), or why it cannot serve for `key`: a damaged file
    (its zip checksums; a flipped bit in the weights would otherwise load and run), or a package made for
    another key (another model's, or another batch's, renamed)."""
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


class GraphCache(KVCache):
    """A KVCache that a graph-safe step can write: one token per row, each row at its own position
    given as a (B,) tensor, nothing read on the host (what an exported program and a CUDA graph need).
    Attention reads the first n slots, n the length of `attended` (the slots' numbers, every slot
    unless set), and a mask hides any slot a row has not written yet: DecodeStep sets n to the slots
    written so far, so a step early in a generation does not read the empty rest."""

    def __init__(self, batch, n_layers, max_len, n_kv_heads, head_dim, context=None, dtype=torch.float32,
                 device="cpu"):
        assert context is None or max_len <= context, "a cache longer than the context"
        super().__init__(batch, n_layers, 0, n_kv_heads, head_dim, context or max_len, dtype, device)
        # KVCache's storage, made here with one slot more than the ring, never written or read: the first
        # n slots are then never the whole storage, which torch.export would otherwise make a case of its
        # own (n == max_len) instead of one compiled step for every n.
        stored = (n_layers, batch, n_kv_heads, max_len + 1, head_dim)
        self.heads_k, self.heads_v = (torch.zeros(stored, dtype=dtype, device=device)[:, :, :, :max_len]
                                      for _ in range(2))
        self.k, self.v = self.heads_k.transpose(2, 3), self.heads_v.transpose(2, 3)
        self.layer_ids, self.rows, self.slots = (torch.arange(n, device=device) for n in (n_layers, batch, max_len))
        self.attended = self.slots

    def insert_kv(self, layer, k, v, start):
        if isinstance(start, int):
            return super().insert_kv(layer, k, v, start)
        B, L, n = k.shape[0], self.heads_k.shape[3], self.attended.shape[0]
        # written through heads_k itself, not a view of one layer: compiled, a write into a view
        # becomes a copy of the whole cache every step
        layer_id, slot = self.layer_ids[layer:layer + 1], start % L
        self.heads_k[layer_id, self.rows, :, slot] = k[:, :, 0]
        self.heads_v[layer_id, self.rows, :, slot] = v[:, :, 0]
        if layer == self.heads_k.shape[0] - 1:
            self.cache_seqlens += 1
        mask = (self.attended <= start.view(B, 1)).view(B, 1, 1, n)
        return self.heads_k[layer][:, :, :n], self.heads_v[layer][:, :, :n], mask


class StepProgram(nn.Module):
    """model.step as a function of the cache's tensors, what torch.export needs: a tensor the step only
    held would be exported as a constant of the program, and its writes would land in a copy."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, token, heads_k, heads_v, cache_seqlens, attended):
        cache = copy.copy(self.cache)  # the same cache, its stored tensors the program's inputs
        cache.heads_k, cache.heads_v, cache.cache_seqlens, cache.attended = heads_k, heads_v, cache_seqlens, attended
        cache.k, cache.v = heads_k.transpose(2, 3), heads_v.transpose(2, 3)
        return self.model.step(token, cache, cache_seqlens.long())


def choice_path(folder, keys):
    """Where the measured times of the compiled ways whose packages have these keys are kept."""
    return os.path.join(folder, f"decode-step-ways-{hashlib.sha256(' '.join(keys).encode()).hexdigest()[:40]}.json")


def read_choice(path, ways):
    """{way: ms a step} as measured here before for these packages, or {} if none is kept (or it is not
    readable as one: then the ways are timed again, and the file left as it is)."""
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return {}
    good = isinstance(kept, dict) and set(kept) == set(ways) and all(
        isinstance(ms, (int, float)) and 0 < ms < float("inf") for ms in kept.values())
    return kept if good else {}


def keep_choice(path, way_ms):
    try:
        with atomic_write(path, "w") as f:
            json.dump(way_ms, f)
    except FileExistsError:  # another run kept its own measurement first, or an unreadable file is there
        pass


def say(message):
    print(f"{os.path.basename(sys.argv[0]) or 'python'}: {message}", file=sys.stderr)


class DecodeStep:
    """model.step for one token per row, graph-safe, optionally compiled and/or captured as a CUDA graph.

    Each row's position is read from cache_seqlens on the device and the cache is written in place,
    so a step needs no Python-side state: what an exported program (one graph, the cache's tensors its
    inputs) and a CUDA graph (replayed with no host work, its token a static buffer) both need. The
    slots a step reads, the cache's `attended`, are the program's one input whose size changes: from
    one slot to the whole ring, the same compiled program.

    compile: the step compiled ahead of time by AOTInductor each of the compile_ways for this device and
    batch (or each of `ways` given, {name: options as in COMPILE_WAYS}), each kept as a package in the folder
    compile_cache
    (default: default_compile_cache()) under its step_key, and loaded from there when a package for
    the same key is kept: no compiling, and no dynamo guards on each step. With more than one way,
    each is timed side by side here and the fastest runs (self.way says which, self.way_ms what each
    took); the times are kept beside the packages (choice_path), so a later step for the same
    packages loads only the faster one. self.loaded says whether every package was loaded,
    self.package where the one that runs is kept, compile_seconds what making the step ready took.
    A package that cannot be loaded, or is not its key's, is said in one line on stderr, left as it
    is, and the step compiled anew; either way the step's first logits are checked against the
    eager step's.
    capture (CUDA only): replay a captured graph of the step.
    """

    def __init__(self, model, cache, compile=False, capture=False, ways=None, compile_cache=None):
        self.model, self.cache = model, cache
        self.token = torch.zeros(cache.shape["batch"], 1, dtype=torch.long, device=cache.k.device)
        self.run, self.graph, self.compile_seconds = self._step, None, 0.0
        self.loaded, self.package, self.way, self.way_ms = False, None, None, {}
        if compile:
            started = time.perf_counter()
            self.run = self._compiled(ways, check_compile_cache(compile_cache))
            self._rehearse(self.run)  # a loaded package prepares its weights on its first calls: not in a timing
            self._check_against_eager()
            self.compile_seconds = time.perf_counter() - started
        if capture:
            self._rehearse(self._capture)

    def _step(self):
        return self.model.step(self.token, self.cache, self.cache.cache_seqlens.long())

    def _compiled(self, ways, folder):
        """The compiled step that runs: the only way, or the fastest of the ways here."""
        model, cache = self.model, self.cache
        int8 = any(isinstance(m, Int8Linear) for m in model.modules())
        ways = ways or compile_ways(cache.k.device, cache.shape["batch"], int8)
        keys = step_keys(model, cache, ways)
        choice = choice_path(folder, list(keys.values()))
        self.way_ms = read_choice(choice, ways) if len(ways) > 1 else {}
        if self.way_ms:  # measured here before, for these very packages: only the faster is loaded
            ways = {name: o for name, o in ways.items() if name == min(self.way_ms, key=self.way_ms.get)}
        made = {name: self._kept_or_compiled(dict(o), keys[name], folder) for name, o in ways.items()}
        self.loaded = all(loaded for _, _, loaded in made.values())
        # each runner's own loader: AOTICompiledModel's call parses its input and output specs every step
        runs = {name: lambda loader=runner.loader: loader.boxed_run(self._inputs())[0]
                for name, (runner, _, _) in made.items()}
        if len(runs) > 1:
            self.way_ms = self._time_ways(runs)
            keep_choice(choice, self.way_ms)
        self.way = min(self.way_ms, key=self.way_ms.get) if self.way_ms else next(iter(runs))
        self.package = made[self.way][1]
        if self.way_ms:
            times = ", ".join(f"{name} {ms:.3f} ms" for name, ms in self.way_ms.items())
            measured = "timed here" if len(runs) > 1 else f"as timed here before ({shown(choice)})"
            say(f"the compiled decode step for {cache.shape['batch']} rows, {measured}: {times} a step; "
                f"running {self.way}")
        return runs[self.way]

    def _kept_or_compiled(self, way, key, folder):
        """(runner, package path, whether it was loaded) for the step compiled `way` (a COMPILE_WAYS entry)
        under `key` (its step_keys): loaded where a package is kept for the key, else compiled and kept."""
        path = package_path(folder, key)
        rows = f"the compiled decode step for {self.cache.shape['batch']} rows"
        if os.path.lexists(path):
            runner, unusable = load_package(path, key)
            if runner is not None:
                say(f"{rows}: loaded from {shown(path)}")
                return runner, path, True
            say(f"{rows}: {shown(path)} cannot be used ({unusable}); compiling anew and leaving that "
                "file as it is (delete it to keep the new one there)")
        # a kept step loads without a C++ compiler; only compiling needs one
        check_compiler(self.cache.k.device, f"or run without compiling (no compiled step is kept at {shown(path)})")
        say(f"{rows}: compiling (a minute or so), to keep in {shown(path)}")
        package = io.BytesIO()
        with torch.no_grad(), warnings.catch_warnings():
            # raised by torch.export and by inductor's autotuner about their own internals
            warnings.filterwarnings("ignore", "TypedStorage is deprecated")
            warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            options = {name: value for name, value in way.items() if name not in WAY_FIELDS}
            torch._inductor.aoti_compile_and_package(self.exported(way), package_path=package,
                                                     inductor_configs={**options, "aot_inductor.metadata": {KEY_FIELD: key}})
        try:
            with atomic_write(path) as f:
                f.write(package.getbuffer())
        except FileExistsError:  # another run kept this key's package first, or a file unusable here is there
            pass
        runner, unusable = load_package(package, key)
        if runner is None:
            raise RuntimeError(f"{rows} was compiled but cannot be loaded ({unusable})")
        return runner, path, False

    def exported(self, way):
        """The step as torch.export makes it for `way` (a COMPILE_WAYS entry): one program for every number
        of slots attended, exported at half of them (inductor tunes its kernels for the example's sizes,
        and at all of them it made a step that reads them all)."""
        slots = self.cache.shape["max_len"]
        example = (*self._inputs()[:-1], self._half_the_slots())
        attended = {0: torch.export.Dim("attended", min=1, max=slots)} if slots > 1 else None
        with COMPILED_ATTENTION[way["attention"]]() if "attention" in way else contextlib.nullcontext():
            return torch.export.export(StepProgram(way_model(self.model, way), self.cache), example,
                                       dynamic_shapes=(None, None, None, None, attended), strict=False)

    def _time_ways(self, runs, steps=10, rounds=5):
        """{name: ms a step} for each compiled way, the ways taking turns and the least disturbed round kept
        (least_disturbed, as the kernels are timed), after two calls each (a loaded package prepares its weights on
        its first calls), each step attending to half the ring's slots, as one mid-way through a generation
        that fills it does; the steps write into the cache, which is put back after."""
        with self._cache_put_back():
            self.cache.attended = self._half_the_slots()
            for run in runs.values():
                run(), run()
            seconds = least_disturbed(runs, self.cache.k.device, rounds, steps)
        return {name: t * 1e3 for name, t in seconds.items()}

    def _half_the_slots(self):
        """The first half of the ring's slots (at least two, if it has them; a length of 1 would make
        torch.export take it for a constant)."""
        slots = self.cache.shape["max_len"]
        return self.cache.slots[:min(slots, max(2, slots // 2))]

    def _inputs(self):
        return [self.token, self.cache.heads_k, self.cache.heads_v, self.cache.cache_seqlens, self.cache.attended]

    def _check_against_eager(self):
        """Refuse a compiled step whose first step is not the eager one's, in its logits or in the cache it
        wrote (a program whose writes landed in a copy would give the eager logits once, then drift)."""
        compiled, eager = self._rehearse(self.run), self._rehearse(self._step)
        # compiled and eager sum in other orders: as close as two float32 forwards, or a few bfloat16 steps
        share = 1e-3 if self.cache.heads_k.dtype == torch.float32 else 5e-2
        for got, want in zip(compiled, eager):
            if got.shape != want.shape or not (got.double() - want.double()).abs().max().item() <= share * max(
                    1.0, want.double().abs().max().item()):
                raise RuntimeError(f"the compiled decode step ({shown(self.package)}) does not compute what the "
                                   "eager step does; delete that file and run again")

    @contextlib.contextmanager
    def _cache_put_back(self):
        """After the block, the cache as it was before it, the slots it attends to included (rehearsals and
        timings must not count as steps)."""
        live = (self.cache.k, self.cache.v, self.cache.cache_seqlens)
        saved, attended = [t.clone() for t in live], self.cache.attended
        try:
            yield live
        finally:
            for t, kept in zip(live, saved):
                t.copy_(kept)
            self.cache.attended = attended

    def _rehearse(self, fn):
        """Run fn, then put the cache back as it was; returns what fn returned and the cache it left."""
        with self._cache_put_back() as live:
            out = fn()
            return [out.clone() if out is not None else None] + [t.clone() for t in live]

    def _capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up runs, which capture requires, on a side stream
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.run()

    def __call__(self, token, pos):
        """Feed token (B, 1) at position pos, every row's (each row's own lives on the device, in
        cache_seqlens); returns logits (B, vocab). The step attends to the slots written by then, pos + 1
        or the whole ring, and a captured graph to every slot, as it was captured."""
        if self.graph is None:
            self.token, self.cache.attended = token, self.cache.slots[:pos + 1]
            return self.run()
        self.token.copy_(token)  # a captured graph reads the tensor it was captured with
        self.graph.replay()
        return self.logits


class FastEngine(Engine):
    """prefill_clone's Engine with its decode step made fast from outside.

    kernel: the decode steps' matrix multiply: "auto" measures the exact candidates once per batch size
    where this runs and keeps the fastest (self.chosen says which); a name fixes it. compile: the
    graph-safe decode step compiled ahead of time, once per batch size, and kept in the folder
    compile_cache, so a later Engine with the same weights loads it in seconds (DecodeStep says
    how; inductor picks the kernels; self.compile_seconds says what making it ready took, and
    self.steps[batch].loaded whether it was loaded); its cache is the full context, so one
    compiled step serves every prompt and length. cuda_graph: replay each decode step as a CUDA graph (on a CPU the same
    graph-safe step runs eagerly); with compile on CUDA the compiled step is what is captured.
    dtype: float32, or bfloat16 (float16 on CUDA) for a copy of the weights and the cache; int8 for
    int8 copies of the Linear weights, quantized here, once (quantized()), with the embedding, the
    activations and the cache float32, the kernel chosen among INT8_KERNELS.
    """

    def __init__(self, model, tokenizer=None, kernel="auto", compile=False, dtype=torch.float32, cuda_graph=False,
                 fill=clone_prompt, compile_cache=None):
        device = model.emb.weight.device
        dtype = check_dtype(dtype, device)
        if kernel != "auto":
            kernel_named(kernel, device, dtype)
            if compile:
                raise ValueError(f"kernel {kernel!r} with compile=True: inductor picks the compiled step's kernels; "
                                 "leave kernel='auto'")
        if dtype == torch.int8:
            ready = quantized(model)
        else:
            ready = model if model.emb.weight.dtype == dtype else copy.deepcopy(model).to(dtype)
        super().__init__(ready, tokenizer, fill)
        # a bfloat16 or int8 copy, or a compiled step with frozen weights, would keep running the weights of now
        self.source, self.weights = model, weights_state(model)
        self.kernel, self.compile, self.cuda_graph, self.dtype = kernel, compile, cuda_graph, dtype
        self.compile_cache = compile_cache
        # a compiled or graphed step is made once per batch and kept; its cache holds the full context
        # and it reads the slots written so far (a graph: all of them, behind a mask), so one of them
        # serves every prompt and length
        self.keeps_step = compile or cuda_graph
        self.chosen, self.kernel_models, self.steps, self.compile_seconds = {}, {}, {}, {}  # keyed by batch

    def kernel_model(self, batch):
        """self.model with its products run by the kernel measured fastest for `batch` rows (or fixed)."""
        if batch not in self.kernel_models:
            self.chosen[batch] = choose(self.model, batch)[0] if self.kernel == "auto" else self.kernel
            name, device = self.chosen[batch], self.model.emb.weight.device
            self.kernel_models[batch] = self.model if name == "nn" else with_kernel(
                self.model, kernel_named(name, device, self.dtype))
        return self.kernel_models[batch]

    def cache_len(self, n_prompt, max_tokens):
        return self.model.cfg.context if self.keeps_step else super().cache_len(n_prompt, max_tokens)

    def decoder(self, batch, max_len):
        """An empty cache of `batch` rows and the decode step that writes it: a graph-safe step and
        its cache are made once per batch and kept (compiling or capturing costs more than a run)."""
        self.check_unchanged()
        if not self.keeps_step:
            model, cache = self.kernel_model(batch), KVCache.for_model(self.model, batch, max_len)
            return cache, lambda token, pos: model.step(token, cache, pos)
        if batch not in self.steps:
            cache = GraphCache.for_model(self.model, batch, max_len)
            model = self.model if self.compile else self.kernel_model(batch)
            self.steps[batch] = DecodeStep(model, cache, self.compile, capture=cache.k.device.type == "cuda",
                                           compile_cache=self.compile_cache)
            self.compile_seconds[batch] = self.steps[batch].compile_seconds
        step = self.steps[batch]
        step.cache.reset()
        return step.cache, step

    def pick(self, logits, history, generators, settings):
        """The Engine's pick, all rows in one call where they share their knobs (as they mostly do): the
        same tokens, without a group's gather and scatter, which cost more than the pick at one row."""
        if any(knobs != settings[0] for knobs in settings):
            return super().pick(logits, history, generators, settings)
        return sampling.pick(logits, history=history, generator=generators, **settings[0])

    def check_unchanged(self):
        """Refuse to run once the model's weights changed after this Engine was made: its bfloat16 copy,
        or a compiled step with the weights frozen in, would go on running the old ones."""
        now = weights_state(self.source)
        if len(now) != len(self.weights) or any(p is not q or v != w for (p, v), (q, w) in zip(self.weights, now)):
            raise ValueError("the model's weights changed after this Engine was made (its decode step or its copy "
                             "holds the old ones); make a new Engine for the new weights")

    @torch.inference_mode()
    def prepare(self, batch):
        """Do now what the first generate of `batch` rows would do before its first token: measure the
        matrix multiplies, or make the kept decode step (compiling takes a minute or so, loading a
        kept one seconds). Returns the seconds making the compiled step ready took, 0 if not compiled;
        a script calls it before anything it times or shows an ETA for."""
        check_request(self, [0], batch, 1, 0, None, None, {})  # as the smallest generate of `batch` rows would be
        if self.keeps_step:
            self.decoder(batch, self.model.cfg.context)
        else:
            self.kernel_model(batch)
        return self.compile_seconds.get(batch, 0.0)


def main():
    ap = Parser(description="Time every exact kernel for a decode step's matrix multiplies; keep the fastest.")
    ap.add_argument("device", nargs="?", default="cpu", help="cpu or cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="rows per step")
    args = ap.parse_args()
    if min(args.batches) < 1:
        raise ValueError(f"--batches must be whole numbers >= 1, got {args.batches}")
    from cached import CachedGPT
    device = device_from(args.device)
    model = CachedGPT().to(device).eval()
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for batch in args.batches:  # time_kernels holds every layer's input rows, and each product's output, at once
        rows_bytes = batch * sum(layer.in_features + layer.out_features for layer in layers) * 4
        check_fits(rows_bytes, f"--batches {batch} (a step's inputs and outputs)", device)
    for batch in args.batches:
        winner, measured = choose(model, batch)
        cells = ", ".join(f"{n} {'not exact' if t is None else f'{t * 1e3:.2f} ms'}" for n, t in measured.items())
        print(f"batch {batch}: {cells}; fastest: {winner}")


if __name__ == "__main__":
    run_cli(main)
