"""engines/fast/rope.py: the lesson's RoPE tables at a (B,) tensor of positions turn each row as rope_at does alone."""
import torch

from engines.fast.rope import rope_rows
from model import rope_at


def test_rope_rows_turns_each_row_exactly_as_rope_at_at_its_own_start():
    x = torch.randn(3, 4, 2, 16, generator=torch.Generator().manual_seed(0))
    got = rope_rows(x, torch.tensor([0, 5, 260]))
    for row, start in enumerate((0, 5, 260)):
        assert torch.equal(got[row:row + 1], rope_at(x[row:row + 1], start))
