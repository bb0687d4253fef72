"""Why a stage-mate's averaging contribution was turned away: a kind and its detail.

A leader (or a part's owner in the chunked all-reduce) refuses a contribution for one of a few
reasons; the kind is what the averager counts (``contributions_refused`` in ``/status``, the
``reason`` label of ``/metrics``) and rate-limits its warnings by, the detail is for the log and the
round's record. Both travel as one string (``"kind: detail"``) in the all-reduce's part-ready reports
and an aborted round's reason; :meth:`Refusal.from_wire` reads one back, and an unknown kind from a
peer is ``other`` (remote input never creates a counter name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["Refusal", "RefusalKind"]

RefusalKind = Literal[
    "excluded",  # this stage excludes the sender for now (checks, silence, a conviction)
    "unsigned",  # an identity swarm: a contribution must be signed
    "bad_signature",  # the signature does not cover these gradients for this round
    "bad_norm",  # the per-sample norm it signed is not its gradients'
    "unproven",  # not a serving stage-mate whose proof this peer holds
    "outlier",  # its per-sample norm is outside the round's band
    "hostile",  # convicted of hostile contributions by the leader's scoring
    "nonfinite",  # NaN or Inf in its gradients (a 422 at the data plane)
    "malformed",  # a frame that does not decode as a contribution
    "bad_opening",  # an opening of its last contribution that only its leader can tell is false (contribution_proofs)
    "other",  # a peer's reason of a kind this build does not know
]
KINDS: frozenset[str] = frozenset(get_args(RefusalKind))


@dataclass(frozen=True)
class Refusal:
    kind: RefusalKind
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"

    @classmethod
    def from_wire(cls, text: str) -> Refusal:
        """A refusal as a peer wrote it (``str(refusal)``); remote input: any string is accepted."""
        kind, sep, detail = text.partition(": ")
        if sep and kind in KINDS:
            return cls(kind, detail)  # type: ignore[arg-type]  # checked against the Literal's values
        return cls("other", text)
