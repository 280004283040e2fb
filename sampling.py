"""The four sampling knobs: repetition penalty, temperature, top-k, top-p.

pick(logits, ...) turns last-position scores (B, vocab) into one token per row
(B,): the penalty on every token in `history` (prompt included), temperature (0
is argmax), top-k, top-p, then a draw with `generator`. Each script checks its knobs
at its command line. `python sampling.py` runs the self-check.
"""
import argparse

import torch


def pick(logits, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, history=None, generator=None):
    """generator: one for every row, or a list of one per row (each row then draws what it would alone)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)  # float64 stays float64
    if penalty != 1.0 and history is not None:
        history = history.expand(len(logits), -1)  # one history row serves every row
        seen = logits.gather(-1, history)
        # Divide positive scores, multiply negative ones: both push the token down.
        logits.scatter_(-1, history, torch.where(seen > 0, seen / penalty, seen * penalty))
        if not torch.isfinite(logits).all():  # no draw is honest from a score pushed past the dtype's range
            raise ValueError(f"penalty {penalty} pushes a score past {logits.dtype}'s range; "
                           "use a penalty nearer 1 (docs/refuses.md states the limit)")
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits / temperature
    # A finite score over a small temperature can overflow to inf (softmax then gives NaN). Softmax is
    # unchanged by subtracting a row's top score, so such rows are shifted first; the rest draw as before.
    overflows = scaled.amax(-1, keepdim=True).isinf()
    logits = torch.where(overflows, (logits - logits.amax(-1, keepdim=True)) / temperature, scaled)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token if the tokens ranked above it already reach p. The top token always survives
        # (kept by hand: a top_p too small for float32 compares as 0, and the top token has 0 above it).
        drop = probs.cumsum(-1) - probs >= top_p
        drop[:, 0] = False
        logits.scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    if isinstance(generator, list):
        assert len(generator) == len(probs), "one generator per row"
        return torch.cat([torch.multinomial(row[None], 1, generator=g)[:, 0] for row, g in zip(probs, generator)])
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def self_check():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 100, generator=g)
    best = scores.argmax(dim=-1)
    assert torch.equal(pick(scores, temperature=0), best), "temperature 0 is argmax"
    assert torch.equal(pick(scores, top_k=1, generator=g), best), "top_k=1 is argmax"
    assert torch.equal(pick(scores, top_p=1e-6, generator=g), best), "a tiny top_p is argmax"
    top5, draws = scores.topk(5, dim=-1).indices, [pick(scores, top_k=5, generator=g) for _ in range(20)]
    assert all((d[:, None] == top5).any(-1).all() for d in draws), "top_k=5 stays in the top 5"
    quarter = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(2000, 4)
    assert set(pick(quarter, top_p=0.75, generator=g).flatten().tolist()) == {0, 1}, "top_p=0.75 keeps two"
    assert pick(torch.tensor([[2.0, 1.5]]), temperature=0, penalty=2.0, history=torch.tensor([[0]])) == 1, "penalty"
    probs, n = torch.tensor([0.4, 0.3, 0.2, 0.1]), 200_000
    freq = torch.bincount(pick(probs.log().expand(n, 4), generator=g), minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.006, f"temperature 1 samples the softmax: {freq.tolist()}"
    return freq


def main():
    argparse.ArgumentParser(description="Self-check of pick(): the reference cases and the draw frequencies.").parse_args()
    try:
        freq = self_check()
    except AssertionError as e:
        raise SystemExit(f"sampling.py: self-check failed: {e}") from None
    print("temperature 0, top_k=1 and top_p=1e-6 give the argmax; top_k=5 stays in the top 5; top_p=0.75 over "
          "[0.5, 0.3, 0.15, 0.05] keeps the first two; penalty 2.0 on [2.0, 1.5], history [0], picks 1")
    print("temperature 1 draw frequencies " + ", ".join(f"{f:.3f}" for f in freq) + " for softmax 0.4, 0.3, 0.2, 0.1")
    print("self-check passed")


if __name__ == "__main__":
    main()
