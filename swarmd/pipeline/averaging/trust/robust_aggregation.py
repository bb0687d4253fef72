"""Bounded influence in averaging: a sample-weighted CenteredClip over a round's contributions.

SWARM's peers of a stage average their accumulated gradients every step (Ryabinin et al., 2023,
section 3.2); a plain mean lets one contribution move it anywhere (a peer sending its gradient
times -20 ruined training, issue #29). "Secure Distributed Training at Scale" (Gorbunov,
Borzunov, Diskin, Ryabinin, ICML 2022, section 3: BTARD-SGD) aggregates with CenteredClip
(Karimireddy, He, Jaggi, ICML 2021) instead; this module is that rule, weighted by samples, as a
pure function (no I/O, no clock): the round's leader calls it, the others apply its answer.

The rule. Contribution ``i`` holds the gradient *sum* ``G_i`` over ``n_i`` samples; its mean is
``g_i = G_i / n_i`` and its weight ``w_i = n_i / sum(n)``. Start at ``v_0``, the weighted
coordinate-wise median of the ``g_i``; pick ``tau`` (default ``TAU_FACTOR`` times the lower
median of the distances ``|g_i - v_0|``, each contribution counted once: weighted by samples, a
peer holding half the samples would sit at distance 0 from ``v_0`` and make ``tau`` 0, so that
its gradient alone became the mean); then ``L`` times::

    v <- v + sum_i w_i * clip(g_i - v, tau),    clip(x, tau) = x * min(1, tau / |x|)

When every ``g_i`` lies within ``tau`` of ``v_0`` and of their weighted mean, every iteration gives
the plain weighted mean ``sum_i w_i g_i`` (an honest round's answer is the mean it always was, up
to float rounding); a contribution further away moves ``v`` by at most ``w_i tau`` per iteration.

The bound (tested with hypothesis in tests/unit/test_robust_aggregation.py). Take any contributions,
and one of them, ``j``, with less than half the samples (``w_j < 1/2``). Replace ``g_j`` by any
vector whatever its norm or direction, and let ``tau_a``, ``tau_b`` be the two runs' ``tau``. Then
the results differ by at most::

    D_j + L * (2 w_j max(tau_a, tau_b) + (1 - w_j) |tau_a - tau_b|)

where ``D_j`` is the norm of the per-coordinate range (max - min) of the *other* contributions.
With a fixed ``tau`` that is ``D_j + 2 L w_j tau``. Why: (1) a weighted median with ``w_j < 1/2`` lies
within the others' range in every coordinate, so ``v_0`` moves by at most ``D_j``; (2) one
iteration ``F(v) = v - grad Phi(v)``, with ``Phi`` the weighted sum of the Huber losses of the
distances, has a symmetric Jacobian with eigenvalues in ``[0, 1]``, so it never increases the
distance between two points; (3) changing ``g_j`` changes ``F`` by at most ``2 w_j tau``, and
changing ``tau`` by ``(1 - w_j) |tau_a - tau_b|`` for the others. And ``tau`` itself, the lower
median of three or more distances, stays within the range of the others' distances to ``v_0``. A liar
holding half a stage's samples or more is not bounded: a majority of a stage can do anything
(docs/SECURITY.md).

Two contributions. With two, neither is a majority by count, and a median of two is either of
them: :func:`robust_mean` cannot tell which one lies, so it is not used; a round of two takes the
plain mean, and what bounds it is the leader's scoring (``swarmd.pipeline.averaging.trust.hostile_contributions``:
a contribution far from the leader's own, or pointing against it, is left out). A clipped step
around the leader's own gradient (radius its norm) was tried and dropped: it moved honest 2-peer
means a median 13% of their norm in a third of the rounds, and ``--sync`` training is no longer
equal to single-process training then (``tests/integration/test_equivalence_bpe.py`` caught it).

Determinism. Contributions are taken in peer-id order and every sum runs in float64 in that
order, so the same contributions given in any order give a bit-identical result on one build.
Peers of a round agree because one leader computes and the others apply its answer
(``swarmd.pipeline.averaging.averager``), not because every build rounds the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CHUNK", "ITERATIONS", "TAU_FACTOR", "Contribution", "RobustMean", "influence_bound", "robust_mean"]

#: CenteredClip iterations: the bound grows with them (``2 L w_j tau``); the fixed point is
#: approached geometrically, and an honest round (all within ``tau``) is the mean after the first.
ITERATIONS = 3
#: The clipping radius, as a multiple of the weighted median distance of the contributions to
#: the coordinate-wise median: honest contributions' distances are alike, so 2x clips none of them.
TAU_FACTOR = 2.0
#: Coordinates handled at once by the median (bounds its memory: contributions x CHUNK x 8 bytes).
CHUNK = 1 << 20


@dataclass(frozen=True)
class Contribution:
    """One peer's part of a round: the gradient sum ``grads`` (flat) over ``samples`` samples."""

    peer_id: str
    grads: torch.Tensor
    samples: int


