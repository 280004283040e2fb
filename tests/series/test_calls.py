"""The series' own calls run on this repo's files and compute what the series' code computes.

Each test makes a call that a script of Parts 3 to 5 makes (the post's two-phase loop with its cache
dicts, Part 4's bench.py and sample_grid.py, Part 3's sample.py) and checks its result against a
reference written here from what the series says the call does.
"""
import pytest
import torch
import torch.nn.functional as F

import cached
import model as model_py
from bpe import BPE
from cached import CachedGPT, Config, load
from helpers import SMALL, uncached_choices
from sample_grid import SETTINGS
from sampling import pick


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return CachedGPT(SMALL).eval()


def decode_with_dicts(model, idx, n_tokens, pick_next):
    """The post's two phases on its cache dicts: the prompt in one step from position 0, then a step
    per picked token at its position, as `caches = [{} for _ in self.blocks]` and step() are used there."""
    dicts = [{} for _ in model.blocks]
    prompt = idx[:, -model.cfg.context:]
    with torch.no_grad():
        scores = model.step(prompt, dicts, 0)
        for position in range(prompt.shape[1], prompt.shape[1] + n_tokens):
            chosen = pick_next(scores, idx)[:, None]
            idx = torch.cat([idx, chosen], dim=1)
            scores = model.step(chosen, dicts, position)
    return idx, dicts


def kv_bytes(dicts):
    return sum(t.numel() * t.element_size() for d in dicts for t in d.values())


def test_the_series_imports_find_every_name():
    # from cached import CachedGPT, Config / load / rope_at, greedy; from model import GPT, Config, ...
    from cached import CachedGPT, Config, greedy, load, rope_at  # noqa: F401
    from model import GPT, Block, RoPEAttention  # noqa: F401
    from sampling import pick  # noqa: F401
    from bpe import BPE  # noqa: F401
    assert cached.Config is model_py.Config and cached.rope_at is model_py.rope_at


def test_the_posts_loop_on_its_dicts_gives_generate_cacheds_250_greedy_tokens(shipped):
    idx = torch.tensor([[346, 739, 308]])
    by_dicts, dicts = decode_with_dicts(shipped, idx, 250, lambda logits, _: logits.argmax(-1))
    assert torch.equal(by_dicts, shipped.generate_cached(idx, 250))
    heads, head_dim = shipped.cfg.n_heads, shipped.cfg.head_dim
    for layer in dicts:
        assert set(layer) == {"k", "v"}
        assert layer["k"].shape == layer["v"].shape == (1, heads, 253, head_dim)


def test_full_window_dicts_hold_2_x_layers_x_tokens_x_d_model_x_4_bytes(shipped):
    cfg = shipped.cfg
    dicts = [{} for _ in shipped.blocks]
    with torch.no_grad():
        shipped.step(torch.zeros(1, cfg.context, dtype=torch.long), dicts, 0)
    assert kv_bytes(dicts) == 2 * cfg.n_layers * cfg.context * cfg.d_model * 4 == 3 * 2**20


