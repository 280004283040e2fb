"""sampling.py: the knobs do what reference.md says, in its order, reproducibly; engines/edge/checks.py refuses what
pick would have to guess at."""
import re

import pytest
import torch

from sampling import pick

G = torch.Generator


def test_greedy_settings_give_the_argmax_for_every_row():
    scores = torch.randn(32, 4096, generator=G().manual_seed(3))
    best = scores.argmax(-1)
    assert torch.equal(pick(scores, temperature=0), best)
    assert torch.equal(pick(scores, top_k=1), best)
    assert torch.equal(pick(scores, top_p=1e-9), best)


def test_top_k_stays_in_the_top_k_and_clamps_above_the_vocabulary():
    scores = torch.randn(8, 50, generator=G().manual_seed(4))
    top5 = scores.topk(5, -1).indices
    g = G().manual_seed(0)
    for _ in range(50):
        assert (pick(scores, top_k=5, generator=g)[:, None] == top5).any(-1).all()
    assert torch.equal(pick(scores, top_k=10_000, generator=G().manual_seed(9)),
                       pick(scores, generator=G().manual_seed(9)))


def test_top_p_keeps_a_token_until_those_above_reach_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(5000, 4)
    assert set(pick(logits, top_p=0.75, generator=G().manual_seed(0)).flatten().tolist()) == {0, 1}
    assert set(pick(logits, top_p=0.81, generator=G().manual_seed(0)).flatten().tolist()) == {0, 1, 2}


def test_penalty_divides_positive_and_multiplies_negative_scores_of_seen_tokens():
    zero = torch.tensor([[0]])
    assert pick(torch.tensor([[2.0, 1.5]]), temperature=0, penalty=2.0, history=zero).item() == 1
    assert pick(torch.tensor([[-1.0, -1.5]]), temperature=0, penalty=2.0, history=torch.tensor([[0, 0]])).item() == 1
    assert pick(torch.tensor([[-1.0, -1.5]]), temperature=0, penalty=1.4, history=zero).item() == 0


def test_penalty_comes_before_temperature_zero():
    assert pick(torch.tensor([[3.0, 2.0]]), temperature=0, penalty=2.0, history=torch.tensor([[0]])).item() == 1


def test_pick_leaves_the_callers_scores_as_they_were():
    scores = torch.tensor([[3.0, 2.0]])
    pick(scores, top_k=1, top_p=0.5, penalty=2.0, history=torch.tensor([[0]]), generator=G().manual_seed(0))
    assert scores.tolist() == [[3.0, 2.0]]


def test_temperature_one_samples_the_softmax_and_low_temperature_sharpens():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 100_000
    draws = pick(probs.log().expand(n, 4), generator=G().manual_seed(1)).flatten()
    assert (torch.bincount(draws, minlength=4) / n - probs).abs().max() < 0.01
    cold = pick(probs.log().expand(n, 4), temperature=0.25, generator=G().manual_seed(1)).flatten()
    assert (cold == 0).float().mean() > 0.7


def test_a_generator_makes_draws_reproducible():
    scores = torch.randn(4, 100, generator=G().manual_seed(5))
    a = pick(scores, temperature=1.2, top_p=0.9, generator=G().manual_seed(7))
    b = pick(scores, temperature=1.2, top_p=0.9, generator=G().manual_seed(7))
    assert torch.equal(a, b)


def test_pick_returns_one_id_per_row_for_the_posts_loops():
    scores = torch.randn(3, 50, generator=G().manual_seed(0))
    assert pick(scores, temperature=0).shape == (3,)
    assert pick(scores, generator=G().manual_seed(1)).shape == (3,)
    idx = torch.zeros(3, 4, dtype=torch.long)
    assert torch.cat([idx, pick(scores, temperature=0, penalty=2.0, history=idx)[:, None]], dim=1).shape == (3, 5)


def test_pick_never_answers_for_fewer_rows_than_it_was_given():
    with pytest.raises(AssertionError, match="one generator per row"):
        pick(torch.randn(4, 50), generator=[G()])


def test_row_i_with_its_own_generator_draws_what_it_draws_alone():
    scores = torch.randn(5, 100, generator=G().manual_seed(6))
    knobs = dict(temperature=1.3, top_k=40, top_p=0.9)
    together = pick(scores, generator=[G().manual_seed(10 + i) for i in range(5)], **knobs)
    alone = [pick(scores[i:i + 1], generator=G().manual_seed(10 + i), **knobs).item() for i in range(5)]
    assert together.tolist() == alone


