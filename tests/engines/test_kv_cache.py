"""engines/fast/kv_cache.py: nanochat's KVCache, its prefill copying one prompt into every row, and its ring."""
import pytest
import torch

from engines.edge.checks import cache_bytes
from engines.fast.kv_cache import KVCache, run_prompt
from engines.fast.rope import with_row_attention
from helpers import PROMPT, SMALL, keys_attended, prompts, small
from model import Config
from support import ring_gives_a_trim_first_caches_logits_for_600_steps

GQA = Config(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=1, n_layers=2, context=32)


def test_prefill_copies_the_source_into_every_row_exactly():
    model = small()
    _, one = run_prompt(model, torch.tensor([PROMPT]), 8)
    many = KVCache.for_model(model, 3, 20)
    many.prefill(one)
    assert many.get_pos() == 5 and many.cache_seqlens.tolist() == [5, 5, 5]
    for row in range(3):
        assert torch.equal(many.k[:, row, :5], one.k[:, 0, :5]) and torch.equal(many.v[:, row, :5], one.v[:, 0, :5])
    assert not many.k[:, :, 5:].any()
    many.reset()
    assert many.get_pos() == 0


@pytest.mark.parametrize("target", [dict(n_layers=3), dict(n_kv_heads=2), dict(head_dim=8), dict(max_len=4)])
def test_prefill_asserts_a_cache_of_the_same_shape_that_holds_the_source(target):
    model = small()
    _, one = run_prompt(model, torch.tensor([PROMPT]), 8)
    shape = dict(batch=3, n_layers=2, max_len=20, n_kv_heads=4, head_dim=16) | target
    with pytest.raises(AssertionError):
        KVCache(**shape).prefill(one)


def test_prefill_asserts_an_empty_cache_and_a_source_batch_of_1_or_equal():
    model = small()
    _, one = run_prompt(model, torch.tensor([PROMPT]), 8)
    _, two = run_prompt(model, torch.tensor([PROMPT, PROMPT]), 8)
    many = KVCache.for_model(model, 3, 20)
    with pytest.raises(AssertionError, match="the source batch is 1 or this cache's"):
        many.prefill(two)
    many.prefill(one)
    with pytest.raises(AssertionError, match="prefill needs an empty cache"):
        many.prefill(one)


def test_ring_past_the_window_gives_a_trim_first_caches_logits_for_600_steps():
    ring_gives_a_trim_first_caches_logits_for_600_steps(KVCache)


def test_a_ring_shorter_than_the_context_refuses_to_wrap():
    model = with_row_attention(small())
    _, cache = run_prompt(model, torch.tensor([PROMPT]), 8)
    with torch.inference_mode():
        for pos in range(5, 8):
            model.step(torch.tensor([[1]]), cache, pos)
        with pytest.raises(AssertionError, match="a ring shorter than the context would drop keys still seen"):
            model.step(torch.tensor([[1]]), cache, 8)


def test_a_cache_for_a_model_is_never_longer_than_its_window():
    with pytest.raises(AssertionError, match="a cache longer than the context"):
        KVCache.for_model(small(), 1, 512)


def test_the_cache_holds_the_posts_formula_with_the_kv_width():
    full = KVCache.for_model(small(), 1, 32).nbytes()
    assert KVCache.for_model(small(GQA), 1, 32).nbytes() * 4 == full
    assert [KVCache.for_model(m, 3, 20).nbytes() for m in (small(), small(GQA))] == [
        cache_bytes(cfg, 3, 20, 4) for cfg in (SMALL, GQA)]


def test_a_ring_step_past_the_window_attends_exactly_context_keys(monkeypatch):
    random_model = with_row_attention(small())
    feed = prompts(1, 50, SMALL.vocab_size)
    caches = KVCache.for_model(random_model, 1, SMALL.context)
    with torch.inference_mode():
        random_model.step(feed[:, :10], caches, 0)
        seen = keys_attended(monkeypatch)
        for t in range(10, 50):
            random_model.step(feed[:, t:t + 1], caches, t)
    per_step = seen[::SMALL.n_layers]
    assert per_step == [min(t + 1, SMALL.context) for t in range(10, 50)]
