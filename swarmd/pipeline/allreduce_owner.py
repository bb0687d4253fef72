"""The owner of one part of a chunked all-reduce round (``swarmd.pipeline.allreduce``).

Owner ``j`` receives part ``j`` of every member's gradients, refuses outliers among them (the
checks of ``swarmd.pipeline.round_checks``, on the part's per-sample norms), reduces the rest with
the leader's rule applied to the part (``swarmd.pipeline.round_reduction``: slices far from or
against the owner's own slice left out, a CenteredClip of three or more, the plain mean of two;
the plain float64 sum in peer-id order when nothing is clipped), encodes the mean once with the
swarm's codec (under ``auto``, the most compressed its members' slices came with) and keeps those
bytes: every member fetches and decodes exactly them, so the part means, hence the peers, stay
bit-identical.

Bounded influence per part: one member's slice moves part ``j``'s mean by at most that part's
bound (``robust_aggregation``), so the whole mean by at most the root of the sum of the parts'
squared bounds. What is left: nobody is convicted here (each owner sees one part, and a
conviction would need the coordinator to gather the owners' strikes), so a hostile member is
bounded and left out round after round but not excluded; and a member whose part's owner is
itself is scored by nobody on that part.
It reports a :class:`~swarmd.pipeline.allreduce_plan.Ready` to the coordinator whether it could
reduce (digest of the decoded mean) or not (missing or refused members: the round aborts).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from swarmd.net.wire import decode_frame
from swarmd.pipeline.allreduce_messages import encode_mean
from swarmd.pipeline.allreduce_plan import Ready, RoundPlan, part_digest, reduce_part
from swarmd.pipeline.executor import Contribution
from swarmd.pipeline.grad_codec_choice import answer_codec
from swarmd.pipeline.refusals import Refusal
from swarmd.pipeline.round_checks import Used, outliers, per_sample_norm, tensor_digest
from swarmd.pipeline.round_reduction import reduce_contributions


class PartOwner:
    """One part of one round, on its owner."""

    def __init__(self, plan: RoundPlan, part: int, owner: str, codec: str) -> None:
        self.plan = plan
        self.part = part
        self.owner = owner
        self.codec = codec
        lo, hi = plan.bounds[part]
        self.size = hi - lo
        self.started = time.monotonic()
        self.parts: dict[str, tuple[int, torch.Tensor | None]] = {}
        self.digests: dict[str, str] = {}  # tensor_digest of each member's slice as decoded here
        self.used: list[list[Any]] = []
        self.refused: dict[str, Refusal] = {}
        self._complete = asyncio.Event()
        self._reduced = asyncio.Event()
        self.sent_codecs: list[str] = []  # the codecs the members' slices came with
        self.encoded: bytes | None = None  # the mean as every member fetches it
        self.mean: torch.Tensor | None = None  # decoded from ``encoded``
        self.ready: Ready | None = None
        self.clipped: tuple[str, ...] = ()  # slices whose influence the part's robust mean cut
        self.struck: tuple[str, ...] = ()  # slices left out of the part's mean (far from or against the owner's)

    def add(self, peer_id: str, samples: int, grads: torch.Tensor | None, digest: str | None = None,
            codec: str = "none") -> str | None:
        """A member's slice (``digest``: its tensor_digest, computed when None; ``codec``: the one it
        travelled with, which under ``auto`` sets the mean's, ``grad_codec_choice.answer_codec``); why
        it is turned away."""
        if peer_id not in self.plan.member_ids:
            return "not a member of this round"
        if self._reduced.is_set() or self.ready is not None:
            return "too late: this part is reduced"
        if peer_id in self.parts:
            return "this member's part arrived already"
        if grads is not None and grads.numel() != self.size:
            return f"part {self.part} has {self.size} values"
        self.parts[peer_id] = (samples, grads)
        if grads is not None:
            self.sent_codecs.append(codec)
        self.digests[peer_id] = digest if digest is not None else tensor_digest(grads)
        if set(self.parts) | set(self.refused) >= set(self.plan.member_ids):
            self._complete.set()
        return None

    def refuse(self, peer_id: str, why: Refusal) -> None:
        """A member's part that could not be read (non-finite, badly signed): the round aborts."""
        if peer_id in self.plan.member_ids and peer_id not in self.parts:
            self.refused[peer_id] = why
            if set(self.parts) | set(self.refused) >= set(self.plan.member_ids):
                self._complete.set()

    async def settle(self, wait_s: float) -> Ready:
        """Wait for every member's part (at most ``wait_s``), then reduce; the report for the coordinator."""
        try:
            await asyncio.wait_for(self._complete.wait(), max(0.0, wait_s))
        except asyncio.TimeoutError:
            pass
        ready = await asyncio.to_thread(self._reduce)
        self.ready = ready
        self._reduced.set()
        return ready

    def _reduce(self) -> Ready:
        plan, parts = self.plan, dict(self.parts)
        missing = tuple(sorted(set(plan.member_ids) - set(parts) - set(self.refused)))
        norms = {pid: (per_sample_norm(g, s), s) for pid, (s, g) in parts.items()}
        refused = dict(self.refused)
        for pid, why in outliers(norms, self.owner).items():
            if pid != self.owner:  # the owner computed its own gradients: it does not refuse them
                refused[pid] = Refusal("outlier", f"in part {self.part}: {why}")
        samples = tuple(sorted((pid, s) for pid, (s, _) in parts.items()))
        if missing or refused:
            return Ready(plan.round_id, self.part, self.owner, "", samples, missing,
                         tuple(sorted((pid, str(why)) for pid, why in refused.items())))
        red = reduce_contributions({pid: Contribution(step=0, samples=s, grads=g) for pid, (s, g) in parts.items()},
                                   {}, leader=self.owner, target=0, numel=self.size, score=True)
        mean = red.mean if red.mean is not None else reduce_part(parts, self.size)[0]
        self.clipped, self.struck = red.clipped, red.struck
        codec = answer_codec(self.codec, self.sent_codecs)
        if codec == "fp16" and mean.numel() and float(mean.abs().max()) > 65504.0:
            codec = "none"  # float16 would overflow: this part travels uncompressed (its frame says so)
        used = [Used(pid, s, self.digests.get(pid, ""), norms[pid][0]).to_wire()
                for pid, (s, _) in sorted(parts.items())]
        encoded = encode_mean(plan.round_id, self.part, mean, codec, used)
        decoded = decode_frame(encoded).tensors["grads"] if codec != "none" else mean
        self.encoded, self.mean, self.used = encoded, decoded, used
        return Ready(plan.round_id, self.part, self.owner, part_digest(decoded, used), samples)

    async def mean_bytes(self, wait_s: float) -> bytes | None:
        """The encoded mean, once reduced (waiting at most ``wait_s``); None if not (yet, or ever)."""
        try:
            await asyncio.wait_for(self._reduced.wait(), max(0.0, wait_s))
        except asyncio.TimeoutError:
            return None
        return self.encoded
