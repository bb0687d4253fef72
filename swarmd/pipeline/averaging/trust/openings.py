"""Opening contributions after each round, and checking the openings (``contribution_proofs``).

Both sides of item 3 of issue #29 on the last stage, where each peer keeps its microbatches'
gradients apart:

* **Contributor.** Once a leader's ``ok`` answer is applied, the contributor sketches its parts,
  whatever no microbatch explains and the contribution as the leader decoded it, under the seed the
  answer fixed, signs that :class:`~swarmd.pipeline.averaging.trust.contribution_proofs.Opening` and sends it with
  its next contribution to the same leader (``AverageRequest.opening``).
* **Leader.** At each reduction it sketches every contribution it received under that
  contribution's seed (it holds the gradients then; it keeps ``K`` numbers per contributor). An
  opening that arrives later is checked: signed by its sender, for this leader and for the
  contribution the leader sketched; its ``sent`` sketch the leader's own; its parts summing to its
  signed total. Failing one of those (only the leader can tell: it needs the gradients) the
  contribution that carried it is refused, and its sender excluded from this leader's rounds. An
  opening whose contribution is not the sum of its own parts contradicts itself, which anyone can
  check from the signed opening: the sender is convicted of a hostile contribution, its contribution
  refused, and the opening (without its parts) posted to the stage-mates, which second it
  (``accuser``) after checking it themselves. A contribution that comes without the
  opening its sender owes this leader is left out of the round's mean (struck: its samples count,
  the round goes on), not refused: an honest peer whose answer was lost has nothing to open, and a
  peer that never opens never moves a mean. The opening stays owed until it comes or a later used
  contribution of that peer replaces it (a contribution turned away after the check must not clear
  the debt: that let one unopened contribution through in one of ~8 loaded test runs).
* **Recomputation** (``swarmd.pipeline.averaging.trust.recomputation``). Contributions carry their microbatches'
  inputs; one that names microbatches without all of them is struck like an unopened one. After an
  ``ok`` reduction, before applying the mean, the leader draws (secretly, ``recompute_share``) one
  microbatch of a contribution, recomputes its gradient on its own worker and keeps its sketch; the
  opening must list exactly the shipped microbatches, sign their inputs' digests, the parameters and
  precision they ran at and this leader's digest (else ``bad``), and its drawn part must match
  (``mismatch``: convicted, and the signed opening and that microbatch's inputs posted to the
  stage-mates, ``POST /v1/recheck``, which recompute it on their own copy of the round's parameters and
  second: ``accuser``), and when every sample is a shipped microbatch's its extra share must stay under
  ``extra_bound`` (else ``bad``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from swarmd.errors import RequestError
from swarmd.pipeline.averaging.round import _OpenRound, log
from swarmd.pipeline.averaging.trust.accuser import RoundAccuser
from swarmd.pipeline.averaging.trust.contribution_proofs import (
    TOLERANCE,
    Awaited,
    OpeningEvidence,
    opened_microbatches,
    proof_seed,
    read_opening,
    sign_opening,
    sketch,
)
from swarmd.pipeline.averaging.trust.contribution_proofs import gap as sketch_gap
from swarmd.pipeline.averaging.trust.recomputation import (
    RECOMPUTE_PRECISIONS,
    RECOMPUTE_TOLERANCE,
    draws,
    extra_overrun,
    extra_share,
    inputs_digest,
    misstated_microbatch,
    sample,
)
from swarmd.pipeline.averaging.trust.refusals import Refusal

if TYPE_CHECKING:
    from swarmd.pipeline.averaging.round import RoundResult
    from swarmd.pipeline.stage.executor import Contribution

__all__ = ["RoundOpenings"]


def _digests(shipped: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]) -> tuple[tuple[int, str], ...]:
    return tuple((mb, inputs_digest(mb, x, y)) for mb, x, y in shipped)


class RoundOpenings(RoundAccuser):
    """Open this peer's contributions after its rounds; check its contributors' openings as leader."""

    # ---- the contributor's side -------------------------------------------------------------

    def _open_contribution(self, leader: str, own: Contribution, decoded: torch.Tensor | None,
                           result: RoundResult, codec: str) -> tuple[bytes | None, float]:
        """After applying ``leader``'s answer to ``own`` (sent as ``decoded``): the signed opening, to go with
        the next contribution to that leader (None: nothing to open), and the CPU seconds it took (off the
        loop: a thread)."""
        if not self.convicts() or self.identity is None or own.grads is None or decoded is None or not own.parts:
            return None, 0.0
        mine = next((u for u in result.used or () if u.peer_id == leader), None)
        digest = next((u.digest for u in result.used or () if u.peer_id == self.peer_id), None)
        if mine is None or not digest:
            return None, 0.0
        started = time.thread_time()
        ex = self.executor
        mbs = opened_microbatches(own.parts)
        # the inputs it shipped, their parameters and the seed's leader digest, signed for a recomputation
        # that the stage-mates can redo (recomputation, "Seconded")
        shipped = {i.mb: i for i in own.inputs}
        at = self._shipped_at.get(own.step)
        signs = at is not None and bool(mbs) and set(shipped) == set(mbs)
        ins = [inputs_digest(mb, shipped[mb].inputs, shipped[mb].targets) for mb in mbs] if signs else []
        opening = sign_opening(self.identity, stage=ex.stage, step=own.step, peer_id=self.peer_id, leader=leader,
                               leader_digest=mine.digest, digest=digest, codec=codec, parts=own.parts,
                               decoded=decoded, numel=ex.grad_numel, ins=ins,
                               at=at if signs and at is not None else (), lead=mine.digest if signs else "")
        return opening.encode(), time.thread_time() - started

    def _opened(self, leader: str, opened: tuple[bytes | None, float]) -> None:
        """Keep the opening for the next contribution to ``leader`` (on the loop)."""
        opening, cpu_s = opened
        self.opening_costs["cpu_s"] += cpu_s
        if opening is not None:
            self._due_openings.pop(leader, None)
            self._due_openings[leader] = opening
            while len(self._due_openings) > 16:  # leaders that went away: their openings are never asked for
                self._due_openings.pop(next(iter(self._due_openings)))
            self.openings["sent"] += 1
            self.opening_costs["bytes"] += len(opening)

    # ---- the leader's side ------------------------------------------------------------------

    def _sketch_received(self, rnd: _OpenRound, used: set[str]) -> None:
        """At a reduction (off the loop): sketch every other contribution with gradients the round used,
        under its seed, to check its opening against (kept in ``rnd.sketched``: see :meth:`_await_openings`)."""
        if self.identity is None:  # nobody opens in a swarm without identities
            return
        started = time.thread_time()
        own_digest = rnd.digests.get(self.peer_id, "")
        for pid in sorted(used - {self.peer_id}):
            c = rnd.contributions.get(pid)
            digest = rnd.digests.get(pid)
            if c is None or c.grads is None or not digest:
                continue
            seed = proof_seed(self.executor.stage, rnd.step, self.peer_id, own_digest, digest)
            sent = sketch([c.grads], seed, self.executor.grad_numel)[0]
            rnd.sketched[pid] = Awaited(rnd.step, digest, rnd.codecs.get(pid, "none"),
                                        tuple(float(x) for x in sent.tolist()))
        rnd.sketch_cpu_s = time.thread_time() - started

    def _recomputes(self) -> bool:
        """Whether this stage's leaders recompute a sampled microbatch of each contribution
        (``swarmd.pipeline.averaging.trust.recomputation``; its contributors ship their microbatches' inputs)."""
        return self.convicts() and self.identity is not None and not self.executor.training.delay_updates

    def _uninspectable(self, rnd: _OpenRound) -> frozenset[str]:
        """The contributions of ``rnd`` that name microbatches without shipping all their inputs: struck, as
        unopened ones are, so that a peer cannot dodge the recomputation by not shipping them."""
        if not self._recomputes():
            return frozenset()
        return frozenset(pid for pid, c in rnd.contributions.items()
                         if pid != self.peer_id and c.grads is not None and c.mbs
                         and {mb for mb, _, _ in rnd.inputs.get(pid, ((), "", ""))[0]} != set(c.mbs))

    async def _recompute_sampled(self, rnd: _OpenRound) -> None:
        """After an ``ok`` reduction, before the mean is applied (on the loop; the work on the worker thread
        and a thread): for each sketched contribution that shipped the inputs of its ``m`` microbatches, with
        probability ``min(1, recompute_share * m)`` (secret), draw one of them and keep the sketch of its
        gradient recomputed here under the contribution's seed (``recomputation``: the expected extra compute
        is ``recompute_share`` of the stage's, and a lie about one microbatch is caught with that probability
        per round)."""
        if not self._recomputes() or not rnd.sketched:
            return
        ex = self.executor
        own_digest = rnd.digests.get(self.peer_id, "")
        for pid, sketched in sorted(rnd.sketched.items()):
            shipped, params, precision = rnd.inputs.get(pid, ((), "", ""))
            contribution = rnd.contributions.get(pid)
            if not shipped or contribution is None:
                continue
            # the microbatches shipped, and the samples they do not explain (handed-in gradients); what its
            # opening must sign of them (their inputs' digests, their parameters and precision, this leader's digest)
            digests = await asyncio.to_thread(_digests, shipped)
            awaited = dataclasses.replace(sketched, input_mbs=frozenset(mb for mb, _, _ in shipped),
                                          unexplained=contribution.samples - sum(x.shape[0] for _, x, _ in shipped),
                                          input_digests=digests, at=(params, precision), lead=own_digest)
            rnd.sketched[pid] = awaited
            if params != ex.digest or precision not in RECOMPUTE_PRECISIONS:
                self.openings["unchecked"] += 1  # other parameters or precision: nothing to compare with here
                continue
            if not draws(min(1.0, self.recompute_share * len(shipped))):
                continue
            mb, x, y = sample(shipped)  # secret: the contributor signs its parts without knowing which
            started = time.perf_counter()
            try:
                flat = await ex.recompute(x, y, precision, rnd.step)
            except RequestError as exc:  # inputs that do not fit the stage: its opening will find no match
                log.warning("stage %d step %d: the inputs of %s's microbatch %#x do not fit this stage (%s)",
                            ex.stage, rnd.step, pid[:12], mb, exc)
                flat = torch.full((ex.grad_numel,), float("nan"))
            if flat is None:  # the parameters moved on (a state adopted meanwhile): nothing to compare with
                continue
            seed = proof_seed(ex.stage, rnd.step, self.peer_id, own_digest, awaited.digest)
            row = await asyncio.to_thread(sketch, [flat], seed, ex.grad_numel)
            self.opening_costs["recompute_s"] += time.perf_counter() - started
            self.openings["recomputed"] += 1
            self.opening_costs["recomputed_samples"] += x.shape[0]
            rnd.sketched[pid] = dataclasses.replace(awaited, sampled=mb, sampled_inputs=(x.clone(), y.clone()),
                                                    recomputed=tuple(float(v) for v in row[0].tolist()))

    def _await_openings(self, rnd: _OpenRound) -> None:
        """After an ``ok`` round (on the loop): its contributors' openings are due with their next contributions."""
        self._awaited.update(rnd.sketched)
        self.opening_costs["cpu_s"] += rnd.sketch_cpu_s
        while len(self._awaited) > 256:
            self._awaited.pop(next(iter(self._awaited)))

    def _judge_opening(self, peer_id: str, raw: bytes | None,
                       step: int) -> tuple[str, str, OpeningEvidence | None, float | None]:
        """What ``peer_id``'s opening (sent with its contribution of ``step``) shows (off the loop): ``(verdict,
        why, evidence)`` with verdict ``none`` (nothing awaited or nothing sent), ``missing``, ``ok``, ``bad``
        (only this leader can tell: refuse), ``inconsistent`` (convict; the evidence goes to the mates) or
        ``mismatch`` (its sampled microbatch's part is not the gradient recomputed here: convict, this
        leader's own judgment); the evidence comes with ``ok``, ``inconsistent`` and ``mismatch``, and the
        recomputed part's gap with a recomputed ``ok`` or ``mismatch``."""
        awaited = self._awaited.get(peer_id)
        if awaited is None or awaited.step >= step:
            return "none", "", None, None  # it owes this leader nothing
        if raw is None:
            return "missing", f"no opening of its contribution of step {awaited.step}", None, None
        verdict, why, opening = read_opening(raw, stage=self.executor.stage, peer_id=peer_id, leader=self.peer_id,
                                             step=awaited.step, digest=awaited.digest)
        if verdict == "other":  # an older one (its answer of that round was lost): the one owed is not there
            return "missing", why, None, None
        if opening is None:
            return verdict, why, None, None
        ev = opening.evidence
        if verdict == "inconsistent":
            return verdict, why, ev, None
        sent_gap = sketch_gap(ev.sent, (0.0,) * len(ev.sent), awaited.sent)
        # both sketched the very gradients the leader decoded (their digest is signed): exact, whatever the codec
        if ev.codec != awaited.codec or sent_gap > TOLERANCE:
            return "bad", (f"bad opening: its contribution's sketch is {sent_gap:.3f} away from the one received "
                           f"(codec {ev.codec}, received {awaited.codec})"), None, None
        parts_gap = opening.parts_gap()
        if parts_gap > TOLERANCE:
            return "bad", f"bad opening: its parts sum {parts_gap:.3f} away from their signed total", None, None
        if awaited.input_mbs is not None and (len(set(opening.mbs)) != len(opening.mbs)
                                              or frozenset(opening.mbs) != awaited.input_mbs):
            return "bad", ("bad opening: its microbatches are not those whose inputs came with its contribution"
                           ), None, None
        if awaited.input_mbs is not None:  # what a stage-mate needs to redo the recomputation: signed, and true
            digests = dict(awaited.input_digests)
            if (opening.ins != tuple(digests.get(mb, "") for mb in opening.mbs) or opening.at != awaited.at
                    or opening.lead != awaited.lead):
                return "bad", ("bad opening: it does not sign the inputs its contribution shipped, the parameters "
                               "they ran at and this leader's digest"), None, None
        # every sample a shipped microbatch's: its extra can only be a codec's residual (item 2)
        overrun = extra_overrun(ev.total, ev.extra, self.executor.training.grad_codec)
        if awaited.unexplained == 0 and overrun is not None:
            return "bad", overrun, None, None
        if awaited.sampled is None or awaited.recomputed is None:
            return "ok", "", ev, None
        part = opening.parts[opening.mbs.index(awaited.sampled)]
        recomputed_gap = sketch_gap(part, (0.0,) * len(part), awaited.recomputed)
        if not recomputed_gap <= RECOMPUTE_TOLERANCE:  # NaN (inputs that did not fit the stage) included
            return "mismatch", misstated_microbatch(awaited.sampled, ev.step, recomputed_gap), ev, recomputed_gap
        return "ok", "", ev, recomputed_gap

    async def _check_opening(self, peer_id: str, raw: bytes | None, step: int) -> Refusal | None:
        """Check the opening a contribution carried (module docstring); the refusal of that contribution, if any."""
        if not self.convicts() or self.identity is None:  # openings are signed: an identity swarm's only
            return None
        awaited = self._awaited.get(peer_id)  # (the drawn microbatch's inputs, for the stage-mates on a mismatch)
        verdict, why, evidence, recomputed_gap = await asyncio.to_thread(self._judge_opening, peer_id, raw, step)
        if verdict == "ok" and recomputed_gap is not None:  # an honest recomputed part's gap: the margin
            self.opening_costs["max_recompute_gap"] = max(self.opening_costs["max_recompute_gap"], recomputed_gap)
        if verdict == "ok" and evidence is not None:  # the largest extra share of an opening judged honest
            share = extra_share(evidence.total, evidence.extra)
            self.opening_costs["max_extra_share"] = max(self.opening_costs["max_extra_share"], share)
        if verdict == "none":
            return None
        if verdict != "missing":  # judged: one verdict per contribution; a missing opening stays owed until
            self._awaited.pop(peer_id, None)  # it comes, or the peer's next used contribution replaces it
        if verdict == "ok" and evidence is not None:  # a consistent opening's gap: the honest margin (bench_verify)
            g = sketch_gap(evidence.total, evidence.extra, evidence.sent)
            self.opening_costs["max_gap"] = max(self.opening_costs["max_gap"], g)
        self.openings[verdict] += 1
        if verdict == "ok":
            return None
        if verdict == "missing":  # not refused (a lost answer leaves an honest contributor nothing to open):
            self._owing.pop(peer_id, None)
            self._owing[peer_id] = step  # its contribution is left out of this round's mean (samples counted)
            while len(self._owing) > 256:
                self._owing.pop(next(iter(self._owing)))
            self._warn(peer_id, "opening_missing", "stage %d step %d: %s sent %s; its contribution is left out of "
                       "the mean", self.executor.stage, step, peer_id[:12], why)
            return None
        if verdict == "bad":
            return Refusal("bad_opening", why)
        assert evidence is not None  # "inconsistent" and "mismatch" carry it
        self._convict_on_opening(peer_id, why, step)
        if verdict == "inconsistent":  # anyone can check it from the signed opening
            self._post_accusation(peer_id, evidence, evidence.step, "sent")
        elif raw is not None and awaited is not None and awaited.sampled is not None and awaited.sampled_inputs:
            # a stage-mate redoes the recomputation on its own copy of that step's parameters (recomputation)
            x, y = awaited.sampled_inputs
            self._post_accusation(peer_id, evidence, evidence.step, "sent", shown=(raw, awaited.sampled, x, y))
        rnd = self._round
        if rnd is not None and not rnd.closed:  # do not wait for it in the open round
            rnd.expected.discard(peer_id)
            rnd.arrived.set()
        return Refusal("hostile", why)

    def _convict_on_opening(self, peer_id: str, why: str, step: int) -> float:
        """Convict ``peer_id`` of a hostile contribution on what its opening (or a check of it) showed at ``step``:
        counted, named in this peer's next round record, excluded here (the period, in seconds). The leader's and
        the all-reduce coordinator's (``allreduce.recompute``, ``allreduce.sent_parts``)."""
        self.hostile_convictions[peer_id] += 1
        self._opening_convictions[peer_id] = why
        period = self.exclude_hostile(peer_id, why)
        log.warning("stage %d step %d: convicted %s of a hostile contribution (%s); excluded from this peer's rounds "
                    "for %.0fs", self.executor.stage, step, peer_id[:12], why, period)
        return period

    def _unopened(self, rnd: _OpenRound) -> frozenset[str]:
        """The contributions of ``rnd`` whose senders did not open their last one here: struck, so that a peer
        that never opens never moves a mean (read in the reduction's thread; written on the loop)."""
        return frozenset(pid for pid in rnd.contributions if self._owing.get(pid) == rnd.step)

    def _take_opening_convictions(self) -> dict[str, str]:
        """The convictions on openings since the last round this leader recorded (for its record)."""
        out, self._opening_convictions = self._opening_convictions, {}
        return out

    def _opening_for(self, leader: str) -> bytes | None:
        """The opening due to ``leader``: it goes with every contribution to it until the next opening replaces
        it (a contribution the leader turns away before reading it must not lose it; a leader reads each once)."""
        return self._due_openings.get(leader)
