"""Recomputing a drawn microbatch of a member's contribution in the chunked all-reduce (issue #29, item 3;
the single leader's is ``swarmd.pipeline.averaging.trust.recomputation``, whose module docstring gives the why).

An opening shows that a contribution is the sum of its microbatches' sketches, but those are claims: a
member that sends ``c - 2 g_1`` and opens ``-R g_1`` for that microbatch is consistent. The leader catches
it by recomputing a drawn microbatch from inputs shipped with every contribution. In the all-reduce no
contribution goes to one peer whole, so the inputs do not travel with it; instead:

* **Committed before the projection.** With part 0 of its contribution (to the coordinator, its owner) a
  last-stage member sends the digest of each of its microbatches' inputs (``ArPart.ins``:
  ``recomputation.inputs_digest``), and keeps the inputs of that round (:class:`InputsKept`, the last
  :data:`KEEP_ROUNDS` rounds it opened). The commit, which fixes the opening's projection, comes after: a
  member cannot pick inputs whose gradient sketches to its lie.
* **Opened, then drawn.** Its opening signs those digests, the parameters' digest and precision its
  backward ran at, and the commit's digest its seed hashes (``Opening.ins``, ``at``, ``lead``: what a
  stage-mate needs to redo the check); the coordinator refuses an opening that does not sign the inputs
  committed (``openings.judge``: ``bad``). Only then does the coordinator draw, with its own secret
  randomness, whether to check this contribution (probability ``min(1, recompute_share * m)`` for ``m``
  microbatches: the leader's rule) and which microbatch: the member has signed every part before it
  learns which one is asked for.
* **Fetched and recomputed.** The coordinator asks the member for that microbatch's inputs
  (``POST /v1/allreduce/inputs``), checks them against the committed digest, recomputes the microbatch's
  parameter gradient on its own copy of the round's parameters (``PastParams``: it has applied the commit
  by then), sketches it under the opening's seed and compares the signed part
  (``recomputation.RECOMPUTE_TOLERANCE``). A mismatch convicts the member (``hostile: unaccountable
  contribution``), excluded here and the signed opening with that microbatch's inputs posted to the
  stage-mates (``POST /v1/recheck``), which recompute it on their own copy and second, as the leader's.
* **Would not show them.** A member that refuses, or answers inputs that are not those it committed, is
  convicted here (``unaccountable contribution: ...``): an honest member keeps the inputs of the rounds it
  opened and answers. One that does not answer :data:`FETCH_ATTEMPTS` requests (gone, or cut off) is only
  kept out of this coordinator's rounds for a while (``suspicions``), as a silent member is.

What it costs: the coordinator recomputes ``recompute_share`` of the stage's samples in expectation (one
forward and backward of a microbatch per drawn member, off the round's critical path: after the opening,
on the worker thread); the wire carries 32 bytes of digest per microbatch with part 0 and one microbatch's
inputs per drawn member (``4 * batch * seq * width + 8 * batch * seq`` bytes), where the leader's
contributions carry every microbatch's. What it does not catch is the leader's list: honest gradients of
made-up inputs, other parameters' digests or precisions (counted ``unchecked``), delayed updates, fp16.

``/status`` averaging ``openings`` counts ``recomputed``, ``mismatch``, ``unchecked``, ``inputs_refused``,
``inputs_unanswered``; ``opening_costs`` the seconds and samples recomputed and the input bytes fetched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swarmd.errors import PeerError, RequestError, SwarmdError
from swarmd.pipeline.averaging.allreduce.messages import ArAck, ArInputs, ArInputsQuery
from swarmd.pipeline.averaging.trust.contribution_proofs import Opening, proof_seed, sketch
from swarmd.pipeline.averaging.trust.recomputation import (
    RECOMPUTE_PRECISIONS,
    RECOMPUTE_TOLERANCE,
    MicrobatchInputs,
    draws,
    inputs_digest,
    misstated_microbatch,
    recheck,
    sample,
)

if TYPE_CHECKING:
    from swarmd.dht.identity import Identity
    from swarmd.net.client import DataPlaneClient
    from swarmd.net.wire import Frame
    from swarmd.pipeline.averaging.allreduce.openings import ArAwaited
    from swarmd.pipeline.averaging.trust.accusations import Evidence
    from swarmd.pipeline.averaging.trust.contribution_proofs import OpeningEvidence
    from swarmd.pipeline.averaging.trust.round_checks import Suspicions
    from swarmd.pipeline.stage.executor import StageExecutor

__all__ = ["FETCH_ATTEMPTS", "FETCH_TIMEOUT_S", "KEEP_ROUNDS", "DrawnRecomputations", "InputsKept"]

log = logging.getLogger(__name__)

#: Requests for a drawn microbatch's inputs before a member that answers none is given up (kept out of this
#: coordinator's rounds for a while, not convicted: it may be gone).
FETCH_ATTEMPTS = 3
#: How long one such request may take.
FETCH_TIMEOUT_S = 30.0
#: The rounds whose inputs a member keeps for its coordinators to ask for (its opening goes with its next
#: report, and the coordinator asks at once: two would do; more for rounds that abort meanwhile).
KEEP_ROUNDS = 4
#: Recomputations one coordinator runs at once (more drawn meanwhile are skipped, counted ``recompute_skipped``).
MAX_RUNNING = 4


class InputsKept:
    """A member's side: the inputs of its microbatches in the last rounds it committed them to (on the loop)."""

    def __init__(self, keep: int = KEEP_ROUNDS) -> None:
        self.keep = keep
        self._by_round: dict[str, dict[int, MicrobatchInputs]] = {}

    def keep_round(self, round_id: str, inputs: Sequence[MicrobatchInputs]) -> None:
        self._by_round.pop(round_id, None)
        self._by_round[round_id] = {i.mb: i for i in inputs}
        while len(self._by_round) > self.keep:
            self._by_round.pop(next(iter(self._by_round)))

    def answer(self, q: ArInputsQuery) -> ArInputs | ArAck:
        kept = self._by_round.get(q.round_id, {}).get(q.mb)
        if kept is None:
            return ArAck(False, "this peer keeps no inputs of that microbatch in that round")
        return ArInputs(q.round_id, q.mb, kept.inputs, kept.targets)

    def clear(self) -> None:
        self._by_round = {}


