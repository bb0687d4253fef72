"""The leader's side of a stage's averaging round (``swarmd.pipeline.averaging.averager`` has the protocol).

The leader opens the round for a step, admits signed contributions from proven, non-excluded
stage-mates, waits for the peers of its view (at most ``averaging_timeout_s``, less for silent
ones: ``patience``), reduces (``reduction``: outliers refused, the robust mean,
hostile contributions struck and convicted), applies the mean and answers every contributor with
the same encoded bytes, or aborts and everyone keeps its gradients (SWARM section 3.2).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from swarmd.dht.identity import peer_id_of, verify
from swarmd.errors import Busy, NonFinite, RequestError
from swarmd.net.messages import AverageRequest
from swarmd.net.wire import Frame, decode_frame
from swarmd.pipeline.averaging.codec_choice import answer_codec
from swarmd.pipeline.averaging.patience import RoundPatience
from swarmd.pipeline.averaging.reduction import reduce_contributions
from swarmd.pipeline.averaging.trust.accusations import NORM_TOLERANCE, contribution_message
from swarmd.pipeline.averaging.trust.openings import RoundOpenings
from swarmd.pipeline.averaging.trust.refusals import Refusal
from swarmd.pipeline.averaging.trust.round_checks import (
    per_sample_norm,
    tensor_digest,
)
from swarmd.pipeline.stage.executor import Contribution

if TYPE_CHECKING:
    pass

from swarmd.pipeline.averaging import round as shared
from swarmd.pipeline.averaging.round import (
    RoundResult,
    _aborted,
    _OpenRound,
    _wire_codec,
    lone_result,
)
from swarmd.tasks import wait_event

# one logger for the whole protocol, whichever module of it speaks
log = logging.getLogger("swarmd.pipeline.averaging.averager")


class RoundLeader(RoundOpenings):
    """Leading a round: open, admit, settle, reduce, answer."""


    def _open(self, step: int, expected: set[str]) -> tuple[_OpenRound, bool]:
        """The round for ``step``, and whether this call opened it (and so must settle it)."""
        if self._round is not None and self._round.step == step:
            self._round.expected |= expected
            return self._round, False
        self._round = _OpenRound(step=step, expected=expected | {self.peer_id},
                                 deadline=time.monotonic() + self.timeout_s)
        return self._round, True

    async def _lead(self, step: int, expected: set[str]) -> None:
        rnd, opened = self._open(step, expected)
        if opened:
            await self._settle(rnd)
        else:
            await asyncio.shield(rnd.result)

    async def _settle(self, rnd: _OpenRound) -> RoundResult:
        """Add our own contribution, wait for the others, reduce, apply, answer everyone."""
        started = time.monotonic()
        try:
            own = await self.executor.take_contribution()
        except Busy:  # our gradients are already out (we are contributing elsewhere)
            result = _aborted(rnd.step)
            rnd.result.set_result(result)
            self._round = None
            return result
        rnd.contributions[self.peer_id] = own
        # a silent proven contributor (a fake that passed the proof) is waited for only as long as
        # honest contributions take (swarmd.pipeline.averaging.patience), then excluded
        opened = rnd.deadline - self.timeout_s
        patient_until = min(rnd.deadline, opened + self.patience.wait_s(self.timeout_s, rnd.expected - {self.peer_id}))
        arrivals: dict[str, float] = {}
        try:
            while not rnd.expected <= set(rnd.contributions) | set(rnd.refused):
                arrivals.update({p: time.monotonic() - opened for p in rnd.contributions if p not in arrivals})
                remaining = patient_until - time.monotonic()
                if remaining <= 0:
                    break
                rnd.arrived.clear()
                if not await wait_event(rnd.arrived, remaining):
                    break
            arrivals.update({p: time.monotonic() - opened for p in rnd.contributions if p not in arrivals})
            # From here the mean is fixed: a contribution arriving while we apply it would be
            # answered with a mean that does not hold it, and its samples would vanish.
            rnd.closed = True
            await self._accuse_silent(rnd, set(rnd.contributions) | set(rnd.refused))
            result = await asyncio.to_thread(self._reduce, rnd)
            if result.status == "ok":
                await self._recompute_sampled(rnd)  # on this step's parameters, before the mean moves them
                self.patience.observe({p: d for p, d in arrivals.items() if p != self.peer_id})
            for pid, why in sorted(rnd.refused.items()):
                if pid not in rnd.convicted:
                    self._refuse_contributor(pid, why, rnd.step)
            self._convict(rnd)
            self.refused_samples += rnd.refused_samples
            late = time.monotonic() - rnd.deadline
            if result.status == "ok" and late > shared.COMMIT_GRACE_S:
                log.warning("stage %d step %d: this leader is %.1fs past the round's deadline (it was frozen?); "
                            "its contributors may have given up, so the round is aborted",
                            self.executor.stage, rnd.step, late)
                result = RoundResult("aborted", rnd.step, result.samples, result.contributors, None)
            if result.status == "ok":
                assert result.mean_grads is not None
                await self.executor.apply_average(result.mean_grads, rnd.step)
                self._await_openings(rnd)  # the contributors apply it too, then open their contributions
                self.rounds_ok += 1
                self.catch_up.stepped(rnd.step, set(rnd.contributions) - {self.peer_id})
                self.count_repeats(rnd.step, [c.mbs for _, c in sorted(rnd.contributions.items())])
            else:
                await self.executor.restore_contribution(own)
                self.rounds_aborted += 1
            self._record(result, self.peer_id, missing=sorted(rnd.expected - set(rnd.contributions)),
                         refused={pid: str(why) for pid, why in rnd.refused.items()}, started=started,
                         clipped=rnd.clipped, struck=rnd.struck,
                         convicted={**rnd.convicted, **self._take_opening_convictions()})
            rnd.result.set_result(result)
            return result
        except BaseException as exc:
            if not rnd.result.done() and isinstance(exc, asyncio.CancelledError):
                # this peer leaves the stage's rounds (a move, a stop): its contributors are answered "aborted"
                # and keep their gradients at once (it was a 500 "the peer failed unexpectedly")
                rnd.result.set_result(_aborted(rnd.step, "the leader left the stage's rounds"))
            elif not rnd.result.done():
                rnd.result.set_exception(exc if isinstance(exc, Exception) else RuntimeError("round cancelled"))
                rnd.result.exception()  # retrieved: contributors see it through their requests
            if self.executor.averaging:
                await asyncio.shield(self.executor.restore_contribution(own))
            raise
        finally:
            self._round = None

    def _convict(self, rnd: _OpenRound) -> None:
        """Exclude the peers this round's reduction convicted of hostile contributions
        (``hostile_contributions``), as long as the trainers' reports exclude a peer at first."""
        self.contributions_clipped += len(rnd.clipped)
        self.contributions_struck += len(rnd.struck)
        for pid, why in sorted(rnd.convicted.items()):
            self.hostile_convictions[pid] += 1
            period = self.exclude_hostile(pid, why)
            dropped = "dropped from" if pid in rnd.refused else "kept, clipped, in"
            log.warning("stage %d step %d: convicted %s of hostile contributions (%s); its contribution %s this "
                        "round; excluded from this peer's rounds for %.0fs", self.executor.stage, rnd.step,
                        pid[:12], why, dropped, period)
            self._accuse(pid, rnd.step)  # and show the stage-mates the evidence (accuser)

    async def _accuse_silent(self, rnd: _OpenRound, arrived: set[str]) -> None:
        """Exclude the expected contributors that never came (issue #18: a proof shows a peer holds
        its identity, not that it will contribute), with the growing periods of the round checks;
        not those whose view moved on while the round waited (asked once: at the round's step naming
        another leader, or past it): while a swarm starts, the listings of stage-mates differ for a few
        seconds, a mate takes a newly listed peer for its leader, and honest peers were excluded for
        "silence" by the leader they had left, which forked them off their stage. Nor those that say
        they left the stage (a move: ``_movers``)."""
        missing = RoundPatience.silent(rnd.expected, arrived, leader=self.peer_id)
        if not missing:
            return
        listed = {pid: self._mates[pid] for pid in missing if pid in self._mates}
        answers = await self._answers(listed)
        progress = self._taking_part(answers)
        moved_on = {pid for pid, p in progress.items() if p.step != rnd.step or p.leader != self.peer_id}
        self.accuse_silent(missing - moved_on - self._movers(answers), rnd.step,
                           "was expected in the round and never contributed")

    def _reduce(self, rnd: _OpenRound) -> RoundResult:
        """Refuse outliers, take the robust mean, score the contributions, encode the answer
        (``swarmd.pipeline.averaging.reduction``; off the event loop: called in a thread)."""
        own = rnd.contributions.get(self.peer_id)
        if set(rnd.contributions) <= {self.peer_id} and own is not None and own.samples >= self.target:
            return lone_result(self.peer_id, rnd.step, own, self.executor.grad_numel)  # nobody to check or answer
        if own is not None and self.peer_id not in rnd.digests:
            rnd.digests[self.peer_id] = tensor_digest(own.grads)
        ex = self.executor
        red = reduce_contributions(rnd.contributions, rnd.digests, leader=self.peer_id, target=self.target,
                                   numel=ex.grad_numel,
                                   watch=self.hostile if self.convicts() else None, score=True,
                                   strike=self._unopened(rnd) | self._uninspectable(rnd))
        self._note_scores(rnd, red)
        for pid, why in red.refused.items():
            rnd.refused[pid] = why
            rnd.contributions.pop(pid)
        rnd.refused_samples += red.refused_samples
        rnd.convicted, rnd.clipped, rnd.struck = dict(red.convicted), red.clipped, red.struck
        if red.scores:
            log.debug("stage %d step %d: contribution scores %s", ex.stage, rnd.step,
                      {pid[:8]: (round(sc.far, 2), round(sc.cos, 3)) for pid, sc in red.scores.items()})
        if red.robust or red.struck:
            log.debug("stage %d step %d: the robust rule moved the mean by %.4g of its norm (clipped %d, struck %d)",
                      ex.stage, rnd.step, red.moved, len(red.clipped), len(red.struck))
        used, total, mean = red.used, red.total, red.mean
        if mean is None and total < self.target:
            log.warning(
                "stage %d step %d: only %d of %d samples arrived from %d peer(s)%s; round aborted, gradients kept",
                ex.stage, rnd.step, total, self.target, len(rnd.contributions),
                f" ({len(red.refused)} refused)" if red.refused else "",
            )
        elif mean is None:  # cannot happen with finite contributions; never apply it
            log.error("stage %d step %d: the mean gradient is not finite; round aborted", ex.stage, rnd.step)
        if mean is None:
            return RoundResult("aborted", rnd.step, total, len(rnd.contributions), None)
        if self.convicts():  # to check the contributors' openings against (openings)
            self._sketch_received(rnd, {u.peer_id for u in used})
        if set(rnd.contributions) <= {self.peer_id}:  # a lone peer: nobody to answer, nothing to encode
            return RoundResult("ok", rnd.step, total, len(rnd.contributions), mean, used=used)
        # one answer for everyone: under "auto", as compressed as the most compressed contribution it used
        sent = [rnd.codecs.get(pid, "none") for pid in rnd.contributions]
        codec = _wire_codec(mean, answer_codec(ex.training.grad_codec, sent))
        answer = RoundResult("ok", rnd.step, total, len(rnd.contributions), mean, used=used).to_reply(ex.stage)
        reply = answer.encode(codec)
        if codec != "none":  # lossy: apply what the contributors will decode, bit for bit
            mean = decode_frame(reply).tensors["grads"]
        return RoundResult("ok", rnd.step, total, len(rnd.contributions), mean, reply, used=used)

    def _take_in(self, rnd: _OpenRound, peer_id: str, contribution: Contribution,
                 request: AverageRequest | None) -> None:
        """Put an admitted contribution into ``rnd``: its codec, its signed digest and claim, the inputs
        its microbatches ran on (for a recomputation)."""
        rnd.contributions[peer_id] = contribution
        rnd.codecs[peer_id] = request.codec if request is not None and contribution.grads is not None else "none"
        if request is not None and request.digest is not None:
            rnd.digests[peer_id] = request.digest
            self._note_claim(rnd, peer_id, request)
        if request is not None and request.inputs and contribution.grads is not None:
            rnd.inputs[peer_id] = (request.inputs, request.inputs_params or "", request.inputs_precision or "fp32")

    async def contribute(self, peer_id: str, step: int, samples: int, grads: torch.Tensor | None,
                         request: AverageRequest | None = None) -> RoundResult:
        """A stage-mate's contribution arrived (``POST /v1/average``): join or open the round.

        ``request``: the decoded request, for its signature (refused unsigned when this averager
        has an identity)."""
        ex = self.executor
        if step != ex.step:
            return _aborted(step)
        if grads is not None and grads.numel() != ex.grad_numel:
            raise ValueError(f"a contribution must carry {ex.grad_numel} gradient values, got {grads.numel()}")
        why = await self._admit(peer_id, step, samples, grads, request)
        if why is None:  # the opening of its last contribution here, if any (openings)
            why = await self._check_opening(peer_id, request.opening if request is not None else None, step)
            if why is not None and why.kind != "hostile":
                period = self.suspicions.accuse(peer_id, str(why))
                self._warn(peer_id, why.kind, "stage %d step %d: excluded %s from this peer's rounds for %.0fs (%s)",
                           ex.stage, step, peer_id[:12], period, why)
        if why is not None:
            self.contributions_refused[why.kind] += 1
            self._warn(peer_id, why.kind, "stage %d step %d: contribution of %s refused (%s)",
                       ex.stage, step, peer_id[:12], why)
            # often for this peer's own view (the sender not yet listed, not yet proven): never silent
            self._not_coming(peer_id, step)
            return _aborted(step, str(why))
        if step != ex.step:  # stepped while the signature was checked
            return _aborted(step)
        contribution = Contribution(step=step, samples=samples, grads=grads,
                                    mbs=request.mbs if request is not None else ())
        if self._round is None:
            if ex.averaging:  # we are contributing to another leader ourselves
                return _aborted(step)
            rnd, _ = self._open(step, {peer_id})
            self._take_in(rnd, peer_id, contribution, request)
            self._own(self._settle_owned(rnd), "swarmd-average")
        else:
            rnd = self._round
            if rnd.step != step or rnd.closed or rnd.result.done():  # too late for this round: keep them
                return _aborted(step)
            self._take_in(rnd, peer_id, contribution, request)
            rnd.expected.add(peer_id)
            rnd.arrived.set()
        result = await asyncio.shield(rnd.result)
        if peer_id in rnd.refused:  # the reduction refused it: the sender keeps its gradients
            return _aborted(step, f"refused: {rnd.refused[peer_id]}")
        return result

    async def _admit(self, peer_id: str, step: int, samples: int, grads: torch.Tensor | None,
                     request: AverageRequest | None) -> Refusal | None:
        """Why a contribution is turned away before it joins a round (None: it may join)."""
        if peer_id in self.excluded():
            return Refusal("excluded", "this stage excludes that peer for now")
        if self.identity is not None:
            if request is None or request.public_key is None or request.signature is None:
                return Refusal("unsigned", "a contribution must be signed with its sender's identity")
            if peer_id_of(request.public_key) != peer_id:
                return Refusal("bad_signature", "the key is not that peer id's")
            digest, norm = await asyncio.to_thread(lambda: (tensor_digest(grads), per_sample_norm(grads, samples)))
            message = contribution_message(self.executor.stage, step, samples, digest, peer_id, self.peer_id,
                                           request.norm)
            if request.digest != digest or not verify(request.public_key, message, request.signature):
                return Refusal("bad_signature", "the signature does not cover these gradients for this round")
            if not math.isclose(request.norm, norm, rel_tol=NORM_TOLERANCE, abs_tol=1e-30):
                return Refusal("bad_norm", f"it signed a per-sample norm of {request.norm:.6g}, its gradients' is "
                               f"{norm:.6g}")
        if self.prover is not None:
            mates = await self.stage_peers()
            addr = mates.get(peer_id)
            if addr is None:
                return Refusal("unproven", "not a serving stage-mate in the DHT")
            if self.prover.table.proof(peer_id, addr) is None:
                self._prove({peer_id: addr})  # it may prove itself before its next try
                return Refusal("unproven", "it has not answered this peer's proof challenge yet")
        return None

    def _not_coming(self, peer_id: str, step: int | None = None) -> None:
        """``peer_id``'s contribution came and was refused: the open round (of ``step``, when given) waits for
        it no longer, and does not accuse it of silence."""
        rnd = self._round
        if rnd is not None and (step is None or rnd.step == step) and not rnd.closed and peer_id in rnd.expected:
            rnd.expected.discard(peer_id)
            rnd.arrived.set()

    def signer_of(self, frame: Frame) -> str | None:
        """The peer that signed this contribution frame for this leader (its key hashing to the peer id
        it names, the signature covering the frame's step, samples and gradients), else None. Pure and
        thread-safe: the data plane calls it on its codec pool (it hashes the gradients)."""
        meta, grads = frame.meta, frame.tensors.get("grads")
        peer_id, pk, sig, digest = meta.get("peer_id"), meta.get("pk"), meta.get("sig"), meta.get("digest")
        step, samples, norm = meta.get("step"), meta.get("samples"), meta.get("norm")
        if not (isinstance(peer_id, str) and type(pk) is bytes and type(sig) is bytes and isinstance(digest, str)
                and type(step) is int and type(samples) is int and type(norm) is float and grads is not None
                and grads.dtype == torch.float32 and grads.dim() == 1 and grads.numel() == self.executor.grad_numel
                and peer_id_of(pk) == peer_id and tensor_digest(grads) == digest):
            return None
        message = contribution_message(self.executor.stage, step, samples, digest, peer_id, self.peer_id, norm)
        return peer_id if verify(pk, message, sig) else None

    def note_unreadable(self, frame: Frame, error: RequestError, signer: str | None) -> None:
        """A contribution the data plane refused while decoding it (a 422): non-finite gradients
        (``NonFinite``), or a malformed frame. Counted and logged (rate-limited); held against the peer
        it names only when that peer signed it (``signer``, from :meth:`signer_of`): anyone can send an
        unsigned frame in another's name."""
        reason = "nonfinite" if isinstance(error, NonFinite) else "malformed"
        why = str(error)
        self.contributions_refused[reason] += 1
        peer_id = frame.meta.get("peer_id")
        name = peer_id[:12] if isinstance(peer_id, str) else "?"
        if signer is not None:
            period = self.suspicions.accuse(signer, f"{reason}: {why[:120]}")
            self._not_coming(signer)
            self._warn(signer, reason, "stage %d: refused a %s contribution signed by %s (%s); excluded from this "
                       "peer's rounds for %.0fs", self.executor.stage, reason, signer[:12], why[:200], period)
        else:
            self._warn(name, reason, "stage %d: refused an unreadable contribution naming %s (%s)",
                       self.executor.stage, name, why[:200])

    async def _settle_owned(self, rnd: _OpenRound) -> None:
        """Settle a round a stage-mate opened: first learn who else is at this step."""
        try:
            mates = await self._trusted_mates()
            progress = await self._poll(mates)
            digest = self.executor.digest
            # only the mates that name this peer their leader are coming: one whose view names another (it was
            # refused here lately, or its listing differs) was never on its way, and waiting for it would
            # accuse an honest peer of silence
            rnd.expected |= {pid for pid, p in progress.items()
                             if p.step == rnd.step and p.params_digest == digest and p.leader == self.peer_id}
            await self._settle(rnd)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("averaging round of stage %d failed", self.executor.stage)

    def _refuse_contributor(self, peer_id: str, why: Refusal, step: int) -> None:
        self.contributions_refused[why.kind] += 1
        period = self.suspicions.accuse(peer_id, str(why))
        if self.prover is not None:
            self.prover.table.forget(peer_id)
        self._warn(peer_id, "refused", "stage %d step %d: refused the contribution of %s (%s); excluded from this "
                   "peer's rounds for %.0fs", self.executor.stage, step, peer_id[:12], why, period)

