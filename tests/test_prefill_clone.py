"""prefill_clone.py: one prefill cloned into N rows gives what N separate runs give."""
import subprocess
import sys

import pytest
import torch

from cached import CachedGPT, LayerCache
from model import Config
from prefill_clone import (
    Engine,
    KVCache,
    cloned_prefill,
    decode_step,
    generate_prealloc,
    prefill,
    project,
    separate_prefills,
)
from sampling import pick

SMALL = Config(vocab_size=512, d_model=64, n_heads=4, n_layers=2, context=32)
GQA = Config(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=1, n_layers=2, context=32)


def small(cfg=SMALL, seed=0):
    torch.manual_seed(seed)
    return CachedGPT(cfg).eval()


def greedy(logits, idx):
    return pick(logits, temperature=0)


PROMPT = [5, 17, 300, 42, 9]


def test_prefill_copies_the_source_into_every_row_exactly():
    model = small()
    _, one = prefill(model, torch.tensor([PROMPT]), 8)
    many = KVCache.for_model(model, 3, 20)
    many.prefill(one)
    assert many.get_pos() == 5 and many.cache_seqlens.tolist() == [5, 5, 5]
    for row in range(3):
        assert torch.equal(many.k[:, row, :5], one.k[:, 0, :5]) and torch.equal(many.v[:, row, :5], one.v[:, 0, :5])
    assert not many.k[:, :, 5:].any()
    many.reset()
    assert many.get_pos() == 0


@pytest.mark.parametrize("target, message", [
    (dict(batch=3, n_layers=3), "n_layers differs, 2 in the source, 3 here"),
    (dict(batch=3, n_kv_heads=2), "n_kv_heads differs, 4 in the source, 2 here"),
    (dict(batch=3, head_dim=8), "head_dim differs, 16 in the source, 8 here"),
    (dict(batch=3, max_len=4), "holds 5 positions, more than max_len 4"),
])
def test_prefill_refuses_a_cache_of_another_shape(target, message):
    model = small()
    _, one = prefill(model, torch.tensor([PROMPT]), 8)
    shape = dict(batch=3, n_layers=2, max_len=20, n_kv_heads=4, head_dim=16) | target
    with pytest.raises(ValueError, match=message):
        KVCache(**shape).prefill(one)


def test_prefill_refuses_a_full_cache_and_a_source_batch_that_is_not_1_or_equal():
    model = small()
    _, one = prefill(model, torch.tensor([PROMPT]), 8)
    _, two = prefill(model, torch.tensor([PROMPT, PROMPT]), 8)
    many = KVCache.for_model(model, 3, 20)
    with pytest.raises(ValueError, match="source batch 2 must be 1 or 3"):
        many.prefill(two)
    many.prefill(one)
    with pytest.raises(ValueError, match="needs an empty cache, this one holds 5"):
        many.prefill(one)


@pytest.mark.parametrize("batch", [1, 4])
def test_preallocated_greedy_equals_cached_inside_the_window(batch):
    model = small()
    idx = torch.randint(512, (batch, 3), generator=torch.Generator().manual_seed(2))
    assert torch.equal(generate_prealloc(model, idx, 29, greedy), model.generate_cached(idx, 29))


def test_engine_greedy_rows_equal_cached_output():
    model = small()
    rows, masks = Engine(model).generate_batch(PROMPT, 3, max_tokens=27, temperature=0)
    expected = model.generate_cached(torch.tensor([PROMPT]), 27)[0, len(PROMPT):].tolist()
    assert rows == [expected] * 3 and masks == [[1] * 27] * 3


@pytest.mark.parametrize("n", [1, 3, 8])
def test_row_i_of_n_equals_a_one_row_run_with_seed_plus_i(n):
    model = small()
    rows, _ = Engine(model).generate_batch(PROMPT, n, max_tokens=20, seed=100, temperature=1.0, top_k=50)
    for i in range(n):
        alone, _ = Engine(model).generate_batch(PROMPT, 1, max_tokens=20, seed=100 + i, temperature=1.0, top_k=50)
        assert rows[i] == alone[0]


def test_each_row_samples_its_own_first_token():
    rows, _ = Engine(small()).generate_batch(PROMPT, 8, max_tokens=1, seed=0, temperature=2.0)
    assert len({r[0] for r in rows}) > 1


def test_per_row_settings_and_seed_lists():
    model = small()
    settings = [dict(temperature=0), dict(temperature=1.5, top_p=0.9)]
    rows, _ = Engine(model).generate_batch(PROMPT, 2, max_tokens=10, seed=[7, 7], settings=settings)
    for row, s in zip(rows, settings):
        assert row == Engine(model).generate_batch(PROMPT, 1, max_tokens=10, seed=7, **s)[0][0]


def test_forced_tokens_have_mask_0_and_generation_goes_on_after_them():
    model = small()
    rows, masks = Engine(model).generate_batch(PROMPT, 2, max_tokens=8, temperature=0, forced=[[7, 8, 9], []])
    assert rows[0][:3] == [7, 8, 9] and masks[0] == [0, 0, 0] + [1] * 5
    expected = model.generate_cached(torch.tensor([PROMPT + [7, 8, 9]]), 5)[0, -5:].tolist()
    assert rows[0][3:] == expected and masks[1] == [1] * 8


