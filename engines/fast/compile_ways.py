"""The ways a decode step is compiled, and the C++ compiler inductor needs for them on a CPU."""
import functools
import os
import shutil
import subprocess
import tempfile

from engines.edge.cli import first_line
from engines.edge.errors import BadValue

import torch
import torch.nn.functional as F

from engines.fast.int8 import dot_products
from engines.fast.matmul import with_kernel


def compiler_missing(device):
    """Why torch.compile cannot run on `device` here, or None. On a CPU inductor builds its kernels with
    the first C++ compiler of its config.cpp.cxx that runs: $CXX if set, else g++ (clang++ on a Mac). A
    file of that name is not proof: the first one found must compile a line of C++ (compiles())."""
    if torch.device(device).type != "cpu":
        return None
    names = torch._inductor.config.cpp.cxx
    names = [names] if isinstance(names, str) else [name for name in names if name]
    found = next((shutil.which(name) for name in names if shutil.which(name)), None)
    if found is None:
        return (f"compiling on the CPU needs the C++ compiler inductor builds its kernels with "
                f"({' or '.join(names)}), and there is none here; install one (apt-get install g++) or name one in CXX")
    if why := compiles(found):
        return (f"compiling on the CPU needs a C++ compiler that works, and {found} does not ({why}); "
                "install one (apt-get install g++) or name one in CXX")
    return None


@functools.cache
def compiles(compiler):
    """Why `compiler` fails to compile a line of C++ to an object file, or None."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            run = subprocess.run([compiler, "-x", "c++", "-c", "-o", os.path.join(folder, "probe.o"), "-"],
                                 input="int probe() { return 0; }\n", capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return first_line(e)
    return None if run.returncode == 0 else first_line(run.stderr or f"exit status {run.returncode}")


def check_compiler(device, otherwise="or leave out --compile"):
    if reason := compiler_missing(device):
        raise BadValue(f"{reason}, {otherwise}")


# The ways a decode step is compiled, and the one kept is measured where it runs: "autotuned" freezes the
# weights into the graph as constants, which lets max_autotune try its own C++ matrix multiplies (weights
# packed, every core used) against ATen's, timed where it compiles (the last two options keep the
# autotuner's tables off stderr); "plain" is inductor's default, ATen's multiplies on the weights as they
# are; "dot products" exports every nn.Linear as
# dot_products, and its two options keep inductor from computing the input (a layer norm, say) again inside
# every output's loop: it is stored once and read; "autotuned, attention as math" is autotuned with the
# attention exported as its arithmetic (attention_as_math), which inductor fuses with the rest, where ATen's
# flash attention for one query per row costs more than the arithmetic. Besides inductor's options, a way
# may name the product its Linears are exported with ("linears", one of COMPILED_LINEARS), its attention
# ("attention": "math") and the most rows it is worth compiling for ("max_rows": past one row, dot
# products are several times slower; at one row, they beat every other product). Which way is fastest
# depends on the CPU and the rows, so DecodeStep compiles (or loads) each and times them side by side on the
# machine it runs on (bench.py table 3 shows the figures). AOTInductor calls the graph from C++.
COMPILED_LINEARS = {"dot_products": dot_products}
WAY_FIELDS = ("linears", "attention", "max_rows")  # a way's own; the rest are inductor's options
DOT_PRODUCTS, ATTENTION_AS_MATH = "dot products", "autotuned, attention as math"
AUTOTUNED = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
             "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
COMPILE_WAYS = {"cpu": {"autotuned": AUTOTUNED,
                        "plain": {},
                        DOT_PRODUCTS: {"linears": "dot_products", "max_rows": 1,
                                       "realize_cpu_opcount_threshold": 0, "realize_reads_threshold": 1},
                        ATTENTION_AS_MATH: {**AUTOTUNED, "attention": "math"}},
                "cuda": {"plain": {}}}


def compile_ways(device, batch):
    """COMPILE_WAYS for this device that are worth compiling for `batch` rows. int8 weights are frozen
    too: they reach torch._int_mm as they are, so the program keeps them int8 (a weight made float for its
    product would be folded into a float32 copy)."""
    return {name: way for name, way in COMPILE_WAYS[device.type].items() if batch <= way.get("max_rows", batch)}


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
