"""kernels.py: every candidate computes nn.Linear's product; only an exact one can be chosen, once per batch."""
import os
import subprocess
import sys

import pytest
import torch

import kernels
from cached import CachedGPT
from cli import run_cli
from kernels import KERNELS, FastEngine, KernelLinear, choose, measure, with_kernel
from model import Config

SMALL = Config(vocab_size=512, d_model=64, n_heads=4, n_layers=2, context=32)


def float64_product(layer, x):
    """rows @ W.T + b in float64: a reference that shares no code with any kernel."""
    out = x.double() @ layer.weight.double().T
    return (out if layer.bias is None else out + layer.bias.double()).float()


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [True, False], ids=["mlp, with bias", "qkv, no bias"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_every_kernel_computes_the_product_through_the_models_linear(name, bias, rows):
    if not kernels.runs_here(name, torch.device("cpu"), torch.float32):
        pytest.skip(f"kernel {name!r} needs a library this torch build lacks")
    torch.manual_seed(0)
    block = CachedGPT(SMALL).eval().blocks[0]
    layer = block.mlp[0] if bias else block.attn.qkv
    x = torch.randn(rows, 1, layer.in_features)
    with torch.inference_mode():
        got = KernelLinear(layer, KERNELS[name])(x)
    assert got.shape == (rows, 1, layer.out_features) and got.is_contiguous()
    torch.testing.assert_close(got, float64_product(layer, x), rtol=1e-5, atol=1e-5)


def test_a_kernels_reordered_weight_follows_the_weight_when_it_changes():
    torch.manual_seed(0)
    layer = CachedGPT(SMALL).blocks[0].mlp[2]
    x = torch.randn(2, layer.in_features)
    fast = KernelLinear(layer, KERNELS["transposed"])
    with torch.no_grad():
        fast(x)
        layer.weight.mul_(2)  # what an optimizer step does: in place
        torch.testing.assert_close(fast(x), float64_product(layer, x), rtol=1e-5, atol=1e-5)


def test_a_kernel_runs_on_a_copy_of_the_tree_that_shares_the_weights_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = CachedGPT(SMALL).eval()
    fast = with_kernel(model, KERNELS["transposed"])
    assert all(type(m) is torch.nn.Linear for m in model.modules() if "Linear" in type(m).__name__)
    assert [p.data_ptr() for p in fast.parameters()] == [p.data_ptr() for p in model.parameters()]
    idx = torch.randint(SMALL.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(fast(idx)[0], model(idx)[0], rtol=1e-5, atol=1e-5)


def test_a_fast_kernel_that_is_not_exact_is_never_chosen(monkeypatch):
    model = CachedGPT(SMALL).eval()
    wrong = lambda layer, rows: torch.zeros(rows.shape[0], layer.out_features)  # fastest, and wrong
    monkeypatch.setitem(KERNELS, "wrong", wrong)
    monkeypatch.setattr(kernels, "CHOSEN", {})
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    measured = measure(layers, 2)
    assert measured["wrong"] is None and all(t > 0 for n, t in measured.items() if n != "wrong")
    assert choose(model, 2)[0] not in ("wrong", None)


def test_where_no_kernel_is_exact_nn_linear_is_chosen(monkeypatch):
    """A model whose products overflow in every kernel: nn.Linear is then what the model itself computes."""
    monkeypatch.setattr(kernels, "exact", lambda *args: False)
    monkeypatch.setattr(kernels, "CHOSEN", {})
    name, measured = choose(CachedGPT(SMALL).eval(), 2)
    assert name == "nn" and all(t is None for t in measured.values())


def test_the_choice_is_measured_once_per_batch_and_kept(monkeypatch):
    model = CachedGPT(SMALL).eval()
    monkeypatch.setattr(kernels, "CHOSEN", {})
    calls = []
    real = kernels.measure
    monkeypatch.setattr(kernels, "measure", lambda layers, batch: calls.append(batch) or real(layers, batch))
    first = [choose(model, b) for b in (1, 4, 1, 4)]
    assert calls == [1, 4] and first[0] == first[2] and first[1] == first[3]
    assert "twice" in first[0][1] and "twice" not in first[1][1]  # the lone-row kernels only for a lone row


def test_cli_prints_each_kernel_and_the_fastest_and_refuses_a_bad_batch_in_one_line():
    run = subprocess.run([sys.executable, "kernels.py", "cpu", "--batches", "2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("batch 2: nn ") and "fastest: " in run.stdout
    run = subprocess.run([sys.executable, "kernels.py", "--batches", "0"], capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.strip() == "kernels.py: error: --batches must be whole numbers >= 1, got [0]"


def test_a_batch_too_large_for_memory_is_refused_before_any_row_is_allocated(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--batches", "2", "3000000"])
    monkeypatch.setattr("cli.free_memory", lambda device: 2**30)
    monkeypatch.setattr(kernels, "measure", lambda *args: pytest.fail("measured before the size check"))
    with pytest.raises(SystemExit) as exit:
        run_cli(kernels.main)
    assert exit.value.code.startswith("kernels.py: error: --batches 3000000 (a step's inputs and outputs) needs ")
    assert len(exit.value.code.splitlines()) == 1


def test_compiling_without_a_cpp_compiler_is_refused_in_one_line_before_anything_compiles(monkeypatch):
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (None, "no-such-c++"))
    assert "C++ compiler inductor builds its kernels with (no-such-c++)" in kernels.compiler_missing("cpu")
    with pytest.raises(ValueError, match=r"\(no-such-c\+\+\), and there is none here; install one "
                                         r"\(apt-get install g\+\+\) or name one in CXX, or make the Engine "
                                         r"without compile=True"):
        FastEngine(CachedGPT(SMALL).eval(), compile=True).generate_batch([1, 2], 2, max_tokens=3)
    run = subprocess.run([sys.executable, "sample_grid.py", "--compile"], capture_output=True, text=True,
                         env={**os.environ, "CXX": "no-such-c++"})
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith("sample_grid.py: error: compiling on the CPU needs the C++ compiler")
    assert len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("batch, message", [
    (0, "num_samples must be a whole number >= 1"), (-1, "num_samples -1 is outside"), (2.0, "is not an integer id"),
    (10**9, "a cache of 1000000000 rows"), ("train", "training mode"), ("plain GPT", "needs a CachedGPT"),
], ids=["zero", "negative", "float", "beyond-memory", "training-mode", "plain-gpt"])
def test_prepare_refuses_what_a_generate_of_that_many_rows_would_before_allocating(batch, message):
    from model import GPT
    model = (GPT if batch == "plain GPT" else CachedGPT)(SMALL).eval()
    if batch == "train":
        model.blocks[0].train()
    with pytest.raises(ValueError, match=message):
        FastEngine(model).prepare(batch if isinstance(batch, (int, float)) else 1)
