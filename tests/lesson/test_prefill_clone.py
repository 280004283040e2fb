"""prefill_clone.py: one prefill cloned into N rows gives what N separate runs give."""

import pytest
import torch

import cached
import prefill_clone
from helpers import PROMPT, SMALL, assert_refused, assert_usage_error, run_main, small
from model import GPT, Config
from prefill_clone import Engine
from sampling import pick

GQA = Config(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=1, n_layers=2, context=32)


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


def test_gqa_cached_equals_uncached_and_the_cache_shrinks():
    model = small(GQA)
    assert model.blocks[0].attn.qkv.weight.shape == (64 + 2 * 16, 64)
    idx = torch.tensor([PROMPT])
    assert torch.equal(model.generate_cached(idx, 27), model.generate_uncached(idx, 27))
    rows, _ = Engine(model).generate_batch(PROMPT, 1, max_tokens=27, temperature=0)
    assert rows[0] == model.generate_cached(idx, 27)[0, len(PROMPT):].tolist()
    dicts = [{} for _ in model.blocks]
    with torch.no_grad():
        model.step(torch.zeros(1, 32, dtype=torch.long), dicts, 0)
    # the post's formula, with the kv width (1 head of 16) for d_model, is what the dicts hold
    assert sum(t.nbytes for d in dicts for t in d.values()) == 2 * 2 * 32 * 16 * 4


@pytest.fixture(scope="module")
def shipped_pair(shipped):
    return shipped, cached.tokenize("tokenizer.json", "x", shipped)[0]


@pytest.mark.parametrize("start, end", [(5, 8), (3, 30), (20, 60)])
def test_a_stop_string_of_any_length_ends_the_row_where_it_first_appears(shipped_pair, start, end):
    model, tokenizer = shipped_pair
    prompt = tokenizer.encode("The night was")
    free = Engine(model).generate_batch(prompt, 1, max_tokens=60, temperature=0)[0][0]
    stop = tokenizer.decode(free[start:end])
    first = next(n for n in range(1, 61) if stop.encode() in b"".join(tokenizer.vocab[t] for t in free[:n]))
    stopped = Engine(model, tokenizer).generate_batch(prompt, 1, max_tokens=60, temperature=0, stop=stop)[0][0]
    assert stopped == free[:first] and first >= end - start


def test_past_the_window_the_engine_gives_generate_cacheds_tokens():
    model = small()
    rows, _ = Engine(model).generate_batch(PROMPT, 2, max_tokens=80, temperature=0)
    assert rows == [model.generate_cached(torch.tensor([PROMPT]), 80)[0, len(PROMPT):].tolist()] * 2


@pytest.mark.parametrize("args, message", [
    (["-n", "0"], "-n must be in 1..1000, --tokens in 1..100000"),
    (["-n", "1001"], "-n must be in 1..1000, --tokens in 1..100000"),  # before: rows until memory ran out
    (["--tokens", "-1"], "-n must be in 1..1000, --tokens in 1..100000"),
    (["--tokens", str(10**9)], "-n must be in 1..1000, --tokens in 1..100000"),  # before: ran on, held every token
    (["--seed", "-1"], "--seed in 0..2**63 - n"),
    (["--temperature", "nan"], "--temperature must be 0 (greedy) or in [1e-4, 1e4)"),
    (["--top-p", "0"], "--top-p in (0, 1]"),
    (["--seed", "abc"], "argument --seed: invalid int value: 'abc'"),
])
def test_bad_flags_are_named_by_argparse(args, message, monkeypatch, capsys):
    assert_usage_error(run_main(prefill_clone.main, ["prefill_clone.py", *args], monkeypatch, capsys), message)


def test_a_missing_checkpoint_is_one_line_and_exit_1(monkeypatch, capsys):
    run = run_main(prefill_clone.main, ["prefill_clone.py", "missing.pt"], monkeypatch, capsys)
    assert_refused(run, "prefill_clone.py: error: no checkpoint at 'missing.pt'")
