"""sampling.py: the knobs do what reference.md says, in its order, reproducibly."""
import subprocess
import sys

import pytest
import torch

from sampling import draw, pick, picker

G = torch.Generator


def test_self_check_runs_from_the_command_line():
    run = subprocess.run([sys.executable, "sampling.py"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "self-check passed" in run.stdout


def test_greedy_settings_give_the_argmax_for_every_row():
    scores = torch.randn(32, 4096, generator=G().manual_seed(3))
    best = scores.argmax(-1, keepdim=True)
    assert torch.equal(pick(scores, temperature=0), best)
    assert torch.equal(pick(scores, top_k=1), best)
    assert torch.equal(pick(scores, top_p=1e-9), best)


def test_top_k_stays_in_the_top_k_and_clamps_above_the_vocabulary():
    scores = torch.randn(8, 50, generator=G().manual_seed(4))
    top5 = scores.topk(5, -1).indices
    g = G().manual_seed(0)
    for _ in range(50):
        assert (pick(scores, top_k=5, generator=g) == top5).any(-1).all()
    assert torch.equal(pick(scores, top_k=10_000, generator=G().manual_seed(9)),
                       pick(scores, generator=G().manual_seed(9)))


def test_top_p_keeps_a_token_until_those_above_reach_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(5000, 4)
    assert set(pick(logits, top_p=0.75, generator=G().manual_seed(0)).flatten().tolist()) == {0, 1}
    assert set(pick(logits, top_p=0.81, generator=G().manual_seed(0)).flatten().tolist()) == {0, 1, 2}


def test_penalty_divides_positive_and_multiplies_negative_scores_of_seen_tokens():
    assert pick(torch.tensor([[2.0, 1.5]]), temperature=0, penalty=2.0, history=[[0]]).item() == 1
    assert pick(torch.tensor([[-1.0, -1.5]]), temperature=0, penalty=2.0, history=[[0, 0]]).item() == 1
    assert pick(torch.tensor([[-1.0, -1.5]]), temperature=0, penalty=1.4, history=[[0]]).item() == 0


def test_penalty_comes_before_temperature_zero():
    assert pick(torch.tensor([[3.0, 2.0]]), temperature=0, penalty=2.0, history=[[0]]).item() == 1


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


@pytest.mark.parametrize("knobs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_k": -1}, "top_k must be a whole number >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"penalty": 0.0}, "penalty must be > 0"),
    ({"history": [[0, 10]]}, "outside the vocabulary 0..9"),
    ({"history": [[-1]]}, "outside the vocabulary 0..9"),
])
def test_bad_knobs_are_refused_by_name(knobs, message):
    with pytest.raises(ValueError, match=message):
        pick(torch.zeros(1, 10), **knobs)


def test_picker_checks_knobs_up_front_and_uses_the_tokens_so_far_as_history():
    with pytest.raises(ValueError, match="temperature"):
        picker(temperature=-1)
    greedy_penalised = picker(temperature=0, penalty=2.0)
    assert greedy_penalised(torch.tensor([[2.0, 1.5]]), torch.tensor([[0]])).item() == 1


@pytest.mark.parametrize("knobs", [dict(temperature=0, penalty=1.3), dict(temperature=0.8, top_k=40, top_p=0.9),
                                   dict(temperature=1.2, penalty=1.3)])
def test_draw_is_pick_without_the_checks(knobs):
    scores = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    history = torch.randint(100, (4, 12), generator=torch.Generator().manual_seed(1))
    picked = pick(scores, history=history, generator=torch.Generator().manual_seed(2), **knobs)
    drawn = draw(scores, history=history, generator=torch.Generator().manual_seed(2), **knobs)
    assert torch.equal(picked, drawn)
