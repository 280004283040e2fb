"""int8 with int8 products: each Linear's weight quantized once, one scale per output channel, and each
row of activations quantized as it comes, one scale a row; int8 x int8 summed in int32, the scales after.

llama.cpp's q8_0 quantizes the activations too and multiplies int8 by int8 (VNNI and AMX do that in
hardware); gpt-fast's weight-only int8 makes the weight float again and multiplies in float, which a CPU
without AMX runs slower than float32 (docs/speed.md). Int8Linear keeps the int8 weight, its scales and
the layer's own float32 bias; the cache and everything between the Linears stay float32. Its two products
(INT8_KERNELS) give the same integer sums, so which runs (timed in engines/fast/matmul.py) never moves a token;
dot_products is the product the compiled "dot products" way exports.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


def quantize_per_channel(weight):
    """Symmetric int8, one float32 scale per row: a weight's output channels, once, or a step's rows of
    activations, as they come. Each row is close to int8 x scale, each value within half a scale step (the
    row's largest maps to 127.5, kept at 127 or -128)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.5).clamp(min=torch.finfo(torch.float32).eps)
    return torch.clamp(torch.round(w / scales[:, None]), -128, 127).to(torch.int8), scales


def scaled(layer, sums, row_scales):
    """The int32 (or whole-number float) sums of int8 rows by int8 weights back in float32: each row's
    scale, each output channel's, then the layer's bias."""
    out = sums.float() * (row_scales[:, None] * layer.scales)
    return out if layer.bias is None else out + layer.bias


def int_mm(layer, rows):
    """The rows quantized, then torch._int_mm: int8 x int8 with int32 sums (oneDNN's kernel on a CPU: VNNI
    or AMX where the CPU has them). On CPUs only: CUDA's kernel refuses 16 rows or fewer, and a decode step
    has no more there than here."""
    q, row_scales = quantize_per_channel(rows)
    return scaled(layer, torch._int_mm(q, layer.weight.t()), row_scales)


def float_sums(layer, rows):
    """The same products as int_mm, summed in float32: every partial sum a whole number, exact below 2^24
    (1,024 inputs of -128 x -128), so the same outputs as int_mm wherever it runs, on any device."""
    q, row_scales = quantize_per_channel(rows)
    return scaled(layer, F.linear(q.float(), layer.weight.float()), row_scales)


INT8_KERNELS = {"int_mm": int_mm, "float sums": float_sums}


def dot_products(layer, rows):
    """Each output as the dot product of its weight row with the input row, written as a multiply and a
    sum. Compiled, inductor makes it one loop per output that reads each weight once (an int8 one as it
    is); eager, it would first make the whole (rows, out, in) product, so it is compiled only (the
    "dot products" way of COMPILE_WAYS), and only for one row: each further row reads every weight again.
    An Int8Linear's rows are quantized first (float_sums' products, in another order: the same sums)."""
    if not isinstance(layer, Int8Linear):
        out = (rows[:, None, :] * layer.weight).sum(-1)
        return out if layer.bias is None else out + layer.bias
    q, row_scales = quantize_per_channel(rows)
    return scaled(layer, (q[:, None, :].float() * layer.weight).sum(-1), row_scales)


class Int8Linear(nn.Module):
    """An nn.Linear with its weight quantized once (quantize_per_channel): int8 weight, float32 scales and
    the layer's own float32 bias. Its rows are quantized as they come and multiplied in int8: int_mm on a
    CPU, float_sums elsewhere (the same outputs)."""

    def __init__(self, layer):
        super().__init__()
        weight, scales = quantize_per_channel(layer.weight)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.bias, self.in_features, self.out_features = layer.bias, layer.in_features, layer.out_features

    def forward(self, x):
        product = int_mm if self.weight.device.type == "cpu" else float_sums
        return product(self, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


def replacing_linears(module, replace):
    """A copy of the module tree with replace(layer) in place of each nn.Linear (or Int8Linear) layer,
    in the layer's mode (a new module starts in training mode, which the Engine refuses)."""
    if isinstance(module, (nn.Linear, Int8Linear)):
        return replace(module).train(module.training)
    tree = copy.copy(module)
    tree._modules = {name: replacing_linears(child, replace) for name, child in module._modules.items()}
    return tree


def quantized(module):
    """A copy of the module tree whose nn.Linear layers hold int8 weights (Int8Linear), the rest the
    model's own. The head is quantized like every other Linear; the embedding it is tied to stays float32,
    so a token's lookup is exact and only the products read int8."""
    return replacing_linears(module, Int8Linear)
