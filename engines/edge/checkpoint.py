"""Part 3's checkpoint file, read as data and checked before anything is built, and the tokenizer beside it.

A checkpoint is torch.save's zip of {"model": state dict, "config": Config's
fields, "step": int}, loaded with weights_only=True: its archive, config and
every weight are checked, with one-line errors naming what is wrong, before a
model is built; docs/refuses.md lists every promise.
"""
import os
import sys
import warnings
import zipfile
from dataclasses import fields

import torch

from bpe import BPE
from engines.edge.cli import check_fits, device_from, first_line
from engines.edge.errors import BadValue, refusing
from engines.edge.files import check_input, shown
from cached import CachedGPT
from model import GPT, Config


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
        raise BadValue(f"{shown(path)} is not a loadable checkpoint ({first_line(e)})") from None
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
    model.trained_with = ckpt.get("tokenizer")  # what series/train.py recorded of the tokenizer, if anything
    return model.to(device).eval()


def tokenizer_for(model, checkpoint, tokenizer_path):
    """The tokenizer at tokenizer_path, refused if it is not the one the checkpoint records, or, for a
    checkpoint that records none (Part 3's), if its vocabulary differs in size."""
    tokenizer = refusing(BPE.load)(tokenizer_path)
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


def load_cached(path, device="cpu"):
    """cached.load with every check above: the CachedGPT the engines run, from a file checked before it is built."""
    return load_checkpoint(path, device, cls=CachedGPT)


def load_pair(checkpoint, tokenizer_path, device="cpu"):
    """The model and the tokenizer it was trained with (tokenizer_for says how that is known)."""
    model = load_cached(checkpoint, device)
    return model, tokenizer_for(model, checkpoint, tokenizer_path)
