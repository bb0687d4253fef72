"""Error feedback for compressed gradient averaging: what a lossy codec dropped is sent next time.

A stage's peers average their gradients every step (SWARM, section 3.2), and with a lossy
``grad_codec`` each contribution reaches the leader as ``D(Q(g))``, not ``g``. The ``8bit``,
``4bit``, ``3bit``, ``2bit`` and ``5level`` codecs round to the *nearest* level, deterministically,
so the error is not noise that averages out: a small, steady gradient component that always rounds
the same way is lost at every step. Error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "Error
Feedback Fixes SignSGD") keeps the dropped part and adds it to the next contribution::

    send  Q(g + e)                    # the compensated gradient, encoded
    keep  e = (g + e) - D(Q(g + e))   # what the leader did not receive

so the sum of what the leader received over any number of rounds differs from the sum of the true
gradients by one residual ``e`` only, whatever the number of rounds.

The residual stays bounded only where the codec shrinks what it is given: if every block's error
is at most ``r < 1`` of the block's norm, ``||e|| <= r (||g|| + ||e_before||)``, so the residual never
exceeds ``r / (1 - r)`` of the largest gradient. ``4bit`` (``r = 0.53``) and ``5level`` (0.84) are
such codecs; ``3bit`` and ``2bit`` are not (1.62 and 3.77 in their worst case), see
``swarmd.net.codecs``.

**After a gradient spike the residual is capped** at :data:`RESIDUAL_CAP` times the norm of the fresh
gradients it joins (scaled down, its direction kept; :attr:`ErrorFeedback.rounds_trimmed` counts the
rounds it happened). A loss spike gives one step gradients a hundred times larger than the next
one's: in ``small`` (seed 1, 2 peers per stage, ``scripts/bench_compression.py``) stage 0's step 3
gradients had norm 400-630 and step 4's 2.2-3.3, uncompressed and compressed alike (fp32 spikes
there too, loss 4.3 -> 7.2 -> 3.9). The residual of the spike step (0.33 of it with ``5level``: 212)
then made the next contribution 85x its stage-mate's, and the leader refused it as an outlier
(``round_checks.OUTLIER_FACTOR``, 64x): the round aborted and the trainer topped the step up, in
every seed-1 run with ``5level`` (3 of 3) and in some with ``3bit`` and ``2bit`` (not with ``4bit``,
whose residual is 0.1 of a gradient); see docs/BENCHMARKS.md, issue 30's section on ``small``.
Capped, a contribution is at most ``1 + RESIDUAL_CAP`` times its own fresh gradients; what the cap
drops is the stale part of a spike the optimizer clips anyway (``clip_norm``). In those runs the
residual was 0.2-1.2 of the fresh gradients in most rounds and above the cap only after the spike
and in the first steps, while the gradients fell fast (3.8x once): there the received sum differs
from the true one by one residual plus what was dropped, elsewhere by one residual, as above.
"""

from __future__ import annotations

import torch

__all__ = ["FED_CODECS", "RESIDUAL_CAP", "ErrorFeedback", "needs_feedback"]

#: Grad codecs whose error accumulates (deterministic rounding to a coarse grid relative to a
#: block's absmax). fp16/bf16 round each value to within 2**-11 / 2**-8 of itself, far below
#: the gradient noise; ``none`` is exact.
FED_CODECS: frozenset[str] = frozenset({"8bit", "4bit", "3bit", "2bit", "5level"})


#: The residual joins the fresh gradients at most this many times their norm (see the module docstring).
RESIDUAL_CAP = 2.0


def needs_feedback(grad_codec: str) -> bool:
    """Whether contributions sent with ``grad_codec`` should carry error feedback (``auto`` may
    choose a fed codec for any round; a round it sends uncompressed leaves no residual)."""
    return grad_codec in FED_CODECS or grad_codec == "auto"


class ErrorFeedback:
    """One peer's residual of its gradient contributions (see the module docstring)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._residual: torch.Tensor | None = None
        self.rounds_kept = 0  # rounds that left a residual
        self.rounds_trimmed = 0  # contributions whose residual was scaled down to RESIDUAL_CAP

    @property
    def residual(self) -> torch.Tensor | None:
        """The residual the next contribution will carry (None: nothing pending)."""
        return self._residual

    def compensate(self, grads: torch.Tensor) -> torch.Tensor:
        """``grads + e``, in place in ``grads``; the residual now belongs to the contribution."""
        residual = self.take_for(grads)
        return grads if residual is None else grads.add_(residual)

    def take_for(self, grads: torch.Tensor) -> torch.Tensor | None:
        """The residual the contribution ``grads`` is to carry, as it is to be added (None: none);
        it now belongs to the contribution.

        A residual of another size (the stage was rebuilt) is dropped, never added; one larger than
        ``RESIDUAL_CAP * ||grads||`` is scaled down to that first.
        """
        residual, self._residual = self._residual, None
        if not self.enabled or residual is None or residual.shape != grads.shape:
            return None
        residual = residual.to(grads.device, grads.dtype)
        norm = float(torch.linalg.vector_norm(residual, dtype=torch.float64))
        cap = RESIDUAL_CAP * float(torch.linalg.vector_norm(grads, dtype=torch.float64))
        if norm > cap:
            self.rounds_trimmed += 1
            residual = residual * (cap / norm)
        return residual

    def keep(self, sent: torch.Tensor | None, decoded: torch.Tensor | None) -> None:
        """The round applied ``decoded`` as this peer's contribution ``sent`` (compensated):
        keep ``sent - decoded`` for the next one. No-op when disabled or nothing was sent."""
        if not self.enabled or sent is None or decoded is None or decoded is sent:
            return
        if decoded.shape != sent.shape:
            raise ValueError(f"decoded gradients of shape {list(decoded.shape)} for {list(sent.shape)} sent")
        residual = sent.detach().to("cpu", torch.float32) - decoded.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(residual).all()):  # never carry a poisoned residual forward
            self._residual = None
            return
        self._residual = residual
        self.rounds_kept += 1

    def reset(self) -> None:
        """Forget the residual (the stage adopted another peer's parameters)."""
        self._residual = None
