"""cached.py: the KV cache changes nothing while the uncached loop sees the whole text, and each gotcha breaks it."""
import importlib
import json
import os

import pytest
import torch

import cached
from bpe import BPE
from cached import CachedGPT, load
from helpers import (PART3_CONFIG, ROOT, SMALL, assert_refused, assert_usage_error, one_line_exit, keys_attended, part3_state_dict,
                     prompts, run_main, run_script, uncached_choices)
from model import GPT, Config, rope_at


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    return CachedGPT(SMALL).eval()


def reference_rope(x, positions):
    """RoPE from reference.md, written out pair by pair: out[2j] = x[2j] cos - x[2j+1] sin, ..."""
    hd = x.shape[-1]
    out = torch.empty_like(x)
    for j in range(hd // 2):
        angle = positions.double() * 10000 ** (-2 * j / hd)
        cos, sin = angle.cos().float(), angle.sin().float()
        out[..., 2 * j] = x[..., 2 * j] * cos - x[..., 2 * j + 1] * sin
        out[..., 2 * j + 1] = x[..., 2 * j] * sin + x[..., 2 * j + 1] * cos
    return out


@pytest.mark.parametrize("start", [0, 7, 300])
def test_rope_at_rotates_pairs_at_the_true_positions(start):
    x = torch.randn(2, 4, 10, 16)
    expected = reference_rope(x, torch.arange(start, start + 10))
    torch.testing.assert_close(rope_at(x, start), expected, atol=1e-4, rtol=1e-4)


def test_cached_model_loads_part3_weights_unchanged(random_model):
    plain = GPT(SMALL).eval()
    plain.load_state_dict(random_model.state_dict(), strict=True)
    idx = prompts(2, 20, SMALL.vocab_size)
    torch.testing.assert_close(random_model(idx)[0], plain(idx)[0])


def test_step_logits_match_the_full_forward(random_model):
    idx = prompts(3, 20, SMALL.vocab_size)
    caches = [{} for _ in random_model.blocks]
    with torch.no_grad():
        full = random_model(idx)[0]
        torch.testing.assert_close(random_model.step(idx[:, :12], caches, 0), full[:, 11], atol=1e-5, rtol=1e-5)
        for t in range(12, 20):
            torch.testing.assert_close(random_model.step(idx[:, t:t + 1], caches, t), full[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("prompt_len", [1, 5, 32, 40])
def test_cached_equals_uncached_for_exactly_context_minus_prompt_plus_1_tokens(random_model, batch, prompt_len):
    idx = prompts(batch, prompt_len, SMALL.vocab_size)
    n = max(SMALL.context - prompt_len + 1, 1)  # the uncached loop sees the whole text: prompt and n - 1 tokens
    assert torch.equal(random_model.generate_cached(idx, n), random_model.generate_uncached(idx, n))


def test_cached_equals_uncached_for_254_tokens_on_the_shipped_checkpoint(shipped):
    idx = torch.tensor([[346, 739, 308]])
    out = shipped.generate_cached(idx, 254)
    assert out.shape[1] == 257 and torch.equal(uncached_choices(shipped, out, 3), out[:, 3:])
    assert torch.equal(shipped.generate_uncached(idx, 20), out[:, :23])  # the loop itself, its first steps


def test_shipped_batch_2_prompt_200_and_a_prompt_longer_than_context(shipped):
    idx = prompts(2, 200, 4096)
    out = shipped.generate_cached(idx, 57)
    assert torch.equal(uncached_choices(shipped, out, 200), out[:, 200:])
    long = prompts(2, 300, 4096)
    assert torch.equal(shipped.generate_cached(long, 1), shipped.generate_uncached(long, 1))


def test_the_head_runs_once_for_the_prompt_and_once_per_generated_token(random_model):
    calls = []
    handle = random_model.head.register_forward_hook(lambda *a: calls.append(1))
    try:
        for n in (0, 1, 5):
            calls.clear()
            out = random_model.generate_cached(prompts(2, 3, SMALL.vocab_size), n)
            assert out.shape == (2, 3 + n) and len(calls) == 1 + n  # the post's loop: prefill, then a step a token
    finally:
        handle.remove()


def test_the_posts_order_attends_context_plus_1_keys_past_the_window(random_model, monkeypatch):
    feed = prompts(1, 40, SMALL.vocab_size)
    caches = [{} for _ in random_model.blocks]
    with torch.no_grad():
        random_model.step(feed[:, :32], caches, 0)
        seen = keys_attended(monkeypatch)
        random_model.step(feed[:, 32:33], caches, 32)
    assert seen == [SMALL.context + 1] * SMALL.n_layers


@pytest.mark.parametrize("name", ["rope", "mask"])
def test_each_gotcha_prints_the_drift_the_docs_show(name, monkeypatch, capsys):
    status, out, err = run_main(cached.main, ["cached.py", "--break", name], monkeypatch, capsys)
    with open(os.path.join(ROOT, "docs", "map.md")) as f:
        shown = f.read().split(f"$ python cached.py --break {name}\n")[1].splitlines()[:2]
    assert status == 0, err
    assert out.splitlines() == [line.strip() for line in shown]


def test_cli_states_the_real_count_for_a_prompt_longer_than_the_context(tmp_path, random_model, monkeypatch,
                                                                      capsys):
    checkpoint = tmp_path / "small.pt"
    save(random_model, checkpoint)
    vocab = tmp_path / "tok.json"
    vocab.write_text('{"merges": ' + str([[97, 97]] * 256) + '}')
    status, out, err = run_main(cached.main, ["cached.py", checkpoint, "--tokenizer", vocab, "--prompt", "x" * 40,
                                              "--tokens", "20"], monkeypatch, capsys)
    assert status == 0, err
    assert "the first 1 generated tokens are identical" in out


def overflowing_checkpoint(path):
    """Finite weights whose scores overflow: a last MLP bias of 3e38 turns the residual stream infinite."""
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=4096, d_model=64, n_heads=4, n_layers=2, context=32))
    with torch.no_grad():
        model.blocks[-1].mlp[2].bias.fill_(3e38)
    save(model, path)


def test_scores_that_overflow_stop_the_cached_loop_at_the_first_token(tmp_path, monkeypatch):
    overflowing_checkpoint(tmp_path / "o.pt")
    message = one_line_exit(cached.main, monkeypatch, "cached.py", str(tmp_path / "o.pt"))
    assert "scores for new token 0 are NaN or infinite" in message


@pytest.mark.parametrize("generate", ["generate_cached", "generate_uncached"])
def test_every_loop_refuses_non_finite_scores_where_they_appear(tmp_path, generate):
    overflowing_checkpoint(tmp_path / "o.pt")
    model = load(tmp_path / "o.pt")
    with pytest.raises(ValueError, match="scores for new token 0 are NaN or infinite"):
        getattr(model, generate)(torch.zeros(1, 3, dtype=torch.long), 5)


def save(model, path):
    """Part 3's format: what its train.py saves."""
    torch.save({"model": model.state_dict(), "config": {f: getattr(model.cfg, f) for f in PART3_CONFIG}, "step": 0},
               path)


@pytest.mark.parametrize("args, message", [
    (["--break", "cache"], "argument --break: invalid choice: 'cache'"),
    (["--tokens", "-5"], "--tokens must be in 0..100000, got -5"),
    (["--tokens", str(10**11)], "--tokens must be in 0..100000"),
])
def test_bad_flags_are_named_by_argparse(args, message, monkeypatch, capsys):
    assert_usage_error(run_main(cached.main, ["cached.py", *args], monkeypatch, capsys), message)


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.pt", "no checkpoint at "),
    (lambda d: (d / "text.pt").write_text("not a checkpoint") and d / "text.pt", "is not a loadable Part 3 checkpoint"),
    (lambda d: torch.save({"model": {}, "config": {"d_model": 64}}, d / "empty.pt") or d / "empty.pt",
     "is not a loadable Part 3 checkpoint (Error(s) in loading state_dict"),
    (lambda d: torch.save({"config": {"d_modle": 64}, "model": {}}, d / "odd.pt") or d / "odd.pt",
     "unexpected keyword argument 'd_modle'"),
    (lambda d: torch.save({"model": print}, d / "code.pt") or d / "code.pt", "one holding code or objects"),
])
def test_a_file_that_is_not_a_part3_checkpoint_is_one_line_and_exit_1(tmp_path, make, message, monkeypatch, capsys):
    path = make(tmp_path)
    run = run_main(cached.main, ["cached.py", str(path)], monkeypatch, capsys)
    assert_refused(run, "cached.py: error: ")
    assert message in run[2]


