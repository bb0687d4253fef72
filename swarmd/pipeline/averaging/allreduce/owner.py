"""The owner of one part of a chunked all-reduce round (``swarmd.pipeline.averaging.allreduce.averager``).

Owner ``j`` receives part ``j`` of every member's gradients, reports each member's per-sample norm of its
slice (the coordinator adds them up over the parts and refuses outlier contributions, judged whole as the
single leader judges them: ``plan.decide``), reduces them with the leader's rule applied to the part
(``swarmd.pipeline.averaging.reduction``: slices far from or against the owner's own slice left out, a
CenteredClip of three or more, the plain mean of two; the plain float64 sum in peer-id order when nothing
is clipped), encodes the mean once with the swarm's codec (under ``auto``, the most compressed its
members' slices came with) and keeps those bytes: every member fetches and decodes exactly them, so
the part means, hence the peers, stay bit-identical. The members the plan names as struck (they owe the
coordinator an opening: ``allreduce.openings``) are left out of the part's mean, counted for their
samples, by every owner alike (this owner's own slice too).

Bounded influence per part: one member's slice moves part ``j``'s mean by at most that part's
bound (``robust_aggregation``), so the whole mean by at most the root of the sum of the parts'
squared bounds. Convictions: the owner also scores every other member's slice against its own
(``hostile_contributions.part_terms``) and reports the terms with its ready report; the coordinator
adds them up over the parts into the leader's scores, strikes and convicts (``member``), so a
hostile member is excluded as the single leader excludes it. The owner's own slice is scored too,
against the coordinate-wise median of the part's slices (three or more:
``hostile_contributions.score_owner``): struck, it is left out of the mean and the others are judged by
that median, so a member whose contribution lies (every member owns a part) cannot make its lie its
part's mean by reducing it honestly. An owner that does not reduce by the rule is what the audits
catch (``audit``: it keeps its members' signed frames and signs its ready report for them). Part 0's
owner (the coordinator: owners are sorted, the coordinator is the smallest of them) also keeps each
member's signed claim of its whole
contribution (``accusations.contribution_message``): the evidence a conviction shows the stage-mates.
It waits for every member's part at most the plan's patience (``RoundPlan.wait_s``: what honest
rounds take, ``patience``), then reduces those that came and reports a
:class:`~swarmd.pipeline.averaging.allreduce.plan.Ready` to the coordinator: the digest of the decoded mean
and the members it missed (``decide`` commits without them only if every owner missed the same
ones), or no digest (refused members, or no part at all: the round aborts).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from swarmd.net.wire import decode_frame
from swarmd.pipeline.averaging.allreduce.messages import encode_mean
from swarmd.pipeline.averaging.allreduce.plan import Ready, RoundPlan, part_digest, reduce_part
from swarmd.pipeline.averaging.codec_choice import answer_codec
from swarmd.pipeline.averaging.reduction import Reduction, reduce_contributions
from swarmd.pipeline.averaging.trust.hostile_contributions import WINDOW, Score, part_terms
from swarmd.pipeline.averaging.trust.refusals import Refusal
from swarmd.pipeline.averaging.trust.robust_aggregation import Contribution as Weighted
from swarmd.pipeline.averaging.trust.round_checks import Used, per_sample_norm, tensor_digest
from swarmd.pipeline.stage.executor import Contribution
from swarmd.tasks import wait_event


def reduce_slices(parts: Mapping[str, tuple[int, torch.Tensor | None]], owner: str, struck: Iterable[str],
                  size: int) -> tuple[torch.Tensor, Reduction]:
    """The owner's rule for one part (module docstring) over the members' slices (member -> (samples, slice)),
    leaving ``struck`` out: the part's mean (float32, before its codec) and the reduction. What an owner
    reduces, and what an audit recomputes from the signed slices (``audit``). Pure; off the event loop."""
    red = reduce_contributions({pid: Contribution(step=0, samples=s, grads=g) for pid, (s, g) in parts.items()},
                               {}, leader=owner, target=0, numel=size, score=True,
                               strike=frozenset(struck), strike_own=True, score_own=True)
    mean = red.mean if red.mean is not None else reduce_part(parts, size)[0]
    return mean, red


def encoded_mean(round_id: str, part: int, mean: torch.Tensor, codec: str,
                 used: list[list[Any]]) -> tuple[bytes, torch.Tensor]:
    """A part's mean encoded once with ``codec`` (the bytes every member fetches), and decoded from them."""
    encoded = encode_mean(round_id, part, mean, codec, used)
    return encoded, decode_frame(encoded).tensors["grads"] if codec != "none" else mean


