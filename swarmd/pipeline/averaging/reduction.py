"""A round's reduction on its leader: refuse outliers, take the robust mean, score and convict.

The pure part of ``StageAverager``'s reduction (SWARM section 3.2's all-reduce, done by one
leader), in the order it runs:

1. **Outliers** (``round_checks.outliers``): contributions whose per-sample norm lies outside the
   64x band are refused; the leader never refuses its own.
2. **Bounded influence** (``robust_aggregation.robust_mean``): the sample-weighted CenteredClip of
   the contributions with samples, when there are three or more; with two, the plain mean, bounded
   by step 3's scoring and the outlier band (``robust_aggregation`` says why). When it clipped nobody
   in any iteration (an honest round, as a rule) the mean is the plain float64 sum in peer-id
   order divided by the samples, bit for bit what it was before the robust rule; otherwise it is
   the CenteredClip result, within the bound of ``robust_aggregation``'s docstring of what the
   honest contributions alone would give.
3. **Consequences** (``hostile_contributions``): every other contribution is scored against the
   leader's own; a struck one (far from it, or pointing against it) is left out of this round's
   mean while its samples still count toward the target, so the round is never aborted for it
   and its sender applies the mean like everyone. A peer struck as *far* ``STRIKES`` times in its
   last ``WINDOW`` rounds is convicted (direction alone never convicts: see there): its
   contribution is turned away when the others still hold the target (its sender keeps it), else
   counted and left out as a struck one. The caller excludes the peer (``round_checks.Suspicions``,
   ``HOSTILE_EXCLUSION_S``) and shows its stage-mates the evidence (``accuser``). A part's owner in
   the chunked all-reduce scores its own slice too (``score_own``): every member owns a part, so a
   liar's own slice must not be the one its part is judged by. A part with two slices holding samples
   has no median to tell which of them lies: each is scored against the other, and when either is
   struck both are (the part moves nothing that round, its samples counted), so neither a liar owner's
   own slice nor a liar member's is the part's mean (a -20x own slice was, in a third of a liar's parts).

Deterministic: contributions are taken in peer-id order and reduced in float64, so the mean does
not depend on arrival order; the leader computes it once and every peer applies that answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from swarmd.finite import all_finite
from swarmd.pipeline.averaging.trust.hostile_contributions import (
    HostileWatch,
    Score,
    score_against,
    score_owner,
    score_round,
)
from swarmd.pipeline.averaging.trust.refusals import Refusal
from swarmd.pipeline.averaging.trust.robust_aggregation import Contribution as Weighted
from swarmd.pipeline.averaging.trust.robust_aggregation import RobustMean, robust_mean
from swarmd.pipeline.averaging.trust.round_checks import Used, outliers, per_sample_norm
from swarmd.pipeline.stage.executor import Contribution

__all__ = ["HOSTILE_EXCLUSION_S", "Reduction", "plain_mean", "reduce_contributions"]

#: How long a peer convicted of hostile contributions is first excluded (it doubles on repeat, as the
#: trainers' reports' exclusions do: ``swarmd.pipeline.reports``).
HOSTILE_EXCLUSION_S = 600.0


@dataclass
class Reduction:
    """What a leader's reduction decided. ``mean`` None: the round is aborted (``total`` short of the
    target, or a mean that is not finite)."""

    total: int
    mean: torch.Tensor | None
    used: tuple[Used, ...]
    refused: dict[str, Refusal] = field(default_factory=dict)  # turned away (outliers, dropped convicts), and why
    refused_samples: int = 0
    clipped: tuple[str, ...] = ()  # contributions whose influence the robust mean cut
    convicted: dict[str, str] = field(default_factory=dict)  # peers convicted by this round, and why
    scores: dict[str, Score] = field(default_factory=dict)
    robust: bool = False  # the mean is CenteredClip's, not the plain one
    struck: tuple[str, ...] = ()  # contributions counted for their samples but left out of the mean
    moved: float = 0.0  # |mean - plain mean| / |plain mean| when the rule changed the mean (robust or struck)


def plain_mean(contributions: Mapping[str, Contribution], numel: int, total: int) -> torch.Tensor:
    """The sample-weighted mean in float64, summed in peer-id order, as float32. Every contribution
    is finite float32 and carries at least one sample per gradient it sums, so the mean is bounded by
    the largest contribution: float32 sums of huge finite gradients could overflow to Inf, this cannot."""
    summed = torch.zeros(numel, dtype=torch.float64)
    for pid in sorted(contributions):
        grads = contributions[pid].grads
        if grads is not None:
            summed += grads
    return (summed / total).to(torch.float32)


def _robust(contributions: Mapping[str, Contribution]) -> RobustMean | None:
    weighted = [Weighted(pid, c.grads, c.samples) for pid, c in sorted(contributions.items())
                if c.samples > 0 and c.grads is not None]
    if len(weighted) >= 3:
        return robust_mean(weighted)
    return None


def _pair_disagrees(weighted: list[Weighted], owner: str, scores: Mapping[str, Score]) -> bool:
    """A part of two slices holding samples, the owner's one of them: whether either is struck against the other
    (the other's score against the owner's own is in ``scores``; the owner's against the other's is taken here)."""
    if len(weighted) != 2 or owner not in {w.peer_id for w in weighted}:
        return False
    own, other = sorted(weighted, key=lambda w: w.peer_id != owner)
    if other.peer_id in scores and scores[other.peer_id].strike() is not None:
        return True
    back = score_against([own], other.grads.detach().to(torch.float64) / other.samples, other.samples)
    return owner in back and back[owner].strike() is not None


def reduce_contributions(contributions: Mapping[str, Contribution], digests: Mapping[str, str], *, leader: str,
                         target: int, numel: int, watch: HostileWatch | None = None,
                         score: bool = False, strike: frozenset[str] = frozenset(),
                         strike_own: bool = False, score_own: bool = False) -> Reduction:
    """Reduce one round's ``contributions`` (peer id -> contribution; ``digests``: of their gradients as
    decoded here) on its ``leader`` (see the module docstring). ``watch``: the leader's strikes,
    updated by this round (None: no convictions, and no scoring unless ``score``: a part's owner of the
    chunked all-reduce leaves struck slices out but convicts nobody). ``strike``: contributions to leave
    out of the mean whatever their scores (their senders owe an opening: ``openings``); never the leader's
    own, unless ``strike_own`` (an all-reduce part's owner may owe its coordinator an opening).
    ``score_own`` (an all-reduce part's owner, with ``score``): the leader's own contribution is scored
    too, against the coordinate-wise median of all of them (``hostile_contributions.score_owner``, three
    or more with samples); struck, it is left out like any struck one and the others are scored against
    that median instead of against it. Pure but for ``watch``; call it off the event loop."""
    kept = dict(contributions)
    refused: dict[str, Refusal] = {}
    refused_samples = 0
    norms = {pid: per_sample_norm(c.grads, c.samples) for pid, c in kept.items()}
    bad = outliers({pid: (norms[pid], c.samples) for pid, c in kept.items()}, leader)
    bad.pop(leader, None)  # the leader computed its own gradients: it does not refuse them
    for pid, why in bad.items():
        refused[pid] = Refusal("outlier", why)
        refused_samples += kept.pop(pid).samples
    scores: dict[str, Score] = {}
    convicted: dict[str, str] = {}
    struck: set[str] = set()
    nothing_moves = False  # (a part's two slices disagree: ``_pair_disagrees``)
    if watch is not None or score:
        weighted = [Weighted(pid, c.grads, c.samples) for pid, c in sorted(kept.items())
                    if c.samples > 0 and c.grads is not None]
        judged = score_owner(weighted, leader) if score_own else None
        if judged is not None and judged[0].strike() is not None:  # the owner's own slice is the one that lies
            own_struck = True
            scores = score_against([w for w in weighted if w.peer_id != leader], judged[1],
                                   sum(w.samples for w in weighted if w.peer_id != leader))
        else:
            own_struck = False
            scores = score_round(weighted, leader)
        struck = {pid for pid, score in scores.items() if score.strike() is not None}
        if own_struck and any(w.peer_id not in struck for w in weighted if w.peer_id != leader):
            struck.add(leader)  # (never all of the mean's samples)
        if score_own and judged is None and _pair_disagrees(weighted, leader, scores):
            struck = {w.peer_id for w in weighted}  # (two slices, one lies: the part moves nothing this round)
            nothing_moves = True
        convicted = watch.observe(scores) if watch is not None else {}
        total = sum(c.samples for c in kept.values())
        for pid, why in sorted(convicted.items()):
            samples = kept[pid].samples
            if total - samples >= target:  # the others hold the target: turned away, its sender keeps them
                refused[pid] = Refusal("hostile", why)
                refused_samples += samples
                total -= samples
                del kept[pid]
    unopened = (strike & set(kept)) - (set() if strike_own else {leader})
    if unopened and any(c.samples for pid, c in kept.items() if pid not in struck | unopened):
        struck |= unopened  # (never all of the mean's samples: a mean of nothing is no step)
    total = sum(c.samples for c in kept.values())
    used = tuple(Used(pid, c.samples, digests.get(pid, ""), norms[pid]) for pid, c in sorted(kept.items()))
    # struck contributions count their samples (the round is not aborted for them) but move nothing
    influential = {pid: c for pid, c in kept.items() if pid not in struck}
    robust = _robust(influential)
    out = Reduction(total, None, used, refused, refused_samples, robust.clipped if robust is not None else (),
                    convicted, scores, struck=tuple(sorted(struck & set(kept))))
    if total < target:
        return out
    if nothing_moves:
        out.mean = torch.zeros(numel, dtype=torch.float32)
    elif robust is None or robust.exact:
        out.mean = plain_mean(influential, numel, sum(c.samples for c in influential.values()))
    else:
        out.mean, out.robust = robust.mean, True
    if not all_finite(out.mean):  # cannot happen with finite contributions; never apply it
        out.mean = None
    elif out.robust or out.struck:  # how far the rule moved the mean from the plain one (for the log)
        plain = plain_mean(kept, numel, total).to(torch.float64)
        scale = float(torch.linalg.vector_norm(plain))
        out.moved = float(torch.linalg.vector_norm(out.mean.to(torch.float64) - plain)) / scale if scale else 0.0
    return out
