"""The last stage's openings in the chunked all-reduce (``swarmd.pipeline.averaging.trust.openings`` is the
single leader's; ``contribution_proofs`` has the opening and its checks).

The rule here: **the round's coordinator checks the openings, as the leader does**, with what it
can check without the members' gradients (it holds one part of each):

* **Member.** After applying a commit, a last-stage member signs an
  :class:`~swarmd.pipeline.averaging.trust.contribution_proofs.Opening` of its contribution: its
  microbatches' sketches, what no microbatch explains, and the contribution as its owners decoded
  it (its parts, concatenated), under a seed that hashes the commit's part digests (fixed only
  once every member sent its parts) and its own signed claim's digest (``plan.claim_digest``).
  It rides to the same coordinator with the member's next report (``ArReport.opening``). With part
  0 of its contribution it says how many of its samples no microbatch of its explains (those not in
  the microbatches whose inputs it kept: handed in; ``ArPart.unexplained``).
* **Coordinator.** At each commit it awaits an opening from every member whose signed claim it
  kept (``member``: claims checked against every part's ``used`` list), with what part 0 (its own)
  got with the member's contribution: the microbatches it named and how many of its samples none
  of them explains (:class:`ArAwaited`). An opening that comes is checked (:func:`judge`): signed by
  the member, for this coordinator, of the awaited step and claim; **consistent**: its
  contribution's sketch is the sum of its parts' (``inconsistency``, which anyone can check); and,
  as the leader checks an opening whose contribution shipped its inputs (not under delayed
  updates): it lists exactly the microbatches its contribution named, and when every sample is one
  of theirs, what no microbatch explains stays under ``recomputation.extra_bound`` (the codec's
  residual). An inconsistent one convicts its sender exactly as the leader's does (``hostile:
  unaccountable contribution ...``, excluded, the opening posted to the stage-mates, which second
  it: ``accuser``); a bad one (unreadable, badly signed, other microbatches, too large an extra)
  excludes it as ``bad_opening``.
* **Strikes.** A member that still owes this coordinator an opening when a round is planned (its
  reports came without it, or with an older one) is struck, as the leader strikes an unopened
  contribution: the coordinator names it in the plan (``RoundPlan.struck``), every owner leaves
  its slices out of its part's mean (its samples count: the round goes on), and the signed commit
  names it among the struck. Decided before any part is reduced, so every owner reduces alike and
  the members still apply one mean bit for bit, or none. Not when it would leave the mean nothing
  (the coordinator holds no samples): a mean of nothing is no step. The debt stays until the
  opening comes or a later committed contribution of the member replaces it.
  The coordinator's round record lists ``used`` (whose samples the mean holds), as a leader's does.

* **Inputs committed.** With part 0 a member commits the digests of its microbatches' inputs
  (``ArPart.ins``); its opening must sign exactly those, the parameters they ran at and the commit's
  digest (else ``bad``): what the coordinator's recomputation of a drawn microbatch, after the opening,
  checks against (``recompute``). One whose contribution named microbatches without committing all their
  inputs is ``uncommitted``: the member's next contribution is struck from its round's mean (the plan
  names it), as the leader strikes one that ships no inputs, so a member that never commits moves no
  mean after its first (an honest one that lost some inputs loses one contribution's weight).

* **Parts sent.** The opening also sketches each part the member sent, as its owner decoded it
  (``Opening.sent_parts``, with each part's range and digest): they must add up to ``sent``, and the
  coordinator's own part must be the slice it received (else ``misstated``: convicted, and the signed
  opening and slice posted to the stage-mates); one other part is drawn and checked with its owner
  (``sent_parts``). So a liar that opens its true contribution as the one it sent is caught.

Not done here (the single leader's only): striking the very contribution that names microbatches
without their inputs (the plan, which names the struck, came before it: the next one is struck
instead). A liar that opens false microbatch parts consistent with what it sent is caught when a
recomputation draws one (``recompute``). How many samples no microbatch
explains is the member's word here (the leader counts the rows of the shipped inputs; both rest on
the contributor's sample count): a member that says some were handed in escapes the extra bound.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgpack
import torch

from swarmd.dht.identity import Identity
from swarmd.pipeline.averaging.allreduce.plan import claim_digest
from swarmd.pipeline.averaging.trust.contribution_proofs import (
    TOLERANCE,
    OpeningEvidence,
    gap,
    read_opening,
    sign_opening,
    tolerance,
)
from swarmd.pipeline.averaging.trust.recomputation import extra_overrun
from swarmd.pipeline.stage.executor import Contribution

__all__ = ["ArAwaited", "judge", "opening_codec", "open_contribution", "round_digest"]


@dataclass(frozen=True)
class ArAwaited:
    """The opening a coordinator awaits from a member after a commit: of its contribution of ``step`` with
    claim digest ``claim``; the microbatches that contribution named and how many of its samples none of them
    explains (None: not checked, as under delayed updates or when the member did not say). For a
    recomputation (``recompute``): the digests of its microbatches' inputs it committed with part 0 (None: not
    checked), the commit's digest its seed hashes (``lead``), the coordinator's own parameters' digest at
    ``step``, where the member answers and the round's id."""

    step: int
    claim: str
    mbs: frozenset[int] | None = None
    unexplained: int | None = None
    ins: tuple[tuple[int, str], ...] | None = None
    lead: str = ""
    params: str = ""
    addr: str = ""
    round_id: str = ""
    # what the member sent, part by part (``sent_parts``): the round's part bounds and owners (peer id, address),
    # and the coordinator's own sketch of the member's slice of the part it owns, ``own_part`` (None: not checked)
    bounds: tuple[tuple[int, int], ...] = ()
    owners: tuple[tuple[str, str], ...] = ()
    own_part: int | None = None
    own_sketch: tuple[float, ...] | None = None
    own_frame: bytes | None = field(default=None, repr=False, compare=False)  # the member's signed frame of it


