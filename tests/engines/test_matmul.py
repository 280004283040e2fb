"""engines/fast/matmul.py and engines/fast/int8.py: every candidate computes nn.Linear's product; only an exact one can be chosen, once per batch."""
import zipfile

import pytest
import torch
import torch.nn.functional as F

from engines.fast import compile_ways
from engines.fast import engine as fast_engine
from engines.fast import int8
from engines.fast import matmul
import model as model_py
from cached import CachedGPT
from helpers import SMALL, assert_refused, run_main
from support import COMPILED_ROWS, command
from prefill_clone import Engine
from engines.fast.int8 import INT8_KERNELS, Int8Linear
from engines.fast.matmul import KERNELS, KernelLinear, choose, time_kernels, with_kernel
from engines.fast.engine import FastEngine


def float64_product(layer, x):
    """rows @ W.T + b in float64: a reference that shares no code with any kernel."""
    out = x.double() @ layer.weight.double().T
    return (out if layer.bias is None else out + layer.bias.double()).float()


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [True, False], ids=["mlp, with bias", "qkv, no bias"])
@pytest.mark.parametrize("name", [*KERNELS, *compile_ways.COMPILED_LINEARS])
def test_every_kernel_computes_the_product_through_the_models_linear(name, bias, rows):
    if name in KERNELS and not matmul.runs_here(name, torch.device("cpu"), torch.float32):
        pytest.skip(f"kernel {name!r} needs a library this torch build lacks")
    torch.manual_seed(0)
    block = CachedGPT(SMALL).eval().blocks[0]
    layer = block.mlp[0] if bias else block.attn.qkv
    x = torch.randn(rows, 1, layer.in_features)
    with torch.inference_mode():
        got = KernelLinear(layer, (KERNELS | compile_ways.COMPILED_LINEARS)[name])(x)
    assert got.shape == (rows, 1, layer.out_features) and got.is_contiguous()
    torch.testing.assert_close(got, float64_product(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mkl", "onednn"])  # the two that reorder the weight once, for their library
def test_a_kernels_reordered_weight_follows_the_weight_when_it_changes(name):
    if not matmul.runs_here(name, torch.device("cpu"), torch.float32):
        pytest.skip(f"{name} is not in this torch build")
    torch.manual_seed(0)
    layer = CachedGPT(SMALL).blocks[0].mlp[2]
    x = torch.randn(2, layer.in_features)
    fast = KernelLinear(layer, KERNELS[name])
    with torch.no_grad():
        fast(x)
        layer.weight.mul_(2)  # what an optimizer step does: in place
        torch.testing.assert_close(fast(x), float64_product(layer, x), rtol=1e-5, atol=1e-5)


def test_a_kernel_runs_on_a_copy_sharing_the_weights_and_leaves_the_model():
    torch.manual_seed(0)
    model = CachedGPT(SMALL).eval()
    fast = with_kernel(model, KERNELS["split"])
    assert all(type(m) is torch.nn.Linear for m in model.modules() if "Linear" in type(m).__name__)
    assert [p.data_ptr() for p in fast.parameters()] == [p.data_ptr() for p in model.parameters()]
    idx = torch.randint(SMALL.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(fast(idx)[0], model(idx)[0], rtol=1e-5, atol=1e-5)


def test_a_fast_kernel_that_is_not_exact_is_never_chosen(monkeypatch):
    model = CachedGPT(SMALL).eval()
    wrong = lambda layer, rows: torch.zeros(rows.shape[0], layer.out_features)  # fastest, and wrong
    monkeypatch.setitem(KERNELS, "wrong", wrong)
    monkeypatch.setattr(matmul, "CHOSEN", {})
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    measured = time_kernels(layers, 2)
    assert measured["wrong"] is None
    assert choose(model, 2)[0] not in ("wrong", None)


def test_where_no_kernel_is_exact_nn_linear_is_chosen(monkeypatch):
    """A model whose products overflow in every kernel: nn.Linear is then what the model itself computes."""
    monkeypatch.setattr(matmul, "exact", lambda *args: False)
    monkeypatch.setattr(matmul, "CHOSEN", {})
    name, measured = choose(CachedGPT(SMALL).eval(), 2)
    assert name == "nn" and all(t is None for t in measured.values())


def test_the_choice_is_measured_once_per_batch_and_kept(monkeypatch):
    model = CachedGPT(SMALL).eval()
    monkeypatch.setattr(matmul, "CHOSEN", {})
    calls = []
    real = matmul.time_kernels
    monkeypatch.setattr(matmul, "time_kernels", lambda layers, batch: calls.append(batch) or real(layers, batch))
    first = [choose(model, b) for b in (1, 4, 1, 4)]
    assert calls == [1, 4] and first[0] == first[2] and first[1] == first[3]


def test_cli_prints_each_kernel_and_the_fastest_and_refuses_a_bad_batch_in_one_line(monkeypatch, capsys):
    status, out, err = run_main(command(matmul.main), ["matmul.py", "cpu", "--batches", "2"], monkeypatch, capsys)
    assert status == 0, err
    assert out.startswith("batch 2: nn ") and "fastest: " in out
    run = run_main(command(matmul.main), ["matmul.py", "--batches", "0"], monkeypatch, capsys)
    assert_refused(run, "matmul.py: error: --batches must be whole numbers >= 1, got [0]")


def test_a_batch_too_large_for_memory_is_refused_before_any_row_is_allocated(monkeypatch, capsys):
    monkeypatch.setattr("engines.edge.cli.free_memory", lambda device: 2**30)
    monkeypatch.setattr(matmul, "time_kernels", lambda *args: pytest.fail("measured before the size check"))
    run = run_main(command(matmul.main), ["matmul.py", "--batches", "2", "3000000"], monkeypatch, capsys)
    assert_refused(run, "matmul.py: error: --batches 3000000 (a step's inputs and outputs) needs ")


def test_compiling_without_a_cpp_compiler_is_refused_before_anything_compiles(monkeypatch, capsys,
                                                                                          inductor_cxx):
    inductor_cxx("no-such-c++")
    assert "C++ compiler inductor builds its kernels with (no-such-c++)" in compile_ways.compiler_missing("cpu")
    with pytest.raises(ValueError, match=r"\(no-such-c\+\+\), and there is none here; install one "
                                         r"\(apt-get install g\+\+\) or name one in CXX, or run without "
                                         r"compiling \(no compiled step is kept at "):
        FastEngine(CachedGPT(SMALL).eval(), compile=True).generate_batch([1, 2], 2, max_tokens=3)
    run = run_main(command(fast_engine.main), ["engine.py", "--compile"], monkeypatch, capsys)
    assert_refused(run, "engine.py: error: compiling on the CPU needs the C++ compiler")
    assert run[1] == ""


def test_int8_quantization_keeps_every_weight_within_half_its_rows_scale_step():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen) * torch.logspace(-4, 1, 48)[:, None]  # rows of every size
    weight[3] = 0  # an all-zero row keeps a positive scale and comes back zero
    q, scales = int8.quantize_per_channel(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scales.shape == (48,) and (scales > 0).all()
    error = (q.float() * scales[:, None] - weight).abs() / scales[:, None]  # in steps of the row's scale
    assert error.max() <= 0.5 + 1e-4  # the margin: float32's rounding of values up to 128 steps
    largest = weight.abs().amax(dim=1)
    assert torch.allclose(scales[largest > 0], largest[largest > 0] / 127.5)  # each row's largest: 127.5 steps
    assert not (q[3]).any()


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["a key head a query head", "grouped-query"])
def test_attention_as_math_gives_sdpas_output_for_one_query_a_row_over_masked_slots(kv_heads):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 16, generator=gen)
    k, v = (torch.randn(3, kv_heads, 10, 16, generator=gen) for _ in range(2))
    mask = (torch.arange(10) <= torch.tensor([2, 9, 5])[:, None]).view(3, 1, 1, 10)  # each row its own slots
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != 4)
    torch.testing.assert_close(compile_ways.attention_as_math(q, k, v, attn_mask=mask, enable_gqa=kv_heads != 4), want)
    with compile_ways.AttentionAsMath():  # how a way with "attention": "math" exports the step
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                  enable_gqa=kv_heads != 4), want)


