"""prefill_clone.py: one prefill cloned into N rows gives what N separate runs give."""

import pytest
import torch

import prefill_clone
from helpers import (PROMPT, SMALL, assert_refused, ring_gives_a_trim_first_caches_logits_for_600_steps, run_main,
                     small)
from model import GPT, Config
from checks import cache_bytes
from prefill_clone import Engine, KVCache, run_prompt
from sampling import pick

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


def test_every_layer_runs_each_decode_step_and_the_head_once_a_token():
    model = small()
    calls = {}
    modules = {name: m for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm))}
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
             for name, m in modules.items()]
    try:
        Engine(model).generate_batch(PROMPT, 2, max_tokens=7, temperature=0)
    finally:
        for h in hooks:
            h.remove()
    assert set(calls) == set(modules) and len(modules) == 2 * 6 + 1 + 1
    assert all(n == 7 for n in calls.values()), calls  # one prefill + 6 decode steps


def test_engine_greedy_rows_equal_cached_output():
    model = small()
    rows, masks = Engine(model).generate_batch(PROMPT, 3, max_tokens=27, temperature=0)
    expected = model.generate_cached(torch.tensor([PROMPT]), 27)[0, len(PROMPT):].tolist()
    assert rows == [expected] * 3 and masks == [[1] * 27] * 3


KNOB_SETS = [dict(temperature=1.0, top_k=50), dict(temperature=0.8, top_p=0.9),
             dict(temperature=1.2, top_k=20, top_p=0.95, penalty=1.3)]


