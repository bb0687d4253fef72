"""Peer-to-peer forwards and the backward chain (issue #31, item 2), through real daemons, HTTP, DHT and torch.

A trainer with ``p2p`` names the peers it picked for the later stages in its forward to stage 0,
whose peer sends its outputs straight on, to the last stage's fused call and back through the same
peers, each running its stage's backward (the backward chain); only stage 0's backward result comes
back. Measured where the bytes go (the trainer's own client counts them), trained as the
single-process reference, and failing hops and backwards (a peer that is gone, one that dies mid
backward chain, one that refuses a hop meant for another, or its backward) fall back to the trainer's
own calls, with every microbatch counted exactly once on every stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import torch

from swarmd.daemon import Daemon
from swarmd.errors import Busy, Draining, PeerError
from swarmd.pipeline.spec import ModelSpec
from swarmd.net.addresses import is_relayed
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import Hop
from swarmd.pipeline.routing import StageRouter
from swarmd.swarm_key import SwarmKey
from swarmd.train.microbatches import Microbatches
from swarmd.train.spot_checks import SpotChecks
from swarmd.train.stage_calls import StageCalls
from swarmd.train.summary import StepLedger, TrainSummary
from swarmd.train.timing import Timing
from swarmd.train.trainer import Trainer, TrainerConfig
from swarmd.train.verify import VerifyStats
from tests.conftest import daemon_config, running_daemon
from tests.support.routing import FixedStages, listed
from tests.support.swarms import CORPUS_BYTES, MICRO, TINY, TRAINING, _config, config, reference_run, started

SPEC = replace(TINY, name="p2p", n_stages=3)  # stages 0 and 1 forward; stage 2 is the fused forward + backward
STEPS = 2
KEY = SwarmKey(b"a private swarm's key, 32 bytes..")
SPOT_SEED = 0  # with it, some of test_spot_checked_pairs...'s microbatches run paired and some do not
TENSOR = MICRO * SPEC.seq_len * SPEC.d_model * 4  # one float32 [B, T, d_model] activation


@contextlib.asynccontextmanager
async def swarm(key: SwarmKey | None, spec: ModelSpec = SPEC) -> AsyncIterator[list[Daemon]]:
    """One daemon per stage of ``spec``, joined through the DHT (a private swarm's, with ``key``)."""
    daemons: list[Daemon] = []
    try:
        for stage in range(spec.n_stages):
            cfg = config(stage, spec, TRAINING, (daemons[0].dht.address,) if daemons else ())
            daemons.append(Daemon(replace(cfg, swarm_key=key)))
            await daemons[-1].start()
        yield daemons
    finally:
        for d in daemons:
            await d.shutdown()


@pytest.mark.parametrize(("key", "spec"), [(None, SPEC), (KEY, SPEC), (None, replace(SPEC, n_stages=2))],
                         ids=["open", "private", "two-stages"])
async def test_p2p_training_is_the_references_and_forwards_skip_the_trainer(key: SwarmKey | None,
                                                                           spec: ModelSpec) -> None:
    # in a private swarm, the hops are signed with the swarm key as the daemon's other requests
    async with swarm(key, spec) as daemons:
        run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=STEPS, sync=True, codec="none",
                            microbatch_size=MICRO, taper=False, window=4, val_every=0, seed=0,
                            max_corpus_bytes=CORPUS_BYTES, verify_fraction=0.0, p2p=True, swarm_key=key)
        summary = await Trainer(run).run()
        assert all(d.executor.step == STEPS for d in daemons)
        sent = sum(d.data_plane.hop_stats["sent"] for d in daemons if d.data_plane is not None)
        failed = sum(d.data_plane.hop_stats["failed"] for d in daemons if d.data_plane is not None)
        middle_cache = daemons[-2].executor.cache_stats()
        back = sum(d.data_plane.hop_stats["backward"] for d in daemons if d.data_plane is not None)
        back_failed = sum(d.data_plane.hop_stats["backward_failed"] for d in daemons if d.data_plane is not None)
    # exactly once: every microbatch issued completed, every sample counted once
    assert summary.microbatches_issued == summary.microbatches_completed
    assert summary.samples == STEPS * TRAINING.target_batch_size and summary.duplicates == 0
    # once its peers are proven (their first calls go through the trainer), a forward goes stage 0 -> stage 1 ->
    # stage 2's fused forward and backward, and back: stage 1's backward, then stage 0's, each run by the peer
    # that ran the forward, and only stage 0's answer comes back (with what every stage answered)
    assert 0 < summary.p2p_hops == sent and summary.p2p_fallbacks == failed == 0
    # (a chain that stopped before a peer on probation had no fused end, and no backward chain)
    assert 0 < summary.p2p_backwards == back <= summary.p2p_hops and back_failed == 0
    # every backward before the last stage used the inputs its forward's peer kept (the trainer's omitted them, the
    # chain's ran where they were kept): none recomputed, none resent
    assert summary.inputs_recovered == summary.inputs_resent == 0
    assert middle_cache["held"] == summary.microbatches_completed
    expected, _ = reference_run(spec, TRAINING, STEPS, seed=0)
    assert summary.step_losses == pytest.approx(expected, rel=1e-4)  # the single-process training's


