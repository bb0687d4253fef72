"""Fair shares of one step's batch among the trainers that ask for it (max-min fairness, by microbatch).

Several trainers share each step of the first stage through its lease book
(``swarmd.pipeline.reservations``). Granted first come, first served, the trainer whose request
happens to arrive first after a step opens takes as much of the step as its window allows: with a
window as large as the step (or several trainers whose windows together exceed it) one trainer
takes whole steps and another may get nothing for many steps in a row (seen: 0 samples in all 6
steps of a run on a loaded machine): its data, its links and its share of the work sat idle.

So a grant is cut to the asker's *fair share* of what is still free, computed here by water-filling
in microbatches: the claimant holding the fewest samples of the step gets the next microbatch
(its own size, the last one cut to what is free), until the step is spoken for or every claimant
has what it asked for. Ties go to the claimant granted the fewest samples so far (then the smaller
id), so the step's spare microbatch goes round, and when there are more claimants than
microbatches in a step, those left out of one step come first in the next. Pure: the book says
who claims what; the clock and the lease bookkeeping stay there.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Claim", "fair_shares"]


@dataclass(frozen=True)
class Claim:
    """One trainer's claim on the step: the samples of its leases of the step (``has``), the samples
    more it asked for and was not granted (``wants``, at its last request), its microbatch ``size``,
    and the samples the book granted it so far (``credit``: the tie rule)."""

    trainer: str
    has: int
    wants: int
    size: int
    credit: int = 0


def fair_shares(claims: Sequence[Claim], free: int, *, max_grants: int | None = None) -> dict[str, int]:
    """The samples each claimant may still be granted of ``free`` (the step's samples no lease or
    held sample accounts for), by max-min fairness over what each claimant holds and asks for.

    At most ``max_grants`` microbatches are shared out (the book's bound on its leases), which also
    bounds the work: one heap operation per microbatch."""
    shares = {c.trainer: 0 for c in claims}
    heap = [(c.has, c.credit, c.trainer, i) for i, c in enumerate(claims) if c.wants > 0 and c.size > 0]
    heapq.heapify(heap)
    grants = 0
    while heap and free > 0 and (max_grants is None or grants < max_grants):
        held, credit, trainer, i = heapq.heappop(heap)
        claim = claims[i]
        samples = min(claim.size, free, claim.wants - shares[trainer])
        shares[trainer] += samples
        free -= samples
        grants += 1
        if shares[trainer] < claim.wants:
            heapq.heappush(heap, (held + samples, credit, trainer, i))
    return shares
