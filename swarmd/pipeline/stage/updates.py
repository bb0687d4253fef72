"""A stage's gradients in and out, its update, and its state in and out, as the executor's worker
thread runs them.

Gradients come in from backwards (:mod:`swarmd.pipeline.stage.passes`), from a benchmark or a
test (``add_gradients``) and from a leaving stage-mate (``receive_gradients``, the hand-over);
they go out as a :class:`Contribution` when an averaging round takes them, and come back if the
round fails (SWARM's synchronous steps, paper section 3.2: ``swarmd.pipeline.averaging.averager``). The
round's mean is applied as the update from one step to the next; under delayed parameter updates
(:mod:`swarmd.pipeline.stage.delayed_updates`) what the stage accumulated meanwhile is kept for the
next one. A stage's state (parameters, optimizer state, step) is copied out for a joining peer
and adopted from a stage-mate. Which step each of these may touch is the step protocol's rule
(:mod:`swarmd.pipeline.stage.step_protocol`). Worker thread only: ``StageExecutor``
(:mod:`swarmd.pipeline.stage.executor`) owns the thread and every object this one is handed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from swarmd.pipeline.averaging.error_feedback import ErrorFeedback
from swarmd.pipeline.averaging.trust.recomputation import MicrobatchInputs
from swarmd.pipeline.model import StageModule, params_digest
from swarmd.pipeline.spec import ModelSpec, TrainingSpec
from swarmd.pipeline.stage.activation_cache import ActivationCache
from swarmd.pipeline.stage.optimizer import apply_step
from swarmd.pipeline.stage.optimizer_state import load_optimizer_state_tensors, optimizer_state_tensors
from swarmd.pipeline.stage.step_protocol import GradientAccumulator, Part, StepProtocol

__all__ = ["Contribution", "StageUpdates"]


@dataclass(frozen=True)
class Contribution:
    """A stage's accumulated gradients, taken out for averaging (``grads`` None: no samples)."""

    step: int
    samples: int
    grads: torch.Tensor | None  # flat float32 sum over samples, parameters in name order
    mbs: tuple[int, ...] = ()  # the microbatch ids it holds (a leader counts repeats: step_protocol)
    # its addends apart, when the stage keeps them (the last: contribution_proofs): they sum to ``grads``
    parts: tuple[Part, ...] = field(default=(), repr=False, compare=False)
    # the inputs of its microbatch parts, for a leader to recompute one (the last stage: recomputation)
    inputs: tuple[MicrobatchInputs, ...] = field(default=(), repr=False, compare=False)


class StageUpdates:
    """One stage's gradients in and out, its update and its state (run on the executor's worker thread)."""

    def __init__(
        self,
        spec: ModelSpec,
        stage: int,
        module: StageModule,
        *,
        training: TrainingSpec,
        optimizer: torch.optim.Optimizer,
        steps: StepProtocol,
        grads: GradientAccumulator,
        feedback: ErrorFeedback,
        cache: ActivationCache,
    ) -> None:
        """Every argument is the executor's own object, shared with the worker thread's other jobs."""
        self.spec = spec
        self.stage = stage
        self.module = module
        self.training = training
        self.optimizer = optimizer
        self.params = [p for _, p in module.named_parameters()]
        self._steps = steps
        self._grads = grads
        self._feedback = feedback
        self._cache = cache
        self.digest = params_digest(module)  # of the parameters at the step; refreshed on every change

    def add_gradients(self, flat: torch.Tensor, samples: int) -> None:
        self._steps.admit(None)
        self._grads.put(flat, accumulate=True)
        self._steps.accumulated(samples)

    def receive_gradients(self, flat: torch.Tensor, samples: int, step: int) -> None:
        self._steps.receive(step, samples)  # the step rule first: a refused hand-over changes nothing
        self._grads.put(flat, accumulate=True)

    def take_contribution(self) -> Contribution:
        taken = self._steps.take()
        parts = self._grads.take_parts()
        if taken.samples:
            summed = self._grads.take()
            residual = self._feedback.take_for(summed)  # what the codec dropped last round: sent again
            grads: torch.Tensor | None = summed if residual is None else summed.add_(residual)
            if residual is not None and parts:
                parts = (*parts, (None, residual))  # the residual is a part no microbatch explains
        else:
            grads, parts = None, ()
            self._grads.clear()
        return Contribution(step=taken.step, samples=taken.samples, grads=grads, mbs=taken.mbs, parts=parts)

    def restore_contribution(self, contribution: Contribution) -> None:
        if self._steps.restore(contribution.step, contribution.samples) and contribution.grads is not None:
            self._grads.put(contribution.grads, accumulate=True, parts=contribution.parts or None)

    def keep_residual(self, sent: torch.Tensor | None, decoded: torch.Tensor | None) -> None:
        """The round applied ``sent`` as the leader decoded it: keep what the codec dropped."""
        self._feedback.keep(sent, decoded)

    def apply_average(self, mean_grads: torch.Tensor, step: int) -> float:
        self._steps.begin_update(step)
        # Under delayed updates the stage kept serving during the round: what it accumulated
        # meanwhile belongs to the next update, so it is set aside and put back after this one.
        held = self._grads.hold()
        try:
            self._grads.put(mean_grads)
            norm = apply_step(self.optimizer, self.training, self.params, step)
        finally:
            self._grads.reinstate(held)
        self.digest = params_digest(self.module)
        # every saved graph holds the old parameters; under delayed updates a backward one step old
        # still counts, so its forward's inputs stay (it recomputes rather than asking for them again)
        self._cache.clear(keep_inputs=self._steps.delay_updates)
        self._steps.finish_update()
        return norm

    def snapshot_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        tensors = {f"param.{name}": p.detach().to("cpu").clone() for name, p in self.module.named_parameters()}
        opt_tensors, opt_meta = optimizer_state_tensors(self.optimizer)
        tensors.update({f"opt.{name}": t.detach().to("cpu").clone() for name, t in opt_tensors.items()})
        meta = {
            "stage": self.stage,
            "step": self._steps.step,
            "model": self.spec.digest,
            "training": self.training.digest,
            "params_digest": params_digest(self.module),
            "optimizer": opt_meta,
        }
        return meta, tensors

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        step = meta.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"the state's step must be a non-negative integer, got {step!r}")
        named = dict(self.module.named_parameters())
        params = {k.removeprefix("param."): t for k, t in tensors.items() if k.startswith("param.")}
        if set(params) != set(named):
            raise ValueError("the state's parameters do not match this stage's")
        for name, p in named.items():
            if params[name].shape != p.shape:
                raise ValueError(f"parameter {name} has shape {list(params[name].shape)}, expected {list(p.shape)}")
        # checks everything before it changes anything, so a refused state leaves the stage as it was
        opt = {k.removeprefix("opt."): t for k, t in tensors.items() if k.startswith("opt.")}
        load_optimizer_state_tensors(self.optimizer, opt, meta.get("optimizer") or {})
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(params[name])
        self._grads.clear()
        self._feedback.reset()
        self.digest = params_digest(self.module)
        self._cache.clear()
        self._steps.adopt(step)
