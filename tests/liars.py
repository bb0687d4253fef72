"""Test-only fault hooks: executors that lie (issue #17, item 4), in three ways.

``scale``: a forward's outputs multiplied by ``factor``; ``noise``: a forward's outputs plus
Gaussian noise of ``noise`` times their standard deviation; ``grad``: a backward's input
gradients negated and tripled. Parameter gradients stay honest (poisoned contributions and a
lying leader are the averaging checks' faults, tests/test_round_checks*.py).

Two ways in: :func:`make_liar` patches one in-process executor (what the tests use: cheap), and
:data:`SITECUSTOMIZE` is a ``sitecustomize`` module for a child-process daemon (put its folder on
``PYTHONPATH`` and set ``SWARMD_TEST_LIE=scale|noise|grad``, optionally ``SWARMD_TEST_LIE_STAGE``),
as tests/test_averaging_faults.py does for its hooks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from swarmd.pipeline.executor import StageExecutor

__all__ = ["LIES", "SITECUSTOMIZE", "make_liar"]

LIES = ("scale", "noise", "grad")


def make_liar(executor: StageExecutor, lie: str, *, factor: float = 1.5, noise: float = 0.5, seed: int = 0) -> None:
    """Make ``executor`` (this instance only) lie the way ``lie`` names."""
    if lie not in LIES:
        raise ValueError(f"unknown lie {lie!r}; one of {LIES}")
    generator = torch.Generator().manual_seed(seed)
    honest_forward, honest_backward = executor._forward_sync, executor._backward_sync

    def forward(inputs: torch.Tensor, targets: torch.Tensor | None, mb: int | None) -> Any:
        result = honest_forward(inputs, targets, mb)
        out = result.outputs
        if targets is not None:  # a loss (validation): left alone, only activations lie
            return result
        if lie == "scale":
            out = out * factor
        else:
            out = out + noise * out.std() * torch.randn(out.shape, generator=generator, dtype=out.dtype)
        return dataclasses.replace(result, outputs=out)

    def backward(*args: Any, **kwargs: Any) -> Any:
        result = honest_backward(*args, **kwargs)
        if result.grad_inputs is None:
            return result
        return dataclasses.replace(result, grad_inputs=-3.0 * result.grad_inputs)

    if lie == "grad":
        executor._backward_sync = backward  # type: ignore[method-assign]
    else:
        executor._forward_sync = forward  # type: ignore[method-assign]


SITECUSTOMIZE = '''
import os

_LIE = os.environ.get("SWARMD_TEST_LIE")
if _LIE:
    from swarmd.pipeline import executor as _executor
    from tests.liars import make_liar

    _init = _executor.StageExecutor.__init__
    _stage = os.environ.get("SWARMD_TEST_LIE_STAGE")

    def _lying_init(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        if _stage is None or int(_stage) == self.stage:
            make_liar(self, _LIE)

    _executor.StageExecutor.__init__ = _lying_init
'''