def round_digest(digests: tuple[str, ...]) -> str:
    """What stands for the coordinator's digest in an all-reduce member's seed: the commit's part digests."""
    return hashlib.sha256(msgpack.packb(list(digests), use_bin_type=True)).hexdigest()


def opening_codec(codecs: list[str]) -> str:
    """The codec an opening names (its tolerance): ``none`` when every part went exact, else the loosest."""
    lossy = [c for c in codecs if c != "none"]
    return max(lossy, key=tolerance) if lossy else "none"


def open_contribution(identity: Identity, *, stage: int, step: int, peer_id: str, coordinator: str,
                      digests: tuple[str, ...], claim: str, codec: str, own: Contribution,
                      decoded: torch.Tensor, numel: int, ins: tuple[tuple[int, str], ...] = (),
                      at: tuple[str, str] | None = None, bounds: tuple[tuple[int, int], ...] = (),
                      part_digests: tuple[str, ...] = ()) -> bytes:
    """A member's signed opening of ``own`` (sent as ``decoded``) after the commit of ``digests`` (off the
    loop: it sketches ``m + 2`` vectors); with the digests of its microbatches' inputs it committed
    (``ins``, in the order its opening lists them) and the parameters' digest and precision they ran at
    (``at``), signed for a recomputation (``recompute``); and, with its round's part ``bounds`` and its parts'
    digests as decoded (``part_digests``), the sketch of each part it sent (``sent_parts``)."""
    lead = round_digest(digests)
    signs = bool(ins) and at is not None
    per_part = bool(bounds) and len(part_digests) == len(bounds)
    return sign_opening(identity, stage=stage, step=step, peer_id=peer_id, leader=coordinator,
                        leader_digest=lead, digest=claim, codec=codec, parts=own.parts,
                        decoded=decoded, numel=numel, ins=[d for _, d in ins] if signs else (),
                        at=at if signs and at is not None else (), lead=lead if signs or per_part else "",
                        bounds=bounds if per_part else (), sent_digests=part_digests if per_part else ()).encode()


