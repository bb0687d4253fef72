"""The last stage's openings in the chunked all-reduce (``swarmd.pipeline.averaging.trust.openings`` is the
single leader's; ``contribution_proofs`` has the opening and its checks).

The rule here: **the round's coordinator checks the openings, as the leader does**, with what it
can check without the members' gradients (it holds one part of each):

* **Member.** After applying a commit, a last-stage member signs an
  :class:`~swarmd.pipeline.averaging.trust.contribution_proofs.Opening` of its contribution: its
  microbatches' sketches, what no microbatch explains, and the contribution as its owners decoded
  it (its parts, concatenated), under a seed that hashes the commit's part digests (fixed only
  once every member sent its parts) and its own signed claim's digest (``plan.claim_digest``).
  It rides to the same coordinator with the member's next report (``ArReport.opening``).
* **Coordinator.** At each commit it awaits an opening from every member whose signed claim it
  kept (``member``: claims checked against every part's ``used`` list). An opening that comes is
  checked (:func:`judge`): signed by the member, for this coordinator, of the awaited step and
  claim; then **consistent**: its contribution's sketch is the sum of its parts' (``inconsistency``,
  which anyone can check). An inconsistent one convicts its sender exactly as the leader's does
  (``hostile: unaccountable contribution ...``, excluded, the opening posted to the stage-mates,
  which second it: ``accuser``); a bad one (unreadable, badly signed) excludes it as ``bad_opening``.

Not done here (the single leader's only, for now): that the opening's ``sent`` sketch is the sketch
of the contribution the owners received (needs every owner to sketch its slices under the member's
seed, known only after the commit), the recomputation of a sampled microbatch
(``recomputation``), and striking a contribution whose sender owes an opening. So a liar that opens
its true microbatches and signs the sketch of its *true* contribution while sending another is
not caught by its opening in the all-reduce; one that sends a sign-flipped contribution and opens
what it sent is (``tests/adversarial/test_averaging_robust.py``).
"""

from __future__ import annotations

import hashlib

import msgpack
import torch

from swarmd.dht.identity import Identity
from swarmd.pipeline.averaging.trust.contribution_proofs import (
    OpeningEvidence,
    read_opening,
    sign_opening,
    tolerance,
)
from swarmd.pipeline.stage.executor import Contribution

__all__ = ["judge", "opening_codec", "open_contribution", "round_digest"]


def round_digest(digests: tuple[str, ...]) -> str:
    """What stands for the coordinator's digest in an all-reduce member's seed: the commit's part digests."""
    return hashlib.sha256(msgpack.packb(list(digests), use_bin_type=True)).hexdigest()


def opening_codec(codecs: list[str]) -> str:
    """The codec an opening names (its tolerance): ``none`` when every part went exact, else the loosest."""
    lossy = [c for c in codecs if c != "none"]
    return max(lossy, key=tolerance) if lossy else "none"


def open_contribution(identity: Identity, *, stage: int, step: int, peer_id: str, coordinator: str,
                      digests: tuple[str, ...], claim: str, codec: str, own: Contribution,
                      decoded: torch.Tensor, numel: int) -> bytes:
    """A member's signed opening of ``own`` (sent as ``decoded``) after the commit of ``digests`` (off the
    loop: it sketches ``m + 2`` vectors)."""
    return sign_opening(identity, stage=stage, step=step, peer_id=peer_id, leader=coordinator,
                        leader_digest=round_digest(digests), digest=claim, codec=codec, parts=own.parts,
                        decoded=decoded, numel=numel).encode()


def judge(raw: bytes, *, stage: int, peer_id: str, coordinator: str, step: int,
          claim: str) -> tuple[str, str, OpeningEvidence | None]:
    """What ``peer_id``'s opening shows the coordinator that awaits the opening of its contribution of
    ``step`` with claim digest ``claim``: ``(verdict, why, evidence)``, verdict ``ok``, ``other`` (an
    opening of another round: the one awaited is still owed), ``bad`` (unreadable or not its signature)
    or ``inconsistent`` (convict; the evidence goes to the stage-mates). Pure."""
    verdict, why, opening = read_opening(raw, stage=stage, peer_id=peer_id, leader=coordinator, step=step,
                                         digest=claim)
    return verdict, why, None if opening is None else opening.evidence
