"""A leaver's gradient hand-over goes to proven stage-mates first, and tries few others (issue #18, item 3)."""

from __future__ import annotations

from swarmd.net.handover import MAX_UNPROVEN_ATTEMPTS, PROVEN_TIMEOUT_S, UNPROVEN_TIMEOUT_S, handover_order


def test_proven_stage_mates_come_first_and_few_unproven_ones_follow_with_a_short_timeout() -> None:
    mates = {f"fake{i:02d}": f"127.0.0.1:{9000 + i}" for i in range(32)}  # sorted before the honest ones
    mates |= {"me": "127.0.0.1:1", "x-honest": "127.0.0.1:2", "y-honest": "127.0.0.1:3", "z-excluded": "127.0.0.1:4"}
    order = handover_order(mates, proven={"x-honest", "y-honest", "z-excluded"}, excluded={"z-excluded"},
                           self_id="me")
    assert [pid for pid, _, _ in order[:2]] == ["x-honest", "y-honest"]
    assert all(t == PROVEN_TIMEOUT_S for _, _, t in order[:2])
    assert [pid for pid, _, _ in order[2:]] == [f"fake{i:02d}" for i in range(MAX_UNPROVEN_ATTEMPTS)]
    assert all(t == UNPROVEN_TIMEOUT_S < PROVEN_TIMEOUT_S for _, _, t in order[2:])
    assert len(order) == 2 + MAX_UNPROVEN_ATTEMPTS


def test_without_proofs_every_listed_stage_mate_is_tried_but_never_itself_or_an_excluded_one() -> None:
    mates = {"a": "addr-a", "b": "addr-b", "me": "addr-me", "c": "addr-c"}
    assert handover_order(mates, proven=None, excluded={"c"}, self_id="me") == [
        ("a", "addr-a", PROVEN_TIMEOUT_S), ("b", "addr-b", PROVEN_TIMEOUT_S)]
    assert handover_order({}, proven=set()) == []
