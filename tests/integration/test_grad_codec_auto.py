"""grad_codec "auto" in a real swarm: exact on loopback, compressed where a link was measured slow.

Stage-mates on one machine (loopback) must average exactly as with ``none`` (no lossy codec, no
residual): that is what keeps the equivalence tests exact with the default settings. Over a link
measured slow, contributions travel compressed, the leader answers in the same codec, error feedback
keeps what the codec dropped, and the stage's peers stay bit-identical.
"""

from __future__ import annotations

from dataclasses import replace

from swarmd.daemon.lifecycle import Daemon
from swarmd.net.links import LinkMeter
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.support.swarms import CORPUS_BYTES, MICRO, TINY, TRAINING, swarm

STEPS = 6


async def _train(daemons: list[Daemon]) -> list[float]:
    run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=STEPS, sync=True, codec="none",
                        microbatch_size=MICRO, window=4, val_every=0, max_corpus_bytes=CORPUS_BYTES,
                        verify_fraction=0.0)  # a paired check's sample weighs twice, at random (issue 29)
    summary = await Trainer(run).run()
    assert summary.steps == STEPS and summary.microbatches_issued == summary.microbatches_completed
    return summary.step_losses


def _identical_stages(daemons: list[Daemon]) -> bool:
    return all(len({d.executor.digest for d in daemons if d.stage == k}) == 1 for k in range(TINY.n_stages))


async def test_auto_averages_exactly_between_stage_mates_on_loopback() -> None:
    async with swarm(TINY, replace(TRAINING, grad_codec="auto")) as daemons:
        assert all(d.executor.training.grad_codec == "auto" for d in daemons)
        losses = await _train(daemons)
        assert losses[-1] < losses[0]
        assert _identical_stages(daemons)
        sent = [d.averager.codecs_sent for d in daemons]
        assert sum(c["none"] for c in sent) >= STEPS * TINY.n_stages and all(set(c) <= {"none"} for c in sent)
        assert all(d.executor._feedback.rounds_kept == 0 for d in daemons)  # nothing dropped, nothing kept


async def test_auto_compresses_over_a_link_measured_slow_and_keeps_peers_identical() -> None:
    async with swarm(TINY, replace(TRAINING, grad_codec="auto")) as daemons:
        addrs = [d.status()["data_addr"] for d in daemons]
        for d in daemons:
            # every stage-mate as if remote, over a link measured at 1 Mbit/s for the whole run (the answers in
            # 5level stay below links.MIN_SAMPLE_BYTES on tiny, but an audit's transfer, loopback-fast, would not)
            links = LinkMeter(loopback_is_local=False)
            for addr in addrs:
                links.record(addr, 2**20, 8.0)
            links.record = lambda *args, **kwargs: None  # type: ignore[method-assign]
            d.averager.client.links = links
        losses = await _train(daemons)
        assert losses[-1] < losses[0]
        assert _identical_stages(daemons)  # the leader answered once, in one codec, for everyone
        sent = [d.averager.codecs_sent for d in daemons]
        assert sum(c["5level"] for c in sent) >= STEPS * TINY.n_stages and all(set(c) == {"5level"} for c in sent
                                                                               if c)
        assert sum(d.executor._feedback.rounds_kept for d in daemons) >= STEPS * TINY.n_stages  # error feedback
        status = daemons[0].status()["averaging"]
        assert status["codecs_sent"] or status["links_mbit_s"]  # in /status
