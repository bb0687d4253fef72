"""Fair shares of a step among the trainers that claim it (swarmd.pipeline.fair_share): pure water-filling."""

from __future__ import annotations

import pytest

from swarmd.pipeline.fair_share import Claim, fair_shares


def test_a_lone_claimant_gets_what_it_asks_for_up_to_what_is_free() -> None:
    assert fair_shares([Claim("a", has=0, wants=32, size=8)], 32) == {"a": 32}
    assert fair_shares([Claim("a", has=0, wants=64, size=8)], 30) == {"a": 30}
    assert fair_shares([Claim("a", has=0, wants=16, size=8)], 32) == {"a": 16}


def test_whole_microbatches_go_round_the_claimants_and_the_least_granted_gets_the_rest() -> None:
    claims = [Claim("a", 0, 32, 8, credit=70), Claim("b", 0, 32, 8, credit=30), Claim("c", 0, 32, 8, credit=50)]
    assert fair_shares(claims, 32) == {"b": 16, "c": 8, "a": 8}


def test_what_a_claimant_already_holds_counts_against_its_share() -> None:
    claims = [Claim("a", has=16, wants=32, size=8), Claim("b", has=0, wants=32, size=8)]
    assert fair_shares(claims, 16) == {"a": 0, "b": 16}
    assert fair_shares(claims, 24) == {"a": 8, "b": 16}


def test_a_claimant_that_wants_little_leaves_the_rest_to_the_others() -> None:
    claims = [Claim("a", 0, 8, 8), Claim("b", 0, 32, 8), Claim("c", 0, 0, 8)]
    assert fair_shares(claims, 32) == {"a": 8, "b": 24, "c": 0}


def test_the_last_microbatch_is_cut_to_what_is_free_and_sizes_may_differ() -> None:
    claims = [Claim("a", 0, 40, 4), Claim("b", 0, 40, 16)]
    # whoever holds fewer goes next (a tie to the smaller id): a 4, b 16, a 8, 12, 16, 20, then b's 16 cut to the 8 left
    assert fair_shares(claims, 44) == {"a": 20, "b": 24}
    assert sum(fair_shares(claims, 27).values()) == 27


def test_more_claimants_than_microbatches_share_by_who_was_granted_least() -> None:
    claims = [Claim(t, 0, 8, 8, credit=c) for t, c in (("a", 40), ("b", 0), ("c", 24), ("d", 8), ("e", 32))]
    assert {t for t, n in fair_shares(claims, 32).items() if n} == {"b", "d", "c", "e"}


@pytest.mark.parametrize("free", [0, -8])
def test_nothing_free_nothing_shared(free: int) -> None:
    assert fair_shares([Claim("a", 0, 32, 8)], free) == {"a": 0}


def test_the_work_is_bounded_by_the_grants_allowed() -> None:
    claims = [Claim(f"t{i}", 0, 10**6, 1) for i in range(8)]
    shares = fair_shares(claims, 10**7, max_grants=4096)
    assert sum(shares.values()) == 4096 and set(shares.values()) == {512}
