"""Mixed precision for a stage's compute: autocast, and loss scaling that works stage by stage.

``--precision`` is a peer's own choice, like ``--device``: parameters, their gradients and the
optimizer state stay float32 (the "master weights" of mixed-precision training, Micikevicius et
al. 2018), the matrix products of forward and backward run in bfloat16 or float16 under
``torch.autocast``, and activations and gradients travel between stages as float32, as they do
in fp32. Stage-mates average float32 gradients and apply the same update, so peers of a stage
that compute in different precisions still hold bit-identical parameters.

Loss scaling (float16 only: its 5-bit exponent flushes small gradients to zero). ``GradScaler``
scales one loss and unscales every parameter before one optimizer step, which a pipeline
cannot do: the loss lives on the last stage, the parameters on all of them, and a stage's
step is an average over many peers' backwards. So each stage scales *its own* backward: it
multiplies the incoming ``grad_outputs`` (on the last stage, its loss) by its scale ``S``,
backpropagates through its float16 activations, and divides the fresh parameter gradients
and the input gradients by ``S`` in float32 before they are accumulated or sent upstream.
``S`` is a power of two, so scaling and unscaling are exact. A backward whose unscaled
gradients are not finite was an overflow: the scale halves and the backward is recomputed
(stateless backward makes that free of consequences); after ``growth_interval`` clean
backwards in a row it doubles. :class:`LossScale` is that rule, pure and unit-tested.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from swarmd.errors import ConfigError
from swarmd.net.messages import PRECISIONS

__all__ = ["PRECISIONS", "LossScale", "autocast_dtype", "check_precision"]

# What ``--precision`` accepts is what a reply may say computed it (``swarmd.net.messages.PRECISIONS``).


def check_precision(precision: object) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ConfigError with a sentence."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def autocast_dtype(precision: str) -> Any:
    """The torch dtype autocast computes in, or None for fp32 (no autocast)."""
    import torch

    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[check_precision(precision)]


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for ``precision`` on ``device_type`` ("cpu", "cuda"); a no-op for fp32."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device_type, dtype=dtype)


@dataclass
class LossScale:
    """A stage's dynamic loss scale (see the module docstring): halve on overflow, double after
    ``growth_interval`` clean backwards, always a power of two within [min_scale, max_scale]."""

    scale: float = 2.0**16
    growth_interval: int = 200
    min_scale: float = 2.0**-14
    max_scale: float = 2.0**24
    clean: int = 0  # backwards without overflow since the last change
    overflows: int = 0  # backwards recomputed because they overflowed, over the whole run

    def overflowed(self) -> bool:
        """Record an overflow and halve the scale; False if it is already at ``min_scale`` (give up)."""
        self.overflows += 1
        self.clean = 0
        if self.scale <= self.min_scale:
            return False
        self.scale = max(self.min_scale, self.scale / 2)
        return True

    def succeeded(self) -> None:
        """Record a clean backward; double the scale after ``growth_interval`` of them in a row."""
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.clean = 0
            self.scale = min(self.max_scale, self.scale * 2)
