"""engines/edge/checkpoint.py and engines/edge/checks.py: a checkpoint that would quietly build another model, and an Engine asked for
what it cannot honour, are refused by name, once, at the edge."""
import json
import os
import shutil
import zipfile

import pytest
import torch

from engines.edge import cli
import sample_grid
from cached import CachedGPT
from bpe import BPE
from engines.edge.checkpoint import load_cached, load_checkpoint, load_pair, parameter_count
from engines.edge.cli import check_fits, device_from
from engines.edge.errors import BadInput
from engines.fast import engine as fast_engine
from helpers import PART3_CONFIG, assert_refused, one_line_exit, part3_state_dict, run_main, small
from support import command, save_checkpoint
from model import GPT, Config


def Engine(model, tokenizer=None):
    return fast_engine.FastEngine(model, tokenizer, kernel="nn")

SMALL = Config(vocab_size=300, d_model=32, n_heads=2, n_layers=1, context=16)
FIELDS = {"vocab_size": 300, "d_model": 32, "n_heads": 2, "n_layers": 1, "context": 16, "dropout": 0.1}


def small_checkpoint(path, config=FIELDS, state=None):
    torch.manual_seed(0)
    torch.save({"model": state or GPT(Config(**config)).state_dict(), "config": config, "step": 0}, path)
    return path


@pytest.mark.parametrize("field", ["vocab_size", "d_model", "n_heads", "n_layers", "context"])
def test_a_config_without_a_field_that_shapes_the_model_is_refused_by_name(tmp_path, field):
    path = small_checkpoint(tmp_path / "c.pt")
    ckpt = torch.load(path, weights_only=True)
    del ckpt["config"][field]
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match=f"its config lacks '{field}'; a checkpoint's config holds every field"):
        load_checkpoint(path)


def test_an_untied_head_is_refused_instead_of_silently_dropping_one_matrix(tmp_path):
    state = {k: v.clone() for k, v in GPT(SMALL).state_dict().items()}
    state["head.weight"] += 1
    with pytest.raises(ValueError, match="head.weight differs from emb.weight, but Part 3's model ties them"):
        load_checkpoint(small_checkpoint(tmp_path / "u.pt", state=state))


