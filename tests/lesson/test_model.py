"""model.py is Part 3's GPT: its keys, its numbers, its checkpoints (read by cached.load), its errors."""
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from dataclasses import dataclass

import cached
from cached import load
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
    model = load(part3_file)
    assert not model.training and model.cfg.n_kv_heads == 4
    idx = torch.randint(4096, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, loss = model(idx)
    assert loss is None
    expected = reference_forward(part3_state_dict(PART3_CONFIG), PART3_CONFIG, idx)
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


def test_loss_is_the_mean_negative_log_likelihood_of_the_hand_written_forward(part3_file):
    model = load(part3_file)
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


def test_shipped_checkpoint_loads(shipped):
    assert sum(p.numel() for p in shipped.parameters()) == 5_781_504


@dataclass
class Part3Config:
    """Part 3's own Config: exactly six fields, so a config dict with any other key is a TypeError."""
    vocab_size: int = 4096
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 6
    context: int = 256
    dropout: float = 0.1


def test_the_shipped_checkpoint_loads_in_part3s_loader():
    ckpt = torch.load("holmes.pt", weights_only=True)
    cfg = Part3Config(**ckpt["config"])
    # Part 3 reads model, config and step; the tokenizer record sits beside them, outside config
    assert set(ckpt) - {"tokenizer"} == {"model", "config", "step"} and isinstance(ckpt["step"], int)
    assert ckpt["model"]["head.weight"].shape == (cfg.vocab_size, cfg.d_model)


def test_the_shipped_checkpoint_holds_part3_fields_only():
    assert torch.load("holmes.pt", weights_only=True)["config"] == PART3_CONFIG


def test_code_in_a_checkpoint_is_refused_without_torchs_retry_hint(tmp_path, monkeypatch, capsys):
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps(Payload()))
    run = run_main(cached.main, ["cached.py", path], monkeypatch, capsys)
    assert_refused(run, "one holding code or objects besides tensors and plain data")
    assert "code ran" not in run[1] and "weights_only" not in run[2]


class Payload:
    def __reduce__(self):
        return (print, ("code ran",))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_catches_one_bad_score_anywhere_and_passes_finite_extremes(bad):
    scores = torch.randn(3, 4096)
    scores[0, 0], scores[2, 1] = torch.finfo(torch.float32).max, torch.finfo(torch.float32).min
    assert check_finite(scores, 0) is scores
    scores[1, 4000] = bad
    with pytest.raises(ValueError, match="scores for new token 7 are NaN or infinite"):
        check_finite(scores, 7)


def test_a_checkpoint_that_is_not_part3s_is_refused_in_one_line_naming_the_file(tmp_path):
    sd = part3_state_dict(PART3_CONFIG)
    sd["blocks.2.mlp.0.weight"] = torch.zeros(512, 256)
    for name, content in [("shape.pt", {"model": sd, "config": PART3_CONFIG, "step": 0}),
                          ("odd.pt", {"model": {}, "config": {"d_model": 8, "flash": True}, "step": 0}),
                          ("no-model.pt", {"weights": {}})]:
        torch.save(content, tmp_path / name)
    (tmp_path / "text.pt").write_text("plain text, not a checkpoint")
    for name, reason in [("shape.pt", "size mismatch for blocks.2.mlp.0.weight"), ("odd.pt", "'flash'"),
                         ("no-model.pt", "'config'"), ("text.pt", "")]:
        with pytest.raises(ValueError, match=f"{name}' is not a loadable Part 3 checkpoint .*{reason}") as refused:
            load(str(tmp_path / name))
        assert len(str(refused.value).splitlines()) == 1
    with pytest.raises(ValueError, match="no checkpoint at .*nope.pt'; pass a Part 3 .pt file"):
        load(str(tmp_path / "nope.pt"))

