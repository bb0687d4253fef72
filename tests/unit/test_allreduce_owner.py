"""What an all-reduce part owner seconds a conviction by (``swarmd.pipeline.averaging.allreduce.owner.PartStrikes``):
the far strikes its own parts gave each member over its last committed rounds, direction alone never counting."""

from __future__ import annotations

from swarmd.pipeline.averaging.allreduce.owner import PartStrikes
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
