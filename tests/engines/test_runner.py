"""engines/serving/runner.py: the step for B rows runs over the smallest size that holds them, made once and kept, and
CUDA's way (torch.compile, every slot attended behind the mask) gives the lesson's tokens, checked on a CPU."""

from helpers import PROMPT, small
from engines.fast.engine import FastEngine
from engines.serving.runner import ModelRunner, batch_sizes


def test_sizes_are_nano_vllms_one_two_four_eight_then_steps_of_16_up_to_the_rows():
    assert batch_sizes(1) == [1] and batch_sizes(3) == [1, 2, 3] and batch_sizes(16) == [1, 2, 4, 8, 16]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64] and batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_a_step_for_b_rows_runs_over_the_smallest_size_holding_them_and_is_kept():
    runner = ModelRunner(small(), 16)
    step = runner.step(3)
    assert step.cache.shape["batch"] == 4 and runner.step(4) is step and runner.step(5) is not step
    assert step.cache.heads_k.data_ptr() == runner.cache.heads_k.data_ptr()  # the runner's rows, not a copy


def test_cudas_way_torch_compile_over_every_slot_gives_the_lessons_tokens():
    """The step CUDA runs, compiled by torch.compile and attending to every slot behind the mask, here on a CPU
    (where only the graph capture is left out): FastEngine's greedy and drawn rows equal the lesson's loop on the
    ring, past the window too (where the ring is TrimFirst's model, not the post's dict's: test_kv_cache)."""
    model = small()
    engine = FastEngine(model, compile=True)
    engine.runners[2] = ModelRunner(model, 2, [2], compile=True, jit=True)
    for knobs in ({"temperature": 0}, {"temperature": 0.9, "top_k": 20, "seed": 3}):
        want = FastEngine(model, kernel="nn").generate_batch(PROMPT, 2, max_tokens=40, **knobs)[0]
        assert engine.generate_batch(PROMPT, 2, max_tokens=40, **knobs)[0] == want
    step = engine.steps[2, ()]
    assert step.every_slot and step.run is not step._step and step.package is None  # compiled, nothing on disk
    assert step.cache.attended.shape[0] == model.cfg.context
