"""Finite values: a fast, exact test that a tensor holds no ``inf`` or ``nan``, and strict JSON.

Every remote tensor a stage computes with, and every gradient sum it accumulates, is checked
for non-finite values (one of them would poison the stage's next update). The obvious
``torch.isfinite(t).all()`` builds a bool tensor as large as ``t`` and costs about as much as
a copy: ~1 ms for one 4x256x512 activation and ~7 ms for a block's 3M gradient values on one
core, on the critical path of every backward. A sum costs a twentieth of that, and answers the
same question in all but one case: any ``inf`` or ``nan`` makes the sum ``inf`` or ``nan``, so
a finite sum proves every value finite. Only when the sum is not finite (a non-finite value,
or finite values whose sum overflows float32) is the exact elementwise test run.

Numbers that leave swarmd as JSON (``--json`` lines, the control plane) are strict JSON:
``json.dumps`` writes ``NaN`` and ``Infinity`` by default, which ``jq``, browsers and most
parsers reject (issue #13). :func:`strict_json` turns every non-finite float into ``null`` and
:func:`strict_json_dumps` refuses to write anything else; :func:`json_response` is the data plane's
(aiohttp) JSON reply written that way, so no endpoint can answer ``NaN``. This module imports torch
only when a tensor is checked, and aiohttp only when a response is built, so the light CLI
commands (``swarmd status``) can use it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from aiohttp import web

__all__ = ["all_finite", "json_response", "strict_json", "strict_json_dumps"]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite (integer and bool tensors always are)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    values = tensor.detach()  # a check, not part of any graph
    if math.isfinite(float(values.sum())):
        return True
    import torch  # loaded by whoever made the tensor: a dictionary lookup

    return bool(torch.isfinite(values).all())


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-Infinity) replaced by None, in nested dicts,
    lists and tuples (tuples become lists, as JSON has them); anything else as it is."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def strict_json_dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`strict_json` (value), with ``allow_nan=False`` as a guard: a
    non-finite number hidden where :func:`strict_json` does not look raises ValueError instead
    of writing ``NaN``."""
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)


def json_response(data: Any, *, status: int = 200, **kwargs: Any) -> web.Response:
    """aiohttp's ``web.json_response`` written with :func:`strict_json_dumps`: a non-finite number
    in ``data`` goes out as ``null``, never as ``NaN`` (aiohttp's default ``json.dumps`` would)."""
    from aiohttp import web  # loaded by every caller already (the data plane): a dictionary lookup

    return web.json_response(data, status=status, dumps=strict_json_dumps, **kwargs)