def judge(raw: bytes, *, stage: int, peer_id: str, coordinator: str, awaited: ArAwaited,
          grad_codec: str) -> tuple[str, str, OpeningEvidence | None]:
    """What ``peer_id``'s opening shows the coordinator that awaits it (``awaited``) in a swarm averaging
    with ``grad_codec``: ``(verdict, why, evidence)``, verdict ``ok``, ``other`` (an opening of another
    round: the one awaited is still owed), ``bad`` (unreadable, not its signature, other microbatches than
    its contribution named, or an extra term over its bound), ``inconsistent`` (convict; the evidence goes
    to the stage-mates), ``misstated`` (its sketch of the part this coordinator owns is not the slice it
    signed and sent here: convict, on this coordinator's own evidence) or ``uncommitted`` (sound, but its
    contribution named microbatches whose inputs it did not commit: its next contribution is struck, as the
    leader strikes one that ships no inputs); the evidence comes with ``ok``, ``inconsistent``, ``misstated``
    and ``uncommitted``. Pure."""
    verdict, why, opening = read_opening(raw, stage=stage, peer_id=peer_id, leader=coordinator, step=awaited.step,
                                         digest=awaited.claim)
    if opening is None or verdict != "ok":
        return verdict, why, None if opening is None else opening.evidence
    ev = opening.evidence
    if awaited.bounds:  # what it sent, part by part (``sent_parts``)
        if len(opening.sent_parts) != len(awaited.bounds):
            return "bad", "bad opening: it does not sketch each part it sent", None
        # (what the stage-mates check a conviction by: the round's ranges, and digests that hash to its claim)
        if opening.sent_bounds != awaited.bounds or claim_digest(opening.sent_digests) != ev.digest:
            return "bad", ("bad opening: its parts sent are not signed with the round's ranges and the digests its "
                           "claim hashes"), None
        sent_gap = opening.sent_parts_gap()
        if sent_gap > TOLERANCE:
            return "bad", f"bad opening: its parts sent sum {sent_gap:.3f} away from its contribution's sketch", None
        if awaited.own_part is not None and awaited.own_sketch is not None:
            part = opening.sent_parts[awaited.own_part]
            got = gap(part, (0.0,) * len(part), awaited.own_sketch)
            if not got <= TOLERANCE:  # (both sketch the slice as this owner decoded it: exact, whatever the codec)
                return "misstated", (f"unaccountable contribution: its opening sketches part {awaited.own_part} as "
                                     f"{got:.3f} away from the part it sent (signed) to this coordinator"), ev
    if awaited.mbs is not None and (len(set(opening.mbs)) != len(opening.mbs)
                                    or frozenset(opening.mbs) != awaited.mbs):
        return "bad", "bad opening: its microbatches are not those its contribution named", None
    uncommitted = False
    if awaited.ins is not None and opening.mbs:  # what a recomputation needs, committed before the commit
        committed = dict(awaited.ins)
        # (an honest member that lost one's inputs commits none: its next contribution is struck, not it excluded)
        uncommitted = set(committed) != set(opening.mbs)
        if not uncommitted and (opening.ins != tuple(committed[mb] for mb in opening.mbs) or len(opening.at) != 2
                or opening.lead != awaited.lead):
            return "bad", ("bad opening: it does not sign the inputs it committed, the parameters they ran at and "
                           "the commit's digest"), None
    if awaited.unexplained == 0:  # every sample a microbatch's: its extra can only be a codec's residual
        overrun = extra_overrun(ev.total, ev.extra, grad_codec)
        if overrun is not None:
            return "bad", overrun, None
    if uncommitted:
        return "uncommitted", ("its contribution named microbatches without committing their inputs (no "
                               "recomputation could draw them)"), ev
    return "ok", "", ev
