"""swarmd.daemon.stage_state.StageState.plan with ``confirm`` (a move's check, ``POST /migrate``): only the holders of
a stage's state that prove themselves now are its sources, while every record still tells whether the swarm trained."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from swarmd.daemon.stage_state import StageState
from swarmd.dht.records import PeerRecord
from swarmd.pipeline.placement.resume import Source

NOW = 1_000_000.0
SELF, MATE, HOLDER = "a" * 40, "b" * 40, "c" * 40


def _record(pid: str, stage: int, step: int) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, state="serving", data_addr=f"127.0.0.1:{ord(pid[0])}", api_addr="",
                      throughput=1.0, queue=0, step=step, params_digest=None, version="t", timestamp=NOW,
                      expiry=NOW + 30)


class Prover:
    def __init__(self, answering: set[str]) -> None:
        self.answering, self.asked = answering, set[str]()

    async def prove_all(self, peers: dict[str, str], *, stage: int | None, fresh: bool = False) -> dict[str, Any]:
        self.asked |= set(peers)
        return {pid: object() for pid in peers if pid in self.answering}


def _state(prover: Prover) -> StageState:
    records = [_record(SELF, 0, 4), _record(MATE, 0, 4), _record(HOLDER, 1, 4)]

    async def all_peers(n_stages: int) -> list[PeerRecord]:
        return records

    host = SimpleNamespace(
        config=SimpleNamespace(dht=SimpleNamespace(state_dir=None), swarm="s"), peer_id=SELF,
        spec=SimpleNamespace(n_stages=2), membership=SimpleNamespace(all_peers=all_peers),
        excluded_peers=lambda: frozenset(), prover=prover)
    return StageState(host)  # type: ignore[arg-type]


async def test_a_dead_holder_is_no_source_and_the_trained_swarm_is_still_trained() -> None:
    # without a check of its own checkpoints (no --state-dir): only the records say the swarm trained
    dead = Prover(answering={MATE})
    assert (await _state(dead).plan(1)).available  # the records alone: the dead holder looks live
    refused = await _state(dead).plan(1, confirm=True)
    assert refused.candidates == () and refused.fallback is Source.LOST and not refused.available  # not FRESH
    assert dead.asked == {HOLDER}  # only the holders of stage 1's state are challenged
    alive = await _state(Prover(answering={HOLDER})).plan(1, confirm=True)
    assert alive.available and alive.best is not None and (alive.best.source, alive.best.peer_id) == (Source.LIVE, HOLDER)
