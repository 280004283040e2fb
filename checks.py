"""What every script and the Engine check once, at the edge, before any work; and the checkpoint file.

The model, the caches and the loops trust what they are given (a bare assert
at most, for a programmer's error); a user's input is checked here, once,
with one-line errors naming what is wrong and what to do: a checkpoint and
its config, a tokenizer beside it, the Engine's arguments. docs/refuses.md
lists every promise.
"""
import math
import os
import sys
import warnings
import zipfile
from dataclasses import fields

import torch

from bpe import BPE, utf8_bytes
from cli import as_id, check_count, check_fits, device_from
from files import atomic_write, check_input, shown
from errors import BadValue
from model import GPT, Config, in_training


# Sampling knobs

MIN_TEMPERATURE = 1e-4  # a floor far above float32's smallest numbers (1e-46 is 0 there); greedy is 0
PENALTY_RANGE = (1e-4, 1e4)  # beyond it, a penalized score can overflow float32 or become -inf
ID_DTYPES = (torch.int64, torch.int32)  # not bool or uint8: those are masks and bytes, not ids


def check_knobs(temperature=1.0, top_k=0, top_p=1.0, penalty=1.0):
    """sampling.pick's four knobs, before the first token."""
    for name, value in (("temperature", temperature), ("top_p", top_p), ("penalty", penalty)):
        # an int past float's range (10**400) is no float32 scale either, and math.isfinite would raise on it
        if type(value) not in (int, float) or abs(value) > sys.float_info.max or not math.isfinite(value):
            raise BadValue(f"{name} must be a finite number, got {repr(value)[:40]}")
    if not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise BadValue(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {temperature}")
    if type(top_k) is not int or top_k < 0:
        raise BadValue(f"top_k must be a whole number >= 0 (0 means off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise BadValue(f"top_p must be in (0, 1] (1 means off), got {top_p}")
    if not PENALTY_RANGE[0] <= penalty <= PENALTY_RANGE[1]:
        raise BadValue(f"penalty must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}] (1 means off), got {penalty}")


def check_history(logits, history):
    """history as a (B or 1, T) tensor of ids the logits' vocabulary has; returns it as pick takes it (int64)."""
    history = torch.as_tensor(history, device=logits.device)
    if history.dim() != 2 or history.shape[0] not in (1, logits.shape[0]) or history.dtype not in ID_DTYPES:
        raise BadValue(f"history must be integer ids (int64 or int32) shaped (1, T) or ({logits.shape[0]}, T) "
                         f"for {logits.shape[0]} rows, got {history.dtype} {tuple(history.shape)}")
    vocab = logits.shape[-1]
    if history.numel() and (history.min() < 0 or history.max() >= vocab):
        raise BadValue(f"history holds ids outside the vocabulary 0..{vocab - 1}")
    return history.long()


def check_pick(logits, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, history=None, generator=None):
    """Everything sampling.pick takes, for a caller handing it scores of its own; returns history as pick
    takes it. pick itself trusts its inputs: the generate loops and the Engine check theirs before the loop."""
    check_knobs(temperature, top_k, top_p, penalty)
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.is_floating_point()
            and logits.shape[0] > 0 and logits.shape[1] > 0):
        raise BadValue(f"logits must be a float tensor (B, vocab), got {getattr(logits, 'shape', type(logits))}")
    if not torch.isfinite(logits).all():
        raise BadValue("logits hold NaN or infinite scores; no token can be chosen honestly from them")
    drawn_with = generator if isinstance(generator, list) else [] if generator is None else [generator]
    if not all(isinstance(g, torch.Generator) for g in drawn_with):
        raise BadValue(f"generator must be a torch.Generator or a list of one per row, got {generator!r:.60}")
    if isinstance(generator, list) and len(generator) != logits.shape[0]:
        raise BadValue(f"generator is a list of {len(generator)}, but the logits have {logits.shape[0]} rows; "
                         "give one generator, or one per row")
    return None if history is None else check_history(logits, history)


# Checkpoints: Part 3's format, read as data and checked before anything is built

MAX_CHECKPOINT_BYTES = 2**34  # 16 GiB: a model this repo can run on a laptop is far smaller


def check_archive(path):
    """torch.save's zip, checked before torch reads it: every entry stored as it is (torch.save compresses
    none, and a compressed entry can inflate to any size) and every entry's CRC right (torch never checks
    them, so one flipped bit in a weight would load and quietly generate other text)."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        return  # not a zip: torch.load says what it is
    with archive:
        packed = next((i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED), None)
        if packed:
            raise BadValue(f"{shown(path)}: entry {packed!r} is compressed, which torch.save never does; "
                             "this file was not written by torch.save")
        damaged = archive.testzip()
    if damaged:
        raise BadValue(f"{shown(path)} is damaged: entry {damaged!r} fails its checksum; copy or download it again")


def read_checkpoint(path):
    """The checkpoint's dict, loaded as data (weights_only), or a one-line error."""
    check_input(path, "checkpoint", MAX_CHECKPOINT_BYTES, "pass a Part 3 .pt file or train one")
    check_fits(os.path.getsize(path), f"checkpoint {shown(path)}", "cpu")
    check_archive(path)
    try:
        with warnings.catch_warnings():  # torch's pickle-protocol warning would break the one-line error
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if "Weights only load failed" in str(e):
            raise BadValue(f"{shown(path)} is not a plain-tensor checkpoint: it is not a torch.save file, or it holds "
                             "code or objects that are not plain tensors and must not be loaded") from None
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadValue(f"{shown(path)} is not a loadable checkpoint ({first_line})") from None
    if not (isinstance(ckpt, dict) and isinstance(ckpt.get("model"), dict) and isinstance(ckpt.get("config"), dict)):
        raise BadValue(f"{shown(path)} is not a Part 3 checkpoint: expected a dict with 'model' (state dict) and 'config'")
    for part in ("model", "config"):
        odd = next((k for k in ckpt[part] if not isinstance(k, str)), None)
        if odd is not None:
            raise BadValue(f"{shown(path)}: its {part} dict has a key {odd!r} that is not a name; "
                             "is this a Part 3 checkpoint?")
    return ckpt


PART3_FIELDS = ("vocab_size", "d_model", "n_heads", "n_layers", "context", "dropout")
SHAPE_FIELDS = PART3_FIELDS[:-1]  # dropout changes nothing at inference
MODULE_BYTES = 2**16  # what the Python objects of one block cost beyond its weights, roughly


def parameter_count(cfg):
    """The weights a Config asks for (tied head counted once), computed without building anything."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    block = d * (d + 2 * kv) + d * d + 2 * (4 * d * d) + 4 * d + d + 4 * d
    return cfg.vocab_size * d + cfg.n_layers * block + 2 * d


MAX_CONTEXT = 2**24  # the last whole number float32 holds exactly, and rope_at's positions are float32


def check_config(cfg):
    """Every Config value a model can be built from, named when it is not."""
    sizes = {f: getattr(cfg, f) for f in ("vocab_size", "d_model", "n_heads", "n_layers", "context", "n_kv_heads")}
    bad = next((f for f, v in sizes.items() if type(v) is not int or v < 1), None)
    if bad:
        raise BadValue(f"config {bad} is {sizes[bad]!r}; expected a whole number >= 1")
    if type(cfg.dropout) not in (int, float) or not 0 <= cfg.dropout < 1:
        raise BadValue(f"config dropout is {cfg.dropout!r}; expected a number in [0, 1)")
    if cfg.d_model % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        raise BadValue(f"d_model ({cfg.d_model}) must divide by n_heads ({cfg.n_heads}) "
                         f"and n_heads by n_kv_heads ({cfg.n_kv_heads})")
    if cfg.head_dim % 2:
        raise BadValue(f"head_dim d_model / n_heads = {cfg.head_dim} is odd; RoPE turns channel pairs")
    if cfg.context > MAX_CONTEXT:
        raise BadValue(f"config context is {cfg.context:,}; RoPE's positions are float32, exact only up to "
                         f"{MAX_CONTEXT:,} (2**24)")
    return cfg


def config_from(d, path="checkpoint"):
    """A Config from a checkpoint's config dict: every field that shapes the model present (a missing one
    would silently take Part 3's default and build another model), no unknown field, and a model that
    fits memory."""
    known = [f.name for f in fields(Config)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise BadValue(f"{shown(path)}: unknown config field {unknown[0]!r}; known fields are {known}")
    missing = [f for f in SHAPE_FIELDS if f not in d]
    if missing:
        raise BadValue(f"{shown(path)}: its config lacks {missing[0]!r}; a checkpoint's config holds every field that "
                         f"shapes the model, {list(SHAPE_FIELDS)} (dropout, and n_kv_heads, may be left to their defaults)")
    if "n_kv_heads" in d and d["n_kv_heads"] in (0, False):
        raise BadValue(f"{shown(path)}: config n_kv_heads is {d['n_kv_heads']!r}; expected a whole number >= 1")
    try:
        cfg = check_config(Config(**d))
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise BadValue(f"{shown(path)}: {e}") from None
    check_fits(4 * parameter_count(cfg) + MODULE_BYTES * cfg.n_layers,
               f"{shown(path)}: the model its config describes ({cfg.n_layers} layers of width {cfg.d_model}, "
               f"vocabulary {cfg.vocab_size})", "cpu")
    return cfg


def check_state_dict(given, expected, path):
    """Every weight the model needs, a dense finite float tensor of the right shape, and no other."""
    for key, want in expected.items():
        got = given.get(key)
        if got is None:
            raise BadValue(f"{shown(path)}: weight {key!r} is missing; is this a Part 3 checkpoint?")
        if not isinstance(got, torch.Tensor):
            raise BadValue(f"{shown(path)}: weight {key!r} is a {type(got).__name__}, not a tensor")
        if got.layout != torch.strided or got.is_meta:
            raise BadValue(f"{shown(path)}: weight {key!r} is a {got.layout} {got.device.type} tensor; "
                             "a checkpoint holds dense tensors with values")
        if tuple(got.shape) != tuple(want.shape):
            raise BadValue(f"{shown(path)}: weight {key!r} has shape {tuple(got.shape)} "
                             f"but the config needs {tuple(want.shape)}")
        if not got.is_floating_point() or not torch.isfinite(got).all():
            raise BadValue(f"{shown(path)}: weight {key!r} holds NaN, infinite or non-float values; "
                             "this checkpoint cannot give meaningful output")
    extra = sorted(set(given) - set(expected))
    if extra:
        raise BadValue(f"{shown(path)}: unexpected weight {extra[0]!r}; is this a Part 3 checkpoint?")
    if not torch.equal(given["head.weight"], given["emb.weight"]):
        # the model ties the two: loading would keep one and silently drop the other
        raise BadValue(f"{shown(path)}: head.weight differs from emb.weight, but Part 3's model ties them (one matrix); "
                         "this checkpoint is of another model")


def load_checkpoint(path, device="cpu", cls=GPT):
    """A model from a Part 3 checkpoint, in eval mode on `device`; config and weights checked
    (against a model built on the meta device, which allocates nothing) before anything is built."""
    device = device_from(device) if isinstance(device, str) else device
    ckpt = read_checkpoint(path)
    cfg = config_from(ckpt["config"], path)
    with torch.device("meta"):
        expected = cls(cfg).state_dict()
    check_state_dict(ckpt["model"], expected, path)
    model = cls(cfg)
    model.load_state_dict(ckpt["model"], strict=True)
    model.trained_with = ckpt.get("tokenizer")  # what save_checkpoint recorded of the tokenizer, if anything
    return model.to(device).eval()


def part3_config(cfg):
    """The config dict a checkpoint holds: Part 3's six fields, n_kv_heads only when it is not n_heads,
    so Part 3's own loader (Config(**ckpt["config"]) on a six-field dataclass) reads what this repo writes."""
    d = {name: getattr(cfg, name) for name in PART3_FIELDS}
    return d | ({"n_kv_heads": cfg.n_kv_heads} if cfg.n_kv_heads != cfg.n_heads else {})


def save_checkpoint(model, path, step, tokenizer=None, force=False):
    """Part 3's checkpoint format, through a new temporary file and a rename, so a cut run leaves no half file.

    tokenizer: what bpe.BPE.record() says of the tokenizer it was trained with; kept beside
    the config, not in it, so Part 3's loader still reads the file. An existing file at `path` is
    replaced only with force."""
    ckpt = {"model": model.state_dict(), "config": part3_config(model.cfg), "step": step}
    with atomic_write(path, force=force) as f:
        torch.save(ckpt | ({"tokenizer": tokenizer} if tokenizer else {}), f)


# A checkpoint's tokenizer, and a prompt

def tokenizer_for(model, checkpoint, tokenizer_path):
    """The tokenizer at tokenizer_path, refused if it is not the one the checkpoint records, or, for a
    checkpoint that records none (Part 3's), if its vocabulary differs in size."""
    tokenizer = BPE.load(tokenizer_path)
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise BadValue(f"{shown(tokenizer_path)} has {tokenizer.vocab_size} tokens but {shown(checkpoint)} a vocabulary of "
                         f"{model.cfg.vocab_size}; give the tokenizer this checkpoint was trained with (--tokenizer)")
    trained_with = model.trained_with
    if trained_with is None:
        print(f"note: {shown(checkpoint)} does not record its tokenizer; assuming {shown(tokenizer_path)} (--tokenizer)",
              file=sys.stderr)
    elif not isinstance(trained_with, dict) or trained_with.get("sha256") != tokenizer.record()["sha256"]:
        raise BadValue(f"{shown(tokenizer_path)} is not the tokenizer {shown(checkpoint)} was trained with (their merges differ); "
                         "give the right one with --tokenizer")
    return tokenizer


def prompt_ids(tokenizer, text, model):
    """The prompt's ids (1, T) on the model's device."""
    ids = tokenizer.encode(text)
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


def check_sample_flags(n, seed, tokens):
    """prefill_clone.py's -n, --seed and --tokens, before any checkpoint is read."""
    if n < 1:
        raise BadValue(f"-n must be at least 1, got {n}")
    if not 0 <= seed < 2**64 - n:
        raise BadValue(f"--seed must be in 0..{2**64 - 1 - n} (row i uses seed + i), got {seed}")
    if tokens < 1:
        raise BadValue(f"--tokens must be at least 1, got {tokens}")


def check_request(engine, tokens, num_samples, max_tokens, seed, stop, forced, knobs):
    """Engine.generate's arguments as the loop needs them: (prompt ids, seeds, settings, stop ids, stop
    texts, forced ids), or a one-line error naming the first that is wrong."""
    model = engine.model
    if not callable(getattr(model, "step", None)):  # a plain GPT has no cached step: it would fail at the first token
        raise BadValue(f"the Engine needs a CachedGPT (cached.load gives one), got a {type(model).__name__}")
    vocab = model.cfg.vocab_size
    if in_training(model):  # one block left in training mode is enough for dropout
        raise BadValue("the model is in training mode, where dropout changes every token; call model.eval() first")
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__") or len(tokens) == 0:
        raise BadValue("the prompt must be a non-empty list of token ids")
    tokens = [as_id(t, "prompt token", vocab) for t in tokens]
    if len(tokens) > model.cfg.context:
        raise BadValue(f"a prompt of {len(tokens)} tokens is longer than the cache (context "
                         f"{model.cfg.context}); trim it")
    num_samples = as_id(num_samples, "num_samples", 2**63, "the counts")
    if num_samples < 1:
        raise BadValue(f"num_samples must be a whole number >= 1, got {num_samples}")
    if max_tokens is None:
        raise BadValue("give max_tokens: without a bound, a row that never meets a stop would generate forever")
    check_count("max_tokens", max_tokens)
    check_cache(model, num_samples, engine.cache_len(len(tokens), max_tokens))
    check_kept_tokens(num_samples, len(tokens) + max_tokens, model.emb.weight.device)
    if isinstance(seed, (list, tuple)):
        seeds = [as_id(s, "seed", 2**64, "the seeds") for s in seed]
    else:  # row i draws with seed + i
        seeds = [as_id(seed, "seed", 2**64 - num_samples + 1, "the seeds") + i for i in range(num_samples)]
    settings = knobs.pop("settings", None)
    if settings is not None and knobs:
        raise BadValue(f"give the knobs either shared ({sorted(knobs)}) or per row in settings, not both")
    settings = [knobs] * num_samples if settings is None else list(settings)
    for name, got in (("seed", seeds), ("settings", settings)):
        if len(got) != num_samples:
            raise BadValue(f"{name} is a list of {len(got)}, but num_samples is {num_samples}")
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
    return tokens, seeds, settings, ids, texts, forced
