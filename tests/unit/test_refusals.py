"""Refusals of averaging contributions: a kind the averager counts, a detail for the log, one string
on the wire that reads back as the same refusal (and an unknown peer's reason as ``other``)."""

from __future__ import annotations

from typing import get_args

import pytest

from swarmd.pipeline.averaging.trust.refusals import Refusal, RefusalKind


@pytest.mark.parametrize("kind", get_args(RefusalKind))
def test_a_refusal_reads_back_from_its_wire_string(kind: str) -> None:
    refusal = Refusal(kind, "in part 3: its per-sample norm is 80x the median")  # type: ignore[arg-type]
    assert str(refusal) == f"{kind}: in part 3: its per-sample norm is 80x the median"
    assert Refusal.from_wire(str(refusal)) == refusal


@pytest.mark.parametrize("text", ["", "outlier", "outlier in part 3: far", "made-up: x", "Outlier: x", "excluded:x",
                                  "\x00: \x00", "a" * 600])
def test_a_peers_reason_of_no_known_kind_is_other_and_kept_whole(text: str) -> None:
    got = Refusal.from_wire(text)
    assert got == Refusal("other", text)
    assert got.kind == "other"  # remote input never names a counter that is not in the list