def test_the_graph_safe_step_reads_only_written_slots_and_gives_the_tokens(monkeypatch):
    model, prompt = CachedGPT(SMALL).eval(), [5, 17, 300]
    want = Engine(model).generate_batch(prompt, 2, max_tokens=40, temperature=0)[0]
    engine = FastEngine(model, cuda_graph=True)  # on a CPU: the graph-safe step, run eagerly
    engine.prepare(2)
    read, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(model_py.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kwargs: read.append(k.shape[-2]) or sdpa(q, k, v, **kwargs))
    assert engine.generate_batch(prompt, 2, max_tokens=40, temperature=0)[0] == want
    # the prompt's pass, then a step for each token but the last: pos + 1 slots, then the whole ring
    assert read[::SMALL.n_layers] == [3] + [min(pos + 1, SMALL.context) for pos in range(3, 3 + 39)]


def test_rows_sharing_knobs_give_the_lesson_engines_tokens():
    model = CachedGPT(SMALL).eval()
    knobs = dict(temperature=1.5, top_p=0.9, penalty=1.3)  # FastEngine picks the rows in one call, Engine by group
    want = Engine(model).generate_batch([5, 17, 300], 3, max_tokens=12, seed=[4, 5, 6], **knobs)
    assert FastEngine(model).generate_batch([5, 17, 300], 3, max_tokens=12, seed=[4, 5, 6], **knobs) == want


