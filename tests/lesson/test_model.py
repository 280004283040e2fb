"""model.py is Part 3's GPT: its keys, its numbers, its checkpoints, its errors."""
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from dataclasses import dataclass

import cached
from engines.edge.cli import device_from
from engines.edge.checkpoint import load_checkpoint, parameter_count, save_checkpoint
from model import GPT, Config, check_finite
from helpers import PART3_CONFIG, assert_refused, part3_state_dict, run_main

def reference_forward(sd, cfg, idx):
    """The forward pass written out by hand, RoPE as complex rotation, mask as -inf."""
    d, H, T = cfg["d_model"], cfg["n_heads"], idx.shape[1]
    hd = d // H
    inv = 10000 ** (-torch.arange(0, hd, 2).float() / hd)
    turn = torch.polar(torch.ones(T, hd // 2), torch.arange(T).float()[:, None] * inv)

    def rope(x):  # x (B, H, T, hd): pairs (2j, 2j+1) as one complex number
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], hd // 2, 2).contiguous())
        return torch.view_as_real(z * turn).flatten(-2)

    def ln(x, name):
        return F.layer_norm(x, (d,), sd[name + ".weight"], sd[name + ".bias"])

    x = sd["emb.weight"][idx]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(cfg["n_layers"]):
        p = f"blocks.{i}."
        h = ln(x, p + "norm1") @ sd[p + "attn.qkv.weight"].T
        q, k, v = (t.reshape(*idx.shape, H, hd).transpose(1, 2) for t in h.split(d, dim=-1))
        att = torch.softmax(rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(*idx.shape, d)
        x = x + y @ sd[p + "attn.out.weight"].T
        h = F.gelu(ln(x, p + "norm2") @ sd[p + "mlp.0.weight"].T + sd[p + "mlp.0.bias"])
        x = x + h @ sd[p + "mlp.2.weight"].T + sd[p + "mlp.2.bias"]
    return ln(x, "norm") @ sd["head.weight"].T


@pytest.fixture(scope="module")
def part3_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "part3.pt"
    torch.save({"model": part3_state_dict(PART3_CONFIG), "config": dict(PART3_CONFIG), "step": 1500}, path)
    return path


def test_parameter_budget_is_part3s():
    model = GPT()
    assert sum(p.numel() for p in model.parameters()) == 5_781_504
    assert model.head.weight is model.emb.weight
    assert set(model.state_dict()) == set(part3_state_dict(PART3_CONFIG))


def test_part3_checkpoint_loads_strict_and_matches_a_hand_written_forward(part3_file):
    model = load_checkpoint(part3_file)
    assert not model.training and model.cfg.n_kv_heads == 4
    idx = torch.randint(4096, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, loss = model(idx)
    assert loss is None
    expected = reference_forward(part3_state_dict(PART3_CONFIG), PART3_CONFIG, idx)
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


def test_loss_is_the_mean_negative_log_likelihood_of_the_hand_written_forward(part3_file):
    model = load_checkpoint(part3_file)
    idx = torch.randint(4096, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, loss = model(idx[:, :-1], idx[:, 1:])
    logits = reference_forward(part3_state_dict(PART3_CONFIG), PART3_CONFIG, idx[:, :-1])
    log_probs = logits - logits.exp().sum(-1, keepdim=True).log()
    expected = -log_probs.gather(-1, idx[:, 1:, None]).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-4)


def test_untrained_loss_is_near_ln_vocab():
    torch.manual_seed(1337)
    idx = torch.randint(4096, (4, 65), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, loss = GPT().eval()(idx[:, :-1], idx[:, 1:])
    assert abs(loss.item() - math.log(4096)) < 0.15


@pytest.mark.parametrize("temperature", [-1.0, 1e-320, math.inf, math.nan])
def test_parts_3_generate_refuses_a_temperature_it_cannot_sample_at(temperature):
    with pytest.raises(AssertionError, match="temperature is 0"):
        GPT(Config(vocab_size=64, d_model=32, n_heads=2, n_layers=1, context=8)).eval().generate(
            torch.zeros(1, 1, dtype=torch.long), 2, temperature)


def test_generate_reruns_the_last_context_tokens_for_every_new_token():
    cfg = dict(PART3_CONFIG, context=8, n_layers=2, d_model=64, vocab_size=300)
    sd = part3_state_dict(cfg)
    model = GPT(Config(**cfg)).eval()
    model.load_state_dict(sd)
    seen = []

    def pick(logits, idx):
        seen.append((logits, idx))
        return logits.argmax(-1)
    with torch.no_grad():
        out = model.generate_uncached(torch.zeros(2, 3, dtype=torch.long), 12, pick)
    assert out.shape == (2, 15) and len(seen) == 12
    for logits, idx in seen:
        expected = reference_forward(sd, cfg, idx[:, -8:])[:, -1]
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
    assert torch.equal(out[:, 3:], torch.stack([l.argmax(-1) for l, _ in seen], dim=1))
    with pytest.raises(AssertionError, match="more tokens than the context"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_shipped_checkpoint_loads():
    model = load_checkpoint("holmes.pt")
    assert sum(p.numel() for p in model.parameters()) == 5_781_504


@dataclass
class Part3Config:
    """Part 3's own Config: exactly six fields, so a config dict with any other key is a TypeError."""
    vocab_size: int = 4096
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 6
    context: int = 256
    dropout: float = 0.1


def test_every_checkpoint_this_repo_ships_or_writes_loads_in_part3s_loader(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(GPT(Config(vocab_size=300, d_model=32, n_heads=2, n_layers=1, context=16)), tmp_path / "a.pt", 3)
    paths = ["holmes.pt", tmp_path / "a.pt"]
    for path in paths:
        ckpt = torch.load(path, weights_only=True)
        cfg = Part3Config(**ckpt["config"])
        # Part 3 reads model, config and step; the tokenizer record sits beside them, outside config
        assert set(ckpt) - {"tokenizer"} == {"model", "config", "step"} and isinstance(ckpt["step"], int)
        assert ckpt["model"]["head.weight"].shape == (cfg.vocab_size, cfg.d_model)
    gqa = GPT(Config(vocab_size=300, d_model=32, n_heads=2, n_kv_heads=1, n_layers=1, context=16))
    save_checkpoint(gqa, tmp_path / "gqa.pt", 0)
    assert torch.load(tmp_path / "gqa.pt", weights_only=True)["config"]["n_kv_heads"] == 1
    assert load_checkpoint(tmp_path / "gqa.pt").cfg.n_kv_heads == 1


def test_the_shipped_checkpoint_holds_part3_fields_only():
    assert torch.load("holmes.pt", weights_only=True)["config"] == PART3_CONFIG


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


def test_code_in_a_checkpoint_is_refused_without_torchs_retry_hint(tmp_path, monkeypatch, capsys):
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps(Payload()))
    run = run_main(cached.main, ["cached.py", path], monkeypatch, capsys)
    assert_refused(run, "holds code or objects that are not plain tensors")
    assert "code ran" not in run[1] and "weights_only" not in run[2]


def test_config_without_newer_fields_falls_back_to_defaults(tmp_path):
    small = {"vocab_size": 300, "d_model": 32, "n_heads": 2, "n_layers": 1, "context": 16}
    torch.save({"model": GPT(Config(**small)).state_dict(), "config": small, "step": 0}, tmp_path / "old.pt")
    model = load_checkpoint(tmp_path / "old.pt")
    assert model.cfg.dropout == 0.1 and model.cfg.n_kv_heads == 2


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


class Payload:
    def __reduce__(self):
        return (print, ("code ran",))


@pytest.mark.parametrize("content", [b"plain text, not a checkpoint", pickle.dumps(Payload()), None])
def test_files_that_are_not_checkpoints_get_a_one_line_error(tmp_path, content):
    path = tmp_path / "x.pt"
    if content is None:
        torch.save({"weights": {}}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match="x.pt is not a"):
        load_checkpoint(path)


def test_missing_checkpoint_and_unknown_config_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt not found"):
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
    assert parameter_count(cfg) == cfg.n_weights == sum(p.numel() for p in GPT(cfg).parameters())


def test_a_state_dict_with_a_key_that_is_not_a_name_is_refused(tmp_path):
    sd = part3_state_dict(PART3_CONFIG) | {7: torch.zeros(1)}
    torch.save({"model": sd, "config": PART3_CONFIG, "step": 0}, tmp_path / "k.pt")
    with pytest.raises(ValueError, match="its model dict has a key 7 that is not a name"):
        load_checkpoint(tmp_path / "k.pt")


def test_a_huge_config_in_a_tiny_file_is_refused_before_anything_is_built(tmp_path, monkeypatch,
                                                                                          capsys):
    torch.save({"model": {}, "config": dict(PART3_CONFIG, d_model=65536), "step": 0}, tmp_path / "huge.pt")
    assert (tmp_path / "huge.pt").stat().st_size < 2000
    assert_refused(run_main(cached.main, ["cached.py", tmp_path / "huge.pt"], monkeypatch, capsys),
                   "the model its config describes")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_catches_one_bad_score_anywhere_and_passes_finite_extremes(bad):
    scores = torch.randn(3, 4096)
    scores[0, 0], scores[2, 1] = torch.finfo(torch.float32).max, torch.finfo(torch.float32).min
    assert check_finite(scores, 0) is scores
    scores[1, 4000] = bad
    with pytest.raises(ValueError, match="scores for new token 7 are NaN or infinite"):
        check_finite(scores, 7)
