"""engines/graph_pick.py: the pick inside the compiled step picks what sampling.pick picks, row by row, and
FastEngine's compiled loop gives the lesson Engine's tokens at 1 and 16 rows, greedy and sampled."""
import pytest
import torch

import sampling
from conftest import PROMPT
from engines.compile_ways import compiler_missing
from engines.fast_engine import FastEngine
from engines.graph_pick import GraphPick, Knobs, STAGES, stages_for
from prefill_clone import Engine

VOCAB = 300
KNOBS = [dict(temperature=0), dict(temperature=0, penalty=1.5), dict(temperature=0.8), dict(temperature=1.3, top_k=7),
         dict(temperature=1.0, top_p=0.6), dict(temperature=0.7, top_k=40, top_p=0.9, penalty=1.3),
         dict(temperature=1.0, top_k=VOCAB), dict(temperature=1e-30), dict(temperature=1.0, penalty=1e-38),
         dict(temperature=0, penalty=1e38), dict(temperature=2.0, top_p=1e-9), dict(temperature=1.0, top_k=1)]


def graph_picks(logits, history, settings, seeds):
    """GraphPick's tokens, run eagerly, with Knobs set and drawn as FastEngine sets and draws them, and the
    generators after."""
    knobs, generators = Knobs(len(settings), logits.shape[1], logits.device), [torch.Generator().manual_seed(s)
                                                                             for s in seeds]
    knobs.set(settings, history[0, :-1].tolist())  # all but the token fed last: the program takes that in
    knobs.draw(generators)
    token = history[:, -1:]
    return GraphPick(stages_for(settings, logits.shape[1]))(logits, token, *knobs.tensors()).view(-1), generators


@pytest.mark.parametrize("trial", range(4))
def test_the_graph_pick_gives_sampling_picks_token_and_leaves_each_generator_where_it_would(trial):
    g = torch.Generator().manual_seed(trial)
    logits = torch.randn(len(KNOBS), VOCAB, generator=g) * 4
    logits[:, :5] = logits[:, 5:10]  # ties, which a sort may order either way
    history = torch.randint(VOCAB, (1, 12), generator=g).expand(len(KNOBS), -1)
    seeds = [trial * 100 + i for i in range(len(KNOBS))]
    got, after = graph_picks(logits, history, KNOBS, seeds)
    for i, knobs in enumerate(KNOBS):
        alone = torch.Generator().manual_seed(seeds[i])
        want = sampling.pick(logits[i:i + 1], history=history[i:i + 1], generator=[alone], **knobs)
        assert got[i].item() == want.item(), knobs
        assert torch.equal(after[i].get_state(), alone.get_state()), knobs


def test_a_row_whose_scores_are_not_finite_is_marked_and_the_others_picked():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    history = torch.zeros(3, 1, dtype=torch.long)
    got, _ = graph_picks(logits, history, [dict(temperature=0)] * 3, [0, 1, 2])
    assert got.tolist() == [logits[0].argmax().item(), -1, logits[2].argmax().item()]


def test_the_program_is_made_only_for_the_knobs_some_row_uses():
    assert stages_for([dict(temperature=0), dict(temperature=0, top_k=5, top_p=0.5)], VOCAB) == ()
    assert stages_for([dict(temperature=0), dict(temperature=0.5)], VOCAB) == ("temperature",)
    assert stages_for([dict(temperature=1.0, top_k=VOCAB)], VOCAB) == ("temperature",)  # top_k asks for nothing
    assert stages_for([dict(temperature=0, penalty=1.0), dict(temperature=0, penalty=1.2)], VOCAB) == ("penalty",)
    assert stages_for([dict(top_p=0.9), dict(top_k=3, penalty=0.9)], VOCAB) == STAGES


ROW_SETTINGS = [dict(temperature=0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.1, top_k=20, penalty=1.3),
                dict(temperature=0, penalty=1.2)]


@pytest.mark.skipif(bool(compiler_missing("cpu")), reason=str(compiler_missing("cpu")))
@pytest.mark.parametrize("rows", [1, 16])
def test_the_compiled_loop_gives_the_lesson_engines_tokens_greedy_and_sampled(rows, every_way_compiled):
    model, folder = every_way_compiled.model, every_way_compiled.folder
    fast, lesson = FastEngine(model, compile=True, compile_cache=folder), Engine(model)
    n = model.cfg.context - len(PROMPT) + 4  # past the window: the ring's positions too
    for kwargs in (dict(temperature=0), dict(settings=(ROW_SETTINGS * 4)[:rows], seed=list(range(7, 7 + rows)))):
        assert fast.generate_batch(PROMPT, rows, max_tokens=n, **kwargs) == \
            lesson.generate_batch(PROMPT, rows, max_tokens=n, **kwargs)
    forced = [[1, 2, 3]] + [[]] * (rows - 1)  # forced tokens are fed in place of the pick; a stop ends a row
    kwargs = dict(temperature=0.9, top_k=30, top_p=0.95, penalty=1.1, forced=forced, stop=[PROMPT[0]])
    assert fast.generate_batch(PROMPT, rows, max_tokens=n, **kwargs) == \
        lesson.generate_batch(PROMPT, rows, max_tokens=n, **kwargs)
    assert {stages for batch, stages in fast.steps if batch == rows} == {(), STAGES}
