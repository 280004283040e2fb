"""What every script and the Engine check once, at the edge, before any work."""
import math

import torch

# Sampling knobs

MIN_TEMPERATURE = 1e-4  # a floor far above float32's smallest numbers (1e-46 is 0 there); greedy is 0
PENALTY_RANGE = (1e-4, 1e4)  # beyond it, a penalized score can overflow float32 or become -inf
ID_DTYPES = (torch.int64, torch.int32)  # not bool or uint8: those are masks and bytes, not ids


def check_knobs(temperature=1.0, top_k=0, top_p=1.0, penalty=1.0):
    """sampling.pick's four knobs, before the first token."""
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


def check_history(logits, history):
    """history as a (B or 1, T) tensor of ids the logits' vocabulary has; returns it as pick takes it (int64)."""
    history = torch.as_tensor(history, device=logits.device)
    if history.dim() != 2 or history.shape[0] not in (1, logits.shape[0]) or history.dtype not in ID_DTYPES:
        raise ValueError(f"history must be integer ids (int64 or int32) shaped (1, T) or ({logits.shape[0]}, T) "
                         f"for {logits.shape[0]} rows, got {history.dtype} {tuple(history.shape)}")
    vocab = logits.shape[-1]
    if history.numel() and (history.min() < 0 or history.max() >= vocab):
        raise ValueError(f"history holds ids outside the vocabulary 0..{vocab - 1}")
    return history.long()


def check_pick(logits, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, history=None, generator=None):
    """Everything sampling.pick takes, for a caller handing it scores of its own; returns history as pick
    takes it. pick itself trusts its inputs: the generate loops and the Engine check theirs before the loop."""
    check_knobs(temperature, top_k, top_p, penalty)
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.is_floating_point()
            and logits.shape[0] > 0 and logits.shape[1] > 0):
        raise ValueError(f"logits must be a float tensor (B, vocab), got {getattr(logits, 'shape', type(logits))}")
    if not torch.isfinite(logits).all():
        raise ValueError("logits hold NaN or infinite scores; no token can be chosen honestly from them")
    if isinstance(generator, list) and len(generator) != logits.shape[0]:
        raise ValueError(f"generator is a list of {len(generator)}, but the logits have {logits.shape[0]} rows; "
                         "give one generator, or one per row")
    return None if history is None else check_history(logits, history)