def test_past_the_window_the_dicts_append_and_trim_in_the_posts_order(small_model):
    idx = torch.randint(SMALL.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    by_dicts, dicts = decode_with_dicts(small_model, idx, 60, lambda logits, _: logits.argmax(-1))
    # The post attends to the kept keys plus the new one, then trims, as generate_cached does.
    assert torch.equal(by_dicts, small_model.generate_cached(idx, 60))
    assert all(d["k"].shape[2] == d["v"].shape[2] == SMALL.context for d in dicts)
    with pytest.raises(AssertionError, match="one token at a time"), torch.no_grad():
        small_model.step(idx, dicts, 65)


def posts_attention(attn, x, cache, start):
    """The post's CachedAttention.forward as printed, on attn's weights."""
    B, T, C = x.shape
    q, k, v = attn.qkv(x).split(C, dim=-1)
    q, k, v = (t.view(B, T, attn.n_heads, -1).transpose(1, 2) for t in (q, k, v))
    q, k = model_py.rope_at(q, start), model_py.rope_at(k, start)
    if "k" in cache:
        k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
    cache["k"], cache["v"] = k[:, :, -attn.context:], v[:, :, -attn.context:]
    y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
    return attn.out(y.transpose(1, 2).reshape(B, T, C))


def test_the_attention_on_a_dict_computes_and_keeps_what_the_posts_forward_does(small_model):
    mine, posts = {}, {}
    attention = small_model.blocks[0].attn
    x = torch.randn(1, 40, SMALL.d_model, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for start, end in ((0, 30), (30, 31), (31, 32), (32, 33), (33, 34)):
            got, want = attention(x[:, start:end], mine, start), posts_attention(attention, x[:, start:end], posts, start)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(mine["k"], posts["k"]) and torch.equal(mine["v"], posts["v"])
    assert mine["k"].shape[2] == SMALL.context


def test_a_random_model_decodes_16_rows_the_same_with_and_without_cache():
    # Part 4's bench.py: CachedGPT(Config()), an 8-token random prompt, greedy, batch 16.
    torch.manual_seed(0)
    model = CachedGPT(Config()).eval()
    prompt = torch.randint(model.cfg.vocab_size, (16, 8), generator=torch.Generator().manual_seed(0))
    out = model.generate_cached(prompt, 32)
    assert torch.equal(uncached_choices(model, out, 8), out[:, 8:])


def sample_as_part3(model, idx, n_tokens, temperature):
    """Part 3's sampling as its post states it: the last `context` tokens in, the last position's scores
    divided by the temperature, one draw from their softmax with torch's global generator."""
    with torch.no_grad():
        for _ in range(n_tokens):
            scores = model(idx[:, -model.cfg.context:])[0][:, -1].float()
            drawn = torch.multinomial(torch.softmax(scores / temperature, dim=-1), num_samples=1)
            idx = torch.cat([idx, drawn], dim=1)
    return idx


def part3_model(path):
    """A model.GPT built the way Part 3's sample.py builds it: torch.load, Config(**config), load_state_dict."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    gpt = model_py.GPT(model_py.Config(**checkpoint["config"]))
    gpt.load_state_dict(checkpoint["model"])
    return gpt.eval()


@pytest.fixture(scope="module")
def part3():
    return part3_model("holmes.pt")


def test_generate_with_a_temperature_draws_part3s_tokens_under_the_same_seed(part3):
    # Part 3's sample.py: torch.manual_seed(42), then model.generate(idx, args.tokens, args.temperature).
    idx = torch.tensor([BPE.load("tokenizer.json").encode("Holmes")])
    torch.manual_seed(42)
    ours = part3.generate(idx, 30, 0.8)
    torch.manual_seed(42)
    assert torch.equal(ours, sample_as_part3(part3, idx, 30, 0.8))


def test_generate_without_a_temperature_samples_at_part3s_default_of_0_8(part3):
    idx = torch.tensor([[346, 739, 308]])
    torch.manual_seed(1)
    default = part3.generate(idx, 30)
    torch.manual_seed(1)
    assert torch.equal(default, sample_as_part3(part3, idx, 30, 0.8))
    torch.manual_seed(1)
    assert not torch.equal(default, part3.generate(idx, 30, 1.5))


def test_pick_goes_by_keyword_or_through_generate_uncached(part3, shipped):
    idx = torch.tensor([[346, 739, 308]])
    greedy = shipped.generate_cached(idx, 20)
    assert torch.equal(part3.generate(idx, 20, pick=lambda logits, _: logits.argmax(-1)), greedy)
    assert torch.equal(part3.generate_uncached(idx, 20), greedy)
    assert torch.equal(part3.generate(idx, 20, 0), greedy)
    assert torch.equal(shipped.generate(idx, 20, pick=model_py.greedy), greedy)
    with pytest.raises(AssertionError, match="temperature"):
        part3.generate(idx, 1, -1.0)


def pick_as_the_post_states_it(logits, temperature=1.0, top_k=0, top_p=1.0, penalty=1.0, history=None):
    """The post's pick() from its prose: positive scores of tokens seen in the history divided by the
    penalty and negative ones multiplied; temperature 0 takes the top score; otherwise scores divided by
    the temperature, all but the top k dropped, a token dropped once the tokens ranked above it reach
    p, and one draw from the softmax with torch's global generator."""
    scores = logits.float()
    if penalty != 1.0 and history is not None:
        seen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, history, True)
        scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
    if temperature == 0:
        return scores.argmax(-1)
    scores = scores / temperature
    minus_inf = float("-inf")
    if top_k:
        scores = scores.masked_fill(scores < scores.topk(top_k, dim=-1).values[:, -1:], minus_inf)
    if top_p < 1.0:
        ranked, order = scores.sort(dim=-1, descending=True)
        share = ranked.softmax(-1)
        gone_ranked = share.cumsum(-1) - share >= top_p
        scores = scores.masked_fill(torch.zeros_like(gone_ranked).scatter(1, order, gone_ranked), minus_inf)
    return torch.multinomial(scores.softmax(-1), 1)[:, 0]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_grids_settings_under_manual_seed_give_the_posts_pick_tokens(shipped, name):
    # sample_grid.py and Part 5's generate.py: torch.manual_seed, then generate_cached with a pick lambda.
    knobs = SETTINGS[name]
    start = torch.tensor([BPE.load("tokenizer.json").encode("Holmes")])
    torch.manual_seed(1)
    ours = shipped.generate_cached(start, 40, lambda logits, idx: pick(logits, history=idx, **knobs))
    torch.manual_seed(1)
    theirs = shipped.generate_cached(start, 40, pick=lambda logits, hist: pick_as_the_post_states_it(
        logits, history=hist, **knobs))
    assert torch.equal(ours, theirs)


def test_load_takes_a_device_and_the_model_scores_like_part3s_loader(shipped):
    # Part 5's eval_bpb.py: load(path, device), then model(x)[0] as the logits.
    on_cpu = load("holmes.pt", "cpu")
    x = torch.tensor([[346, 739, 308, 12, 99]])
    with torch.no_grad():
        out = on_cpu(x)
        assert isinstance(out, tuple)
        torch.testing.assert_close(out[0], part3_model("holmes.pt")(x)[0])
    assert isinstance(on_cpu, model_py.GPT)
