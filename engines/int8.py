"""gpt-fast's weight-only int8: each nn.Linear's weight quantized once, one float32 scale per output channel.

Int8Linear keeps the int8 weight, its scales and the layer's own float32
bias; rows, products and the cache stay float32. Its products (dequantize,
ATen's int8pack) are timed like every other kernel in engines/matmul.py;
dot_products is the product the compiled "dot products" way exports.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


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