class PartStrikes:
    """The far strikes this peer's own parts gave each member in its last ``window`` committed rounds
    (``hostile_contributions.Score.far_strike`` of each slice against this owner's own): what it
    seconds a coordinator's conviction by, knowing nothing but its own parts (``member``). Bounded to
    ``max_peers`` peers, the least recently scored forgotten first."""

    def __init__(self, *, window: int = WINDOW, max_peers: int = 1024) -> None:
        self.window = window
        self.max_peers = max_peers
        self._history: dict[str, deque[bool]] = {}

    def observe(self, scores: Mapping[str, Score]) -> None:
        """One committed round's scores of the slices of this peer's parts (one per member: the part
        where it scored worst)."""
        for pid, score in sorted(scores.items()):
            history = self._history.pop(pid, None) or deque(maxlen=self.window)
            history.append(score.far_strike() is not None)
            self._history[pid] = history
        while len(self._history) > self.max_peers:
            self._history.pop(next(iter(self._history)))

    def far(self, peer_id: str) -> int:
        """Far strikes in ``peer_id``'s window."""
        return sum(self._history.get(peer_id, ()))


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
        self.arrived: dict[str, float] = {}  # seconds from the plan to each member's slice (patience)
        self.mbs: dict[str, tuple[int, ...]] = {}  # the microbatch ids each member's gradients hold (part 0)
        # (part 0) the samples of each member's contribution that no microbatch of its explains, by its word (None:
        # not said); what its opening's extra term is bounded by (``openings``)
        self.unexplained: dict[str, int | None] = {}
        # (part 0, last stage) the digests of each member's microbatches' inputs, as it committed them before the
        # commit (what its opening must sign, and a recomputation check: ``recompute``)
        self.ins: dict[str, tuple[tuple[int, str], ...]] = {}
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
        self.claims: dict[str, tuple[bytes, float, bytes]] = {}  # part 0: member -> (key, per-sample norm, signature)
        # each member's signed part frame as it came (its own slice: as this owner would have sent it), and this
        # owner's key and signature of its ready report: what an audit of this part is shown (``audit``)
        self.frames: dict[str, bytes] = {}
        self.ready_signed: tuple[bytes, bytes] | None = None
        self.mean_codec = "none"  # the codec the mean was encoded with
        self.scores: dict[str, Score] = {}

    def add(self, peer_id: str, samples: int, grads: torch.Tensor | None, digest: str | None = None,
            codec: str = "none", mbs: tuple[int, ...] = (),
            claim: tuple[bytes, float, bytes] | None = None, unexplained: int | None = None,
            frame: bytes | None = None, ins: tuple[tuple[int, str], ...] = ()) -> str | None:
        """A member's slice (``digest``: its tensor_digest, computed when None; ``codec``: the one it
        travelled with, which under ``auto`` sets the mean's, ``codec_choice.answer_codec``; ``signed``: the
        member's signed ``ar_part`` frame as it came, kept for audits); why it is turned away."""
        if peer_id not in self.plan.member_ids:
            return "not a member of this round"
        if self._reduced.is_set() or self.ready is not None:
            return "too late: this part is reduced"
        if peer_id in self.parts:
            return "this member's part arrived already"
        if grads is not None and grads.numel() != self.size:
            return f"part {self.part} has {self.size} values"
        self.parts[peer_id] = (samples, grads)
        self.arrived[peer_id] = time.monotonic() - self.started
        self.mbs[peer_id] = mbs
        self.unexplained[peer_id] = unexplained
        self.ins[peer_id] = ins
        if claim is not None:  # (checked by the coordinator against every part's used list: ``member``)
            self.claims[peer_id] = claim
        if frame is not None:
            self.frames[peer_id] = frame
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
        """Wait for every member's part (at most ``wait_s``: the plan's patience), then reduce those that
        came; the report for the coordinator (naming the members whose part did not come)."""
        await wait_event(self._complete, wait_s)
        ready = await asyncio.to_thread(self._reduce)
        self.ready = ready
        self._reduced.set()
        # the decoded slices served their purpose (an audit is shown the signed frames): this peer keeps the
        # owners of its last rounds, and each held the whole gradient's worth in slices (n slices of G / n)
        self.parts = {pid: (samples, None) for pid, (samples, _) in self.parts.items()}
        return ready

    def release(self) -> None:
        """Its members' signed frames are no longer needed (the commit did not draw this part for an audit, and
        ``audit.KEEP_ROUNDS`` rounds passed: ``auditor.PartAuditor.release_later``): dropped; the mean stays served
        to members that still fetch it."""
        self.frames.clear()

    def _reduce(self) -> Ready:
        plan, parts = self.plan, dict(self.parts)
        missing = tuple(sorted(set(plan.member_ids) - set(parts) - set(self.refused)))
        norms = {pid: (per_sample_norm(g, s), s) for pid, (s, g) in parts.items()}
        refused = dict(self.refused)  # (outliers are the coordinator's to judge, on the whole contributions)
        samples = tuple(sorted((pid, s) for pid, (s, _) in parts.items()))
        # members whose part did not come within the plan's patience are left out (``decide`` commits without
        # them only if every owner left out the same ones); a refusal aborts the round
        if refused or not parts:
            return Ready(plan.round_id, self.part, self.owner, "", samples, missing,
                         tuple(sorted((pid, str(why)) for pid, why in refused.items())))
        mean, red = self._rule(parts)
        self.clipped, self.struck = red.clipped, red.struck
        self.scores = dict(red.scores)  # each other member's slice against this owner's own (PartStrikes)
        terms = part_terms([Weighted(pid, g, s) for pid, (s, g) in sorted(parts.items()) if s > 0 and g is not None],
                           self.owner)
        codec = answer_codec(self.codec, self.sent_codecs)
        if codec == "fp16" and mean.numel() and float(mean.abs().max()) > 65504.0:
            codec = "none"  # float16 would overflow: this part travels uncompressed (its frame says so)
        used = [Used(pid, s, self.digests.get(pid, ""), norms[pid][0]).to_wire()
                for pid, (s, _) in sorted(parts.items())]
        encoded, decoded = encoded_mean(plan.round_id, self.part, mean, codec, used)
        self.encoded, self.mean, self.used, self.mean_codec = encoded, decoded, used, codec
        return Ready(plan.round_id, self.part, self.owner, part_digest(decoded, used), samples, missing,
                     scores=tuple(sorted(terms.items())),
                     norms=tuple(sorted((pid, norm) for pid, (norm, s) in norms.items() if s > 0)),
                     struck=tuple(sorted(plan.struck)))

    def _rule(self, parts: Mapping[str, tuple[int, torch.Tensor | None]]) -> tuple[torch.Tensor, Reduction]:
        """The part's mean by the rule (:func:`reduce_slices`; tests make an owner lie here)."""
        return reduce_slices(parts, self.owner, self.plan.struck, self.size)

    async def mean_bytes(self, wait_s: float) -> bytes | None:
        """The encoded mean, once reduced (waiting at most ``wait_s``); None if not (yet, or ever)."""
        if not await wait_event(self._reduced, wait_s):
            return None
        return self.encoded