def test_a_stop_token_completes_only_its_row():
    model = small()
    greedy_row = Engine(model).generate_batch(PROMPT, 1, max_tokens=6, temperature=0)[0][0]
    stop = greedy_row[2]
    settings = [dict(temperature=0), dict(temperature=0, penalty=5.0)]
    steps = list(Engine(model).generate(PROMPT, 2, max_tokens=6, stop=stop, settings=settings))
    rows = [[c[i] for c, _ in steps if c[i] is not None] for i in range(2)]
    assert rows[0] == greedy_row[:greedy_row.index(stop) + 1]
    assert stop not in rows[1][:-1] and len(rows[1]) == 6
    assert steps[-1][0][0] is None and steps[-1][1][0] is None


def test_a_stop_string_completes_a_row():
    from bpe import BPE
    tokenizer = BPE.load("tokenizer.json")
    model = small(Config(d_model=64, n_heads=4, n_layers=2, context=32))
    row = Engine(model, tokenizer).generate_batch(PROMPT, 1, max_tokens=12, temperature=0)[0][0]
    text = tokenizer.decode(row[:4])
    stopped = Engine(model, tokenizer).generate_batch(PROMPT, 1, max_tokens=12, temperature=0, stop=text[-2:])[0][0]
    assert len(stopped) <= 4 and tokenizer.decode(stopped).endswith(text[-2:])


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_project_computes_what_the_layer_computes(rows, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=bias)
    x = torch.randn(rows, 64)
    got = project(layer, x)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("known_pos", [True, False], ids=["sliced reads", "masked reads (graph-safe)"])
def test_ring_past_the_window_gives_cached_py_logits_for_600_steps(known_pos):
    model = small()
    feed = torch.randint(512, (2, 600), generator=torch.Generator().manual_seed(3))
    logits_ring, ring = prefill(model, feed[:, :10], SMALL.context)
    caches = [LayerCache() for _ in model.blocks]
    with torch.no_grad():
        logits_rolling = model.step(feed[:, :10], caches, 0)
        for t in range(10, 600):
            torch.testing.assert_close(logits_ring, logits_rolling, atol=1e-4, rtol=1e-4)
            logits_ring = decode_step(model, feed[:, t:t + 1], ring, t if known_pos else None)
            logits_rolling = model.step(feed[:, t:t + 1], caches, t)
    assert ring.k.shape[2] == SMALL.context and ring.get_pos() == 600


def test_gqa_cached_equals_uncached_and_the_cache_shrinks():
    model = small(GQA)
    assert model.blocks[0].attn.qkv.weight.shape == (64 + 2 * 16, 64)
    idx = torch.tensor([PROMPT])
    assert torch.equal(model.generate_cached(idx, 27), model.generate_uncached(idx, 27))
    assert torch.equal(generate_prealloc(model, idx, 27, greedy), model.generate_cached(idx, 27))
    full = KVCache.for_model(small(), 1, 32).nbytes()
    assert KVCache.for_model(model, 1, 32).nbytes() * 4 == full


def test_clone_and_separate_prefills_fill_the_same_cache():
    model = small()
    a_logits, a = cloned_prefill(model, torch.tensor([PROMPT]), 3, 16)
    b_logits, b = separate_prefills(model, torch.tensor([PROMPT]), 3, 16)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a_logits, b_logits)


@pytest.mark.parametrize("call, message", [
    (dict(num_samples=0), "num_samples must be a whole number >= 1"),
    (dict(max_tokens=-1), "max_tokens must be a whole number >= 0"),
    (dict(tokens=[]), "prompt is empty"),
    (dict(tokens=list(range(33))), "33 tokens is longer than the cache"),
    (dict(num_samples=3, settings=[{}, {}]), "settings is a list of 2, but num_samples is 3"),
    (dict(num_samples=2, seed=[1]), "seed is a list of 1, but num_samples is 2"),
    (dict(stop=512), "stop token id 512 is outside the vocabulary 0..511"),
    (dict(tokens=[5, 512]), "prompt token 512 is outside the vocabulary 0..511"),
    (dict(tokens=[5, 2.0]), "prompt token 2.0 is outside the vocabulary 0..511"),
    (dict(forced=[[7, -1]]), "forced token for row 0: -1 is outside the vocabulary 0..511"),
    (dict(stop="the end"), "stop strings need"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(topk=3), "unknown sampling knob 'topk'"),
])
def test_bad_input_is_named(call, message):
    args = dict(tokens=PROMPT, num_samples=1, max_tokens=4) | call
    with pytest.raises(ValueError, match=message):
        Engine(small()).generate_batch(**args)


def test_cli_prints_samples_and_the_side_by_side_timing():
    cmd = [sys.executable, "prefill_clone.py", "-n", "2", "--tokens", "4"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "--- sample 1 (seed 1)" in run.stdout and "1 prefill + clone" in run.stdout and "speedup" in run.stdout
    run = subprocess.run([sys.executable, "prefill_clone.py", "-n", "0"], capture_output=True, text=True)
    assert run.returncode != 0 and run.stderr.strip() == "prefill_clone.py: error: -n must be at least 1, got 0"
