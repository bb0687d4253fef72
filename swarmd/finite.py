"""A fast, exact test that a tensor holds no ``inf`` or ``nan``.

Every remote tensor a stage computes with, and every gradient sum it accumulates, is checked
for non-finite values (one of them would poison the stage's next update). The obvious
``torch.isfinite(t).all()`` builds a bool tensor as large as ``t`` and costs about as much as
a copy: ~1 ms for one 4x256x512 activation and ~7 ms for a block's 3M gradient values on one
core, on the critical path of every backward. A sum costs a twentieth of that, and answers the
same question in all but one case: any ``inf`` or ``nan`` makes the sum ``inf`` or ``nan``, so
a finite sum proves every value finite. Only when the sum is not finite (a non-finite value,
or finite values whose sum overflows float32) is the exact elementwise test run.
"""

from __future__ import annotations

import math

import torch

__all__ = ["all_finite"]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite (integer and bool tensors always are)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    values = tensor.detach()  # a check, not part of any graph
    if math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(values).all())