@pytest.mark.parametrize("knobs", KNOB_SETS, ids=["top-k", "top-p", "all four"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_row_i_samples_what_cached_py_does_with_seed_plus_i(n, knobs):
    model = small()
    rows, _ = Engine(model).generate_batch(PROMPT, n, max_tokens=20, seed=100, **knobs)
    for i in range(n):
        generator = torch.Generator().manual_seed(100 + i)
        alone = model.generate_cached(torch.tensor([PROMPT]), 20, lambda logits, idx: pick(
            logits, history=idx, generator=generator, **knobs))[0, len(PROMPT):].tolist()
        assert rows[i] == alone


def test_each_row_samples_its_own_first_token():
    rows, _ = Engine(small()).generate_batch(PROMPT, 8, max_tokens=1, seed=0, temperature=2.0)
    assert len({r[0] for r in rows}) > 1


def test_per_row_settings_and_seed_lists():
    model = small()
    # rows sharing knobs are filtered as one batch; each must still sample what it samples alone
    settings = [dict(temperature=0), dict(temperature=1.5, top_p=0.9), KNOB_SETS[2], dict(temperature=1.5, top_p=0.9),
                KNOB_SETS[2]]
    seeds = [7, 7, 8, 9, 10]
    rows, _ = Engine(model).generate_batch(PROMPT, 5, max_tokens=10, seed=seeds, settings=settings)
    for row, seed, s in zip(rows, seeds, settings):
        assert row == Engine(model).generate_batch(PROMPT, 1, max_tokens=10, seed=seed, **s)[0][0]


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


def test_ring_past_the_window_gives_a_trim_first_caches_logits_for_600_steps():
    ring_gives_a_trim_first_caches_logits_for_600_steps(KVCache)


def test_gqa_cached_equals_uncached_and_the_cache_shrinks():
    model = small(GQA)
    assert model.blocks[0].attn.qkv.weight.shape == (64 + 2 * 16, 64)
    idx = torch.tensor([PROMPT])
    assert torch.equal(model.generate_cached(idx, 27), model.generate_uncached(idx, 27))
    rows, _ = Engine(model).generate_batch(PROMPT, 1, max_tokens=27, temperature=0)
    assert rows[0] == model.generate_cached(idx, 27)[0, len(PROMPT):].tolist()
    full = KVCache.for_model(small(), 1, 32).nbytes()
    assert KVCache.for_model(model, 1, 32).nbytes() * 4 == full
    # the post's formula, kv width for d_model, is what the tensors hold
    assert [KVCache.for_model(m, 3, 20).nbytes() for m in (small(), model)] == [
        cache_bytes(cfg, 3, 20, 4) for cfg in (SMALL, GQA)]


@pytest.mark.parametrize("call, message", [
    (dict(num_samples=0), "num_samples must be a whole number >= 1"),
    (dict(max_tokens=-1), "max_tokens must be a whole number >= 0"),
    (dict(max_tokens=10**12), r"1 rows x 1000000000005 tokens \(the tokens they keep\) needs "),
    (dict(tokens=[]), "prompt must be a non-empty list"),
    (dict(tokens=list(range(33))), "33 tokens is longer than the cache"),
    (dict(num_samples=3, settings=[{}, {}]), "settings is a list of 2, but num_samples is 3"),
    (dict(num_samples=2, seed=[1]), "seed is a list of 1, but num_samples is 2"),
    (dict(stop=512), "stop token id 512 is outside the vocabulary 0..511"),
    (dict(tokens=[5, 512]), "prompt token 512 is outside the vocabulary 0..511"),
    (dict(tokens=[5, 2.0]), "prompt token 2.0 is not an integer id"),
    (dict(forced=[[7, -1]]), "forced token for row 0: -1 is outside the vocabulary 0..511"),
    (dict(stop="the end"), "stop strings need"),
    (dict(temperature=-1), "temperature must be 0"),
    (dict(temperature=1e-38), "temperature must be 0"),
    (dict(top_p=float("nan")), "top_p must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(stop=2.0), "stop token id 2.0 is not an integer id"),
    (dict(stop={3}), r"stop token id \{3\} is not an integer id"),
    (dict(stop=b"x"), "stop token id b'x' is not an integer id"),
    (dict(tokens=[5, True]), "prompt token True is not an integer id"),
    (dict(num_samples=True), "num_samples True is not an integer id"),
    (dict(num_samples=1.0), "num_samples 1.0 is not an integer id"),
    (dict(seed=-1), "seed -1 is outside the seeds"),
    (dict(seed=2.5), "seed 2.5 is not an integer id"),
    (dict(tokens="hello"), "prompt must be a non-empty list of token ids"),
    (dict(num_samples=10**9), "needs .* GiB, more than half of this machine"),
    (dict(topk=3), "unknown sampling knob 'topk'"),
])
def test_bad_input_is_named(call, message):
    args = dict(tokens=PROMPT, num_samples=1, max_tokens=4) | call
    with pytest.raises(ValueError, match=message):
        Engine(small()).generate_batch(**args)


def test_integer_likes_are_accepted_as_ids_and_counts():
    import numpy as np
    model = small()
    expected = Engine(model).generate_batch(PROMPT, 2, max_tokens=5, temperature=0)
    got = Engine(model).generate_batch([np.int64(t) for t in PROMPT[:-1]] + [torch.tensor(PROMPT[-1])],
                                       np.int32(2), max_tokens=5, temperature=0, stop=np.int64(511))
    assert got == expected


def test_a_second_generator_on_one_engine_is_refused_while_the_first_is_open():
    engine = Engine(small())
    first = engine.generate(PROMPT, 1, max_tokens=5, temperature=0)
    next(first)
    with pytest.raises(ValueError, match="already generating"):
        next(engine.generate(PROMPT, 1, max_tokens=5, temperature=0))
    first.close()
    assert len(engine.generate_batch(PROMPT, 1, max_tokens=3, temperature=0)[0][0]) == 3


def test_a_ring_shorter_than_the_context_refuses_to_wrap():
    model = small()
    _, cache = run_prompt(model, torch.tensor([PROMPT]), 8)
    with torch.inference_mode():
        for pos in range(5, 8):
            model.step(torch.tensor([[1]]), cache, pos)
        with pytest.raises(AssertionError, match="a ring shorter than the context would drop keys still seen"):
            model.step(torch.tensor([[1]]), cache, 8)


@pytest.mark.parametrize("args, message", [
    (["--temperature", "inf"], "temperature must be a finite number, got inf"),
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--temperature", "1e-38"], "temperature must be 0 (greedy) or at least 0.0001"),
    (["--top-p", "nan"], "top_p must be a finite number"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--seed", "-1"], "--seed -1 is outside the seeds 0.."),
    (["--seed", str(2**64)], f"--seed {2**64} is outside the seeds 0.."),
    (["-n", "100000"], "GiB, more than half of this machine"),
    (["-n", "100000000"], "GiB, more than half of this machine"),
    (["-n", "0"], "-n must be a whole number >= 1, got 0"),
    (["--tokens", str(10**11)], "(the tokens they keep) needs "),
    (["-n", "-2"], "-n must be a whole number >= 1, got -2"),
    (["--tokens", "-1"], "--tokens must be a whole number >= 1, got -1"),
    (["--seed", "abc"], "argument --seed: invalid int value: 'abc'"),
])
def test_hostile_cli_input_gets_one_line_naming_it_and_exit_1(args, message, monkeypatch, capsys):
    run = run_main(prefill_clone.main, ["prefill_clone.py", *args], monkeypatch, capsys)
    assert_refused(run, "prefill_clone.py: error: ")
    assert message in run[2] and run[1] == ""


@pytest.mark.parametrize("call, message", [
    (dict(forced=[5]), r"forced must be one list of ids per row \(1 lists\)"),
    (dict(forced="ab"), "forced must be one list of ids per row"),
    (dict(stop=""), "a stop string is empty; it would end every row at once"),
    (dict(stop=["the", ""]), "a stop string is empty"),
    (dict(stop="\ud800"), "cannot be UTF-8 encoded"),
    (dict(max_tokens=None), "give max_tokens: without a bound, a row that never meets a stop would generate forever"),
])
def test_ill_typed_calls_are_refused_by_name(call, message):
    args = dict(tokens=PROMPT, num_samples=1, max_tokens=4) | call
    with pytest.raises(ValueError, match=message):
        Engine(small(), tokenizer=object()).generate_batch(**args)


def test_an_engine_on_a_plain_gpt_is_refused_by_name():
    plain = GPT(SMALL).eval()  # no cached step
    with pytest.raises(ValueError, match=r"the Engine needs a CachedGPT \(cached.load gives one\), got a GPT"):
        Engine(plain, tokenizer=object()).generate_batch(tokens=PROMPT, num_samples=1, max_tokens=4)


def test_a_cache_for_a_model_is_never_longer_than_its_window():
    with pytest.raises(AssertionError, match="a cache longer than the context"):
        KVCache.for_model(small(), 1, 512)


def test_scores_that_overflow_stop_the_engine_instead_of_giving_rows_of_zeros():
    model = small()
    with torch.no_grad():
        model.blocks[-1].mlp[2].bias.fill_(3e38)
    for knobs in (dict(temperature=0), dict(temperature=1.0)):
        with pytest.raises(ValueError, match="scores for new token 0 are NaN or infinite"):
            Engine(model).generate_batch(PROMPT, 2, max_tokens=4, **knobs)


def test_finite_scores_that_overflow_at_a_small_temperature_still_give_tokens():
    # scores near 1e35 are finite, but over a temperature of 1e-4 they pass float32's largest number
    model = small()
    with torch.no_grad():
        model.norm.weight.mul_(1e36)
    greedy = Engine(model).generate_batch(PROMPT, 2, max_tokens=4, temperature=0)[0]
    assert Engine(model).generate_batch(PROMPT, 2, max_tokens=4, temperature=1e-4, top_p=0.9)[0] == greedy


def test_a_forced_id_appended_between_steps_is_checked_when_it_is_used():
    engine = Engine(small())
    steps = engine.generate(PROMPT, 1, max_tokens=4, temperature=0)
    next(steps)
    engine.rows[0].forced_tokens.append(10**6)
    with pytest.raises(ValueError, match="forced token for row 0: 1000000 is outside the vocabulary 0..511"):
        next(steps)


@pytest.fixture(scope="module")
def shipped_pair():
    from cached import load_pair
    return load_pair("holmes.pt", "tokenizer.json")


@pytest.mark.parametrize("start, end", [(5, 8), (3, 30), (20, 60)])
def test_a_stop_string_of_any_length_ends_the_row_where_it_first_appears(shipped_pair, start, end):
    model, tokenizer = shipped_pair
    prompt = tokenizer.encode("The night was")
    free = Engine(model).generate_batch(prompt, 1, max_tokens=60, temperature=0)[0][0]
    stop = tokenizer.decode(free[start:end])
    first = next(n for n in range(1, 61) if stop.encode() in b"".join(tokenizer.vocab[t] for t in free[:n]))
    stopped = Engine(model, tokenizer).generate_batch(prompt, 1, max_tokens=60, temperature=0, stop=stop)[0][0]
    assert stopped == free[:first] and first >= end - start


