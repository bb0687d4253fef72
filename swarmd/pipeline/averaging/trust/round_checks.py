"""Averaging that checks its inputs and its leader (issue #17, item 2): the pure decisions.

SWARM (section 3.2) all-reduces a stage's gradients among peers it assumes honest. In an open
swarm a member may send a poisoned contribution (scaled, noisy, or non-finite gradients; zeros
under an inflated sample count) or, as a round's leader, answer with a mean it made up. This
module decides, from numbers only (no I/O, no clock but the one injected), what
``swarmd.pipeline.averaging.averager`` refuses:

**The leader refuses outlier contributions.** For each contribution with samples it takes the
L2 norm of its per-sample mean gradient, ``r_j = ||G_j|| / n_j``, and compares it with a
reference: the median of the round's ``r_j`` (:func:`reference`); with an even count, of the two
middle values the leader's own if it is one of them, else their geometric mean, so that with two
peers the leader trusts its own gradients (it computed them) and a 2-peer round cannot be
captured by the other peer. A contribution is an outlier when ``r_j`` lies outside
``[ref / bound, ref * bound]`` with ``bound = OUTLIER_FACTOR * sqrt(max(n_j, n_ref) / min(n_j,
n_ref))``. Why that bound: ``r_j`` is the norm of a mean of ``n_j`` per-sample gradients; the
signal part of that norm does not depend on ``n_j`` and the noise part shrinks as ``1/sqrt(n_j)``,
so two honest peers' ``r`` differ by at most ``sqrt`` of their sample-count ratio, times the
estimation noise of a norm over hundreds of thousands of coordinates (a few percent). The 8-bit
codec changes a gradient's norm by well under 1 % in practice (``swarmd.net.codecs``: at most
``EIGHT_BIT_REL_ERROR`` of each block's absmax per value). But per-sample gradients are heavy-
tailed: at initialisation two honest 1-sample microbatches of the tiny model differ by up to 2.5x,
yet in a real 60-step run (``tests/integration/test_migration.py``, step 14, codec none, identical parameters)
one honest 4-sample contribution had 33x the per-sample norm of its stage-mates' 4- and 8-sample
ones, and a factor of 4 refused it and stalled the stage. ``OUTLIER_FACTOR = 64`` leaves about
twice that margin: the rule refuses *gross* poisoning (scaled by 64x or more against as many
samples, noise of that size, zeros or a gradient shrunk as much, e.g. by claiming 64x the
samples it holds); poisoning within that band is not detected here (the optimizer's clipping
bounds its effect, and docs/SECURITY.md says so). 8-bit encoding moved a norm by at most 0.15 %.
Non-finite gradients never get here: the data plane refuses them while decoding (422).

**Contributors check the leader's answer** (:func:`check_answer`). The leader publishes, for
every contribution it used, ``(peer id, samples, digest, r)``; the digest is the SHA-256 of the
float32 bytes as the leader decoded them (:func:`tensor_digest`), the same bytes the
contributor can compute from what it sent. A contributor refuses the answer when:

- its own contribution is not listed exactly (digest and samples), or a peer is listed twice,
  or the samples listed do not sum to the round's total;
- the listed norms fail the leader's own outlier rule (a leader cannot inflate the others'
  norms to hide a big mean without making the contributor's own entry an outlier);
- the mean ``m`` leaves the box that holds every mean the leader may take: the plain weighted
  mean, and the robust one (``swarmd.pipeline.averaging.trust.robust_aggregation``, issue #29), both lie in every
  coordinate between the contributions' smallest and largest value (CenteredClip starts at their
  coordinate-wise median and each iteration is a convex combination of its point and the
  contributions). So ``|m_k| <= max_j |g_jk|`` and ``|m_k - g_ik| <= max_j |g_jk - g_ik|``, which
  give ``||m||^2 <= sum_j r_j^2`` and ``||m - g_i||^2 <= sum_{j != i} (r_j + r_i)^2`` over the
  contributions with samples, with a slack for the codec of the answer (:data:`ANSWER_SLACK`).
  An honest leader never fails it, and a lying one is held to a mean no larger than the published
  (and self-checked) norms allow. These bounds are looser than the weighted mean's triangle
  inequality (``||m|| <= sum_j w_j r_j``, used before the robust mean) by up to ``sqrt(n)``: the
  price of letting the leader clip. A lie inside them (e.g. a sign flip in a noise-dominated
  round) is not detected here; the optimizer's clipping bounds its effect, and SECURITY.md says so.

A refused answer is not applied: the contributor keeps its gradients (and their samples) for
the next round, and the leader is excluded from leading for a growing period
(:class:`Suspicions`). A refused contribution's sender is excluded from the leader's rounds
the same way.

**Contributors bound a stalling leader** (:class:`StallWatch`). A leader can also answer every
contribution ``aborted`` (or refuse them as outliers it made up): nothing it answers is wrong,
but its stage never steps while its id is the smallest. A contributor asks only while its own
view holds the batch and the leader does not exclude it; a leader that keeps answering
``aborted`` at one step for ``patience_s`` (twice the averaging timeout: an honest round aborts
once when a contributor dies, and the next one goes without it) is accused like a refused one.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.finite import all_finite

__all__ = [
    "ANSWER_SLACK",
    "OUTLIER_FACTOR",
    "StallWatch",
    "Suspicions",
    "Used",
    "allowed_ratio",
    "check_answer",
    "outliers",
    "per_sample_norm",
    "reference",
    "tensor_digest",
    "whole_norms",
]

OUTLIER_FACTOR = 64.0
#: Relative slack on the answer's norm bounds, by the codec the mean travels with. ``none``:
#: float32 rounding of the mean. Lossy codecs: the mean's own encoding error; for ``8bit`` the
#: documented worst case per 4096-value block is ``EIGHT_BIT_REL_ERROR * sqrt(4096) ~= 0.45`` of
#: the block's norm, so 0.5 never refuses an honest leader.
#: ``4bit``: at most ``sqrt(64) / 15 ~= 0.53`` of a 64-value block's norm (``swarmd.net.codecs``).
#: ``3bit`` / ``2bit``: at most ``sqrt(128) / 7 ~= 1.62`` / ``sqrt(128) / 3 ~= 3.77`` of a 128-value
#: block's norm (their documented worst cases; typically 0.23 / 0.55). ``5level``: at most
#: ``five_level_bound(64) ~= 0.84`` of a 64-value block's norm (typically 0.34). ``auto``: the answer
#: may come in any codec of ``codec_choice.LADDER``, so the slack of its lossiest (``5level``).
ANSWER_SLACK = {"none": 1e-3, "fp16": 1e-2, "bf16": 2e-2, "8bit": 0.5, "4bit": 0.6, "3bit": 1.7, "2bit": 3.8,
                "5level": 0.9, "auto": 0.9}


@dataclass(frozen=True)
class Used:
    """One contribution a leader used, as its answer publishes it."""

    peer_id: str
    samples: int
    digest: str  # tensor_digest of its gradients as decoded by the leader; "" with no gradients
    norm: float  # per_sample_norm: ||grads|| / samples (0.0 with no samples)

    def to_wire(self) -> list[Any]:
        return [self.peer_id, self.samples, self.digest, self.norm]

    @classmethod
    def from_wire(cls, value: Any) -> Used:
        """Validate one entry of a leader's answer (remote input): ``ValueError`` when malformed."""
        if not isinstance(value, (list, tuple)) or len(value) != 4:
            raise ValueError("a used contribution is [peer_id, samples, digest, norm]")
        pid, samples, digest, norm = value
        if not isinstance(pid, str) or not 0 < len(pid) <= 64:
            raise ValueError("a used contribution's peer id must be a short string")
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
            raise ValueError("a used contribution's samples must be a non-negative integer")
        if not isinstance(digest, str) or len(digest) not in (0, 64):
            raise ValueError("a used contribution's digest must be 64 hex characters or empty")
        if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not math.isfinite(norm) or norm < 0:
            raise ValueError("a used contribution's norm must be a finite non-negative number")
        return cls(pid, samples, digest, float(norm))