def test_rows_with_knobs_of_their_own_each_get_what_they_get_alone():
    model = CachedGPT(SMALL).eval()
    settings, seeds = [dict(temperature=0), dict(top_k=5), dict(top_k=5, temperature=0.7)], [4, 5, 6]
    rows, _ = FastEngine(model).generate_batch([5, 17, 300], 3, max_tokens=12, seed=seeds, settings=settings)
    alone = [Engine(model).generate_batch([5, 17, 300], 1, max_tokens=12, seed=seed, **knobs)[0][0]
             for seed, knobs in zip(seeds, settings)]
    assert rows == alone


def int8_product_in_float64(layer, x):
    """An Int8Linear's product written from its definition in float64: each row quantized, the integer
    sums of int8 by int8, each row's scale and each output channel's, the bias."""
    q, row_scales = int8.quantize_per_channel(x)
    out = (q.double() @ layer.weight.double().T) * row_scales.double()[:, None] * layer.scales.double()
    return (out if layer.bias is None else out + layer.bias.double()).float()


@pytest.mark.parametrize("name", [*INT8_KERNELS, *compile_ways.COMPILED_LINEARS, "Int8Linear"])
def test_every_int8_kernel_computes_the_int8_product(name):
    if name in INT8_KERNELS and not matmul.runs_here(name, torch.device("cpu"), torch.int8):
        pytest.skip(f"kernel {name!r} does not run in this torch build")
    torch.manual_seed(0)
    block = CachedGPT(SMALL).eval().blocks[0]
    for layer in (block.mlp[0], block.attn.qkv, block.mlp[2]):  # with and without a bias; 4d inputs
        int8_layer = Int8Linear(layer)
        x = torch.randn(3, 1, layer.in_features)
        with torch.no_grad():
            got = int8_layer(x) if name == "Int8Linear" else \
                KernelLinear(int8_layer, (INT8_KERNELS | compile_ways.COMPILED_LINEARS)[name])(x)
        want = int8_product_in_float64(int8_layer, x.view(3, -1)).view(3, 1, -1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_int8_products_error_is_within_half_a_step_of_each_factor_vs_float64():
    """|sum x w - sum x' w'| <= sum |x| s_w / 2 + sum |w'| s_x / 2, x' and w' each within half its
    row's step (s_x, s_w) of x and w: the bound a product of this model's sizes keeps, at 1 and 16 rows."""
    gen = torch.Generator().manual_seed(0)
    for rows, (n_in, n_out) in ((1, (256, 768)), (16, (1024, 256)), (16, (256, 4096))):
        layer = torch.nn.Linear(n_in, n_out)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n_out, n_in, generator=gen) * 0.05)
        x = torch.randn(rows, n_in, generator=gen) * torch.logspace(-2, 1, rows)[:, None]  # rows of every size
        int8_layer = Int8Linear(layer)
        with torch.no_grad():
            got = int8_layer(x).double()
        exact = x.double() @ layer.weight.double().T + layer.bias.double()
        w_step, x_step = int8_layer.scales.double(), int8.quantize_per_channel(x)[1].double()
        w_back = int8_layer.weight.double() * w_step[:, None]
        bound = x.double().abs() @ (w_step / 2).expand(n_in, -1) + (x_step / 2)[:, None] * w_back.abs().sum(1)
        error = (got - exact).abs()
        assert (error <= bound * (1 + 1e-4) + 1e-5).all(), (error / bound).max()
        assert error.mean() < bound.mean() / 4  # rounding errors mostly cancel: the bound is the worst case