@dataclass(frozen=True)
class RobustMean:
    """The round's mean gradient per sample (float32, flat), the clipping radius used, the peers
    whose contribution was still further than ``tau`` from it (their influence was cut), and
    ``exact``: no contribution was clipped in any iteration, so ``mean`` is the plain weighted mean
    up to float64 rounding (a caller may then use its own plain sum, bit for bit what it was)."""

    mean: torch.Tensor
    tau: float
    clipped: tuple[str, ...]
    exact: bool = False


def _checked(contributions: Sequence[Contribution]) -> list[Contribution]:
    if not contributions:
        raise ValueError("a robust mean needs at least one contribution")
    ordered = sorted(contributions, key=lambda c: c.peer_id)
    ids = [c.peer_id for c in ordered]
    if len(set(ids)) != len(ids):
        raise ValueError("two contributions of one peer")
    shape = ordered[0].grads.shape
    for c in ordered:
        if c.samples <= 0:
            raise ValueError(f"contribution of {c.peer_id[:12]} holds no samples")
        if c.grads.dim() != 1 or c.grads.shape != shape:
            raise ValueError("contributions must be flat tensors of one size")
        if not bool(torch.isfinite(c.grads).all()):
            raise ValueError(f"contribution of {c.peer_id[:12]} is not finite")
    return ordered


def weighted_median(values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The per-coordinate weighted (lower) median of flat float64 ``values``: in each coordinate the
    smallest value at which the weights of the values up to it reach half the total."""
    w = torch.tensor(list(weights), dtype=torch.float64)
    half = float(w.sum()) / 2
    out = torch.empty_like(values[0])
    if len(set(weights)) == 1:
        # equal weights (a part's slices counted once each, or equal samples): the cumulative weights are the same
        # whatever the order, so the median is the k-th smallest value, k the rule's own, selected without a
        # sort (0.035 s against 0.1 s for a quarter of ``small``'s stage, n = 4); the same value (a zero's sign
        # among equal zeros aside)
        k = int((torch.cumsum(w, dim=0) >= half).to(torch.int8).argmax()) + 1
        for lo in range(0, values[0].numel(), CHUNK):
            out[lo:lo + CHUNK] = torch.kthvalue(torch.stack([v[lo:lo + CHUNK] for v in values]), k, dim=0).values
        return out
    for lo in range(0, values[0].numel(), CHUNK):
        # (chunk, n): a coordinate's values side by side in memory, sorted along the rows (twice as fast as
        # sorting the columns of (n, chunk): 0.07 s against 0.15 s for a quarter of ``small``'s stage, n = 4)
        block = torch.stack([v[lo:lo + CHUNK] for v in values], dim=1)
        ordered, index = torch.sort(block, dim=1, stable=True)
        cum = torch.cumsum(w[index], dim=1)
        pick = (cum >= half).to(torch.int8).argmax(dim=1, keepdim=True)
        out[lo:lo + CHUNK] = ordered.gather(1, pick)[:, 0]
    return out


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x))


def robust_mean(contributions: Sequence[Contribution], *, tau: float | None = None,
                iterations: int = ITERATIONS) -> RobustMean:
    """The sample-weighted CenteredClip of ``contributions`` (see the module docstring for the rule
    and the bound on one contribution's influence). ``tau``: the clipping radius (default: the
    rule's). Non-finite, empty, shapeless or sample-less contributions: ValueError (the caller's
    checks refuse them first, ``swarmd.pipeline.averaging.trust.round_checks``)."""
    if iterations < 1:
        raise ValueError("at least one iteration")
    ordered = _checked(contributions)
    total = sum(c.samples for c in ordered)
    weights = [c.samples / total for c in ordered]
    means = [c.grads.detach().to(torch.float64) / c.samples for c in ordered]
    v = weighted_median(means, weights)
    if tau is None:
        distances = sorted(_norm(g - v) for g in means)
        tau = TAU_FACTOR * distances[(len(distances) - 1) // 2]
    if tau < 0 or tau != tau:
        raise ValueError("tau must be a non-negative number")
    exact = True
    for _ in range(iterations):
        step = torch.zeros_like(v)
        for g, w in zip(means, weights, strict=True):
            d = g - v
            n = _norm(d)
            scale = w if n <= tau else w * tau / n
            exact = exact and n <= tau
            step.add_(d, alpha=scale)
        v = v + step
    clipped = tuple(c.peer_id for c, g in zip(ordered, means, strict=True) if _norm(g - v) > tau)
    return RobustMean(mean=v.to(torch.float32), tau=tau, clipped=clipped, exact=exact and not clipped)


def influence_bound(others: Sequence[Contribution], samples: int, tau_a: float, tau_b: float,
                    iterations: int = ITERATIONS) -> float:
    """How far replacing one contribution of ``samples`` samples (by anything) can move
    :func:`robust_mean` of it with ``others``, given the two runs' radii ``tau_a`` and ``tau_b``
    (the module docstring's bound; infinite when it holds half the samples or more)."""
    total = samples + sum(c.samples for c in others)
    w = samples / total
    if w >= 0.5 or not others:
        return float("inf")
    stacked = torch.stack([c.grads.detach().to(torch.float64) / c.samples for c in others])
    spread = _norm(stacked.max(dim=0).values - stacked.min(dim=0).values)
    return spread + iterations * (2 * w * max(tau_a, tau_b) + (1 - w) * abs(tau_a - tau_b))
