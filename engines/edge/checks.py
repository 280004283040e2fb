"""What every script and the Engine check once, at the edge, before any work.

The model, the caches and the loops trust what they are given (a bare assert
at most, for a programmer's error); a user's input is checked here, once,
with one-line errors naming what is wrong and what to do: the sampling knobs,
the memory a cache or a run's tokens would take, the Engine's arguments
(engines/edge/checkpoint.py checks a checkpoint). docs/refuses.md lists every promise.
"""
import math
import sys
from typing import NamedTuple

import torch

import bpe
from engines.edge.cli import as_id, check_count, check_fits
from engines.edge.errors import BadValue, refusing


# Sampling knobs

MIN_TEMPERATURE = 1e-4  # a floor far above float32's smallest numbers (1e-46 is 0 there); greedy is 0
PENALTY_RANGE = (1e-4, 1e4)  # beyond it, a penalized score can overflow float32 or become -inf


def check_knobs(temperature=1.0, top_k=0, top_p=1.0, penalty=1.0):
    """sampling.pick's four knobs, before the first token."""
    for name, value in (("temperature", temperature), ("top_p", top_p), ("penalty", penalty)):
        # an int past float's range (10**400) is no float32 scale either, and math.isfinite would raise on it
        if type(value) not in (int, float) or abs(value) > sys.float_info.max or not math.isfinite(value):
            raise BadValue(f"{name} must be a finite number, got {repr(value)[:40]}", name)
    if not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise BadValue(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {temperature}", "temperature")
    if type(top_k) is not int or top_k < 0:
        raise BadValue(f"top_k must be a whole number >= 0 (0 means off), got {top_k!r}", "top_k")
    if not 0 < top_p <= 1:
        raise BadValue(f"top_p must be in (0, 1] (1 means off), got {top_p}", "top_p")
    if not PENALTY_RANGE[0] <= penalty <= PENALTY_RANGE[1]:
        raise BadValue(f"penalty must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}] (1 means off), got {penalty}",
                       "penalty")


def prompt_ids(tokenizer, text, model):
    """The prompt's ids (1, T) on the model's device."""
    ids = refusing(tokenizer.encode)(text)
    if not ids:
        raise BadValue("the prompt is empty; give at least one character")
    return torch.tensor([ids], device=model.emb.weight.device)


# The Engine's front door: every argument of Engine.generate, checked once before the first step

KNOBS = ["temperature", "top_k", "top_p", "penalty"]


def cache_bytes(cfg, batch, tokens, bytes_per_value):
    """The post's formula, per row: 2 (k and v) x layers x tokens x kv width (d_model, or fewer kv heads) x bytes."""
    return 2 * cfg.n_layers * batch * tokens * cfg.n_kv_heads * cfg.head_dim * bytes_per_value


def check_cache(model, batch, max_len):
    """Refuse, before allocating it, a cache of `batch` rows x max_len positions that memory cannot hold."""
    w = model.emb.weight
    nbytes = cache_bytes(model.cfg, batch, max_len, w.element_size())
    check_fits(nbytes, f"a cache of {batch} rows x {max_len} positions", w.device)


# what one generated token costs a row that keeps it, generously: a Python int in the row's list and in
# the returned one (36 bytes each), and a long in a history or idx tensor (8)
KEPT_TOKEN_BYTES = 80


def check_kept_tokens(rows, n_tokens, device):
    """Refuse, before the first step, a generation whose kept tokens memory cannot hold: the loops keep
    every token they make, so a count like 10**11 would run for days and then fail, not finish."""
    check_fits(rows * n_tokens * KEPT_TOKEN_BYTES, f"{rows} rows x {n_tokens} tokens (the tokens they keep)", device)


def check_seeds(seed, n, name="seed"):
    """Each of n rows' seeds: seed + i for row i (a range: n may be too many rows for a list, which a later check
    refuses), or the list given, one a row; each in 0..2**64 - 1."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != n:
            raise BadValue(f"{name} is a list of {len(seed)}, but num_samples is {n}")
        return [as_id(s, name, 2**64, "the seeds", name) for s in seed]
    first = as_id(seed, name, 2**64 - n + 1, "the seeds", name)
    return range(first, first + n)


utf8_bytes = refusing(bpe.utf8_bytes)  # text as UTF-8, a lone surrogate refused by name


class Request(NamedTuple):
    """Engine.generate's arguments as its loop takes them, each checked."""
    tokens: list  # the prompt's ids
    seeds: list  # one a row
    settings: list  # sampling.pick's knobs, one dict a row
    stop_ids: set
    stop_texts: list  # as bytes
    forced: list  # one list of ids a row


def check_request(engine, tokens, num_samples, max_tokens, seed, stop, forced, knobs, served=False):
    """Engine.generate's arguments as a Request, or a one-line error naming the first that is wrong. served: a
    request of the serving engine, its prompt and max_tokens inside the model's window (the one rule, said here)."""
    model = engine.model
    if not callable(getattr(model, "step", None)):  # a plain GPT has no cached step: it would fail at the first token
        raise BadValue(f"the Engine needs a CachedGPT (cached.load gives one), got a {type(model).__name__}")
    vocab = model.cfg.vocab_size
    if any(m.training for m in model.modules()):  # one block left in training mode is enough for dropout
        raise BadValue("the model is in training mode, where dropout changes every token; call model.eval() first")
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__") or len(tokens) == 0:
        raise BadValue("the prompt must be a non-empty list of token ids", "prompt")
    context, n = model.cfg.context, len(tokens)
    if n > context - served:  # a served prompt leaves room for a token; checked before its ids, so a long one is cheap
        raise BadValue(f"the prompt is {n} tokens; at most {context - served} fit the model's {context}-token window",
                       "prompt")
    tokens = [as_id(t, "prompt token", vocab, field="prompt") for t in tokens]
    num_samples = as_id(num_samples, "num_samples", 2**63, "the counts")
    if num_samples < 1:
        raise BadValue(f"num_samples must be a whole number >= 1, got {num_samples}")
    if max_tokens is None:
        raise BadValue("give max_tokens: without a bound, a row that never meets a stop would generate forever")
    if served and (type(max_tokens) is not int or not 1 <= max_tokens <= context - n):
        raise BadValue(f"max_tokens must be in 1..{context - n}, got {max_tokens}: this prompt's {n} tokens leave "
                       f"{context - n} of the model's {context}-token window", "max_tokens")
    check_count("max_tokens", max_tokens)
    cache_len = getattr(engine, "cache_len", None)  # the lesson's dicts hold the prompt and its tokens, up to the window
    check_cache(model, num_samples, cache_len(len(tokens), max_tokens) if cache_len else
                min(model.cfg.context, len(tokens) + max_tokens))
    check_kept_tokens(num_samples, len(tokens) + max_tokens, model.emb.weight.device)
    seeds = check_seeds(seed, num_samples)
    settings = knobs.pop("settings", None)
    if settings is not None and knobs:
        raise BadValue(f"give the knobs either shared ({sorted(knobs)}) or per row in settings, not both")
    settings = [knobs] * num_samples if settings is None else list(settings)
    if len(settings) != num_samples:
        raise BadValue(f"settings is a list of {len(settings)}, but num_samples is {num_samples}")
    for s in settings:
        unknown = sorted(set(s) - set(KNOBS)) if isinstance(s, dict) else ["settings must be dicts"]
        if unknown:
            raise BadValue(f"unknown sampling knob {unknown[0]!r}; the knobs are {KNOBS}")
        check_knobs(**s)
    stops = [] if stop is None else list(stop) if isinstance(stop, (list, tuple)) else [stop]
    texts = [utf8_bytes(s) for s in stops if isinstance(s, str)]
    ids = {as_id(s, "stop token id", vocab) for s in stops if not isinstance(s, str)}
    if texts and engine.tokenizer is None:
        raise BadValue("stop strings need Engine(model, tokenizer)")
    if b"" in texts:
        raise BadValue("a stop string is empty; it would end every row at once")
    forced = [[]] * num_samples if forced is None else list(forced)
    if len(forced) != num_samples or not all(isinstance(f, (list, tuple)) for f in forced):
        raise BadValue(f"forced must be one list of ids per row ({num_samples} lists), got {forced!r:.60}")
    forced = [[as_id(t, f"forced token for row {i}:", vocab) for t in f] for i, f in enumerate(forced)]
    return Request(tokens, seeds, settings, ids, texts, forced)