def tensor_digest(grads: torch.Tensor | None) -> str:
    """SHA-256 of a flat float32 tensor's bytes ("" for None): what contributor and leader compare."""
    if grads is None:
        return ""
    t = grads.detach().to(torch.float32).contiguous().cpu()
    return hashlib.sha256(t.numpy().data).hexdigest()  # no copy: the tensor is contiguous


def per_sample_norm(grads: torch.Tensor | None, samples: int) -> float:
    """``||grads|| / samples`` in float64 (0.0 without gradients or samples)."""
    if grads is None or samples <= 0:
        return 0.0
    return float(torch.linalg.vector_norm(grads.to(torch.float64))) / samples


def allowed_ratio(n_a: int, n_b: int) -> float:
    """How far apart two honest per-sample norms over ``n_a`` and ``n_b`` samples may lie."""
    lo, hi = sorted((max(1, n_a), max(1, n_b)))
    return OUTLIER_FACTOR * math.sqrt(hi / lo)


def reference(entries: Mapping[str, tuple[float, int]], leader: str) -> tuple[float, int] | None:
    """The median ``(norm, samples)`` of the contributions with samples; with an even count the
    leader's own if it is one of the two middle ones, else their geometric mean (and the smaller
    sample count). None when no contribution has samples."""
    ranked = sorted(((norm, n, pid) for pid, (norm, n) in entries.items() if n > 0), key=lambda e: (e[0], e[2]))
    if not ranked:
        return None
    k = len(ranked)
    if k % 2:
        norm, n, _ = ranked[k // 2]
        return norm, n
    a, b = ranked[k // 2 - 1], ranked[k // 2]
    for norm, n, pid in (a, b):
        if pid == leader:
            return norm, n
    return math.sqrt(a[0] * b[0]), min(a[1], b[1])


def outliers(entries: Mapping[str, tuple[float, int]], leader: str) -> dict[str, str]:
    """The contributions (peer id -> why) whose per-sample norm is too far from the reference.

    ``entries``: peer id -> (per-sample norm, samples); contributions without samples are never
    outliers (they carry no gradients). A zero reference (every gradient zero) refuses nothing.
    """
    ref = reference(entries, leader)
    if ref is None or ref[0] <= 0.0:
        return {}
    ref_norm, ref_n = ref
    out = {}
    for pid, (norm, n) in sorted(entries.items()):
        if n <= 0:
            continue
        bound = allowed_ratio(n, ref_n)
        if norm > ref_norm * bound:
            out[pid] = f"norm {norm:.3g} per sample is {norm / ref_norm:.1f}x the round's median {ref_norm:.3g}"
        elif norm * bound < ref_norm:
            ratio = ref_norm / norm if norm > 0 else math.inf
            out[pid] = f"norm {norm:.3g} per sample is 1/{ratio:.1f} of the round's median {ref_norm:.3g}"
    return out


def whole_norms(parts: Sequence[Mapping[str, tuple[float, int]]]) -> dict[str, tuple[float, int]] | None:
    """Each member's whole per-sample norm and samples from its slices' (peer id -> (per-sample norm of
    the slice, samples), one mapping per part of a chunked all-reduce, in part order): the root of the
    sum of the squares, as :func:`outliers` takes them. None when the parts name different members or
    sample counts (no whole to speak of). The coordinator (from the owners' ready reports) and every
    member (from the part means' used lists) sum the same floats in the same order: the same verdict."""
    if not parts:
        return None
    first = parts[0]
    squares = {pid: 0.0 for pid in first}
    for part in parts:
        if set(part) != set(first) or any(part[pid][1] != first[pid][1] for pid in part):
            return None
        for pid in sorted(part):
            squares[pid] += part[pid][0] ** 2
    return {pid: (math.sqrt(squares[pid]), first[pid][1]) for pid in sorted(first)}


def whole_outliers(whole: Mapping[str, tuple[float, int]], coordinator: str) -> dict[str, str]:
    """The outlier rule of a chunked all-reduce round on whole contributions (:func:`whole_norms`): the
    coordinator's own is never refused (it computed it), as a leader's own is not. The coordinator
    (``plan.decide``) and every member (before applying) ask it of the same sums: the same verdict."""
    return {pid: why for pid, why in outliers(whole, coordinator).items() if pid != coordinator}


def check_answer(
    *,
    own: Used,
    own_grads: torch.Tensor | None,
    mean: torch.Tensor,
    used: Sequence[Used],
    total: int,
    leader: str,
    codec: str,
    check_outliers: bool = True,
) -> str | None:
    """Why a contributor refuses the leader's ``ok`` answer (None: it applies it).

    ``own``: this contributor's entry as it computed it (digest and norm of its gradients as the
    leader decoded them: ``own_grads``); ``mean``: the decoded mean; ``used``: the leader's list.
    ``check_outliers``: False for one part of a chunked all-reduce, whose members check the whole
    contributions' norms (:func:`whole_norms`) instead: a part's slice of an honest gradient can lie far
    further from its stage-mates' than the whole does.
    """
    by_peer: dict[str, Used] = {}
    for u in used:
        if u.peer_id in by_peer:
            return f"the answer lists {u.peer_id[:12]} twice"
        by_peer[u.peer_id] = u
    listed = by_peer.get(own.peer_id)
    if listed is None:
        return "the answer does not list this peer's contribution"
    if listed.samples != own.samples or listed.digest != own.digest:
        return "the answer lists this peer's contribution with another digest or sample count"
    if sum(u.samples for u in used) != total:
        return f"the contributions listed sum to {sum(u.samples for u in used)} samples, not the round's {total}"
    if total <= 0:
        return "the round has no samples"
    listed_norms = {u.peer_id: (own.norm if u.peer_id == own.peer_id else u.norm, u.samples) for u in used}
    bad = outliers(listed_norms, leader) if check_outliers else {}
    if bad:
        pid, why = next(iter(bad.items()))
        return f"the answer lists {pid[:12]} although it is an outlier ({why})"
    if not all_finite(mean):
        return "the mean is not finite"
    slack = 1.0 + ANSWER_SLACK.get(codec, 0.5)
    m = mean.to(torch.float64)
    m_norm = float(torch.linalg.vector_norm(m))
    holding = [u for u in used if u.samples > 0]
    # the mean lies, coordinate by coordinate, between the contributions' smallest and largest value
    # (a weighted mean does, and so does the robust one: see the module docstring)
    bound = math.sqrt(sum(listed_norms[u.peer_id][0] ** 2 for u in holding))
    if m_norm > slack * bound + 1e-12:
        return f"the mean's norm {m_norm:.3g} exceeds what the contributions allow ({bound:.3g})"
    if own_grads is not None and own.samples > 0:
        dist = float(torch.linalg.vector_norm(m - own_grads.to(torch.float64) / own.samples))
        far = math.sqrt(sum((listed_norms[u.peer_id][0] + own.norm) ** 2
                            for u in holding if u.peer_id != own.peer_id))
        # the mean's own encoding error may add up to (slack - 1) * ||m|| to the distance
        if dist > far * (1.0 + 1e-3) + (slack - 1.0) * m_norm + 1e-12:
            return (f"the mean lies {dist:.3g} from this peer's gradient, "
                    f"beyond what the contributions allow ({far:.3g})")
    return None


class Suspicions:
    """Peers caught misbehaving in rounds, excluded for a period that doubles on every repeat.

    ``base_s * 2**(k-1)`` for the k-th offence, at most ``max_s`` (10 s, 20 s, ... 10 minutes);
    offences are remembered for ``memory_s`` after the exclusion ends, so a peer that lies again
    soon after coming back is excluded longer. Bounded to ``max_peers`` entries.
    """

    def __init__(self, *, base_s: float = 10.0, max_s: float = 600.0, memory_s: float = 3600.0,
                 max_peers: int = 1024, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.memory_s = memory_s
        self.max_peers = max_peers
        self.clock = clock
        self._entries: dict[str, tuple[int, float, str]] = {}  # peer id -> (offences, until, last reason)

    def accuse(self, peer_id: str, reason: str, *, base_s: float | None = None) -> float:
        """Record an offence; returns the exclusion's length in seconds. ``base_s``: a first offence's
        period for this kind of offence (default the watch's; it doubles on repeat all the same, and
        ``max_s`` does not cap it below ``base_s``)."""
        now = self.clock()
        count, until, old_reason = self._entries.pop(peer_id, (0, now, ""))
        if now > until + self.memory_s:
            count = 0
        count += 1
        base = self.base_s if base_s is None else base_s
        period = min(max(self.max_s, base), base * 2 ** (count - 1))
        # the reason shown is the one the exclusion lasts for: a lesser offence while a longer exclusion runs (a
        # contribution refused because a mate excluded the peer as hostile) does not relabel it
        self._entries[peer_id] = (count, max(until, now + period), reason if now + period >= until else old_reason)
        while len(self._entries) > self.max_peers:
            self._entries.pop(next(iter(self._entries)))
        return period

    def excluded(self) -> set[str]:
        now = self.clock()
        return {pid for pid, (_, until, _) in self._entries.items() if until > now}

    def offenders(self) -> set[str]:
        """Peers with an offence still remembered (excluded now, or within ``memory_s`` after)."""
        now = self.clock()
        return {pid for pid, (_, until, _) in self._entries.items() if now <= until + self.memory_s}

    def is_excluded(self, peer_id: str) -> bool:
        entry = self._entries.get(peer_id)
        return entry is not None and entry[1] > self.clock()

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {pid: {"offences": n, "excluded_for_s": round(until - now, 1), "reason": why}
                for pid, (n, until, why) in self._entries.items() if until > now}


class StallWatch:
    """Aborted answers of each leader at one step, since the first with no ``ok`` in between (see
    the module docstring). Bounded to ``max_peers`` leaders; ``clock`` injected for tests."""

    def __init__(self, *, max_peers: int = 1024, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_peers = max_peers
        self.clock = clock
        self._since: dict[str, tuple[int, float]] = {}  # leader -> (step, first aborted answer there)

    def aborted(self, leader: str, step: int, patience_s: float) -> float | None:
        """Record an aborted answer of ``leader`` at ``step``: how long it has stalled once that is
        ``patience_s`` or more (and it starts afresh), else None."""
        now = self.clock()
        since = self._since.get(leader)
        if since is None or since[0] != step:
            self._since.pop(leader, None)
            self._since[leader] = (step, now)
            while len(self._since) > self.max_peers:
                self._since.pop(next(iter(self._since)))
            return None
        if now - since[1] >= patience_s:
            del self._since[leader]
            return now - since[1]
        return None

    def answered(self, leader: str) -> None:
        """``leader`` answered ``ok``: not stalling."""
        self._since.pop(leader, None)
