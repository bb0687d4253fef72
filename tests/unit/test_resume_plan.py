"""swarmd.pipeline.placement.resume: where a stage's state comes from (pure)."""

from __future__ import annotations

from swarmd.pipeline.placement.resume import Offer, Source, plan


def sources(p) -> list[tuple[Source, int, str | None]]:  # type: ignore[no-untyped-def]
    return [(o.source, o.step, o.peer_id) for o in p.candidates]


def test_a_live_stage_mate_at_or_past_the_checkpoint_wins() -> None:
    # the stage stays bit-identical with the peers serving it
    assert plan(live=[("a", 10)], own=10, swarm_trained=True).best == Offer(Source.LIVE, 10, "a")
    assert plan(live=[("a", 12), ("b", 3)], own=10, swarm_trained=True).best == Offer(Source.LIVE, 12, "a")
    assert plan(live=[("a", 0)], swarm_trained=False).best == Offer(Source.LIVE, 0, "a")


def test_only_peers_behind_or_none_resume_from_the_own_checkpoint() -> None:
    assert plan(live=[("a", 3)], own=10, swarm_trained=True).best == Offer(Source.OWN, 10)
    assert plan(own=10, swarm_trained=True).best == Offer(Source.OWN, 10)


def test_fresh_only_while_nothing_trained_and_lost_otherwise() -> None:
    fresh = plan(swarm_trained=False)
    assert fresh.best is None and fresh.fallback is Source.FRESH and fresh.available
    lost = plan(swarm_trained=True)
    assert lost.best is None and lost.fallback is Source.LOST and not lost.available


def test_a_checkpoint_another_peer_offers_is_a_source_and_the_newest_wins() -> None:
    # the README's restart: this peer holds only an old checkpoint of the stage; another peer offers step 350
    p = plan(own=150, offered=[("b", 350), ("c", 300)], swarm_trained=True)
    assert sources(p) == [(Source.OFFERED, 350, "b"), (Source.OFFERED, 300, "c"), (Source.OWN, 150, None)]
    assert p.fallback is Source.LOST  # every source failing is a loss, never a fresh start
    # a live peer that resumed from an older checkpoint is overtaken by a newer one offered
    assert plan(live=[("a", 100)], offered=[("b", 350)], swarm_trained=True).best == Offer(Source.OFFERED, 350, "b")


def test_ties_go_live_then_own_then_offered_then_by_peer_id() -> None:
    p = plan(live=[("z", 7)], own=7, offered=[("b", 7), ("a", 7)], swarm_trained=True)
    assert sources(p) == [(Source.LIVE, 7, "z"), (Source.OWN, 7, None), (Source.OFFERED, 7, "a"),
                          (Source.OFFERED, 7, "b")]


def test_min_step_drops_older_sources() -> None:
    p = plan(live=[("a", 4)], own=9, offered=[("b", 5)], swarm_trained=True, min_step=6)
    assert sources(p) == [(Source.OWN, 9, None)]
