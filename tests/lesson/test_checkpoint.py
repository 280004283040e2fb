"""checkpoint.py and checks.py: a checkpoint that would quietly build another model, and an Engine asked for
what it cannot honour, are refused by name, once, at the edge."""
import shutil
import zipfile

import pytest
import torch

import cli
import sample_grid
from cached import CachedGPT
from checkpoint import load_checkpoint, save_checkpoint
from cli import check_fits
from model import GPT, Config
from prefill_clone import Engine

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
