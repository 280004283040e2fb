"""engines/fast/graph_pick.py: the pick inside the compiled step picks what sampling.pick picks, row by row, and
FastEngine's compiled loop gives the lesson Engine's tokens for rows at settings of their own, greedy and sampled."""
import pytest
import torch

import sampling
from helpers import PROMPT
from support import COMPILED_ROWS
from engines.fast.compile_ways import compiler_missing
from engines.fast import engine as fast_engine
from engines.fast.engine import FastEngine
from engines.fast.graph_pick import GraphPick, Knobs, STAGES, stages_for

VOCAB = 300
KNOBS = [dict(temperature=0), dict(temperature=0, penalty=1.5), dict(temperature=0.8), dict(temperature=1.3, top_k=7),
         dict(temperature=1.0, top_p=0.6), dict(temperature=0.7, top_k=40, top_p=0.9, penalty=1.3),
         dict(temperature=1.0, top_k=VOCAB), dict(temperature=1e-30), dict(temperature=1.0, penalty=1e-4),
         dict(temperature=0, penalty=1e4), dict(temperature=2.0, top_p=1e-9), dict(temperature=1.0, top_k=1)]


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
def test_the_graph_pick_picks_as_sampling_pick_and_leaves_each_generator_so(trial):
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


ROW_SETTINGS = [dict(temperature=0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.1, top_k=20, penalty=1.3)]


@pytest.mark.skipif(bool(compiler_missing("cpu")), reason=str(compiler_missing("cpu")))
def test_the_compiled_loop_gives_the_lesson_engines_tokens_greedy_and_sampled(every_way_compiled):
    model, folder, rows = every_way_compiled.model, every_way_compiled.folder, COMPILED_ROWS
    # the lesson's loop on the ring, eager: past the window the ring's reference (test_kv_cache), not the dict's
    fast, lesson = FastEngine(model, compile=True, compile_cache=folder), FastEngine(model, kernel="nn")
    n = model.cfg.context - len(PROMPT) + 4  # past the window: the ring's positions too
    assert stages_for(ROW_SETTINGS, model.cfg.vocab_size) == STAGES  # each row its own knobs: every stage of the pick
    for kwargs in (dict(temperature=0), dict(settings=ROW_SETTINGS, seed=list(range(7, 7 + rows)))):
        assert fast.generate_batch(PROMPT, rows, max_tokens=n, **kwargs) == \
            lesson.generate_batch(PROMPT, rows, max_tokens=n, **kwargs)
    forced = [[1, 2, 3]] + [[]] * (rows - 1)  # forced tokens are fed in place of the pick; a stop ends a row
    kwargs = dict(temperature=0.9, top_k=30, top_p=0.95, penalty=1.1, forced=forced, stop=[PROMPT[0]])
    assert fast.generate_batch(PROMPT, rows, max_tokens=n, **kwargs) == \
        lesson.generate_batch(PROMPT, rows, max_tokens=n, **kwargs)
    assert {stages for batch, stages in fast.steps if batch == rows} == {(), STAGES}


def counted_steps(engine, rows, marked_at=None):
    """The kept greedy step for `rows` rows, its calls counted; from call `marked_at` on (if given) it returns
    what the pick returns for scores that are not finite: row 0 marked -1, its scores NaN."""
    engine.prepare(rows)
    step = engine.steps[rows, ()]
    run, calls = step.run, []

    def counted():
        calls.append(1)
        logits, tokens = run()
        if marked_at is not None and len(calls) >= marked_at:
            logits, tokens = logits.clone(), tokens.clone()
            logits[0], tokens[0] = float("nan"), -1
        return logits, tokens
    step.run = counted
    return calls, run, step


@pytest.mark.skipif(bool(compiler_missing("cpu")), reason=str(compiler_missing("cpu")))
def test_steps_run_ahead_only_where_no_token_decides_the_next_nor_past_the_end(compiled):
    engine, rows = FastEngine(compiled.model, compile=True, compile_cache=compiled.folder), COMPILED_ROWS
    calls, run, step = counted_steps(engine, rows)
    try:
        n = engine.model.cfg.context + 5  # past the window, and more than AHEAD steps (one run ahead, then the rest)
        assert fast_engine.AHEAD < n - 1 and (n - 1) % fast_engine.AHEAD
        tokens = engine.generate_batch(PROMPT, rows, max_tokens=n, temperature=0)[0]
        assert len(calls) == n - 1 and [len(t) for t in tokens] == [n] * rows  # no step for the last token
        stop = tokens[0][2]  # every row is greedy from one prompt: all stop where it first comes, by the third token
        calls.clear()
        assert [len(t) for t in engine.generate_batch(PROMPT, rows, max_tokens=n, temperature=0, stop=[stop])[0]] == \
            [tokens[0].index(stop) + 1] * rows
        assert len(calls) == tokens[0].index(stop)  # with a stop, a step at a time: none past it
    finally:
        step.run = run


@pytest.mark.skipif(bool(compiler_missing("cpu")), reason=str(compiler_missing("cpu")))
@pytest.mark.parametrize("marked_at", [1, 3, fast_engine.AHEAD + 2])
def test_non_finite_scores_stop_steps_run_ahead_at_their_token(marked_at, compiled):
    engine = FastEngine(compiled.model, compile=True, compile_cache=compiled.folder)
    calls, run, step = counted_steps(engine, COMPILED_ROWS, marked_at)
    try:
        message = f"scores for new token {marked_at} are NaN or infinite"
        with pytest.raises(ValueError, match=message):  # the steps ahead: the marked row fed on, its mark raised
            engine.generate_batch(PROMPT, COMPILED_ROWS, max_tokens=3 * fast_engine.AHEAD, temperature=0)
        calls.clear()
        with pytest.raises(ValueError, match=message):  # a step at a time
            for _ in engine.generate(PROMPT, COMPILED_ROWS, max_tokens=3 * fast_engine.AHEAD, temperature=0):
                pass
        assert len(calls) == marked_at
    finally:
        step.run = run
