"""Contributions that keep pulling against their stage: scored every round, convicted on repeat.

Bounded influence (``swarmd.pipeline.averaging.trust.robust_aggregation``) keeps one poisoned contribution from
moving a round's mean by more than its bound; it does not stop a peer from spending that bound
every round (issue #29, item 4). "Secure Distributed Training at Scale" (Gorbunov et al., ICML
2022, section 3) pairs CenteredClip with accusations that ban a peer; this module is the
accusation a round's leader can make from the contributions alone, with no recomputation.

The scores of another peer's contribution ``i`` (per-sample mean ``g_i`` over ``n_i`` samples),
taken by a round's leader against its *own* contribution ``a`` over ``n_a`` samples, the one
gradient it knows to be honest (it computed it):

* **far**: ``||g_i - a|| / (||a|| * sqrt(1 + n_a / n_i))``. For honest peers the difference is
  noise, whose norm over ``n`` samples shrinks as ``1/sqrt(n)``: even when the gradients are all
  noise, ``||g_i - a||^2 ~ sigma^2 (1/n_i + 1/n_a)`` against ``||a||^2 >= sigma^2 / n_a``, so an
  honest ``far`` stays near 1 or below; a gradient scaled by -20 scores about 20 / sqrt(1 + n_a/n_i).
* **cos**: the cosine between ``g_i`` and ``a``. Honest peers' gradients of one loss are
  positively correlated in expectation (``E<g_i, a> = ||E g||^2 >= 0``); a sign-flipped one (or
  one scaled by -20) negatively.

Both scores use only the scored contribution and the leader's own: another liar cannot make an
honest contribution look far or opposed by where it puts its own (scores against the round's
robust mean could be steered that way: a contribution inside the clipping radius moves it).

A round is a **strike** against ``i`` when ``far > FAR_FACTOR`` or ``cos < -AGAINST_COS``. A struck
contribution is **dropped from that round's mean** (its samples still count toward the target, so
the round is not aborted for it: ``swarmd.pipeline.averaging.reduction``): a sign-flipped contribution
moves nothing, round after round. A peer is **convicted** (and excluded) when ``STRIKES`` of its
last ``WINDOW`` scored rounds were *far* strikes. Direction alone never convicts: an honest
peer's gradients point against its stage-mates' when a liar on the next stage feeds it negated
input gradients (the check-aware liar of issue #29's table, tripled and negated: in a 2x3 run two
honest stage-0 peers were convicted by direction, then excluded), and from the contributions alone
a victim cannot be told from a liar; such contributions are left out, which is what they deserve,
and their senders are not punished. The same holds for distance on any stage but the last: a liar on
the next stage that returns input gradients times -20 makes an honest peer's contributions far, so
only the last stage's leaders convict at all (``accuser.RoundAccuser.convicts``; earlier
stages strike and leave out). Why these numbers: in an honest
2x3 run of the ``tiny`` preset for 40 steps (``scripts/bench_verify.py``; ``swarmd.pipeline.averaging.averager``
logs each round's scores at DEBUG) the 163 scored contributions had ``far`` at most 1.28 and
``cos`` with median 0.64 but as low as -0.28 late in training, where the gradients grow noisy (5
below -0.05, two of them one peer's in a row): so a strike needs ``cos`` below -0.5, and
``far`` above 8. Both liars of issue #29's table score ``cos`` near -0.95 while training moves
(the first rounds: left out of the mean), the -20x one ``far`` of 8-20 as well (convicted). A single
heavy-tailed honest microbatch (round_checks' docstring: one honest contribution at 33x its
mates' norm) makes one strike (its gradient sits out one round), never four in six. What is not
caught: a liar that strikes less often than ``STRIKES`` in ``WINDOW`` (its influence stays
bounded by the clipping, and a struck contribution moves nothing), a sign flip once the
gradients are noise-dominated (honest cosines are then near 0 too, and the flip moves the mean
by little), a contribution scaled against the leader's by less than the far bound and pointing
at an angle under 120 degrees from it, a leader with no samples of its own in the round (nothing to
score against), and a liar that leads (docs/SECURITY.md).

**In the chunked all-reduce** (``swarmd.pipeline.averaging.allreduce``) no peer holds a whole
contribution: owner ``j`` holds slice ``j`` of every member's. Each owner scores every other member's
slice against its *own* slice (:func:`part_terms`: the per-sample sums the two scores are made of) and
reports them with its part; the coordinator adds the sums over the parts (:func:`combine_terms`) into
one :class:`Score` per member: the leader's score, with the reference ``a`` made of each owner's own
slice (``far`` = ``sqrt(sum_j ||g_ij - a_j||^2 / (1 + n_j / n_i)) / sqrt(sum_j ||a_j||^2)``, ``cos`` the
cosine of the concatenations). With one part it is :func:`score_round`'s, bit for bit up to float64
rounding. Summing, not averaging per-part scores, bounds what one lying owner does to an honest
member's ``far``: whatever slice ``x`` it takes for its own, its part adds at most ``2||g_j||^2 +
2||x||^2`` to the numerator and ``||x||^2`` to the denominator, so with the other parts honest the
honest member's ``far`` stays within a small constant (``tests/unit/test_hostile_contributions.py``);
a member's own part (it owns it) is not scored here, and neither is a part whose owner holds no samples.
The owner's reduction scores its own slice against the part's median instead (:func:`score_owner`):
struck, it is left out of that part's mean (every member owns a part, so a liar's own slice must not
be the reference its part is judged by), but that strike counts toward no conviction.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from swarmd.pipeline.averaging.trust.robust_aggregation import Contribution, weighted_median

__all__ = ["AGAINST_COS", "FAR_FACTOR", "STRIKES", "WINDOW", "HostileWatch", "PartTerms", "Score", "combine_terms",
           "part_terms", "score_against", "score_owner", "score_round"]

#: A contribution further than this from the leader's own, relative to the leader's norm and their
#: sample counts (the module docstring's ``far``), is a strike.
FAR_FACTOR = 8.0
#: A contribution whose cosine with the others' clipped mean is below minus this is a strike.
AGAINST_COS = 0.5
#: Convicted at this many strikes ...
STRIKES = 4
#: ... among its last this many scored rounds.
WINDOW = 6
@dataclass(frozen=True)
class Score:
    """One contribution's scores in one round (see the module docstring)."""

    far: float
    cos: float

    def strike(self) -> str | None:
        """Why this contribution is left out of this round's mean (None: it is not)."""
        if self.far > FAR_FACTOR:
            return self.far_strike()
        if self.cos < -AGAINST_COS:
            return f"cosine {self.cos:.3f} with the leader's own gradient (below -{AGAINST_COS:g})"
        return None

    def far_strike(self) -> str | None:
        """Why this round counts toward a conviction (None: it does not): only a far contribution does
        (see the module docstring's "Convicted")."""
        if self.far > FAR_FACTOR:
            return f"{self.far:.1f} times the honest distance from the leader's own gradient (over {FAR_FACTOR:g})"
        return None


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x))


