"""Each kind of liar of issue #29's table, in a real 2-stage x 3-peer swarm (in-process daemons on
loopback, patched at start-up by ``tests.liars.make_liar``): caught by the trainers' paired checks,
reported and excluded by every honest peer, no honest peer blamed, training finishing every
microbatch.

The check-aware liar is honest whenever a request looks like a check (flagged ``verify``, a
backward of a microbatch whose forward it never ran, or one of its first answers) and lies
otherwise: before paired checks (issue #29, item 1) it was never caught; now a check is an
ordinary microbatch, so it lies to checks as to anything else. Steps until exclusion, the checks'
cost and the held-out loss against an honest run are measured by ``scripts/bench_verify.py``."""

from __future__ import annotations

import asyncio

from typing import Any

import pytest

from swarmd.daemon import Daemon
from swarmd.train import pairing
from swarmd.train.trainer import Trainer
from tests.support.checks import SPEC, TRAINING, trainer_config
from tests.support.liars import make_liar
from tests.support.swarms import fast_swarm

#: A check share that catches each liar in a few steps of two trainers: what the test needs is that it
#: is caught at all and no honest peer ever is; how fast at the default share is the benchmark's.
FRACTION = 0.25
#: The stage each liar serves: input-gradient liars the last one (its fused backward answers them).
STAGE = {"aware": 1, "gradnoise": 1, "sometimes": 0, "stale": 0, "ahead": 0, "far": 0}


@pytest.mark.timeout(300)
# "ahead" (every reply one step ahead) ran past the 300 s timeout once in a CI run on 2 loaded cores (5 s alone):
# slow until that is understood
@pytest.mark.parametrize("lie", [pytest.param(lie, marks=pytest.mark.slow) if lie == "ahead" else lie
                                 for lie in sorted(STAGE)])
async def test_each_liar_of_the_table_is_caught_and_excluded_and_no_honest_peer_is_blamed(lie: str) -> None:
    async with fast_swarm(SPEC, TRAINING, peers_per_stage=3) as daemons:
        liar: Daemon = [d for d in daemons if d.stage == STAGE[lie]][1]
        assert liar.executor is not None and liar.peer_id is not None
        make_liar(liar.executor, lie)
        honest = [d for d in daemons if d is not liar]
        api = f"http://{daemons[0].status()['api_addr']}"
        caught: set[str] = set()
        # two trainers at a time until every honest peer excludes the liar (two reporters): each pair of
        # trainers routes at random, and the check-aware liar answers its first dozen honestly
        for attempt in range(6):
            summaries = await asyncio.gather(*(Trainer(trainer_config(
                api, f"t{attempt}{k}", steps=4, fraction=FRACTION, seed=10 * attempt + k)).run() for k in range(2)))
            for summary in summaries:
                assert summary.microbatches_issued == summary.microbatches_completed
                assert set(summary.verify["caught"]) <= {liar.peer_id}, summary.verify  # no honest peer blamed
                caught |= set(summary.verify["caught"])
            if all(liar.peer_id in d.status()["reports"]["excluded"] for d in honest):
                break
        assert caught == {liar.peer_id}
        for d in honest:
            assert set(d.status()["reports"]["excluded"]) == {liar.peer_id}, d.status()["reports"]


async def _unpaired_run(lie: str, steps: int) -> tuple[Daemon, list[Daemon], Any, list[Any]]:
    """Two trainers for ``steps`` steps with (almost) no random pairing against a check-aware liar on
    the last stage: its first, always-paired answers are honest (it waits them out), so what catches
    it afterwards is what is checked after an answer came. Returns the liar, the honest peers, its
    count of lies and the trainers' summaries."""
    async with fast_swarm(SPEC, TRAINING, peers_per_stage=3) as daemons:
        liar: Daemon = [d for d in daemons if d.stage == STAGE["aware"]][1]
        assert liar.executor is not None and liar.peer_id is not None
        told = make_liar(liar.executor, lie)
        api = f"http://{daemons[0].status()['api_addr']}"
        summaries = await asyncio.gather(*(Trainer(trainer_config(
            api, f"u{k}", steps=steps, fraction=1e-9, seed=k)).run() for k in range(2)))
        for summary in summaries:
            assert summary.microbatches_issued == summary.microbatches_completed
            assert set(summary.verify["caught"]) <= {liar.peer_id}, summary.verify  # no honest peer blamed
        return liar, [d for d in daemons if d is not liar], told, summaries