class RecomputeHost(Protocol):
    """What the recomputations use of their averager (``averager.AllReduceAverager``)."""

    executor: StageExecutor
    peer_id: str
    identity: Identity | None
    client: DataPlaneClient
    suspicions: Suspicions
    hostile_convictions: Counter[str]
    openings: Counter[str]
    opening_costs: dict[str, float]
    recompute_share: float
    _opening_convictions: dict[str, str]

    def _own(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...

    def _recomputes(self) -> bool: ...

    def _excluded_as_hostile(self, peer_id: str) -> bool: ...

    def exclude_hostile(self, peer_id: str, why: str) -> float: ...

    def _convict_on_opening(self, peer_id: str, why: str, step: int) -> float: ...

    def _warn(self, peer_id: str, reason: str, msg: str, *args: Any) -> None: ...

    def _post_accusation(self, accused: str, evidence: Evidence | OpeningEvidence, step: int, counter: str,
                         shown: tuple[bytes, int, torch.Tensor, torch.Tensor] | None = None) -> None: ...


class DrawnRecomputations:
    """A coordinator's side: draw, fetch, recompute and judge (module docstring)."""

    def __init__(self, av: RecomputeHost) -> None:
        self.av = av
        self.timeout_s = FETCH_TIMEOUT_S
        self.retry_s = 1.0
        self.running = 0

    def consider(self, pid: str, awaited: ArAwaited, raw: bytes) -> None:
        """After ``pid``'s opening ``raw`` was judged ``ok`` (on the loop): draw, secretly, whether to recompute
        one of its microbatches, and which; the check runs in an owned task."""
        av = self.av
        if not av._recomputes() or not awaited.ins or not awaited.params or not awaited.addr:
            return
        if not draws(min(1.0, av.recompute_share * len(awaited.ins))):
            return
        if self.running >= MAX_RUNNING:
            av.openings["recompute_skipped"] += 1
            return
        mb = sample([mb for mb, _ in awaited.ins])  # secret: the member signed its parts without knowing which
        self.running += 1
        av._own(self._check(pid, awaited, raw, mb), "swarmd-ar-recompute")

    async def _check(self, pid: str, awaited: ArAwaited, raw: bytes, mb: int) -> None:
        try:
            await self._recompute(pid, awaited, raw, mb)
        finally:
            self.running -= 1

    async def _recompute(self, pid: str, awaited: ArAwaited, raw: bytes, mb: int) -> None:
        av, ex = self.av, self.av.executor
        opening = await asyncio.to_thread(Opening.decode, raw)  # (judged ``ok`` already: it reads)
        params, precision = (opening.at[0], opening.at[1]) if len(opening.at) == 2 else ("", "")
        if params != awaited.params or precision not in RECOMPUTE_PRECISIONS:
            av.openings["unchecked"] += 1  # other parameters or precision: nothing to compare with here
            return
        got = await self._fetch(pid, awaited, mb)
        if got is None:
            return
        x, y = got
        committed = dict(awaited.ins or ()).get(mb)
        if await asyncio.to_thread(inputs_digest, mb, x, y) != committed:
            self._unaccountable(pid, awaited, mb, "it answered inputs that are not those it committed")
            return
        started = time.perf_counter()
        try:
            flat = await ex.recompute_past(x, y, precision, awaited.step, params)
        except RequestError as exc:  # inputs that do not fit the stage: no signed part can match them
            log.warning("stage %d step %d: the inputs of %s's microbatch %#x do not fit this stage (%s)",
                        ex.stage, awaited.step, pid[:12], mb, exc)
            flat = torch.full((ex.grad_numel,), float("nan"))
        if flat is None:  # this peer holds the round's parameters no more (a state adopted meanwhile)
            av.openings["unchecked"] += 1
            return
        seed = proof_seed(ex.stage, awaited.step, av.peer_id, awaited.lead, awaited.claim)
        row = await asyncio.to_thread(sketch, [flat], seed, ex.grad_numel)
        av.opening_costs["recompute_s"] += time.perf_counter() - started
        av.opening_costs["recomputed_samples"] += x.shape[0]
        av.openings["recomputed"] += 1
        part = opening.parts[opening.mbs.index(mb)]
        gap = recheck(part, tuple(float(v) for v in row[0].tolist()))
        if gap <= RECOMPUTE_TOLERANCE:  # (NaN is not: inputs that did not fit the stage)
            av.opening_costs["max_recompute_gap"] = max(av.opening_costs["max_recompute_gap"], gap)
            return
        if av._excluded_as_hostile(pid):  # convicted meanwhile
            return
        why = misstated_microbatch(mb, awaited.step, gap)
        av.openings["mismatch"] += 1
        av._convict_on_opening(pid, why, awaited.step)
        # a stage-mate redoes the recomputation on its own copy of that step's parameters (``recomputation``)
        av._post_accusation(pid, opening.evidence, awaited.step, "sent", shown=(raw, mb, x, y))

    async def _fetch(self, pid: str, awaited: ArAwaited, mb: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The drawn microbatch's inputs from the member (None: it refused, answered nonsense, or nothing)."""
        av, ex = self.av, self.av.executor
        query = ArInputsQuery(ex.stage, awaited.round_id, mb)
        why = ""
        for attempt in range(FETCH_ATTEMPTS):
            if attempt:
                await asyncio.sleep(self.retry_s)
            try:
                frame = await av.client.allreduce(awaited.addr, "inputs", query.encode, timeout_s=self.timeout_s)
            except (PeerError, SwarmdError) as exc:
                why = str(exc)
                continue
            return await self._read(pid, awaited, mb, frame)
        av.openings["inputs_unanswered"] += 1
        period = av.suspicions.accuse(pid, f"inputs_unanswered: {FETCH_ATTEMPTS} requests for the inputs of its "
                                           f"microbatch {mb:#x} of step {awaited.step} unanswered ({why[:120]})")
        av._warn(pid, "inputs_unanswered", "stage %d step %d: %s did not answer for the inputs of a microbatch drawn "
                 "for a recomputation; left out of this peer's rounds for %.0fs", ex.stage, awaited.step, pid[:12],
                 period)
        return None

    async def _read(self, pid: str, awaited: ArAwaited, mb: int,
                    frame: Frame) -> tuple[torch.Tensor, torch.Tensor] | None:
        if frame.kind == ArAck.KIND:
            try:
                reason = ArAck.from_frame(frame).reason
            except RequestError as exc:
                reason = str(exc)
            self._unaccountable(pid, awaited, mb, f"it refused ({reason[:200]})")
            return None
        try:
            got = await asyncio.to_thread(ArInputs.from_frame, frame)
        except RequestError as exc:
            self._unaccountable(pid, awaited, mb, f"its answer does not read ({str(exc)[:200]})")
            return None
        if got.round_id != awaited.round_id or got.mb != mb:
            self._unaccountable(pid, awaited, mb, "it answered the inputs of another microbatch")
            return None
        self.av.opening_costs["input_bytes"] += got.inputs.numel() * 4 + got.targets.numel() * 8
        return got.inputs, got.targets

    def _unaccountable(self, pid: str, awaited: ArAwaited, mb: int, why: str) -> None:
        """A member that would not show the inputs it committed: convicted here (not posted: nothing to recheck)."""
        av = self.av
        av.openings["inputs_refused"] += 1
        if av._excluded_as_hostile(pid):
            return
        reason = (f"unaccountable contribution: asked for the inputs of its microbatch {mb:#x} of step {awaited.step} "
                  f"to recompute it, {why}")
        av._convict_on_opening(pid, reason, awaited.step)
