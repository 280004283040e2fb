"""The four sampling knobs: repetition penalty, temperature, top-k, top-p.

pick(logits, ...) turns a batch of last-position scores (B, vocab) into one
token per row (B, 1), applying, in this order: the repetition penalty on every
token in `history` (prompt included), temperature (0 means argmax), top-k,
top-p, then a draw from the softmax with `generator`.

    python sampling.py

runs the self-check: the reference cases and a draw-frequency check that
temperature 1 samples the softmax.
"""
import sys
import time

import torch


def check_knobs(temperature=1.0, top_k=0, top_p=1.0, penalty=1.0):
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a whole number >= 0 (0 means off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 means off), got {top_p}")
    if not penalty > 0:
        raise ValueError(f"penalty must be > 0 (1 means off), got {penalty}")


def pick(logits, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, history=None, generator=None):
    check_knobs(temperature, top_k, top_p, penalty)
    if history is not None:
        vocab = logits.shape[-1]
        history = torch.as_tensor(history, device=logits.device)
        if history.numel() and (history.min() < 0 or history.max() >= vocab):
            raise ValueError(f"history holds ids outside the vocabulary 0..{vocab - 1}")
    return draw(logits, temperature, top_k, top_p, penalty, history, generator)


def draw(logits, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, history=None, generator=None):
    """pick without its checks, for the loops that checked the knobs once, before the first token."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    vocab = logits.shape[-1]
    if history is not None:
        history = torch.as_tensor(history, device=logits.device).reshape(logits.shape[0], -1)
    if history is not None and penalty != 1.0:
        seen = logits.gather(1, history)
        logits = logits.scatter(1, history, torch.where(seen > 0, seen / penalty, seen * penalty))
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if 0 < top_k < vocab:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        above = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(above >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


def picker(generator=None, **knobs):
    """A pick(logits, idx) for the generate loops, the tokens so far as history."""
    check_knobs(**knobs)
    return lambda logits, idx: draw(logits, history=idx, generator=generator, **knobs)


def self_check():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 100, generator=g)
    best = scores.argmax(dim=-1, keepdim=True)
    assert torch.equal(pick(scores, temperature=0), best), "temperature 0 is argmax"
    assert torch.equal(pick(scores, top_k=1, generator=g), best), "top_k=1 is argmax"
    assert torch.equal(pick(scores, top_p=1e-6, generator=g), best), "a tiny top_p is argmax"
    top5 = scores.topk(5, dim=-1).indices
    for _ in range(20):
        assert (pick(scores, top_k=5, generator=g) == top5).any(dim=-1).all(), "top_k=5 stays in the top 5"
    quarter = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(2000, 4)
    assert set(pick(quarter, top_p=0.75, generator=g).flatten().tolist()) == {0, 1}, "top_p=0.75 keeps two"
    assert pick(torch.tensor([[2.0, 1.5]]), temperature=0, penalty=2.0, history=[[0]]).item() == 1, "penalty"
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 200_000
    draws = pick(probs.log().expand(n, 4), generator=g).flatten()
    freq = torch.bincount(draws, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.006, f"temperature 1 samples the softmax: {freq.tolist()}"
    return freq


if __name__ == "__main__":
    t0 = time.time()
    try:
        freq = self_check()
    except AssertionError as e:
        sys.exit(f"sampling.py: self-check failed: {e}")
    print("temperature 0, top_k=1 and top_p=1e-6 all give the argmax")
    print("top_k=5 never leaves the top 5; top_p=0.75 over [0.5, 0.3, 0.15, 0.05] picks only the first two")
    print("penalty 2.0 on scores [2.0, 1.5] with history [0] picks 1")
    print("temperature 1 draw frequencies " + ", ".join(f"{f:.3f}" for f in freq) + " for softmax 0.4, 0.3, 0.2, 0.1")
    print(f"self-check passed in {time.time() - t0:.2f}s")