def test_an_int8_engine_quantizes_a_copy_once_and_its_rows_are_each_a_one_row_runs():
    torch.manual_seed(0)
    model = CachedGPT(SMALL).eval()
    with torch.no_grad():  # x10: untrained scores are too flat for greedy rows to say much
        for p in model.parameters():
            p.mul_(10)
    engine = FastEngine(model, dtype=torch.int8)
    linears = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * SMALL.n_layers + 1 and all(m.weight.dtype == torch.int8 for m in linears)
    # the tied head is quantized; the embedding it shares a weight with stays the model's float32 one
    assert isinstance(engine.model.head, Int8Linear) and engine.model.emb.weight is model.emb.weight
    assert all(type(m) is torch.nn.Linear for m in model.modules() if "Linear" in type(m).__name__)
    prompt, tokens = [5, 17, 300, 42, 9], {}
    for kernel in [n for n in INT8_KERNELS if matmul.runs_here(n, torch.device("cpu"), torch.int8)]:
        fixed = FastEngine(model, kernel=kernel, dtype=torch.int8)
        for knobs, seeds in ((dict(temperature=0), 42), (dict(temperature=1.0), 3)):  # every row seeded alike
            rows, _ = fixed.generate_batch(prompt, 3, max_tokens=12, seed=[seeds] * 3, **knobs)
            one, _ = fixed.generate_batch(prompt, 1, max_tokens=12, seed=seeds, **knobs)
            assert rows == one * 3
            tokens.setdefault(seeds, rows)
            assert rows == tokens[seeds], f"kernel {kernel!r} moved a token"  # the same sums, whichever runs
    with torch.no_grad():
        model.blocks[0].mlp[0].weight.mul_(2)
    with pytest.raises(ValueError, match="the model's weights changed after this Engine was made"):
        engine.generate_batch(prompt, 1, max_tokens=3, temperature=0)


def test_int_mm_runs_on_cpus_only_and_float_sums_everywhere():
    # CUDA's torch._int_mm refuses 16 rows or fewer: a decode step there multiplies with float_sums
    assert matmul.runs_here("int_mm", torch.device("cpu"), torch.int8)
    assert not matmul.runs_here("int_mm", torch.device("cuda"), torch.int8)
    assert matmul.runs_here("float sums", torch.device("cuda"), torch.int8)
    assert not matmul.runs_here("int_mm", torch.device("cpu"), torch.float32)


@pytest.mark.skipif(bool(compile_ways.compiler_missing("cpu")), reason=str(compile_ways.compiler_missing("cpu")))
def test_the_compiled_int8_engine_gives_the_eager_int8_tokens(compiled):
    eager, rows = FastEngine(compiled.model, dtype=torch.int8), COMPILED_ROWS
    # greedy: the int8 products give the scores; the compiled sampled pick on them is float32's, tested there
    assert compiled.int8.generate_batch([5, 17, 300], rows, max_tokens=40, temperature=0) == \
        eager.generate_batch([5, 17, 300], rows, max_tokens=40, temperature=0)  # past the window
    assert list(compiled.int8.compile_seconds) == [(rows, ())]
    with zipfile.ZipFile(compiled.int8.steps[rows, ()].package) as package:  # its products int8's, not float's
        assert any(b"_int_mm" in package.read(name) for name in package.namelist() if name.endswith(".cpp"))


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


@pytest.mark.parametrize("settings, message", [
    ([{"temperature": -1}], "temperature"), ([{"top_q": 0.5}], "unknown sampling knob 'top_q'"),
    ([{"temperature": 0}] * 2, "settings is a list of 2, but num_samples is 3"),
], ids=["bad-value", "unknown-knob", "rows-mismatch"])
def test_prepare_refuses_the_knobs_a_generate_would(settings, message):
    with pytest.raises(ValueError, match=message):
        FastEngine(CachedGPT(SMALL).eval()).prepare(3, settings)


def test_a_compiler_that_is_found_but_does_not_compile_is_refused_in_one_line(tmp_path, inductor_cxx):
    broken = tmp_path / "c++"
    broken.write_text("#!/bin/sh\necho 'c++: fatal error: cannot execute cc1plus' >&2\nexit 1\n")
    broken.chmod(0o755)
    inductor_cxx(str(broken))
    reason = compile_ways.compiler_missing("cpu")
    assert reason == (f"compiling on the CPU needs a C++ compiler that works, and {broken} does not (c++: fatal error: "
                      "cannot execute cc1plus); install one (apt-get install g++) or name one in CXX")
