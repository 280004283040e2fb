"""cached.py: the KV cache changes nothing while the uncached loop sees the whole text, and each gotcha breaks it."""
import importlib
import json
import os

import pytest
import torch

import cached
from bpe import BPE
from cached import CachedGPT, exact_tokens, load
from checkpoint import save_checkpoint
from helpers import (PART3_CONFIG, ROOT, SMALL, assert_refused, one_line_exit, keys_attended, part3_state_dict,
                     prompts, run_main, uncached_choices)
from model import GPT, Config, rope_at
from prefill_clone import KVCache


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    return CachedGPT(SMALL).eval()


@pytest.fixture(scope="module")
def shipped():
    return load("holmes.pt")


def reference_rope(x, positions):
    """RoPE from reference.md, written out pair by pair: out[2j] = x[2j] cos - x[2j+1] sin, ..."""
    hd = x.shape[-1]
    out = torch.empty_like(x)
    for j in range(hd // 2):
        angle = positions.double() * 10000 ** (-2 * j / hd)
        cos, sin = angle.cos().float(), angle.sin().float()
        out[..., 2 * j] = x[..., 2 * j] * cos - x[..., 2 * j + 1] * sin
        out[..., 2 * j + 1] = x[..., 2 * j] * sin + x[..., 2 * j + 1] * cos
    return out


@pytest.mark.parametrize("start", [0, 7, 300])
def test_rope_at_rotates_pairs_at_the_true_positions(start):
    x = torch.randn(2, 4, 10, 16)
    expected = reference_rope(x, torch.arange(start, start + 10))
    torch.testing.assert_close(rope_at(x, start), expected, atol=1e-4, rtol=1e-4)


def test_cached_model_loads_part3_weights_unchanged(random_model):
    plain = GPT(SMALL).eval()
    plain.load_state_dict(random_model.state_dict(), strict=True)
    idx = prompts(2, 20, SMALL.vocab_size)
    torch.testing.assert_close(random_model(idx)[0], plain(idx)[0])


def test_step_logits_match_the_full_forward(random_model):
    idx = prompts(3, 20, SMALL.vocab_size)
    caches = [{} for _ in random_model.blocks]
    with torch.no_grad():
        full = random_model(idx)[0]
        torch.testing.assert_close(random_model.step(idx[:, :12], caches, 0), full[:, 11], atol=1e-5, rtol=1e-5)
        for t in range(12, 20):
            torch.testing.assert_close(random_model.step(idx[:, t:t + 1], caches, t), full[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("prompt_len", [1, 5, 32, 40])
def test_cached_equals_uncached_for_exactly_context_minus_prompt_plus_1_tokens(random_model, batch, prompt_len):
    idx = prompts(batch, prompt_len, SMALL.vocab_size)
    n = exact_tokens(SMALL.context, prompt_len)
    assert n == max(SMALL.context - prompt_len + 1, 1)
    assert torch.equal(random_model.generate_cached(idx, n), random_model.generate_uncached(idx, n))


def test_cached_equals_uncached_for_254_tokens_on_the_shipped_checkpoint(shipped):
    idx = torch.tensor([[346, 739, 308]])
    assert exact_tokens(256, 3) == 254
    out = shipped.generate_cached(idx, 254)
    assert out.shape[1] == 257 and torch.equal(uncached_choices(shipped, out, 3), out[:, 3:])
    assert torch.equal(shipped.generate_uncached(idx, 20), out[:, :23])  # the loop itself, its first steps


def test_shipped_batch_2_prompt_200_and_a_prompt_longer_than_context(shipped):
    idx = prompts(2, 200, 4096)
    out = shipped.generate_cached(idx, 57)
    assert torch.equal(uncached_choices(shipped, out, 200), out[:, 200:])
    long = prompts(2, 300, 4096)
    assert torch.equal(shipped.generate_cached(long, 1), shipped.generate_uncached(long, 1))


def test_the_head_runs_once_for_the_prompt_and_once_per_generated_token(random_model):
    calls = []
    handle = random_model.head.register_forward_hook(lambda *a: calls.append(1))
    try:
        for n in (0, 1, 5):
            calls.clear()
            out = random_model.generate_cached(prompts(2, 3, SMALL.vocab_size), n)
            assert out.shape == (2, 3 + n) and len(calls) == 1 + n  # the post's loop: prefill, then a step a token
    finally:
        handle.remove()


def test_a_ring_step_past_the_window_attends_exactly_context_keys(random_model, monkeypatch):
    feed = prompts(1, 50, SMALL.vocab_size)
    caches = KVCache.for_model(random_model, 1, SMALL.context)
    with torch.inference_mode():
        random_model.step(feed[:, :10], caches, 0)
        seen = keys_attended(monkeypatch)
        for t in range(10, 50):
            random_model.step(feed[:, t:t + 1], caches, t)
    per_step = seen[::SMALL.n_layers]
    assert per_step == [min(t + 1, SMALL.context) for t in range(10, 50)]


def test_the_posts_order_attends_context_plus_1_keys_past_the_window(random_model, monkeypatch):
    feed = prompts(1, 40, SMALL.vocab_size)
    caches = [{} for _ in random_model.blocks]
    with torch.no_grad():
        random_model.step(feed[:, :32], caches, 0)
        seen = keys_attended(monkeypatch)
        random_model.step(feed[:, 32:33], caches, 32)
    assert seen == [SMALL.context + 1] * SMALL.n_layers


@pytest.mark.parametrize("name", ["rope", "mask"])
def test_each_gotcha_prints_the_drift_the_docs_show(name, monkeypatch, capsys):
    status, out, err = run_main(cached.main, ["cached.py", "--break", name], monkeypatch, capsys)
    with open(os.path.join(ROOT, "docs", "map.md")) as f:
        shown = f.read().split(f"$ python cached.py --break {name}\n")[1].splitlines()[:2]
    assert status == 0, err
    assert out.splitlines() == [line.strip() for line in shown]


def test_bad_counts_and_names_are_refused(monkeypatch):
    assert one_line_exit(cached.main, monkeypatch, "cached.py", "--break", "cache").startswith(
        "cached.py: error: argument --break: invalid choice: 'cache' (choose from ")
    assert "prompt is empty" in one_line_exit(cached.main, monkeypatch, "cached.py", "--prompt", "")
    assert "unknown device 'tpu'" in one_line_exit(cached.main, monkeypatch, "cached.py", "--device", "tpu")
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in one_line_exit(cached.main, monkeypatch, "cached.py", "--device", "cuda")
    assert "--tokens must be a whole number >= 0, got -5" in one_line_exit(cached.main, monkeypatch, "cached.py", "--tokens", "-5")
    assert "(the tokens they keep) needs " in one_line_exit(cached.main, monkeypatch, "cached.py", "--tokens", str(10**11))


def test_cli_states_the_real_count_for_a_prompt_longer_than_the_context(tmp_path, random_model, monkeypatch,
                                                                      capsys):
    checkpoint = tmp_path / "small.pt"
    save_checkpoint(random_model, checkpoint, step=0)
    vocab = tmp_path / "tok.json"
    vocab.write_text('{"merges": ' + str([[97, 97]] * 256) + '}')
    status, out, err = run_main(cached.main, ["cached.py", checkpoint, "--tokenizer", vocab, "--prompt", "x" * 40,
                                              "--tokens", "20"], monkeypatch, capsys)
    assert status == 0, err
    assert "the first 1 generated tokens are identical" in out


@pytest.mark.parametrize("script", ["cached.py", "sample_grid.py", "prefill_clone.py"])
def test_a_tokenizer_larger_than_the_model_is_named(script, tmp_path, random_model, monkeypatch, capsys):
    checkpoint = tmp_path / "small.pt"
    save_checkpoint(random_model, checkpoint, step=0)
    main = importlib.import_module(script.removesuffix(".py")).main
    run = run_main(main, [script, checkpoint, *(["--prompt"] if script == "cached.py" else []), "Sherlock Holmes"],
                   monkeypatch, capsys)
    assert_refused(run, "tokenizer.json")
    assert "512" in run[2] and "4096" in run[2]


def hostile_checkpoint(path, kind):
    sd, cfg = part3_state_dict(PART3_CONFIG), dict(PART3_CONFIG)
    if kind == "nan weight":
        sd["blocks.0.attn.qkv.weight"][0, 0] = float("nan")
    elif kind == "zero heads":
        cfg["n_heads"] = 0
    elif kind == "string size":
        cfg["d_model"] = "256"
    elif kind == "None context":
        cfg["context"] = None
    elif kind == "weight not a tensor":
        sd["norm.bias"] = [0.0] * 256
    torch.save({"model": sd, "config": cfg, "step": 0}, path)


@pytest.mark.parametrize("kind, message", [
    ("nan weight", "'blocks.0.attn.qkv.weight' holds NaN, infinite or non-float values"),
    ("zero heads", "config n_heads is 0; expected a whole number >= 1"),
    ("string size", "config d_model is '256'; expected a whole number >= 1"),
    ("None context", "config context is None"),
    ("weight not a tensor", "'norm.bias' is a list, not a tensor"),
])
def test_hostile_checkpoints_get_one_line_and_exit_1(tmp_path, kind, message, monkeypatch):
    hostile_checkpoint(tmp_path / "h.pt", kind)
    assert message in one_line_exit(cached.main, monkeypatch, "cached.py", str(tmp_path / "h.pt"))


@pytest.mark.parametrize("content, message", [
    ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ('{"merges": [[97, 97], [256, 256], [257, 257], [258, 258], [259, 259], [260, 260], [261, 261], [262, 262], '
     '[263, 263], [264, 264], [265, 265], [266, 266], [267, 267]]}', "builds a token of 8,192 bytes"),
    ('{"merges": [[1, "a"]]}', "merge 0 is [1, 'a'], expected a pair of integer ids"),
])
def test_hostile_tokenizer_files_get_one_line_and_exit_1(tmp_path, content, message, monkeypatch):
    (tmp_path / "t.json").write_text(content)
    assert message in one_line_exit(cached.main, monkeypatch, "cached.py", "--tokenizer", str(tmp_path / "t.json"))


def overflowing_checkpoint(path):
    """Finite weights whose scores overflow: a last MLP bias of 3e38 turns the residual stream infinite."""
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=4096, d_model=64, n_heads=4, n_layers=2, context=32))
    with torch.no_grad():
        model.blocks[-1].mlp[2].bias.fill_(3e38)
    save_checkpoint(model, path, 0)


def test_scores_that_overflow_stop_the_cached_loop_at_the_first_token(tmp_path, monkeypatch):
    overflowing_checkpoint(tmp_path / "o.pt")
    message = one_line_exit(cached.main, monkeypatch, "cached.py", str(tmp_path / "o.pt"))
    assert "scores for new token 0 are NaN or infinite" in message


@pytest.mark.parametrize("generate", ["generate_cached", "generate_uncached"])
def test_every_loop_refuses_non_finite_scores_where_they_appear(tmp_path, generate):
    overflowing_checkpoint(tmp_path / "o.pt")
    model = load(tmp_path / "o.pt")
    with pytest.raises(ValueError, match="scores for new token 0 are NaN or infinite"):
        getattr(model, generate)(torch.zeros(1, 3, dtype=torch.long), 5)


def test_a_tokenizer_other_than_the_recorded_one_is_refused_even_at_the_same_size(tmp_path, monkeypatch):
    merges = json.load(open("tokenizer.json"))["merges"]
    merges[-1] = [32, 32] if merges[-1] != [32, 32] else [33, 33]
    (tmp_path / "other.json").write_text(json.dumps({"merges": merges}))
    message = one_line_exit(cached.main, monkeypatch, "cached.py", "--tokenizer", str(tmp_path / "other.json"))
    assert "other.json is not the tokenizer holmes.pt was trained with" in message


def test_a_checkpoint_without_a_tokenizer_record_says_which_tokenizer_it_assumed(tmp_path, capsys):
    torch.manual_seed(0)
    save_checkpoint(CachedGPT(Config(vocab_size=4096, d_model=64, n_layers=2, context=32)), tmp_path / "p3.pt", 0)
    model, _ = cached.load_pair(tmp_path / "p3.pt", "tokenizer.json")
    assert model.trained_with is None
    assert capsys.readouterr().err.strip() == \
        f"note: {tmp_path / 'p3.pt'} does not record its tokenizer; assuming tokenizer.json (--tokenizer)"


def test_the_shipped_checkpoint_records_the_shipped_tokenizer(shipped):
    assert shipped.trained_with == BPE.load("tokenizer.json").record()


@pytest.mark.parametrize("make, message", [
    (lambda d: os.mkfifo(d / "fifo.pt") or d / "fifo.pt", "is not a regular file (a pipe or a device?)"),
    (lambda d: "/dev/zero", "is not a regular file (a pipe or a device?)"),
    (lambda d: d, "is a folder; give a file"),
])
def test_a_checkpoint_that_would_block_or_never_end_is_refused_without_reading_it(tmp_path, monkeypatch, make, message):
    assert message in one_line_exit(cached.main, monkeypatch, "cached.py", str(make(tmp_path)))