def test_one_flipped_bit_in_a_weight_is_caught_by_the_zips_checksum(tmp_path):
    path = small_checkpoint(tmp_path / "ok.pt")
    load_checkpoint(path)
    with zipfile.ZipFile(path) as z:
        entry = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 1000)
    data = bytearray(path.read_bytes())
    data[entry.header_offset + 30 + len(entry.filename) + len(entry.extra) + 100] ^= 0x01  # inside its bytes
    (tmp_path / "flipped.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"flipped.pt is damaged: entry '.*' fails its checksum"):
        load_checkpoint(tmp_path / "flipped.pt")


def test_a_compressed_entry_is_refused_before_anything_inflates_it(tmp_path):
    path = small_checkpoint(tmp_path / "ok.pt")
    shutil.copy(path, tmp_path / "bomb.pt")
    with zipfile.ZipFile(tmp_path / "bomb.pt", "a", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/extra", b"\0" * 10**6)
    with pytest.raises(ValueError, match="entry 'archive/extra' is compressed, which torch.save never does"):
        load_checkpoint(tmp_path / "bomb.pt")


@pytest.mark.parametrize("left_training", ["the whole model", "one block", "one dropout"])
@pytest.mark.parametrize("path", ["Engine", "sample_grid.grid", "generate_cached", "GPT.generate"])
def test_every_generate_path_refuses_a_model_with_any_part_in_training_mode(path, left_training):
    model = CachedGPT(SMALL).eval()
    {"the whole model": model, "one block": model.blocks[-1],
     "one dropout": next(m for m in model.modules() if isinstance(m, torch.nn.Dropout))}[left_training].train()
    run = {"Engine": lambda: Engine(model).generate_batch([1, 2], 1, max_tokens=3),
           "sample_grid.grid": lambda: sample_grid.grid(Engine(model), [1, 2], 3, 0),
           "generate_cached": lambda: model.generate_cached(torch.tensor([[1, 2]]), 3),
           "GPT.generate": lambda: model.generate(torch.tensor([[1, 2]]), 3)}[path]
    # the Engine's front door says it in one line; the model's own loops (the lesson's) assert it
    with pytest.raises(AssertionError if path.startswith(("generate", "GPT")) else ValueError,
                       match="call model.eval.. first"):
        run()


def test_an_engine_refuses_a_request_without_a_bound():
    with pytest.raises(ValueError, match="give max_tokens"):
        Engine(CachedGPT(SMALL).eval()).generate_batch([1, 2])


def test_memory_is_checked_where_the_system_says_what_is_available(monkeypatch):
    with pytest.raises(ValueError, match="more than half of this machine's"):
        check_fits(2**60, "a cache", "cpu")
    monkeypatch.delattr(cli.os, "sysconf")  # as on native Windows
    monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    assert cli.free_memory("cpu") is None
    check_fits(2**60, "a cache", "cpu")  # unknown: not refused


def test_a_checkpoint_written_here_loads_with_its_config(tmp_path):
    save_checkpoint(GPT(SMALL), tmp_path / "s.pt", 3)
    assert load_checkpoint(tmp_path / "s.pt").cfg == SMALL


def test_a_tokenizer_larger_than_the_model_is_named(tmp_path, monkeypatch, capsys):
    checkpoint = tmp_path / "small.pt"
    save_checkpoint(small(), checkpoint, step=0)
    run = run_main(command(fast_engine.main), ["engine.py", checkpoint, "Sherlock Holmes"], monkeypatch, capsys)
    assert_refused(run, "tokenizer.json")
    assert "512" in run[2] and "4096" in run[2]


def hostile_checkpoint(path, kind):
    sd, cfg = part3_state_dict(PART3_CONFIG), dict(PART3_CONFIG)
    if kind == "nan weight":
        sd["blocks.0.attn.qkv.weight"][0, 0] = float("nan")
    elif kind == "zero heads":
        cfg["n_heads"] = 0
    elif kind == "string size":
        cfg["d_model"] = "256"
    elif kind == "None context":
        cfg["context"] = None
    elif kind == "weight not a tensor":
        sd["norm.bias"] = [0.0] * 256
    torch.save({"model": sd, "config": cfg, "step": 0}, path)


@pytest.mark.parametrize("kind, message", [
    ("nan weight", "'blocks.0.attn.qkv.weight' holds NaN, infinite or non-float values"),
    ("zero heads", "config n_heads is 0; expected a whole number >= 1"),
    ("string size", "config d_model is '256'; expected a whole number >= 1"),
    ("None context", "config context is None"),
    ("weight not a tensor", "'norm.bias' is a list, not a tensor"),
])
def test_hostile_checkpoints_get_one_line_and_exit_1(tmp_path, kind, message, monkeypatch):
    hostile_checkpoint(tmp_path / "h.pt", kind)
    assert message in one_line_exit(command(fast_engine.main), monkeypatch, "engine.py", str(tmp_path / "h.pt"))


@pytest.mark.parametrize("content, message", [
    ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ('{"merges": [[97, 97], [256, 256], [257, 257], [258, 258], [259, 259], [260, 260], [261, 261], [262, 262], '
     '[263, 263], [264, 264], [265, 265], [266, 266], [267, 267]]}', "builds a token of 8,192 bytes"),
    ('{"merges": [[1, "a"]]}', "merge 0 is [1, 'a'], expected a pair of integer ids"),
])
def test_hostile_tokenizer_files_get_one_line_and_exit_1(tmp_path, content, message, monkeypatch):
    (tmp_path / "t.json").write_text(content)
    assert message in one_line_exit(command(fast_engine.main), monkeypatch, "engine.py", "--tokenizer", str(tmp_path / "t.json"))


def test_a_tokenizer_other_than_the_recorded_one_is_refused_even_at_the_same_size(tmp_path, monkeypatch):
    merges = json.load(open("tokenizer.json"))["merges"]
    merges[-1] = [32, 32] if merges[-1] != [32, 32] else [33, 33]
    (tmp_path / "other.json").write_text(json.dumps({"merges": merges}))
    message = one_line_exit(command(fast_engine.main), monkeypatch, "engine.py", "--tokenizer", str(tmp_path / "other.json"))
    assert "other.json is not the tokenizer holmes.pt was trained with" in message


def test_a_checkpoint_without_a_tokenizer_record_says_which_tokenizer_it_assumed(tmp_path, capsys):
    torch.manual_seed(0)
    save_checkpoint(CachedGPT(Config(vocab_size=4096, d_model=64, n_layers=2, context=32)), tmp_path / "p3.pt", 0)
    model, _ = load_pair(tmp_path / "p3.pt", "tokenizer.json")
    assert model.trained_with is None
    assert capsys.readouterr().err.strip() == \
        f"note: {tmp_path / 'p3.pt'} does not record its tokenizer; assuming tokenizer.json (--tokenizer)"


@pytest.mark.parametrize("make, message", [
    (lambda d: os.mkfifo(d / "fifo.pt") or d / "fifo.pt", "is not a regular file (a pipe or a device?)"),
    (lambda d: "/dev/zero", "is not a regular file (a pipe or a device?)"),
    (lambda d: d, "is a folder; give a file"),
])
def test_a_checkpoint_that_would_block_or_never_end_is_refused_without_reading_it(tmp_path, monkeypatch, make, message):
    assert message in one_line_exit(command(fast_engine.main), monkeypatch, "engine.py", str(make(tmp_path)))


def test_the_shipped_checkpoint_records_the_shipped_tokenizer():
    assert load_cached("holmes.pt").trained_with == BPE.load("tokenizer.json").record()


# the engines' checkpoint reader (engines/edge/checkpoint.py): every way a file can fail to be Part 3's, named

@pytest.mark.parametrize("change, message", [
    (dict(n_heads=0), "config n_heads is 0; expected a whole number >= 1"),
    (dict(d_model=-8), "config d_model is -8"),
    (dict(n_layers="6"), "config n_layers is '6'"),
    (dict(context=None), "config context is None"),
    (dict(vocab_size=True), "config vocab_size is True"),
    (dict(dropout=2.0), r"config dropout is 2.0; expected a number in \[0, 1\)"),
    (dict(d_model=250), "d_model .250. must divide by n_heads"),
    (dict(d_model=12), "head_dim d_model / n_heads = 3 is odd; RoPE turns channel pairs"),
    (dict(n_kv_heads=3), r"n_heads by n_kv_heads \(3\)"),
    (dict(context=10**12), r"config context is 1,000,000,000,000; RoPE's positions are float32, exact only up to "
                           r"16,777,216 \(2\*\*24\)"),
    (dict(d_model=65536), r"c.pt: the model its config describes \(6 layers of width 65536.* needs .* GiB"),
    (dict(n_layers=10**7), r"c.pt: the model its config describes \(10000000 layers.* needs .* GiB"),
    (dict(vocab_size=2**40), "needs .* GiB, more than half of this machine's"),
    ({1: 2}, "its config dict has a key 1 that is not a name"),
])
def test_bad_config_values_are_named(tmp_path, change, message):
    torch.save({"model": {}, "config": PART3_CONFIG | change, "step": 0}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path / "c.pt")


@pytest.mark.parametrize("poison, message", [
    (float("nan"), "holds NaN, infinite or non-float values"),
    (float("inf"), "holds NaN, infinite or non-float values"),
    ("not a tensor", "is a str, not a tensor"),
    (torch.zeros(256).to_sparse(), "is a torch.sparse_coo cpu tensor; a checkpoint holds dense tensors"),
    (torch.zeros(256, device="meta"), "is a torch.strided meta tensor; a checkpoint holds dense tensors"),
    (torch.zeros(256, dtype=torch.long), "holds NaN, infinite or non-float values"),
])
def test_weights_that_are_not_finite_tensors_are_refused(tmp_path, poison, message):
    sd = part3_state_dict(PART3_CONFIG)
    if isinstance(poison, (str, torch.Tensor)):
        sd["blocks.1.norm2.bias"] = poison
    else:
        sd["blocks.1.norm2.bias"][3] = poison
    torch.save({"model": sd, "config": PART3_CONFIG, "step": 0}, tmp_path / "p.pt")
    with pytest.raises(ValueError, match=f"'blocks.1.norm2.bias' {message}"):
        load_checkpoint(tmp_path / "p.pt")


def test_config_without_newer_fields_falls_back_to_defaults(tmp_path):
    small = {"vocab_size": 300, "d_model": 32, "n_heads": 2, "n_layers": 1, "context": 16}
    torch.save({"model": GPT(Config(**small)).state_dict(), "config": small, "step": 0}, tmp_path / "old.pt")
    model = load_checkpoint(tmp_path / "old.pt")
    assert model.cfg.dropout == 0.1 and model.cfg.n_kv_heads == 2


@pytest.mark.parametrize("content", [b"plain text, not a checkpoint", None])
def test_files_that_are_not_checkpoints_get_a_one_line_error(tmp_path, content):
    path = tmp_path / "x.pt"
    if content is None:
        torch.save({"weights": {}}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match="x.pt is not a"):
        load_checkpoint(path)


def test_missing_checkpoint_and_unknown_config_field(tmp_path):
    with pytest.raises(BadInput, match="nope.pt not found"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"model": {}, "config": {"d_model": 8, "flash": True}, "step": 0}, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match="unknown config field 'flash'"):
        load_checkpoint(tmp_path / "odd.pt")


def test_devices_are_checked():
    assert device_from("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        device_from("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            device_from("cuda")


@pytest.mark.parametrize("cfg", [Config(), Config(n_kv_heads=1), Config(vocab_size=300, d_model=64, n_layers=2)])
def test_the_memory_check_counts_the_weights_the_model_really_has(cfg):
    assert parameter_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_a_state_dict_with_a_key_that_is_not_a_name_is_refused(tmp_path):
    sd = part3_state_dict(PART3_CONFIG) | {7: torch.zeros(1)}
    torch.save({"model": sd, "config": PART3_CONFIG, "step": 0}, tmp_path / "k.pt")
    with pytest.raises(ValueError, match="its model dict has a key 7 that is not a name"):
        load_checkpoint(tmp_path / "k.pt")


def test_weights_that_do_not_fit_the_config_name_key_and_shapes(tmp_path):
    sd = part3_state_dict(PART3_CONFIG)
    sd["blocks.2.mlp.0.weight"] = torch.zeros(512, 256)
    torch.save({"model": sd, "config": PART3_CONFIG, "step": 0}, tmp_path / "bad.pt")
    message = r"'blocks.2.mlp.0.weight' has shape \(512, 256\) but the config needs \(1024, 256\)"
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path / "bad.pt")
    del sd["blocks.2.mlp.0.weight"]
    torch.save({"model": sd, "config": PART3_CONFIG, "step": 0}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="'blocks.2.mlp.0.weight' is missing"):
        load_checkpoint(tmp_path / "bad.pt")
