"""Averaging rounds as daemons report them."""


from __future__ import annotations


def ok_rounds(statuses: list[dict]) -> dict[int, int]:
    """step -> samples of the stage's successful round at that step, from the survivors' books."""
    rounds: dict[int, int] = {}
    for s in statuses:
        for r in s["averaging"]["recent"]:
            if r["status"] == "ok":
                assert rounds.setdefault(r["step"], r["samples"]) == r["samples"], (r, rounds)
    return rounds
