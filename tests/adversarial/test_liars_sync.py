"""A ``--sync`` trainer against averaging liars (issue #17): a poisoned contributor and a lying leader
in a real 2-stage x 3-peer swarm of in-process daemons (real HTTP, real DHT, real torch).

What a user runs is ``swarmd train --sync``: it waits until every peer of every stage stepped. A
poisoned contributor still reports the samples its stage-mates refuse, and a refused leader steps
alone on its own lie (a fork, one step ahead or at the honest step with another digest); the wait
must not count either (``swarmd.train.verify.stage_distrust``), top the honest peers up, and go on.
The pure rules have unit tests here; the swarm tests check that training ends every step, the honest
peers stay identical, the liar's gradients never enter an honest step, and the liar is excluded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from swarmd.daemon import Daemon
from swarmd.net.client import DataPlaneClient
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.train.summary import TrainSummary
from swarmd.train.swarm_client import PeerProgress
from swarmd.train.sync_steps import SyncSteps
from swarmd.train.timing import Timing
from swarmd.train.trainer import Trainer, TrainerConfig
from swarmd.train.verify import excluded_by_stage, forks, stage_distrust
from tests.support.liars import lie_as_leader, poison_contributions
from tests.support.swarms import fast_swarm


@dataclass(frozen=True)
class P:
    peer_id: str
    step: int | None
    excluded: tuple[str, ...] = ()
    params_digest: str | None = None


def test_whose_word_counts_forks_accusations_and_majorities() -> None:
    honest = [P("a", 3, (), "d"), P("b", 3, (), "d"), P("c", 3, (), "d")]
    assert forks(honest) == stage_distrust(honest) == excluded_by_stage(honest) == frozenset()
    # a refused leader applied its lie: at the honest peers' step with another digest, or alone ahead
    forked = [P("L", 3, (), "x"), P("a", 3, ("L",), "d"), P("b", 3, ("L",), "d")]
    assert forks(forked) == {"L"} and excluded_by_stage(forked) == {"L"} and stage_distrust(forked) == {"L"}
    ahead = [P("L", 4, (), "x"), P("a", 3, ("L",), "d"), P("b", 3, ("L",), "d")]
    assert forks(ahead) == frozenset() and stage_distrust(ahead) == {"L"}
    # two peers, two digests: no majority, nobody is a fork; no digest known: nobody either
    assert forks([P("a", 3, (), "x"), P("b", 3, (), "d")]) == frozenset()
    assert forks([P("a", 3), P("b", 3), P("c", 3, (), "x")]) == frozenset()
    # one accuser (the leader that refused a poisoned contribution) makes the wait distrust it, not routing
    poisoned = [P("a", 0, ("z",), "d"), P("b", 0, (), "d"), P("z", 0, (), "d")]
    assert stage_distrust(poisoned) == {"z"} and excluded_by_stage(poisoned) == frozenset()
    # a liar naming every honest peer makes the wait distrust them (more top-ups), never the routing
    framing = [P("a", 0, (), "d"), P("b", 0, (), "d"), P("z", 0, ("a", "b"), "d")]
    assert stage_distrust(framing) == {"a", "b"} and excluded_by_stage(framing) == frozenset()
    # silent peers' lists do not count, self-accusations and other stages' peers are ignored
    assert stage_distrust([P("a", None, ("b",)), P("b", 0, ("b", "elsewhere"))]) == frozenset()


class _ScriptedStages:
    """The sync step wait's inputs and outputs, without a swarm: its polls answer what ``stage1(topups)``
    says (stage 0: one peer, already stepped; stage 1: the peers given), and its microbatches only
    count (the wait's decisions are what is tested here; the swarm test below runs them for real)."""

    def __init__(self, stage1: Callable[[int], list[PeerProgress]]) -> None:
        self.topups = 0
        self.stage1 = stage1
        self.routers: list[object] = []

    async def refresh(self, force: bool = False) -> None:
        return None

    async def swarm_step(self) -> int:
        return 0

    async def poll(self, wait_step: int | None = None, on_stage=None, refresh=True) -> list[list[PeerProgress]]:
        await asyncio.sleep(0.01)
        return [[PeerProgress("s0", 1, 0, params_digest="d0")], self.stage1(self.topups)]

    async def run(self, x: torch.Tensor, y: torch.Tensor, **_: object) -> None:
        self.topups += 1


class _Sampler:
    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(n, 4, dtype=torch.long), torch.zeros(n, 4, dtype=torch.long)


def _waiting(stages: _ScriptedStages) -> tuple[SyncSteps, TrainSummary]:
    """A sync trainer's steps with short graces, waiting on the scripted ``stages``."""
    summary = TrainSummary()
    config = TrainerConfig(api="http://127.0.0.1:9", sync=True, microbatch_size=4, stage_wait_timeout_s=20,
                           timing=Timing(stuck_grace_s=0.2, lag_grace_s=0.2))

    async def nothing(*args: object) -> None:
        return None

    steps = SyncSteps(config, TrainingSpec(target_batch_size=12), view=stages, microbatches=stages,
                      summary=summary, on_step=nothing)
    return steps, summary


async def test_the_sync_wait_tops_up_a_stuck_stage_and_stops_waiting_for_a_peer_left_behind(
        caplog: pytest.LogCaptureFixture) -> None:
    """Three decisions of ``SyncSteps.wait_all_stepped`` on scripted progress answers (short graces)."""
    # a liar claims 4 samples it never contributes, nobody excludes it: the stage holds the target and does
    # not step; after the grace one microbatch, and the round goes through
    stuck = _ScriptedStages(lambda topups: [PeerProgress(p, 1 if topups else 0, 4, params_digest="d")
                                            for p in ("a", "b", "z")])
    steps, summary = _waiting(stuck)
    await asyncio.wait_for(steps.wait_all_stepped(1, _Sampler()), 10)
    assert stuck.topups == 1 and summary.topup_microbatches == 1
    assert "has not stepped for 0s (a peer holds samples it does not contribute?)" in caplog.text
    # its leader refused the liar ("a" excludes "z"): its 4 samples do not count, 4 are topped up at once
    short = _ScriptedStages(lambda topups: [PeerProgress("a", 1 if topups else 0, 4, excluded=("z",),
                                                         params_digest="d"),
                                            PeerProgress("b", 1 if topups else 0, 4, params_digest="d"),
                                            PeerProgress("z", 0, 4, params_digest="d")])
    steps, _ = _waiting(short)
    began = time.monotonic()
    await asyncio.wait_for(steps.wait_all_stepped(1, _Sampler()), 10)
    assert short.topups == 1 and time.monotonic() - began < 1.0  # no 1 s grace: nothing left to wait for
    # a peer that claims an old step forever while the rest of its stage stepped: not waited for past the grace
    behind = _ScriptedStages(lambda topups: [PeerProgress("a", 1, 0, params_digest="d"),
                                             PeerProgress("b", 1, 0, params_digest="d"),
                                             PeerProgress("z", 0, 0, params_digest="d")])
    steps, _ = _waiting(behind)
    await asyncio.wait_for(steps.wait_all_stepped(1, _Sampler()), 10)
    assert behind.topups == 0 and "not waiting any longer for z, left behind by most of its stage" in caplog.text


SPEC = replace(PRESETS["tiny"], name="sync-liars")
TRAINING = TrainingSpec(target_batch_size=12, lr=3e-3, warmup_steps=2, averaging_timeout_s=5.0)
STEPS = 2


async def _proven(daemons: list[Daemon]) -> None:
    """Until every peer has proven both its stage-mates (rounds are only among proven peers)."""
    deadline = asyncio.get_running_loop().time() + 30
    while not all(d.averager is not None and d.averager.prover is not None
                  and d.averager.prover.table.status()["proven"] >= 2 for d in daemons):
        assert asyncio.get_running_loop().time() < deadline, "stage-mates did not prove each other"
        await asyncio.sleep(0.05)


async def _feed(client: DataPlaneClient, first: Daemon, last: Daemon) -> None:
    """Four samples into ``last`` (a stage-1 peer) at step 0, through a real forward on ``first``."""
    x = torch.randint(0, SPEC.vocab_size, (4, SPEC.seq_len), generator=torch.Generator().manual_seed(5))
    acts = (await client.forward(str(first.data_addr), 0, x, model=SPEC.digest)).outputs
    await client.backward(str(last.data_addr), 1, acts, None, torch.roll(x, -1, 1), model=SPEC.digest)


@pytest.mark.timeout(120)
async def test_a_sync_trainer_tops_up_around_a_lying_leader_and_a_poisoned_contributor(
        caplog: pytest.LogCaptureFixture) -> None:
    """Stage 0's leader (its smallest id) answers with ten times the mean; stage 1's largest id sends
    5000x-scaled contributions (and holds samples at step 0, so its first round is refused). A
    ``--sync`` trainer (what a user runs) finishes every step; every honest round holds a full batch
    of honest samples only; the honest peers stay identical; each liar is named in a log line with
    the evidence, counted in ``/status``, and the refused leader (a fork) is not routed to."""
    async with fast_swarm(SPEC, replace(TRAINING, averaging="leader"), peers_per_stage=3) as daemons:
        await _proven(daemons)
        stages = [sorted((d for d in daemons if d.stage == k), key=lambda d: str(d.peer_id)) for k in (0, 1)]
        leader_liar, poisoner = stages[0][0], stages[1][-1]  # the smallest id leads
        assert leader_liar.averager is not None and poisoner.averager is not None
        lie_as_leader(leader_liar.averager, "scaled")
        poison_contributions(poisoner.averager, "scaled")
        async with DataPlaneClient(timeout_s=20) as client:
            await _feed(client, stages[0][1], poisoner)
        api = f"http://{daemons[0].status()['api_addr']}"
        trainer = Trainer(TrainerConfig(api=api, steps=STEPS, sync=True, microbatch_size=4, window=4, codec="none",
                                        val_every=0, val_batches=2, max_corpus_bytes=1 << 20, refresh_s=0.5,
                                        heartbeat_s=1.0, request_timeout_s=20.0, stage_wait_timeout_s=60.0,
                                        verify_fraction=0.0))  # paired checks' extra samples would fill the gaps
        summary = await asyncio.wait_for(trainer.run(), 100)
        statuses = {d.peer_id: d.status() for d in daemons}
        history = {d.peer_id: list(d.averager.history) for d in daemons if d.averager is not None}

    assert summary.steps == STEPS and summary.microbatches_issued == summary.microbatches_completed
    assert summary.topup_microbatches >= 2  # each stage was short of its liar's share at least once
    for liar, stage in ((leader_liar, stages[0]), (poisoner, stages[1])):
        a, b = (statuses[d.peer_id] for d in stage if d is not liar)
        assert a["step"] == b["step"] and a["params_digest"] == b["params_digest"]
        assert a["step"] >= STEPS
    logs = caplog.text
    # the lying leader: both contributors refused its answer at step 0, kept their gradients and stepped alone
    for d in stages[0][1:]:
        avg = statuses[d.peer_id]["averaging"]
        # once, or again after its exclusion ran out (10 s) on a loaded machine: never applied
        assert set(avg["leaders_refused"]) == {leader_liar.peer_id}, avg
        at0 = [r["status"] for r in history[d.peer_id] if r["step"] == 0]
        assert at0[0] == "refused" and at0[-1] == "ok", history[d.peer_id]
        assert all(r["leader"] != leader_liar.peer_id for r in history[d.peer_id] if r["status"] == "ok")
    assert f"refused the answer of leader {leader_liar.peer_id[:12]} (the mean's norm" in logs
    assert f"not routing to {leader_liar.peer_id[:12]}" in logs  # excluded by most of its stage, or a fork
    # the poisoned contributor: refused by its leader, never in an honest round
    leader = stages[1][0]
    assert statuses[leader.peer_id]["averaging"]["contributions_refused"].get("outlier", 0) >= 1
    assert f"refused the contribution of {poisoner.peer_id[:12]} (outlier: norm" in logs
    ok = [r for r in history[leader.peer_id] if r["status"] == "ok"]
    assert [r["step"] for r in ok] == list(range(STEPS)), ok  # one full honest batch per step (topped up)
    assert all(r["used"].get(poisoner.peer_id, 0) == 0 and r["samples"] >= TRAINING.target_batch_size for r in ok)
