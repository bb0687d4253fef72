"""Token ids on the wire in the narrowest integer dtype that holds them (issue 30).

The first stage's inputs and the last stage's targets are token ids: int64 in every tensor a
stage computes with, but a byte-level vocabulary (256 ids) needs one byte per id, not eight, and
a 32k vocabulary two. Ids travel uncompressed (no float codec applies to them), so once the
activations are 4-bit and the stage boundaries narrow, int64 ids were half of what a `tiny`
sample sent (docs/BENCHMARKS.md, "Fewer bytes per sample"). Sent narrow, they cost a byte each:

- :func:`narrow` (the sender's side): an int64 tensor whose values all lie in ``[0, 255]`` goes as
  ``uint8``, in ``[-2**15, 2**15)`` as ``int16``, in ``[-2**31, 2**31)`` as ``int32``; anything
  else unchanged. Lossless: it looks at the values, not at the vocabulary, so it is at least as
  narrow as the vocabulary's type and needs no agreement between the peers.
- :func:`widen` (the receiver's side, on remote input): any integer dtype the wire carries
  (``uint8``, ``int16``, ``int32``, ``int64``) becomes int64, exactly; floating and bool tensors
  are returned as they are, for the stage's own checks to refuse where ids belong
  (``RequestError``, 422). A dtype outside the wire's allow-list never gets here: the frame
  decoder refuses it (``UnsupportedDtype``, 422).

Pure: no I/O, no knowledge of frames; ``swarmd.net.messages`` applies them to ``inputs`` and
``targets`` of forward and backward requests.
"""

from __future__ import annotations

from typing import overload

import torch

__all__ = ["ID_DTYPES", "narrow", "widen"]

#: Integer dtypes a token-id tensor may arrive in, each widened to int64 on receipt.
ID_DTYPES: frozenset[torch.dtype] = frozenset({torch.uint8, torch.int16, torch.int32, torch.int64})

# (dtype, lowest, highest) in the order tried: the first that holds every value is used.
_NARROWER: tuple[tuple[torch.dtype, int, int], ...] = (
    (torch.uint8, 0, 2**8 - 1),
    (torch.int16, -(2**15), 2**15 - 1),
    (torch.int32, -(2**31), 2**31 - 1),
)


def narrow(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` in the narrowest wire dtype that holds all its values (int64 tensors only; any
    other tensor, or an empty one, is returned as it is)."""
    if ids.dtype != torch.int64 or ids.numel() == 0:
        return ids
    low, high = int(ids.min()), int(ids.max())
    for dtype, lowest, highest in _NARROWER:
        if lowest <= low and high <= highest:
            return ids.to(dtype)
    return ids


@overload
def widen(ids: torch.Tensor) -> torch.Tensor: ...
@overload
def widen(ids: None) -> None: ...
@overload
def widen(ids: torch.Tensor | None) -> torch.Tensor | None: ...
def widen(ids: torch.Tensor | None) -> torch.Tensor | None:
    """Integer ``ids`` as int64 (exact); None, floating and bool tensors unchanged."""
    if ids is None or ids.dtype == torch.int64 or ids.dtype not in ID_DTYPES:
        return ids
    return ids.to(torch.int64)
