"""cached.py: the KV cache changes nothing inside the window, and each gotcha really breaks it."""
import subprocess
import sys

import pytest
import torch

from cached import CachedGPT, LayerCache, drift, load, rope_at
from model import GPT, Config, rope, save_checkpoint

SMALL = Config(vocab_size=512, d_model=64, n_heads=4, n_layers=2, context=32)


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    return CachedGPT(SMALL).eval()


@pytest.fixture(scope="module")
def shipped():
    return load("holmes.pt")


def prompts(batch, length, vocab, seed=1):
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_rope_at_zero_is_part3_rope_and_an_offset_is_a_slice():
    x = torch.randn(2, 4, 10, 16)
    torch.testing.assert_close(rope_at(x, 0), rope(x))
    torch.testing.assert_close(rope_at(x[:, :, 7:], 7), rope(x)[:, :, 7:])


def test_cached_model_loads_part3_weights_unchanged(random_model):
    plain = GPT(SMALL).eval()
    plain.load_state_dict(random_model.state_dict(), strict=True)
    idx = prompts(2, 20, SMALL.vocab_size)
    torch.testing.assert_close(random_model(idx)[0], plain(idx)[0])


def test_step_logits_match_the_full_forward(random_model):
    idx = prompts(3, 20, SMALL.vocab_size)
    caches = [LayerCache() for _ in random_model.blocks]
    with torch.no_grad():
        full = random_model(idx)[0]
        torch.testing.assert_close(random_model.step(idx[:, :12], caches, 0), full[:, 11], atol=1e-5, rtol=1e-5)
        for t in range(12, 20):
            torch.testing.assert_close(random_model.step(idx[:, t:t + 1], caches, t), full[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("prompt_len", [1, 5])
def test_cached_equals_uncached_inside_the_window_random_weights(random_model, batch, prompt_len):
    idx = prompts(batch, prompt_len, SMALL.vocab_size)
    n = SMALL.context - prompt_len
    assert torch.equal(random_model.generate_cached(idx, n), random_model.generate_uncached(idx, n))


@pytest.mark.parametrize("batch", [1, 4])
def test_prompt_longer_than_context_is_trimmed_alike_in_both_loops(random_model, batch):
    idx = prompts(batch, SMALL.context + 9, SMALL.vocab_size)
    cached, uncached = random_model.generate_cached(idx, 1), random_model.generate_uncached(idx, 1)
    assert torch.equal(cached, uncached)
    trimmed = random_model.generate_cached(idx[:, -SMALL.context:], 1)
    assert torch.equal(cached[:, -1], trimmed[:, -1])


def test_cache_never_holds_more_than_the_window(random_model):
    caches = [LayerCache() for _ in random_model.blocks]
    with torch.no_grad():
        random_model.step(prompts(1, 30, SMALL.vocab_size), caches, 0)
        for t in range(30, 80):
            random_model.step(prompts(1, 1, SMALL.vocab_size, seed=t), caches, t)
    assert all(c.k.shape[2] == SMALL.context and c.v.shape[2] == SMALL.context for c in caches)


def test_cached_equals_uncached_inside_the_window_shipped_batch_1(shipped):
    idx = prompts(1, 3, 4096)
    n = 256 - 3
    assert torch.equal(shipped.generate_cached(idx, n), shipped.generate_uncached(idx, n))


def test_cached_equals_uncached_inside_the_window_shipped_batch_4(shipped):
    idx = prompts(4, 200, 4096)
    assert torch.equal(shipped.generate_cached(idx, 56), shipped.generate_uncached(idx, 56))


def test_prompt_longer_than_context_is_trimmed_alike_shipped(shipped):
    idx = prompts(4, 300, 4096)
    assert torch.equal(shipped.generate_cached(idx, 1), shipped.generate_uncached(idx, 1))


@pytest.mark.parametrize("name", ["rope", "mask"])
def test_each_gotcha_drifts_within_100_tokens(name):
    model = load("holmes.pt")
    prompt = torch.tensor([[346, 739, 308]])
    correct = model.generate_cached(prompt, 100)
    assert torch.equal(correct, model.generate_uncached(prompt, 100))
    assert drift(model, prompt, name) is not None


def test_bad_counts_and_names_are_refused(random_model):
    with pytest.raises(ValueError, match="n_tokens must be a whole number >= 0"):
        random_model.generate_cached(prompts(1, 2, 10), -1)
    run = subprocess.run([sys.executable, "cached.py", "--break", "cache"], capture_output=True, text=True)
    assert run.returncode != 0
    assert run.stderr.strip() == "cached.py: error: --break must be one of ['mask', 'rope'], got 'cache'"
    run = subprocess.run([sys.executable, "cached.py", "--prompt", ""], capture_output=True, text=True)
    assert run.returncode != 0 and "prompt is empty" in run.stderr
    run = subprocess.run([sys.executable, "cached.py", "--device", "tpu"], capture_output=True, text=True)
    assert run.returncode != 0 and "unknown device 'tpu'" in run.stderr


@pytest.mark.parametrize("script", ["cached.py", "sample_grid.py", "prefill_clone.py"])
def test_a_tokenizer_larger_than_the_model_is_named(script, tmp_path, random_model):
    checkpoint = tmp_path / "small.pt"
    save_checkpoint(random_model, checkpoint, step=0)
    run = subprocess.run([sys.executable, script, str(checkpoint), *(["--prompt"] if script == "cached.py" else []),
                          "Sherlock Holmes"], capture_output=True, text=True)
    assert run.returncode != 0
    assert run.stderr.strip().startswith(f"{script}: error: the tokenizer gave id ")
    assert run.stderr.strip().endswith("but the model's vocabulary is 0..511; "
                                       "give the tokenizer this checkpoint was trained with (--tokenizer)")