def test_a_one_row_history_applies_to_every_row():
    scores = torch.tensor([[2.0, 1.5], [2.0, 1.5]])
    assert pick(scores, temperature=0, penalty=2.0, history=torch.tensor([[0]])).tolist() == [1, 1]
    assert pick(scores, temperature=0, penalty=2.0, history=torch.tensor([[0], [1]])).tolist() == [1, 0]


def test_float64_scores_beyond_float32s_range_keep_their_order():
    scores = torch.tensor([[1e39, 3e39, 2e39]], dtype=torch.float64)
    assert pick(scores, temperature=0).item() == 1
    assert pick(scores, top_k=1, generator=G().manual_seed(0)).item() == 1


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-300])
def test_a_top_p_below_float32s_precision_is_exactly_argmax(top_p):
    scores = torch.randn(64, 100, generator=G().manual_seed(3))
    assert torch.equal(pick(scores, top_p=top_p, generator=G().manual_seed(0)), scores.argmax(dim=-1))


@pytest.mark.parametrize("penalty", [1e-4, 1e4])
def test_the_penalty_range_ends_still_give_a_token_from_real_scores(penalty):
    scores = torch.randn(8, 100, generator=G().manual_seed(4)) * 20
    history = torch.arange(100).expand(8, -1)
    tokens = pick(scores, penalty=penalty, history=history, generator=G().manual_seed(0))
    assert tokens.shape == (8,) and bool(((0 <= tokens) & (tokens < 100)).all())


def test_float64_scores_stay_float64_where_float32_would_tie_them():
    scores = torch.tensor([[1.0, 1.0 + 1e-12]], dtype=torch.float64)
    assert pick(scores, temperature=0).item() == 1 and pick(scores, top_k=1, generator=G()).item() == 1


@pytest.mark.parametrize("scores, temperature, dtype", [
    ([1e35, 1e35, 0.0], 1e-4, torch.float32),
    ([3e38, 3e38, -3e38], 0.5, torch.float32),
    ([1e306, 1e306, 0.0], 1e-4, torch.float64),
])
def test_finite_scores_that_overflow_after_the_temperature_still_sample(scores, temperature, dtype):
    # past float's range only ties are left to draw between: the two top scores, each about half the time
    rows = torch.tensor([scores], dtype=dtype).expand(4000, 3)
    counts = torch.bincount(pick(rows, temperature=temperature, generator=G().manual_seed(0)), minlength=3)
    assert counts[2] == 0 and abs(counts[0] - counts[1]) < 300
    assert pick(torch.tensor([[1e35, 0.0]]), temperature=1e-4, top_p=0.9, generator=G()).item() == 0


def test_scores_that_do_not_overflow_draw_exactly_as_the_plain_division_does():
    # the overflow guard changes no draw for ordinary scores, even beside a row that overflows
    scores = torch.randn(64, 500, generator=G().manual_seed(8)) * 4
    plain = torch.multinomial((scores / 0.7).softmax(-1), 1, generator=G().manual_seed(2))[:, 0]
    assert torch.equal(pick(scores, temperature=0.7, generator=G().manual_seed(2)), plain)
    scores[0, 0] = 1e36
    tokens = pick(scores, temperature=0.7, generator=[G().manual_seed(i) for i in range(64)])
    assert tokens[0] == 0 and tokens[1:].tolist() == [
        torch.multinomial((row / 0.7).softmax(-1), 1, generator=G().manual_seed(i)).item()
        for i, row in enumerate(scores[1:], start=1)]


@pytest.mark.parametrize("scores, seen, penalty", [
    ([1e35, 0.0, 0.0], [0], 1e-4),  # divided past float32's range: +inf
    ([3e38, 2.9e38, 0.0], [0, 1], 1e-4),
    ([-1e35, -1e35, -1e35], [0, 1, 2], 1e4),  # every score of the row multiplied to -inf
])
@pytest.mark.parametrize("temperature", [1.0, 0])
def test_a_penalty_that_pushes_a_score_past_float32_is_refused_by_name(scores, seen, penalty, temperature):
    with pytest.raises(ValueError, match=re.escape(f"penalty {penalty} pushes a score past torch.float32's range")):
        pick(torch.tensor([scores]), temperature=temperature, penalty=penalty, history=torch.tensor([seen]),
             generator=G())