def score_round(contributions: Sequence[Contribution], leader: str) -> dict[str, Score]:
    """Each other contribution's :class:`Score` against the ``leader``'s own; empty when the leader
    holds no samples or its gradient is zero. Pure; float64 throughout."""
    by_id = {c.peer_id: c for c in contributions if c.samples > 0}
    own = by_id.pop(leader, None)
    if own is None:
        return {}
    return score_against(by_id.values(), own.grads.detach().to(torch.float64) / own.samples, own.samples)


def score_against(contributions: Iterable[Contribution], reference: torch.Tensor, samples: int) -> dict[str, Score]:
    """Each contribution's :class:`Score` against a per-sample ``reference`` gradient standing for
    ``samples`` samples (:func:`score_round`'s, with the leader's own as the reference); empty when the
    reference is zero. Pure; float64 throughout."""
    a = reference.to(torch.float64)
    a_norm = _norm(a)
    if a_norm == 0:
        return {}
    out = {}
    for c in sorted((c for c in contributions if c.samples > 0), key=lambda c: c.peer_id):
        g = c.grads.detach().to(torch.float64) / c.samples
        g_norm = _norm(g)
        far = _norm(g - a) / (a_norm * math.sqrt(1 + samples / c.samples))
        cos = float(torch.dot(g, a)) / (g_norm * a_norm) if g_norm > 0 else 0.0
        out[c.peer_id] = Score(far=far, cos=cos)
    return out


def score_owner(contributions: Sequence[Contribution], owner: str) -> tuple[Score, torch.Tensor] | None:
    """An all-reduce part owner's own slice scored against the others' (``reduction``, ``score_own``): the
    :class:`Score` of the owner's slice against the coordinate-wise median of every slice of the part (each
    counted once, whatever its samples, the owner's included), and that median (per sample, float64). None
    with fewer than three slices holding samples (a median of two is either of them) or without the
    owner's. A liar owns a part as every member does; scored against its own slice alone, its lie would
    be the part's reference and the honest slices the ones left out."""
    holding = sorted((c for c in contributions if c.samples > 0 and c.grads is not None), key=lambda c: c.peer_id)
    own = next((c for c in holding if c.peer_id == owner), None)
    if own is None or len(holding) < 3:
        return None
    median = weighted_median([c.grads.detach().to(torch.float64) / c.samples for c in holding], [1.0] * len(holding))
    others = sum(c.samples for c in holding if c.peer_id != owner)
    scores = score_against([own], median, others)
    return (scores[owner], median) if owner in scores else None