async def test_the_check_aware_liar_is_caught_by_the_size_of_its_lies_whatever_the_pairing_rate() -> None:
    """The check-aware liar triples its input gradients once its first answers are spent: each lie is
    far larger than its stage-mates' answers of the same steps, so it gets a second opinion as it
    comes, and both trainers convict the liar."""
    liar, honest, told, summaries = await _unpaired_run("aware", steps=30)
    assert told.lies > 0 and sum(s.verify["suspicions"] for s in summaries) > 0
    assert all(s.verify["caught"] == [liar.peer_id] for s in summaries), [s.verify for s in summaries]


async def test_the_check_aware_liar_that_keeps_its_size_is_caught_by_probing_its_direction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``awareflip`` negates its input gradients without scaling them: no size rule sees it, and with
    (almost) no random pairing only the direction probes can (a forward at the inputs moved against
    the answer's gradient, asked of another peer: the loss must fall). A trainer convicts it. Probes
    are drawn at half the answers here, not the default share (one CI run of 40 steps convicted nobody
    at 0.1): that the mechanism convicts is the test's; how soon at the default, bench_verify's."""
    monkeypatch.setattr(pairing, "PROBE_FRACTION", 0.5)
    liar, honest, told, summaries = await _unpaired_run("awareflip", steps=40)
    assert told.lies > 0 and sum(s.verify["probes"] for s in summaries) > 0
    assert sum(s.verify["suspicions"] for s in summaries) > 0
    assert {p for s in summaries for p in s.verify["caught"]} == {liar.peer_id}, [s.verify for s in summaries]


async def test_a_check_is_an_ordinary_microbatch_to_every_peer() -> None:
    """What each peer's executor got while a trainer paired every microbatch and validation batch:
    no validation forward with an id (none has one), no backward flagged ``verify``, every backward with a deadline, every backward of a stage that
    is not the last one preceded by its own forward on the same peer (no stateless backward of a
    microbatch the peer never saw), and the sample weighed twice in the stages' counts (both halves
    accumulated, booked by the trainer)."""
    async with fast_swarm(SPEC, TRAINING, peers_per_stage=3) as daemons:
        seen: dict[str, list[tuple[str, int | None, bool, bool]]] = {}
        for d in daemons:
            ex = d.executor
            assert ex is not None and d.peer_id is not None
            log = seen.setdefault(d.peer_id, [])
            fwd, bwd = ex._forward_sync, ex._backward_sync

            def forward(inputs, targets, mb, *rest, _f=fwd, _log=log):  # type: ignore[no-untyped-def]
                _log.append(("forward", mb, False, True))
                return _f(inputs, targets, mb, *rest)

            def backward(inputs, grad_outputs, targets, step, mb, deadline=None, verify=False, *rest, _b=bwd,
                         _log=log):  # type: ignore[no-untyped-def]
                _log.append(("backward", mb, verify, deadline is not None))
                return _b(inputs, grad_outputs, targets, step, mb, deadline, verify, *rest)

            ex._forward_sync, ex._backward_sync = forward, backward  # type: ignore[method-assign]
        api = f"http://{daemons[0].status()['api_addr']}"
        cfg = trainer_config(api, "all", steps=2, fraction=1.0, seed=3)
        summary = await Trainer(cfg).run()
        assert summary.verify["checks"] > 0 and summary.verify["agreements"] == summary.verify["checks"]
        # both halves count (a paired microbatch holds two leases; an odd lease left over runs alone)
        assert cfg.microbatch_size * summary.microbatches_completed < summary.samples
        assert summary.samples <= 2 * cfg.microbatch_size * summary.microbatches_completed
        backwards = 0
        for d in daemons:
            calls = seen[d.peer_id or ""]
            if d.stage == 1:  # the last stage's forwards are validation's: paired or not, none carries an id
                assert all(mb is None for kind, mb, _, _ in calls if kind == "forward")
            for i, (kind, mb, verify, deadline) in enumerate(calls):
                if kind != "backward":
                    continue
                backwards += 1
                assert not verify and deadline
                if d.stage == 0:
                    assert ("forward", mb, False, True) in calls[:i]  # it ran this microbatch's forward itself
        assert backwards >= 2 * summary.microbatches_completed * 2
