"""The four sampling knobs: repetition penalty, temperature, top-k, top-p.

pick(logits, ...) turns a batch of last-position scores (B, vocab) into one
token per row, shape (B,), applying, in this order: the repetition penalty on
every token in `history` (prompt included), temperature (0 means argmax),
top-k, top-p, then a draw from the softmax with `generator`. The generate
loops append it as pick(logits, idx)[:, None].

    python sampling.py

runs the self-check: the reference cases and a draw-frequency check that
temperature 1 samples the softmax.
"""
import math
import sys
import time

import torch

from cli import Parser

MIN_TEMPERATURE = 1e-4  # below it, scores divided by the temperature can overflow float32
PENALTY_RANGE = (1e-4, 1e4)  # beyond it, a penalized score can overflow float32 or become -inf


def check_knobs(temperature=1.0, top_k=0, top_p=1.0, penalty=1.0):
    for name, value in (("temperature", temperature), ("top_p", top_p), ("penalty", penalty)):
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {temperature}")
    if type(top_k) is not int or top_k < 0:
        raise ValueError(f"top_k must be a whole number >= 0 (0 means off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 means off), got {top_p}")
    if not PENALTY_RANGE[0] <= penalty <= PENALTY_RANGE[1]:
        raise ValueError(f"penalty must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}] (1 means off), got {penalty}")


ID_DTYPES = (torch.int64, torch.int32)  # not bool or uint8: those are masks and bytes, not ids


def check_history(logits, history):
    """history as a (B or 1, T) tensor of ids the logits' vocabulary has."""
    history = torch.as_tensor(history, device=logits.device)
    if history.dim() != 2 or history.shape[0] not in (1, logits.shape[0]) or history.dtype not in ID_DTYPES:
        raise ValueError(f"history must be integer ids (int64 or int32) shaped (1, T) or ({logits.shape[0]}, T) "
                         f"for {logits.shape[0]} rows, got {history.dtype} {tuple(history.shape)}")
    vocab = logits.shape[-1]
    if history.numel() and (history.min() < 0 or history.max() >= vocab):
        raise ValueError(f"history holds ids outside the vocabulary 0..{vocab - 1}")
    return history.long()


def pick(logits, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, history=None, generator=None):
    """One token per row (B,) from scores (B, vocab); every input checked first."""
    check_knobs(temperature, top_k, top_p, penalty)
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.is_floating_point()
            and logits.shape[0] > 0 and logits.shape[1] > 0):
        raise ValueError(f"logits must be a float tensor (B, vocab), got {getattr(logits, 'shape', type(logits))}")
    if not torch.isfinite(logits).all():
        raise ValueError("logits hold NaN or infinite scores; no token can be chosen honestly from them")
    if history is not None:
        history = check_history(logits, history)
    return draw(logits, temperature, top_k, top_p, penalty, history, generator)


def draw(logits, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, history=None, generator=None):
    """pick without its checks, for the loops that checked their inputs once, before the first token.

    generator: one for all rows, or a list of one per row (each row then draws what it would alone)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64: no overflow
    vocab = logits.shape[-1]
    if history is not None and penalty != 1.0:
        history = history.expand(logits.shape[0], -1)
        seen = logits.gather(1, history)
        # Divide positive scores, multiply negative ones: both push a seen token down.
        logits = logits.scatter(1, history, torch.where(seen > 0, seen / penalty, seen * penalty))
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < vocab:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the tokens ranked above it reach p; the top token always survives,
        # even for a top_p too small for the scores' precision.
        above = probs.cumsum(dim=-1) - probs
        drop = above >= top_p
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if isinstance(generator, list):
        return torch.cat([torch.multinomial(row[None], 1, generator=g)[:, 0] for row, g in zip(probs, generator)])
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def picker(generator=None, **knobs):
    """A pick(logits, idx) for the generate loops, the tokens so far as history."""
    check_knobs(**knobs)
    return lambda logits, idx: draw(logits, history=idx, generator=generator, **knobs)


def self_check():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 100, generator=g)
    best = scores.argmax(dim=-1)
    assert torch.equal(pick(scores, temperature=0), best), "temperature 0 is argmax"
    assert torch.equal(pick(scores, top_k=1, generator=g), best), "top_k=1 is argmax"
    assert torch.equal(pick(scores, top_p=1e-6, generator=g), best), "a tiny top_p is argmax"
    top5 = scores.topk(5, dim=-1).indices
    for _ in range(20):
        assert (pick(scores, top_k=5, generator=g)[:, None] == top5).any(dim=-1).all(), "top_k=5 stays in the top 5"
    quarter = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(2000, 4)
    assert set(pick(quarter, top_p=0.75, generator=g).flatten().tolist()) == {0, 1}, "top_p=0.75 keeps two"
    assert pick(torch.tensor([[2.0, 1.5]]), temperature=0, penalty=2.0, history=[[0]]).item() == 1, "penalty"
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 200_000
    draws = pick(probs.log().expand(n, 4), generator=g).flatten()
    freq = torch.bincount(draws, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.006, f"temperature 1 samples the softmax: {freq.tolist()}"
    return freq


def main():
    Parser(description="Self-check of pick(): the reference cases, and that temperature 1 samples the softmax. "
                       "Takes no arguments.").parse_args()
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


if __name__ == "__main__":
    main()
