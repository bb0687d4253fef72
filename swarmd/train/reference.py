"""Single-process training of a model's stages: what a swarm in ``--sync`` mode must compute.

The equivalence test and ``scripts/bench_pipeline.py`` both compare a swarm against this one
step, so it lives in one place: the global batch's microbatches run through every stage in one
process, each backpropagates ``loss * samples`` (the data plane's gradient accounting), the
summed gradients are divided by the step's sample count, and every stage takes the same
``apply_step`` the peers take.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarmd.pipeline.model import StageModule
from swarmd.pipeline.spec import TrainingSpec
from swarmd.pipeline.stage.optimizer import apply_step


def single_process_step(
    stages: Sequence[StageModule],
    optimizers: Sequence[torch.optim.Optimizer],
    training: TrainingSpec,
    microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    step: int,
) -> float:
    """One optimizer step over ``microbatches``; returns the step's sample-weighted mean loss."""
    total, weighted = 0, 0.0
    for x, y in microbatches:
        h = x
        for stage in stages[:-1]:
            h = stage(h)
        loss = stages[-1](h, y)
        (loss * x.shape[0]).backward()
        total += x.shape[0]
        weighted += loss.item() * x.shape[0]
    apply_mean_step(stages, optimizers, training, total, step)
    return weighted / total


def apply_mean_step(
    stages: Sequence[StageModule],
    optimizers: Sequence[torch.optim.Optimizer],
    training: TrainingSpec,
    samples: int,
    step: int,
) -> None:
    """Divide the gradients ``loss * samples`` accumulated over ``samples`` by their count and take
    every stage's ``apply_step``: the update of a ``--sync`` step, however its gradients were made."""
    for stage, opt in zip(stages, optimizers, strict=True):
        params = list(stage.parameters())
        for p in params:
            assert p.grad is not None, "every parameter takes part in the loss"
            p.grad /= samples
        apply_step(opt, training, params, step)
