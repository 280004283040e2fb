"""The decode step's matrix multiply: every exact candidate timed where it runs, the fastest kept.

A decode step multiplies a few rows by each of the model's 25 weight matrices
(4 per block, and the head). Every kernel here computes what nn.Linear does,
rows @ W.T + b, but which one is fastest depends on the CPU's BLAS and the
number of rows. So nothing is hard-coded: choose() times every candidate that
runs on this device, dtype and batch, refuses any whose output is not
nn.Linear's (within 1e-5 in float32), and keeps the fastest, once per
(batch, device, dtype, shapes); int8 weights have candidates of their own
(engines/fast/int8.py), measured alike. Only candidates that won somewhere on the
CPUs this repo meets are kept (docs/bench.md: the eager products kept).

    python -m engines.fast.matmul [cpu|cuda] [--batches 1 16]

prints what each candidate took for one step's 25 multiplies and which won.
"""
import weakref

from engines.edge.cli import Parser, check_fits, device_from, run_cli
from engines.edge.errors import BadValue

import torch
import torch.nn as nn
import torch.nn.functional as F

from cached import CachedGPT
from engines.fast.int8 import INT8_KERNELS, Int8Linear, float_sums, replacing_linears
from bench import median
from engines.edge.timing import timings


PREPARED = weakref.WeakKeyDictionary()  # layer -> {kernel name: (weight version, reordered weight)}


def prepared(layer, name, reorder):
    """layer.weight reordered for a kernel (packed), kept until the weight changes."""
    kept = PREPARED.setdefault(layer, {})
    w = layer.weight
    version = (w.data_ptr(), 0 if w.is_inference() else w._version)  # inference tensors keep no version
    if name not in kept or kept[name][0] != version:
        kept[name] = (version, reorder(layer.weight.detach()))
    return kept[name][1]


def nn_linear(layer, rows):
    return F.linear(rows, layer.weight, layer.bias)


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


# each kept because it was the fastest somewhere (docs/bench.md, "The eager products kept"): nn.Linear on an
# Intel Xeon with AMX at one row, mkl there at 16; split on an AMD EPYC at one row, onednn there at 16
KERNELS = {"nn": nn_linear, "mkl": mkl_packed, "onednn": onednn_packed, "split": split_rows}


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


def runs_here(name, device, dtype):
    """Whether a kernel exists for this device and dtype (the packed ones are CPU libraries; int8
    weights have kernels of their own)."""
    if (dtype == torch.int8) != (name in INT8_KERNELS):
        return False
    if name == "int_mm":  # torch._int_mm: CUDA's refuses a decode step's few rows
        return device.type == "cpu"
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
        raise BadValue(f"unknown kernel {name!r}; the kernels are {list(KERNELS)} ({list(INT8_KERNELS)} for "
                         "int8), or 'auto' to measure them")
    if not runs_here(name, device, dtype):
        raise BadValue(f"kernel {name!r} does not run on {device.type} in {str(dtype).removeprefix('torch.')}")
    return every[name]


def tolerance(dtype):
    """How far a kernel may be from nn.Linear: 1e-5 in float32, one rounding step in a half type."""
    return 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps


def exact(kernel, layers, inputs, reference=nn_linear):
    """Whether kernel gives the reference's output (nn.Linear's, or float_sums' for int8 weights) on
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
    int8 = w.dtype == torch.int8  # int8 weights take float32 rows, quantized as they come
    candidates, reference = (INT8_KERNELS, float_sums) if int8 else (KERNELS, nn_linear)
    gen = torch.Generator(w.device).manual_seed(0)
    rows_dtype = torch.float32 if int8 else w.dtype
    inputs = [torch.randn(batch, layer.in_features, generator=gen, device=w.device).to(rows_dtype) for layer in layers]
    names = [n for n in candidates if runs_here(n, w.device, w.dtype)]
    exact_ones = [n for n in names if exact(candidates[n], layers, inputs, reference)]
    timed = timings({n: lambda kernel=candidates[n]: [kernel(layer, rows) for layer, rows in zip(layers, inputs)]
                     for n in exact_ones}, rounds, w.device, label="matrix multiplies:")
    return {n: median(timed[n]) if n in timed else None for n in names}


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


def main():
    ap = Parser(description="Time every exact kernel for a decode step's matrix multiplies; keep the fastest.")
    ap.add_argument("device", nargs="?", default="cpu", help="cpu or cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="rows per step")
    args = ap.parse_args()
    if min(args.batches) < 1:
        raise BadValue(f"--batches must be whole numbers >= 1, got {args.batches}")
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