@pytest.mark.parametrize("script", ["cached.py", "sample_grid.py", "prefill_clone.py"])
def test_a_fifo_given_as_the_checkpoint_is_refused_in_one_line_without_being_opened(script, tmp_path):
    """Before: torch.load opened the FIFO and waited for a writer for good."""
    os.mkfifo(tmp_path / "fifo.pt")
    assert_refused(run_script(script, tmp_path / "fifo.pt"),
                   f"{script}: error: checkpoint '{tmp_path / 'fifo.pt'}' is not a regular file")


def another_tokenizer_of_4096(path):
    """The shipped tokenizer with its last merge changed: the same size, other merges (so other text)."""
    merges = BPE.load(os.path.join(ROOT, "tokenizer.json")).merges[:-1] + [(0, 1)]
    path.write_text(json.dumps({"merges": [list(m) for m in merges]}))
    return path


@pytest.mark.parametrize("script", ["cached", "sample_grid", "prefill_clone"])
def test_a_tokenizer_other_than_the_one_the_checkpoint_records_is_refused_naming_both(script, tmp_path, monkeypatch,
                                                                                       capsys):
    """Before: holmes.pt with another 4,096-token tokenizer printed other text with exit 0."""
    other = another_tokenizer_of_4096(tmp_path / "other.json")
    main = importlib.import_module(script).main
    assert_refused(run_main(main, [script, "holmes.pt", "--tokenizer", other], monkeypatch, capsys),
                   f"{script}.py: error: '{other}' is not the tokenizer 'holmes.pt' was trained with (their merges "
                   "differ); give that one with --tokenizer")


def test_a_part3_checkpoint_records_no_tokenizer_so_any_of_its_size_is_taken(tmp_path):
    torch.save({"model": part3_state_dict(PART3_CONFIG), "config": dict(PART3_CONFIG), "step": 1500},
               tmp_path / "part3.pt")
    model = load(tmp_path / "part3.pt")
    assert model.trained_with is None
    assert cached.tokenize(another_tokenizer_of_4096(tmp_path / "other.json"), "Holmes", model)[1].shape == (1, 1)


def test_an_empty_prompt_and_a_tokenizer_of_another_size_are_named(tmp_path, random_model, monkeypatch, capsys):
    assert "prompt is empty" in one_line_exit(cached.main, monkeypatch, "cached.py", "--prompt", "")
    save(random_model, tmp_path / "small.pt")
    run = run_main(cached.main, ["cached.py", str(tmp_path / "small.pt")], monkeypatch, capsys)
    assert_refused(run, "cached.py: error: 'tokenizer.json' has 4096 tokens but the model a vocabulary of 512")
