"""Every forward of the repo hands F.scaled_dot_product_attention a mask or is_causal=True, never both: torch 2.14
refuses both, and 2.13 silently applied is_causal alone. SDPA is wrapped here to refuse both on any torch, so
the next forward that hands it both fails here, not in a user's hands."""
import pytest
import torch
import torch.nn.functional as F

from bpe import BPE
from helpers import PROMPT, SMALL, TOKENIZER, small
from support import compiled_model
from engines.fast.decode_step import GraphCache
from engines.fast.engine import FastEngine
from engines.fast.rope import RowAttention, with_row_attention
from engines.serving.row_cache import prompt_step
from engines.serving.engine import Request, ServingEngine
from prefill_clone import Engine


@pytest.fixture
def calls(monkeypatch):
    """Each SDPA call's (queries, a mask given, is_causal); a call handed both fails where it is made."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def strict(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        assert attn_mask is None or not is_causal, "SDPA handed both attn_mask and is_causal=True"
        seen.append((q.shape[-2], attn_mask is not None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", strict)
    return seen


def test_the_lessons_forwards_hand_sdpa_a_mask_or_is_causal(calls):
    model, past_window = small(), SMALL.context + 8
    idx = torch.tensor([PROMPT])
    model(idx)  # Part 3's forward
    model.generate_cached(idx, past_window)
    model.step(idx, [{} for _ in model.blocks], 0)  # the post's dicts
    Engine(model).generate_batch(PROMPT, 3, max_tokens=past_window, seed=0)  # prefill once, clone, decode
    assert (len(PROMPT), False, True) in calls and (1, False, False) in calls


def test_the_engines_forwards_hand_sdpa_a_mask_or_is_causal(calls):
    model, tokenizer = compiled_model(), BPE.load(TOKENIZER)
    FastEngine(model).generate_batch(PROMPT, 3, max_tokens=40, seed=0)
    engine = ServingEngine(model, tokenizer, max_rows=2, block_size=4, prefill_chunk=4)
    shared = list(range(10, 30))
    for i, prompt in enumerate([shared, shared + [7, 8, 9, 11, 12, 13]]):  # the second's chunks follow cached blocks
        engine.submit(Request(str(i), prompt, max_tokens=5, temperature=0))
        while engine.has_work():
            engine.step()
    assert engine.scheduler.prompt_tokens_cached > 0
    assert any(queries > 1 and masked for queries, masked, _ in calls)  # prompt chunks after cached positions


class BothHanded(RowAttention):
    """The prompt chunks' attention handing SDPA the lesson's is_causal=T > 1 beside the chunks' mask."""

    def attend(self, q, k, v, is_causal, attn_mask=None):
        return super().attend(q, k, v, q.shape[2] > 1, attn_mask)


def test_a_forward_that_hands_sdpa_both_fails_here(calls):
    model = with_row_attention(compiled_model())
    for block in model.blocks:
        block.attn.__class__ = BothHanded
    rows = GraphCache.for_model(model, 1, model.cfg.context)
    with pytest.raises(AssertionError, match="SDPA handed both"), torch.inference_mode():
        prompt_step(model, rows, [(0, PROMPT, 0)])
