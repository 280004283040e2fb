"""FastEngine's front door: every argument of generate checked once (engines/edge/checks.check_request), one
line naming the first that is wrong, before the first step."""
import pytest
import torch

from engines.fast.engine import FastEngine
from helpers import PROMPT, SMALL, small
from model import GPT


def Engine(model, tokenizer=None):
    return FastEngine(model, tokenizer, kernel="nn")


@pytest.mark.parametrize("call, message", [
    (dict(num_samples=0), "num_samples must be a whole number >= 1"),
    (dict(max_tokens=-1), "max_tokens must be a whole number >= 0"),
    (dict(max_tokens=10**12), r"1 rows x 1000000000005 tokens \(the tokens they keep\) needs "),
    (dict(tokens=[]), "prompt must be a non-empty list"),
    (dict(tokens=list(range(33))), "the prompt is 33 tokens; at most 32 fit the model's 32-token window"),
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


