"""What an all-reduce part owner seconds a conviction by (``swarmd.pipeline.averaging.allreduce.owner.PartStrikes``):
the far strikes its own parts gave each member over its last committed rounds, direction alone never counting;
and its rule for a part of two slices (``reduce_slices``: neither may be the part's mean on its own say)."""

from __future__ import annotations

import pytest
import torch

from swarmd.pipeline.averaging.allreduce.owner import PartStrikes, reduce_slices
from swarmd.pipeline.averaging.trust.accusations import SECOND_CLAIMS
from swarmd.pipeline.averaging.trust.hostile_contributions import FAR_FACTOR, WINDOW, Score

FAR = Score(far=2 * FAR_FACTOR, cos=-0.9)
AGAINST = Score(far=1.0, cos=-0.9)  # struck, never a far strike
NEAR = Score(far=0.5, cos=0.7)


def test_far_strikes_are_counted_over_the_window_and_direction_alone_never_counts() -> None:
    strikes = PartStrikes()
    for _ in range(SECOND_CLAIMS - 1):
        strikes.observe({"liar": FAR, "flip": AGAINST, "honest": NEAR})
    assert strikes.far("liar") == SECOND_CLAIMS - 1 < SECOND_CLAIMS
    strikes.observe({"liar": FAR, "flip": AGAINST, "honest": NEAR})
    assert strikes.far("liar") == SECOND_CLAIMS
    assert strikes.far("flip") == strikes.far("honest") == strikes.far("never seen") == 0
    for _ in range(WINDOW):  # honest rounds push the old strikes out of the window
        strikes.observe({"liar": NEAR})
    assert strikes.far("liar") == 0


def test_the_peers_kept_are_bounded() -> None:
    strikes = PartStrikes(max_peers=3)
    for k in range(10):
        strikes.observe({f"p{k}": FAR})
    assert [strikes.far(f"p{k}") for k in range(10)] == [0] * 7 + [1] * 3


def _slices(factor_owner: float, factor_member: float, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """A part of two slices (owner "a", member "b", 4 samples each): one true per-sample gradient with a little
    noise each, times the given factors."""
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(512, generator=g)
    a = (true + 0.3 * torch.randn(512, generator=g)) * 4 * factor_owner
    b = (true + 0.3 * torch.randn(512, generator=g)) * 4 * factor_member
    return {"a": (4, a), "b": (4, b)}, (a + b) / 8


@pytest.mark.parametrize("liar", ["owner", "member"])
@pytest.mark.parametrize("factor", [-20.0, -1.0, 20.0])
def test_a_part_of_two_slices_moves_nothing_when_one_disagrees_with_the_other(liar: str, factor: float) -> None:
    """With two slices there is no median to tell which lies: the owner's own -20x (or sign-flipped, or 20x)
    slice is not the part's mean, and neither is a member's: both are struck, their samples counted."""
    parts, _ = _slices(factor if liar == "owner" else 1.0, factor if liar == "member" else 1.0)
    mean, red = reduce_slices(parts, "a", (), 512)
    assert set(red.struck) == {"a", "b"} and red.total == 8
    assert torch.equal(mean, torch.zeros(512))


def test_a_part_of_two_agreeing_slices_is_their_mean() -> None:
    parts, expected = _slices(1.0, 1.0)
    mean, red = reduce_slices(parts, "a", (), 512)
    assert not red.struck
    assert torch.allclose(mean, expected, atol=1e-6)