@dataclass(frozen=True)
class PartTerms:
    """What one part adds to a member's :class:`Score` in a chunked all-reduce (module docstring), from
    per-sample slices ``g`` (the member's) and ``a`` (the part owner's own), over ``n_i`` and ``n_a`` samples."""

    dist2: float  # ||g - a||^2 / (1 + n_a / n_i)
    ref2: float  # ||a||^2
    dot: float  # <g, a>
    own2: float  # ||g||^2

    def to_wire(self) -> list[float]:
        return [self.dist2, self.ref2, self.dot, self.own2]

    @classmethod
    def from_wire(cls, value: object) -> PartTerms:
        """``ValueError`` unless four finite floats, the squares non-negative (remote input)."""
        if not (isinstance(value, (list, tuple)) and len(value) == 4
                and all(isinstance(x, float) and math.isfinite(x) for x in value)):
            raise ValueError("a part's score terms are four finite floats")
        dist2, ref2, dot, own2 = value
        if dist2 < 0 or ref2 < 0 or own2 < 0:
            raise ValueError("a part's squared norms are not negative")
        return cls(dist2, ref2, dot, own2)


def part_terms(contributions: Sequence[Contribution], owner: str) -> dict[str, PartTerms]:
    """Each other member's :class:`PartTerms` for one part, against the ``owner``'s own slice; empty
    when the owner holds no samples or its slice is zero. Pure; float64 throughout."""
    by_id = {c.peer_id: c for c in contributions if c.samples > 0}
    own = by_id.pop(owner, None)
    if own is None:
        return {}
    a = own.grads.detach().to(torch.float64) / own.samples
    ref2 = float(torch.dot(a, a))
    if ref2 == 0:
        return {}
    out = {}
    for pid, c in sorted(by_id.items()):
        g = c.grads.detach().to(torch.float64) / c.samples
        d = g - a
        out[pid] = PartTerms(dist2=float(torch.dot(d, d)) / (1 + own.samples / c.samples), ref2=ref2,
                             dot=float(torch.dot(g, a)), own2=float(torch.dot(g, g)))
    return out


def combine_terms(parts: Iterable[Mapping[str, PartTerms]]) -> dict[str, Score]:
    """Each member's :class:`Score` from the parts' terms (module docstring): the leader's scores with
    the owners' own slices, concatenated, as the reference. Members no part scored are left out."""
    sums: dict[str, list[float]] = {}
    for terms in parts:
        for pid, t in terms.items():
            acc = sums.setdefault(pid, [0.0, 0.0, 0.0, 0.0])
            acc[0] += t.dist2
            acc[1] += t.ref2
            acc[2] += t.dot
            acc[3] += t.own2
    out = {}
    for pid, (dist2, ref2, dot, own2) in sorted(sums.items()):
        if ref2 <= 0:
            continue
        far = math.sqrt(dist2 / ref2)
        cos = dot / math.sqrt(own2 * ref2) if own2 > 0 else 0.0
        out[pid] = Score(far=far, cos=max(-1.0, min(1.0, cos)))
    return out


class HostileWatch:
    """Each peer's strikes over its last ``window`` scored rounds; convicts at ``strikes`` of them.

    Bounded to ``max_peers`` peers (the least recently scored forgotten first)."""

    def __init__(self, *, window: int = WINDOW, strikes: int = STRIKES, max_peers: int = 1024) -> None:
        if not 1 <= strikes <= window:
            raise ValueError("strikes must be between 1 and the window")
        self.window = window
        self.strikes = strikes
        self.max_peers = max_peers
        self._history: dict[str, deque[str | None]] = {}

    def observe(self, scores: Mapping[str, Score]) -> dict[str, str]:
        """Record one round's scores; the peers convicted by it (peer id -> why). A convicted peer's
        history starts afresh (its exclusion is the daemon's business; the evidence shown to its
        stage-mates, ``swarmd.pipeline.averaging.trust.accusations``)."""
        convicted = {}
        for pid, score in sorted(scores.items()):
            history = self._history.pop(pid, None) or deque(maxlen=self.window)
            history.append(score.far_strike())
            self._history[pid] = history
            strikes = [why for why in history if why is not None]
            if len(strikes) >= self.strikes:
                convicted[pid] = (f"{len(strikes)} of its last {len(history)} contributions struck "
                                  f"({strikes[-1]})")
                del self._history[pid]
        while len(self._history) > self.max_peers:
            self._history.pop(next(iter(self._history)))
        return convicted

    def strikes_of(self, peer_id: str) -> int:
        """Strikes in ``peer_id``'s current window."""
        return sum(1 for why in self._history.get(peer_id, ()) if why is not None)
