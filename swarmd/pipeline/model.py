"""Pipeline stages by architecture: the unit of work a SWARM peer serves.

:func:`build_stage` builds stage ``k`` of a spec with the architecture its ``arch`` names
(:mod:`swarmd.models`: ``gpt``, ``llama``, or one another package registers), with
deterministic initial parameters (SHA-256 of the spec's digest, the stage and each
parameter's name: see :mod:`swarmd.models.base`), so every peer's copy of a stage is
interchangeable (SWARM, Ryabinin et al. 2023, section 3.1) and :func:`params_digest` lets them
check it. :class:`FullModel` chains all stages in one process: the single-machine reference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from swarmd.errors import ConfigError
from swarmd.models.base import StageModule
from swarmd.models.gpt import MLP, Block, CausalSelfAttention
from swarmd.models.registry import stage_builder
from swarmd.pipeline.spec import ModelSpec

__all__ = [
    "Block",
    "CausalSelfAttention",
    "FullModel",
    "MLP",
    "StageModule",
    "build_stage",
    "params_digest",
    "tensors_digest",
]

_PARAMS_DIGEST_VERSION = b"swarmd.params/1\n"


def build_stage(
    spec: ModelSpec,
    stage: int,
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype = torch.float32,
) -> StageModule:
    """Build stage ``stage`` of ``spec`` with its deterministic initial parameters.

    The spec's ``arch`` picks the builder (:func:`swarmd.models.registry.stage_builder`); what
    it returns must be a :class:`StageModule`, whose interface the executor, the activation
    cache and the reference training rely on.
    """
    module = stage_builder(spec.arch)(spec, stage, device=device, dtype=dtype)
    if not isinstance(module, StageModule):
        raise ConfigError(
            f"arch {spec.arch!r}: its stage builder returned a {type(module).__name__}, not a StageModule"
        )
    return module


def params_digest(module: nn.Module) -> str:
    """SHA-256 hex over (name, dtype, shape, raw bytes) of every parameter, in name order.

    Equal digests mean bit-identical parameters, which is how peers of one stage check that
    they start from (or, after averaging, agree on) the same weights without shipping them.
    """
    return tensors_digest(module.named_parameters())


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """:func:`params_digest` of named tensors (e.g. a downloaded state, checked before adopting it)."""
    h = hashlib.sha256(_PARAMS_DIGEST_VERSION)
    for name, param in sorted(named, key=lambda item: item[0]):
        data = param.detach().contiguous().cpu().reshape(-1)
        header = f"{name}\0{str(data.dtype).removeprefix('torch.')}\0"
        header += f"{','.join(map(str, param.shape))}\0{data.numel() * data.element_size()}\0"
        h.update(header.encode())
        h.update(data.view(torch.uint8).numpy().data)
    return h.hexdigest()


class FullModel(nn.Module):
    """All stages chained in one process: the single-machine reference for tests and training."""

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device | str = "cpu",
        *,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.stages = nn.ModuleList(
            build_stage(spec, k, device, dtype=dtype) for k in range(spec.n_stages)
        )

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        x = tokens
        for stage in self.stages[:-1]:
            x = stage(x)
        return self.stages[-1](x, targets)
