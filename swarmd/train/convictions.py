"""A peer a spot check convicted: banned by this trainer, and reported to the swarm (issue #17).

The liar is banned from this trainer's routes for ``LIAR_BAN_S``; a signed
:class:`~swarmd.pipeline.reports.MisbehaviourReport` (this trainer's ephemeral identity; the
digests of the request and of each answer as evidence) goes to every other listed peer, whose
ledger excludes a peer two independent checks convicted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Literal

import torch

from swarmd.dht.identity import Identity
from swarmd.errors import PeerError
from swarmd.net.client import DataPlaneClient
from swarmd.net.messages import ReportRequest
from swarmd.pipeline.reports import MisbehaviourReport, digest_tensor_bytes
from swarmd.train.stage_calls import StageCalls
from swarmd.train.timing import Timing
from swarmd.train.verify import LIAR_BAN_S, Answer, VerifyStats

__all__ = ["Convictions", "evidence"]

log = logging.getLogger("swarmd.train.spot_checks")  # the checks' lines, under the name they always had

Kind = Literal["forward", "backward"]


def evidence(request: tuple[torch.Tensor, ...], answers: Sequence[Answer]) -> tuple[str, dict[str, str]]:
    """The digests a report carries: of the request's tensors, and of each peer's answer (its step too)."""

    def raw(t: torch.Tensor) -> bytes:
        return t.detach().contiguous().cpu().numpy().tobytes()

    request_digest = digest_tensor_bytes(*(raw(t) for t in request))
    digests = {
        a.peer_id: digest_tensor_bytes(raw(a.tensor) if a.tensor is not None else b"",
                                       repr((a.loss, a.step)).encode())
        for a in answers
    }
    return request_digest, digests


class Convictions:
    """Bans and reports the peers this trainer's checks convicted (each reported once)."""

    def __init__(self, calls: StageCalls, client: DataPlaneClient, *, stats: VerifyStats, timing: Timing) -> None:
        self.calls = calls
        self.client = client
        self.stats = stats
        self.timing = timing
        self._identity: Identity | None = None  # ephemeral: signs this trainer's reports

    async def convict(self, stage: int, kind: Kind, liar: str, answers: list[Answer],
                      request: tuple[torch.Tensor, ...]) -> None:
        """Ban ``liar`` for ``LIAR_BAN_S``, say so, and report it to every listed peer."""
        stats, routers = self.stats, self.calls.stages.routers
        routers[stage].ban(liar, LIAR_BAN_S)
        if liar in stats.caught:  # another check that was in flight caught it too: reported already
            return
        stats.liars += 1
        stats.caught = (*stats.caught, liar)
        if len({a.peer_id for a in answers}) < 2:
            log.warning("spot check: stage %d peer %s lied about its step; banned for %.0fs (no stage-mate answered "
                        "the poll: nothing to report it with)", stage, liar[:12], LIAR_BAN_S)
            return
        request_digest, answer_digests = await asyncio.to_thread(evidence, request, answers)
        step = answers[0].step
        log.warning("spot check: stage %d peer %s lied (its %s at step %d disagrees with %s); banned for %.0fs "
                    "and reported (request %s, answers %s)", stage, liar[:12], kind, step,
                    " and ".join(a.peer_id[:12] for a in answers if a.peer_id != liar) or "its stage's steps",
                    LIAR_BAN_S, request_digest[:16],
                    ", ".join(f"{p[:12]}={d[:12]}" for p, d in sorted(answer_digests.items())))
        if self._identity is None:
            self._identity = Identity.generate()
        report = MisbehaviourReport.signed(self._identity, accused=liar, stage=stage, step=max(0, step), kind=kind,
                                           mb=secrets.randbits(64), request_digest=request_digest,
                                           answers=answer_digests, at=time.time())
        body, signature = report.encode()
        peers = {p.peer_id: p.addr for router in routers for p in router.snapshot() if p.peer_id != liar and p.routable}
        client, timeout = self.client, self.timing.report_timeout_s

        async def send(addr: str) -> bool:
            try:
                return (await client.report(addr, ReportRequest(body, signature), timeout_s=timeout)).accepted
            except PeerError:
                return False

        accepted = await asyncio.gather(*(send(addr) for addr in peers.values()))
        stats.reports_sent += sum(accepted)
