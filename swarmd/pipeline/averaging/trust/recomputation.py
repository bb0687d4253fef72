"""Recomputing one sampled microbatch of a contribution (issue #29, item 3, the second half).

An opening (``contribution_proofs``) shows that a contribution is the sum of its microbatches'
sketches, but those sketches are only claims: a peer that sends ``c' = c - 2 g_1`` (one microbatch's
gradient flipped) and opens ``p_1 = -R g_1`` is consistent. So its leader recomputes one microbatch.

**Inputs ride with the contribution.** A last-stage peer keeps the inputs of each microbatch it
counted (the activations it received and the targets, :class:`KeptInputs`: what its backward ran on,
bit for bit) and sends them with its contribution (``AverageRequest.inputs``: float32 bits as int32,
so no codec touches them), with the digest of the parameters they were computed at and the
precision it computes in. They are committed before the projection is fixed (its seed hashes the
leader's answer), so a peer cannot pick inputs whose gradient sketches to its lie.

**The leader samples and recomputes.** After its reduction and before it applies the mean, while
its parameters are those of the round's step (identical to the contributor's: an honest stage's
peers apply the same means; a claimed digest that differs is not recomputed), the leader draws one
of each contributor's shipped microbatches with its own secret randomness (:func:`sample`: the
contributor cannot tell which before it signs its parts), recomputes its parameter gradient on its
worker thread (:func:`recompute_gradient`: no ``.grad`` touched) under the contributor's precision,
and sketches it under the contribution's seed: ``K`` numbers kept per contributor. When the
opening comes, its part for that microbatch must be within :data:`RECOMPUTE_TOLERANCE`
(``contribution_proofs.gap``) of it, and its microbatches must be exactly those whose inputs came;
else the contributor is convicted (``openings``). A lie about one of ``m`` microbatches is
caught with probability ``1/m`` per round.

A contribution that names microbatches (``AverageRequest.mbs``) without shipping all their inputs is
struck from the mean (its samples count), as an unopened one is; one that names none has no microbatch
to recompute, and its opening must have no microbatch parts (what it holds is ``extra``).

**The extra term, bounded.** When every sample of a contribution is a shipped microbatch's (nothing was
handed in), what its opening's ``extra`` holds can only be a lossy codec's residual: its share
``||e|| / (||t|| + ||e||)`` must stay under :func:`extra_bound` (0.5 in a swarm whose codec leaves a small
residual; 0.9 under ``auto`` and the coarse codecs, whose honest residual reaches 0.6), else the opening
is ``bad`` (refused, the sender excluded from that leader's rounds for a while). Under 0.5, ``c = t + e``
has ``c . t >= 0``: a lie hidden in ``extra`` cannot turn the contribution against its microbatches.
With handed-in samples the extra is not bounded (a hand-over's gradients are the leaver's).

**What it costs.** The leader: one forward and backward of one microbatch per contributor per
round, on the round's critical path (before the answer), plus one sketch. The contributor: its
microbatches' inputs on the wire with every contribution (``4 * batch * seq * width`` bytes of
activations and ``8 * batch * seq`` of targets per microbatch), and memory for the inputs of the
microbatches of the current and last step. ``scripts/bench_recompute.py`` measures both.

**What it does not catch.** A peer that computes honest gradients of inputs it made up (the inputs
are the peer's word: only the trainer that sent them could vouch for them); a contribution whose
parameters' digest or precision differs from the leader's (not recomputed; counted ``unchecked``);
delayed updates (a microbatch may have been computed at the step before: not recomputed, nothing
shipped); fp16 (its loss scale is the peer's own).

**Seconded.** A mismatch is not the leader's word alone. The opening signs, with its parts, the
digest of each shipped microbatch's inputs (:func:`inputs_digest`), the parameters' digest and
precision they ran at, and the leader's digest the sketch's seed hashes; the leader refuses an opening
whose signed inputs, parameters or seed are not those it received (``openings``). On a mismatch it
posts its stage-mates the signed opening and the drawn microbatch's inputs (``POST /v1/recheck``,
``swarmd.net.messages.averaging.RecheckRequest``); a stage-mate checks the inputs against their signed
digest, recomputes that microbatch on its own parameters of the signed digest and sketches it under the
signed seed, and seconds when the signed part is more than :data:`RECOMPUTE_TOLERANCE` away
(:func:`recheck`): the leader is only the messenger, so it cannot frame an honest peer, whose parts
match. The conviction comes with the contributor's *next* contribution, when every peer has stepped
past the round's parameters: so a last-stage peer that ships inputs keeps a CPU copy of its
parameters from before each of its last :data:`PAST_PARAMS` updates (:class:`PastParams`: ``2 x 4 x
|stage parameters|`` bytes, one copy per step on the worker thread) to recompute at.

Pure except :class:`KeptInputs` and :class:`PastParams` (the executor's worker thread owns them).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from swarmd.pipeline.averaging.trust.contribution_proofs import gap
from swarmd.pipeline.stage.precision import autocast

__all__ = ["EXTRA_BOUND", "LOOSE_EXTRA_BOUND", "PAST_PARAMS", "RECOMPUTE_PRECISIONS", "RECOMPUTE_SHARE",
           "RECOMPUTE_TOLERANCE", "TIGHT_CODECS", "KeptInputs", "MicrobatchInputs", "PastParams", "draws",
           "extra_bound", "extra_overrun", "extra_share", "inputs_digest", "misstated_microbatch", "recheck",
           "recompute_gradient", "sample"]

T = TypeVar("T")

#: ``gap`` between a microbatch part's sketch and the leader's recomputed one that an honest peer stays
#: under: both run the same float32 computation on the same inputs and parameters; the difference is
#: float rounding of another thread count or device (measured: ``tests/integration`` and
#: ``scripts/bench_recompute.py`` report the largest honest gap). A lie about a part moves it by ~1.
RECOMPUTE_TOLERANCE = 1e-2
#: The share of its contributors' samples a leader recomputes, in expectation: a contribution of ``m`` shipped
#: microbatches is recomputed (one of them) with probability ``min(1, share * m)``, so the extra compute is
#: ``share`` of the stage's own and a lie about one microbatch is caught with probability ``share`` per round
#: (``1/m`` once ``share * m >= 1``). Leader-local (``StageAverager.recompute_share``): the contributors need
#: not know it, and cannot tell which contributions are recomputed.
RECOMPUTE_SHARE = 0.25
#: How large the ``extra`` of an opening whose samples are all its shipped microbatches' may be, as
#: ``||e|| / (||t|| + ||e||)`` of the sketches (``t``: the parts' sum): then it can only be a codec's
#: error-feedback residual. Under 0.5 a lie hidden there cannot turn the contribution against its
#: microbatches (``c . t >= 0``; a sign flip hidden there has share 2/3): the bound of a swarm whose codec
#: leaves a small residual (:data:`TIGHT_CODECS`; measured honest shares, ``scripts/bench_recompute.py``,
#: ``tiny``, 2 x 3 peers: 0 uncompressed, 0.045 under 8bit; heavy-tailed random gradients of steady size:
#: 8bit 0.018, 4bit 0.076). A coarser codec's residual is as large as the contribution itself (5level:
#: 0.38-0.60 measured in honest swarms), and ``auto`` may pick 5level on a slow link: there the bound is
#: :data:`LOOSE_EXTRA_BOUND` (``||e|| <= 9 ||t||``: a gross lie is refused, a flip is not).
EXTRA_BOUND = 0.5
LOOSE_EXTRA_BOUND = 0.9
#: Swarm averaging codecs (``TrainingSpec.grad_codec``) whose residual is small: the tight bound.
TIGHT_CODECS = frozenset({"none", "fp16", "bf16", "8bit", "4bit"})
#: Precisions a leader recomputes in (fp16's loss scale is each peer's own).
RECOMPUTE_PRECISIONS = frozenset({"fp32", "bf16"})
#: Microbatches a peer keeps the inputs of (the current step's and the last's).
MAX_KEPT = 1024
#: Parameters a last-stage peer keeps from before its last updates, to check a stage-mate's recomputed
#: conviction with (it comes with the convicted peer's next contribution: one step later, two if the
#: leader's answer of that next round overtakes it).
PAST_PARAMS = 2
_INPUTS_DOMAIN = b"swarmd-mb-inputs/1\x00"


@dataclass(frozen=True)
class MicrobatchInputs:
    """What a last-stage backward ran on: the activations (float32 ``[batch, seq, width]``) and targets
    (int64 ``[batch, seq]``) of microbatch ``mb``."""

    mb: int
    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.inputs.numel() * self.inputs.element_size() + self.targets.numel() * self.targets.element_size()


class KeptInputs:
    """The inputs of the microbatches a last-stage peer counted, by step (the worker thread's)."""

    def __init__(self, max_entries: int = MAX_KEPT) -> None:
        self.max_entries = max_entries
        self._by_mb: dict[int, tuple[int, MicrobatchInputs]] = {}

    def keep(self, step: int, mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self._by_mb.pop(mb, None)
        self._by_mb[mb] = (step, MicrobatchInputs(mb, inputs.detach().to("cpu"), targets.detach().to("cpu")))
        while len(self._by_mb) > self.max_entries:
            self._by_mb.pop(next(iter(self._by_mb)))

    def of(self, step: int, mbs: Sequence[int]) -> tuple[MicrobatchInputs, ...] | None:
        """The inputs of ``mbs``, all counted at ``step``; None when one is missing."""
        out = []
        for mb in mbs:
            kept = self._by_mb.get(mb)
            if kept is None or kept[0] != step:
                return None
            out.append(kept[1])
        return tuple(out)

    def prune(self, step: int) -> None:
        """The stage is at ``step`` now: forget the inputs of older steps than the last."""
        self._by_mb = {mb: kept for mb, kept in self._by_mb.items() if kept[0] >= step - 1}

    def clear(self) -> None:
        self._by_mb = {}

    def __len__(self) -> int:
        return len(self._by_mb)


class PastParams:
    """CPU copies of a stage's parameters from before its last ``keep`` updates, by their digest (the
    worker thread's): what a stage-mate recomputes a convicted microbatch on (module docstring)."""

    def __init__(self, keep: int = PAST_PARAMS) -> None:
        self.keep = keep
        self._by_digest: dict[str, tuple[int, tuple[torch.Tensor, ...]]] = {}

    def keep_copy(self, step: int, digest: str, params: Sequence[torch.Tensor]) -> None:
        """``params`` at ``step`` (their digest ``digest``), about to be updated: copied."""
        if digest in self._by_digest:
            return
        self._by_digest[digest] = (step, tuple(p.detach().to("cpu", copy=True) for p in params))
        while len(self._by_digest) > self.keep:
            self._by_digest.pop(next(iter(self._by_digest)))

    def at(self, step: int, digest: str) -> tuple[torch.Tensor, ...] | None:
        """The parameters of ``digest`` this peer held at ``step`` (None: not kept)."""
        kept = self._by_digest.get(digest)
        return kept[1] if kept is not None and kept[0] == step else None

    def clear(self) -> None:
        self._by_digest = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, ts in self._by_digest.values() for t in ts)


def inputs_digest(mb: int, inputs: torch.Tensor, targets: torch.Tensor) -> str:
    """What an opening signs of one microbatch's inputs: its id, shapes and the bits of the float32
    activations and int64 targets, as ``AverageRequest.inputs`` carries them."""
    x = inputs.detach().to("cpu", torch.float32).contiguous()
    y = targets.detach().to("cpu", torch.int64).contiguous()
    h = hashlib.sha256(_INPUTS_DOMAIN)
    h.update(repr((mb % 2**64, tuple(x.shape), tuple(y.shape))).encode())
    h.update(x.reshape(-1).view(torch.int32).numpy().tobytes())
    h.update(y.reshape(-1).numpy().tobytes())
    return h.hexdigest()


def recheck(part: Sequence[float], recomputed: Sequence[float]) -> float:
    """How far a signed part lies from the sketch of its microbatch's recomputed gradient
    (``contribution_proofs.gap``: 0 for an honest part; NaN when the recomputation was not finite)."""
    return gap(part, (0.0,) * len(part), recomputed)


def sample(shipped: Sequence[T]) -> T:
    """The microbatch a leader recomputes: drawn with this process's secret randomness."""
    return shipped[secrets.randbelow(len(shipped))]


def extra_bound(grad_codec: str) -> float:
    """The bound on an opening's extra share in a swarm averaging with ``grad_codec`` (:data:`EXTRA_BOUND`)."""
    return EXTRA_BOUND if grad_codec in TIGHT_CODECS else LOOSE_EXTRA_BOUND


def extra_share(total: Sequence[float], extra: Sequence[float]) -> float:
    """``||e|| / (||t|| + ||e||)`` of an opening's sketches: 0 without extra, 1 with nothing but extra."""
    t, e = math.sqrt(math.fsum(x * x for x in total)), math.sqrt(math.fsum(x * x for x in extra))
    return e / (t + e) if t + e > 0 else 0.0


def extra_overrun(total: Sequence[float], extra: Sequence[float], grad_codec: str) -> str | None:
    """Why an opening (its sketches ``total`` and ``extra``) of a contribution whose every sample is one of its
    microbatches' is ``bad``: its extra share over :func:`extra_bound` (None: within it). The single leader's
    and the all-reduce coordinator's rule."""
    share, bound = extra_share(total, extra), extra_bound(grad_codec)
    if share <= bound:
        return None
    return (f"bad opening: what no microbatch of its explains is {share:.3f} of its contribution (bound {bound:g}: "
            "a codec's residual), yet every sample is a microbatch's")


def misstated_microbatch(mb: int, step: int, gap: float) -> str:
    """Why a peer whose signed part of microbatch ``mb`` of ``step`` lies ``gap`` from its recomputed gradient is
    convicted (the leader's, a stage-mate's recheck and the all-reduce coordinator's)."""
    return (f"unaccountable contribution: the signed part of its microbatch {mb:#x} of step {step} is {gap:.3f} away "
            f"from that microbatch's gradient recomputed from its inputs (tolerance {RECOMPUTE_TOLERANCE:g})")


def draws(probability: float) -> bool:
    """True with ``probability``, from this process's secret randomness."""
    return secrets.randbits(53) < probability * 2**53


def recompute_gradient(module: torch.nn.Module, params: Sequence[torch.nn.Parameter], device: torch.device,
                       precision: str, inputs: torch.Tensor, targets: torch.Tensor,
                       at: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """The flat float32 parameter gradient of ``loss * batch`` on ``(inputs, targets)``, as a last-stage
    backward accumulates it (``stage.passes``), without touching any ``.grad`` (``autograd.grad``).
    ``inputs`` and ``targets`` are checked by the caller (``StagePasses.prepare``). ``at``: other values of
    ``params`` (in their order: ``module.named_parameters()``'s) to compute at instead, the module's own
    untouched (:class:`PastParams`)."""
    with torch.enable_grad():
        if at is None:
            with autocast(device.type, precision):
                out = module(inputs, targets)
            wrt: list[torch.Tensor] = list(params)
        else:
            names = [name for name, _ in module.named_parameters()]
            if len(names) != len(at) or len(at) != len(params):
                raise ValueError("past parameters must match the stage's, one for one")
            wrt = [t.detach().to(p.device, p.dtype).requires_grad_(True) for t, p in zip(at, params, strict=True)]
            with autocast(device.type, precision):
                out = torch.func.functional_call(module, dict(zip(names, wrt, strict=True)), (inputs, targets))
        grads = torch.autograd.grad(out * inputs.shape[0], wrt, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).to("cpu", torch.float32)
                      for p, g in zip(params, grads, strict=True)])