def dead_address() -> str:
    """A loopback address nobody listens at (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def proven(router: StageRouter) -> StageRouter:
    """Every listed peer answered once (a peer-to-peer forward names only proven peers as hops)."""
    for p in router.snapshot():
        router.begin(p.peer_id)
        router.report_success(p.peer_id, MICRO, 0.01, "forward")
    return router


@contextlib.asynccontextmanager
async def microbatches(stage1: dict[str, str], p2p: bool, daemons: list[Daemon], stage2: dict[str, str] | None = None,
                       *, fraction: float = 0.0, seed: int = 0,
                       ) -> AsyncIterator[tuple[Microbatches, TrainSummary, DataPlaneClient]]:
    """The trainer's microbatch machine over fixed routers: stage 0 is ``daemons``' own, stage 1 lists
    ``stage1`` (``peer_id -> address``: a hop names the peer id, and a peer serves only its own), stage 2
    ``stage2`` (default: ``daemons``' own). ``fraction``: spot checks' share of paired microbatches
    (drawn with a ``seed``ed rng)."""
    last = {daemons[2].peer_id: daemons[2].data_addr} if stage2 is None else stage2
    async with machine([{daemons[0].peer_id: daemons[0].data_addr}, stage1, last], p2p, fraction=fraction,
                       seed=seed) as made:
        yield made


@contextlib.asynccontextmanager
async def machine(peers: list[dict[str, str]], p2p: bool, *, fraction: float = 0.0, seed: int = 0,
                  spec: ModelSpec = SPEC) -> AsyncIterator[tuple[Microbatches, TrainSummary, DataPlaneClient]]:
    """The trainer's microbatch machine over fixed routers for ``spec``, stage ``k`` listing ``peers[k]`` (proven)."""
    routers = [proven(StageRouter(k, rng=random.Random(k))) for k in range(len(peers))]
    for k, listing in enumerate(peers):
        routers[k].update_peers(listed(listing, stage=k))
        proven(routers[k])
    timing = Timing()
    summary = TrainSummary()
    async with DataPlaneClient() as client:
        calls = StageCalls(FixedStages(routers), client, model=spec.digest, codec="none", summary=summary,
                           timing=timing, request_timeout_s=30.0, stage_wait_timeout_s=30.0)
        checks = SpotChecks(calls, client, stats=VerifyStats(), codec="none", fraction=fraction, window=4,
                            timing=timing, rng=random.Random(seed))
        yield (Microbatches(calls, checks, n_stages=len(peers), summary=summary, ledger=StepLedger(), timing=timing,
                            p2p=p2p), summary, client)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, SPEC.vocab_size, (MICRO, SPEC.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


async def test_the_trainer_no_longer_sends_nor_receives_the_activations() -> None:
    n = 3  # 2 x 3 microbatches of 4: 24 samples, below the stages' target batch (none steps meanwhile)
    async with running_daemon(0, SPEC) as s0, running_daemon(1, SPEC) as s1, running_daemon(2, SPEC) as s2:
        daemons = [s0, s1, s2]
        moved = {}
        for p2p in (False, True):
            async with microbatches({s1.peer_id: s1.data_addr}, p2p, daemons) as (mbs, summary, client):
                for i in range(n):
                    await mbs.run(*batch(i))
                moved[p2p] = (client.bytes_sent, client.bytes_received)
                # two hops a microbatch: stage 0 -> stage 1, stage 1 -> stage 2's fused forward and backward, and
                # two backwards back: stage 1's and stage 0's, each run by the peer that ran the forward
                assert summary.microbatches_completed == n and summary.p2p_hops == (2 * n if p2p else 0)
                assert summary.p2p_backwards == (2 * n if p2p else 0) and summary.claims == 0
                # every body the client moved was a microbatch call's, and each call's are metered (a chain's
                # hops are not the trainer's): what the spot checks' traffic is weighed against
                assert summary.wire_bytes == client.bytes_sent + client.bytes_received > 0
        assert [d.executor.grad_samples for d in daemons] == [2 * n * MICRO] * 3  # each microbatch counted once
    # stages 0 and 1's outputs no longer come back to the trainer, nor go out again to the next stage, and the
    # gradients at stages 1 and 2's inputs neither (a few bytes of meta more or less): what the trainer still
    # sends and receives is the token ids, the targets and the meta, under a kilobyte a microbatch
    assert moved[False][0] - moved[True][0] == pytest.approx(4 * n * TENSOR, rel=0.02)
    assert moved[False][1] - moved[True][1] == pytest.approx(4 * n * TENSOR, rel=0.02)
    assert moved[True][0] < n * 1024 and moved[True][1] < n * 1024


async def test_a_hop_to_a_dead_peer_falls_back_to_the_trainer_and_counts_once() -> None:
    n = 6
    async with running_daemon(0, SPEC) as s0, running_daemon(1, SPEC) as s1, running_daemon(2, SPEC) as s2:
        daemons = [s0, s1, s2]
        # the trainer's stage 1 lists a live peer and one that is gone: picked in turn, the dead one's hops fail
        stage1 = {"dead": dead_address(), s1.peer_id: s1.data_addr}
        async with microbatches(stage1, True, daemons) as (mbs, summary, _):
            for i in range(n):
                await mbs.run(*batch(i))
        assert summary.microbatches_issued == summary.microbatches_completed == n
        # every forward named a hop (both peers are proven); those to the dead peer broke there, and the trainer
        # went on with stage 1 itself (a call of its own to the dead peer: banned, sent elsewhere); the broken
        # chain's fused end may have counted as far as the trainer can tell, and so may the dead hop's backward:
        # it asked stage 2 and the dead peer (a claim, unanswered) first
        assert summary.p2p_fallbacks >= 1 and summary.p2p_hops >= 2 and summary.claims == 2 * summary.p2p_fallbacks
        assert summary.claims_unanswered == summary.p2p_fallbacks
        assert s0.data_plane is not None and s0.data_plane.hop_stats["failed"] == summary.p2p_fallbacks
        assert [d.executor.grad_samples for d in daemons] == [n * MICRO] * 3 and summary.duplicates == 0


async def test_a_hop_refused_by_the_peer_at_its_address_falls_back_to_the_trainer() -> None:
    n = 3
    async with running_daemon(0, SPEC) as s0, running_daemon(1, SPEC) as s1, running_daemon(2, SPEC) as s2:
        daemons = [s0, s1, s2]
        # the trainer takes s1's address for another peer's ("ghost"): s1 refuses every hop meant for that
        # peer (409), and the trainer's own call, which names nobody, is served
        async with microbatches({"ghost": s1.data_addr}, True, daemons) as (mbs, summary, _):
            for i in range(n):
                await mbs.run(*batch(i))
        # ... and settles the fused end the chain would have reached before its own call to stage 2 (a claim), and
        # the backward the refused hop would have run in the backward chain, before its own call to stage 1
        assert summary.microbatches_completed == n and summary.p2p_fallbacks == n and summary.p2p_hops == 0
        assert summary.claims == 2 * n and summary.claims_counted == 0
        assert [d.executor.grad_samples for d in daemons] == [n * MICRO] * 3



async def test_a_hop_that_lost_what_it_kept_runs_its_backward_on_the_forwards_own_inputs_once() -> None:
    n = 3
    lossy = daemon_config(1, SPEC)  # every kept forward expires before its backward (a restart, an eviction)
    lossy = replace(lossy, pipeline=replace(lossy.pipeline, activation_cache_ttl_s=0.0))
    async with running_daemon(0, SPEC) as s0, running_daemon(2, SPEC) as s2:
        s1 = Daemon(lossy)
        try:
            await s1.start()
            daemons = [s0, s1, s2]
            async with microbatches({s1.peer_id: s1.data_addr}, True, daemons) as (mbs, summary, _):
                for i in range(n):
                    await mbs.run(*batch(i))
            # stage 1's peer lost what it kept at once, but its backward in the backward chain runs where the
            # forward's inputs still are (the request it answers): nothing recomputed, nothing resent by the trainer;
            # every microbatch counted once on every stage
            assert summary.p2p_hops == summary.p2p_backwards == 2 * n
            assert summary.inputs_resent == summary.inputs_recovered == summary.inputs_omitted == 0
            assert [d.executor.grad_samples for d in daemons] == [n * MICRO] * 3 and summary.duplicates == 0
        finally:
            await s1.shutdown()


async def test_a_fused_hop_that_failed_is_settled_before_the_trainer_sends_it_again() -> None:
    n = 3
    async with running_daemon(0, SPEC) as s0, running_daemon(1, SPEC) as s1, running_daemon(2, SPEC) as s2:
        daemons = [s0, s1, s2]
        # the last stage's fused call, sent by stage 1's peer, is refused (s2 is listed as "ghost"): the trainer
        # cannot tell a refusal from a lost answer there, so it asks s2 whether it counted the microbatch (a
        # claim, which fences the hop's attempt off) before its own fused call
        ghost = {"ghost": s2.data_addr}
        async with microbatches({s1.peer_id: s1.data_addr}, True, daemons, ghost) as (mbs, summary, _):
            for i in range(n):
                await mbs.run(*batch(i))
        assert summary.microbatches_completed == n and summary.p2p_fallbacks == n and summary.p2p_hops == n
        assert summary.claims == n and summary.claims_counted == 0 and summary.duplicates == 0
        assert [d.executor.grad_samples for d in daemons] == [n * MICRO] * 3


async def took_a_step(client: DataPlaneClient, daemon: Daemon, stage: int) -> None:
    """A lone ``daemon`` of ``stage`` at step 0 with nothing held: backwards of exactly its target batch (none
    more: one sent as it steps would count into step 1), then until it stepped (alone) to step 1."""
    x, y = batch(99)
    hidden = torch.randn(MICRO, SPEC.seq_len, SPEC.d_model, generator=torch.Generator().manual_seed(stage))
    last = stage == SPEC.n_stages - 1
    assert daemon.executor.step == 0 and daemon.executor.grad_samples == 0
    for _ in range(daemon.training.target_batch_size // MICRO):
        await client.backward(daemon.data_addr, stage, hidden if stage else x, None if last else hidden,
                              y if last else None)
    for _ in range(1000):
        if daemon.executor.step >= 1:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"stage {stage}'s lone peer did not step")


async def test_a_hop_runs_only_once_its_peer_took_the_step_the_chain_is_for() -> None:
    x = torch.randn(MICRO, SPEC.seq_len, SPEC.d_model, generator=torch.Generator().manual_seed(0))
    async with running_daemon(1, SPEC) as s1, running_daemon(2, SPEC) as s2, DataPlaneClient() as client:
        await took_a_step(client, s1, 1)
        hop = Hop(stage=2, addr=s2.data_addr, peer_id=s2.peer_id, timeout_ms=60_000)
        served = s2.status()["served"]["forward"]
        # a sync trainer's step-1 chain reaches stage 2 while that stage is still at step 0: its peer waits for
        # the step within what the hop was given, then refuses (nothing computed there), and stage 1's own
        # outputs are the answer (the trainer goes on from stage 2 itself, once it took the step)
        late = await client.forward(s1.data_addr, 1, x, mb=5, next=(hop,), budget_ms=1_000, min_step=1)
        assert late.step == 1 and late.chain == () and late.hop_error is not None
        assert "not yet at step 1" in late.hop_error and s2.status()["served"]["forward"] == served
        # a peer asked for a step it has not taken, without a budget to wait in, refuses at once (409)
        with pytest.raises(PeerError) as behind:
            await client.forward(s2.data_addr, 2, x, min_step=1)
        assert behind.value.status == 409 and s2.status()["served"]["forward"] == served
        # with time to wait, the hop runs the moment its peer stepped, at that step
        waiting = asyncio.create_task(client.forward(s1.data_addr, 1, x, mb=6, next=(hop,), budget_ms=60_000,
                                                     min_step=1))
        await asyncio.sleep(0.3)
        assert not waiting.done() and s2.status()["served"]["forward"] == served
        await took_a_step(client, s2, 2)
        ok = await waiting
        assert ok.hop_error is None and [(r.stage, r.step) for r in ok.chain] == [(2, 1)]
        assert s2.status()["served"]["forward"] == served + 1
        assert s1.data_plane is not None and s1.data_plane.hop_stats == {"sent": 2, "failed": 1, "backward": 0,
                                                                         "backward_failed": 0}


class HeldGates:
    """A sync step's gates while the step before is still being taken: stage 0's never opens here, the
    others' once ``later`` is set."""

    step = 1

    def __init__(self) -> None:
        self.later = asyncio.Event()

    async def wait(self, stage: int) -> None:
        await (asyncio.Event() if stage == 0 else self.later).wait()


@pytest.mark.parametrize("p2p", [True, False], ids=["chain", "trainer"])
async def test_a_microbatch_goes_out_before_its_first_stage_stepped_and_runs_there_once_it_did(p2p: bool) -> None:
    async with running_daemon(0, SPEC) as s0, running_daemon(1, SPEC) as s1, running_daemon(2, SPEC) as s2:
        daemons = [s0, s1, s2]
        async with microbatches({s1.peer_id: s1.data_addr}, p2p, daemons) as (mbs, summary, client):
            # the trainer holds its first call at no gate: it waits at stage 0's peer for step 1 (and so does each
            # stage of a chain; the trainer's own later calls wait at their gates)
            gates = HeldGates()
            ran = asyncio.create_task(mbs.run(*batch(0), gates=gates))
            await asyncio.sleep(0.3)
            assert not ran.done() and s0.status()["served"]["forward"] == 0
            for k, d in enumerate(daemons):  # the step before ends, stage by stage
                await took_a_step(client, d, k)
            gates.later.set()
            await asyncio.wait_for(ran, 30)
        # it ran once on each stage, at step 1: its gradients are the new step's
        assert s0.status()["served"]["forward"] == 1 and summary.p2p_hops == (2 if p2p else 0)
        assert summary.microbatches_completed == 1 and summary.stale_redos == 0
        assert [d.executor.step for d in daemons] == [1, 1, 1]
        assert [d.executor.grad_samples for d in daemons] == [MICRO] * 3


async def test_a_hop_gets_what_is_left_of_its_senders_budget_or_is_not_sent() -> None:
    x = torch.randn(MICRO, SPEC.seq_len, SPEC.d_model, generator=torch.Generator().manual_seed(0))
    async with running_daemon(1, SPEC) as s1, running_daemon(2, SPEC) as s2, DataPlaneClient() as client:
        hop = Hop(stage=2, addr=s2.data_addr, peer_id=s2.peer_id, timeout_ms=60_000)
        # a sender that waits 10 ms: nothing left for the next hop once stage 1 computed (and kept its margin)
        late = await client.forward(s1.data_addr, 1, x, mb=5, next=(hop,), budget_ms=10)
        assert late.hop_error is not None and "no time left" in late.hop_error and late.chain == ()
        assert late.outputs.shape == x.shape and s1.data_plane is not None and s1.data_plane.hop_stats["sent"] == 0
        ok = await client.forward(s1.data_addr, 1, x, mb=6, next=(hop,), budget_ms=60_000)
        assert ok.hop_error is None and [r.stage for r in ok.chain] == [2] and s1.data_plane.hop_stats["sent"] == 1


async def test_spot_checked_pairs_go_through_the_trainer_beside_p2p_microbatches() -> None:
    n = 4  # microbatches of 4, some paired (their samples count twice): below the stages' target batch
    async with running_daemon(0, SPEC) as s0, running_daemon(1, SPEC) as s1, running_daemon(1, SPEC) as t1, \
            running_daemon(2, SPEC) as s2:
        daemons = [s0, s1, s2]
        async with microbatches({s1.peer_id: s1.data_addr, t1.peer_id: t1.data_addr}, True, daemons,
                                fraction=0.5, seed=SPOT_SEED) as (mbs, summary, client):
            for i in range(n):
                await mbs.run(*batch(i))
            stats = mbs.checks.stats
            # the pairs' halves are the checks' traffic, the rest the microbatches': together all the client moved
            assert 0 < stats.extra_wire_bytes == stats.extra_wire_by_reason["pair"]
            assert stats.extra_wire_bytes + summary.wire_bytes == client.bytes_sent + client.bytes_received
        # a paired microbatch's forwards went through the trainer, each half to its own stage-1 peer, and were
        # compared there; the unpaired ones went peer to peer; each half counted once on every stage
        assert 0 < stats.paired < n and stats.checks > 0 and stats.mismatches == 0
        assert summary.p2p_hops == 2 * (n - stats.paired) and summary.p2p_fallbacks == 0
        samples = (n + stats.paired) * MICRO
        assert s0.executor.grad_samples == s2.executor.grad_samples == samples
        assert s1.executor.grad_samples + t1.executor.grad_samples == samples


async def test_a_relayed_peer_is_never_a_hop_and_still_gets_its_share_from_the_trainer() -> None:
    # stage 1 has a peer nobody can dial (a wrong --announce, as behind a NAT), served through a relay: a chain
    # never names it (its stage-mates cannot dial it); where its pick comes up the chain stops before it and the
    # trainer's own call of stage 1 goes to it, through the relay
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        hidden = ("127.0.0.1", s.getsockname()[1])
    async with started(_config(0)) as (founder,):
        join = (founder.dht.address,)
        async with started(_config(1, join)) as (direct,), started(_config(1, join, announce=hidden)) as (natted,):
            for _ in range(400):
                if natted.relayed_addr is not None and natted.reachability.status == "yes":
                    break
                await asyncio.sleep(0.05)
            assert is_relayed(natted.data_addr), "the unreachable peer was not relayed within 20 s"
            run = TrainerConfig(api=f"http://{founder.status()['api_addr']}", steps=4, sync=True, codec="none",
                                microbatch_size=4, val_every=0, max_corpus_bytes=1 << 20, verify_fraction=0.0,
                                p2p=True)
            summary = await Trainer(run).run()
            assert summary.steps == 4 and summary.microbatches_issued == summary.microbatches_completed
            assert summary.p2p_hops > 0 and summary.p2p_fallbacks == 0 and summary.bans == summary.retries == 0
            assert natted.status()["served"]["backward"] > 0  # its share, through the relay, from the trainer
            assert founder.data_plane is not None and founder.data_plane.hop_stats["sent"] == summary.p2p_hops


async def test_the_trainers_bytes_per_microbatch_do_not_grow_with_the_number_of_stages() -> None:
    # with the backward chain, a microbatch's only traffic at the trainer is its token ids and targets out, and
    # the chain's meta both ways (each stage's hop, its forward's result, its backward's): a few hundred bytes a
    # stage, where one activation or gradient of this model is 64 KiB
    n = 3
    per_mb: dict[int, tuple[float, float]] = {}
    for stages in (2, 4):
        spec = replace(SPEC, n_stages=stages)
        async with contextlib.AsyncExitStack() as stack:
            daemons = [await stack.enter_async_context(running_daemon(k, spec)) for k in range(stages)]
            async with machine([{d.peer_id: d.data_addr} for d in daemons], True, spec=spec) as (mbs, summary, client):
                for i in range(n):
                    await mbs.run(*batch(i))
                per_mb[stages] = (client.bytes_sent / n, client.bytes_received / n)
            assert summary.p2p_hops == summary.p2p_backwards == n * (stages - 1) and summary.claims == 0
            assert [d.executor.grad_samples for d in daemons] == [n * MICRO] * stages
    for way in (0, 1):
        assert per_mb[2][way] < 1024 and abs(per_mb[4][way] - per_mb[2][way]) < 0.01 * TENSOR


async def test_a_previous_stage_peer_that_dies_mid_backward_chain_leaves_each_microbatch_counted_once() -> None:
    n = 4
    async with running_daemon(0, SPEC) as s0, running_daemon(1, SPEC) as s1, running_daemon(1, SPEC) as t1, \
            running_daemon(2, SPEC) as s2:
        died = asyncio.Event()

        async def dies(*args: object, **kwargs: object) -> None:
            # s1 ran its forward and sent the fused hop, stage 2 answered (and counted); as s1 is about to run its
            # own backward in the chain, its process dies: nothing listens at its address any more, and its open
            # connections (stage 0's peer waiting on the hop) are reset
            assert s1.data_plane is not None and s1.data_plane._site is not None and s1.data_plane._runner is not None
            server = s1.data_plane._site._server
            assert server is not None
            server.close()
            for handler in list(s1.data_plane._runner.server.connections):
                if handler.transport is not None:
                    handler.transport.abort()
            died.set()
            raise Draining("this peer is dead")

        s1.executor.backward = dies  # type: ignore[method-assign]
        async with microbatches({s1.peer_id: s1.data_addr, t1.peer_id: t1.data_addr}, True,
                                [s0, s1, s2]) as (mbs, summary, _):
            for i in range(n):
                await mbs.run(*batch(i))
        assert died.is_set(), "no chain went through s1"
        # the broken chain came back to the trainer from stage 0 (its hop's connection reset); stage 2's fused call
        # had counted: the trainer's claim there said so, and its own only computed; s1 could not be asked and died
        # with nothing counted, so stage 1's backward counted on t1; stage 0's the trainer sent itself
        assert summary.microbatches_issued == summary.microbatches_completed == n
        # (the trainer's own fused call, compute only, was answered as a duplicate: not added twice)
        assert summary.p2p_fallbacks >= 1 and summary.claims_counted == summary.duplicates >= 1
        assert s1.executor.grad_samples == 0 and t1.executor.grad_samples == n * MICRO
        assert s0.executor.grad_samples == s2.executor.grad_samples == n * MICRO


@pytest.mark.parametrize("lossy", [False, True], ids=["kept", "lost"])
async def test_a_backward_the_chain_could_not_run_is_sent_by_the_trainer_after_a_claim_and_counts_once(
        lossy: bool) -> None:
    n = 3
    cfg = daemon_config(1, SPEC)  # lossy: every kept forward expires before its backward (a restart, an eviction)
    if lossy:
        cfg = replace(cfg, pipeline=replace(cfg.pipeline, activation_cache_ttl_s=0.0))
    async with running_daemon(0, SPEC) as s0, running_daemon(2, SPEC) as s2, contextlib.AsyncExitStack() as stack:
        s1 = Daemon(cfg)
        await s1.start()
        stack.push_async_callback(s1.shutdown)
        daemons = [s0, s1, s2]
        real = s1.executor.backward
        refused = 0

        async def busy_once_per_microbatch(*args: object, **kwargs: object) -> object:
            # stage 1's peer refuses the backward chain's call (its gradients are out for averaging, say), and
            # serves the trainer's own when it comes
            nonlocal refused
            if kwargs.get("attempt") == 0:
                refused += 1
                raise Busy("averaging")
            return await real(*args, **kwargs)  # type: ignore[arg-type]

        s1.executor.backward = busy_once_per_microbatch  # type: ignore[method-assign]
        async with microbatches({s1.peer_id: s1.data_addr}, True, daemons) as (mbs, summary, _):
            for i in range(n):
                await mbs.run(*batch(i))
        # every chain reached the fused end; stage 1's backward failed there and said so, stage 0's peer skipped
        # its own: the trainer asked stage 1's peer (a claim: not counted), sent stage 1's backward itself (without
        # the inputs, which that peer kept), then stage 0's. Lossy: that peer had lost them (refused, counting
        # nothing), and the trainer, which never saw them, forwarded through stage 0 again at the same step to send them
        assert refused == n and summary.p2p_hops == 2 * n and summary.p2p_backwards == 0
        assert summary.claims == n and summary.claims_counted == 0 and summary.inputs_omitted == 2 * n
        assert summary.inputs_resent == summary.inputs_recovered == (n if lossy else 0)
        assert s1.data_plane is not None and s1.data_plane.hop_stats["backward_failed"] == n
        assert [d.executor.grad_samples for d in daemons] == [n * MICRO] * 3 and summary.duplicates == 0
