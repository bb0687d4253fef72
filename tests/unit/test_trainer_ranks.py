"""swarmd.api.trainer_ranks: which claim keeps a rank (pure parts)."""

from __future__ import annotations

import pytest

from swarmd.api.trainer_ranks import free_rank, lost
from swarmd.dht.records import RanksRecord
from swarmd.errors import MalformedRecord

A, B, C = "a" * 40, "b" * 40, "c" * 40


def record(peer: str, *ranks: tuple[int, float]) -> RanksRecord:
    return RanksRecord(peer, ranks, 100.0, 130.0)


def test_free_rank_is_the_smallest_gap() -> None:
    assert free_rank(set()) == 0 and free_rank({0, 1, 3}) == 2 and free_rank({1, 2}) == 0


def test_the_earlier_claim_keeps_a_rank_and_ties_go_to_the_smaller_daemon_id() -> None:
    mine = {0: 10.0, 1: 12.0}
    assert lost(mine, B, [record(A, (0, 11.0)), record(C, (1, 11.5))]) == {1}  # A came later, C earlier
    assert lost(mine, B, [record(A, (0, 10.0))]) == {0}  # the same instant: A < B
    assert lost(mine, A, [record(B, (0, 10.0))]) == set()
    assert lost(mine, B, [record(B, (0, 1.0))]) == set()  # its own record is not another's claim


def test_a_ranks_record_normalises_and_refuses_bad_claims() -> None:
    assert record(A, (2, 1.0), (0, 2.0)).ranks == ((0, 2.0), (2, 1.0))
    for bad in (((0, 1.0), (0, 2.0)), ((-1, 1.0),), ((0, float("nan")),), ((0,),)):
        with pytest.raises(MalformedRecord):
            record(A, *bad)  # type: ignore[arg-type]
