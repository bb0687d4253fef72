"""Runs one pipeline stage's forward and backward passes off the event loop.

SWARM's backward is *stateless* (paper, section 3.2): a peer keeps nothing between a
microbatch's forward and its backward, so any peer of the stage can serve the backward. The
backward request therefore carries the stage inputs again and the peer recomputes the forward
before backpropagating. Parameter gradients accumulate in place together with a sample count,
which the averaging step (later) divides by.

Gradient scale: the last stage backpropagates ``loss * batch_size``, the sum of per-sample
mean losses, so every stage accumulates *sums* over samples and ``grad / samples`` is the
gradient of the mean loss over everything accumulated, however the batch was split.

All torch work runs on one worker thread owned by the executor: the event loop never blocks
on compute, and jobs on one stage never race on ``.grad``.

The step rule (see also ``swarmd.pipeline.averaging``): every reply says which optimizer step
the stage's parameters were at. A backward names the step its forward ran at; a backward for an
older step is refused with ``StaleStep`` and counted (its gradient would mix two versions of the
parameters), one for a newer step with ``PeerBehind``. While the stage's gradients are out for
averaging, backwards are refused with ``Busy`` (retry shortly), so no gradient computed at step
``s`` can land after the update to ``s + 1``.

With delayed parameter updates (``TrainingSpec.delay_updates``, paper section 3.3) the stage
keeps serving with the previous parameters while its round runs: backwards accumulate into the
*next* update, and a backward whose forward ran one step ago is accepted (staleness exactly 1,
counted in ``stale_applied``); two or more steps old is still refused.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from swarmd.errors import Busy, LimitExceeded, PeerBehind, RequestError, StaleStep
from swarmd.pipeline.model import StageModule, build_stage, params_digest
from swarmd.pipeline.optimizer import (
    TrainingSpec,
    apply_step,
    build_optimizer,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
)
from swarmd.pipeline.spec import ModelSpec
from swarmd.pipeline.throughput import ThroughputEMA

T = TypeVar("T")


@dataclass(frozen=True)
class ForwardResult:
    outputs: torch.Tensor  # hidden states, logits, or the scalar loss
    step: int  # the optimizer step the parameters were at


@dataclass(frozen=True)
class BackwardResult:
    grad_inputs: torch.Tensor | None  # None on the first stage (token ids have no gradient)
    loss: float | None  # the last stage reports the microbatch's mean loss
    samples: int
    step: int  # the step whose accumulator the gradient went into


@dataclass(frozen=True)
class Contribution:
    """A stage's accumulated gradients, taken out for averaging (``grads`` None: no samples)."""

    step: int
    samples: int
    grads: torch.Tensor | None  # flat float32 sum over samples, parameters in name order


class StageExecutor:
    """Owns a stage's parameters and the single worker thread that touches them."""

    def __init__(
        self,
        spec: ModelSpec,
        stage: int,
        device: str = "cpu",
        *,
        training: TrainingSpec | None = None,
        max_batch_tokens: int = 1 << 16,
        threads: int | None = None,
    ) -> None:
        self.spec = spec
        self.stage = stage
        self.device = torch.device(device)
        self.max_batch_tokens = max_batch_tokens
        self.training = training or TrainingSpec()
        self.module: StageModule = build_stage(spec, stage, device=self.device)
        self.params = [p for _, p in self.module.named_parameters()]
        self.grad_numel = sum(p.numel() for p in self.params)
        self.optimizer = build_optimizer(self.training, self.module.named_parameters())
        self.step = 0
        self.grad_samples = 0  # samples whose gradients are accumulated in .grad since the last step
        self.averaging = False  # gradients are out for averaging: backwards are refused (Busy)
        self.out_samples = 0  # samples of the contribution out for averaging
        self.stale_dropped = 0  # backwards refused because they were computed at an older step
        self.stale_applied = 0  # delayed updates: backwards one step old, accumulated into the next update
        self.dropped_samples = 0  # accumulated samples discarded by adopting a neighbour's state
        self.last_grad_norm: float | None = None
        self.digest = params_digest(self.module)  # of the parameters at ``step``; refreshed on every change
        self.forward_ema = ThroughputEMA()
        self.backward_ema = ThroughputEMA()
        self._pending = 0
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"swarmd-stage{stage}")
        self._closed = False
        self._pool.submit(self._init_worker).result()

    # ---- introspection -------------------------------------------------------------------

    @property
    def queue(self) -> int:
        """Jobs submitted to the worker and not finished yet (the one running included)."""
        return self._pending

    @property
    def throughput(self) -> float:
        """Samples per second for a full forward + backward, from the two EMAs.

        A microbatch needs both passes on this stage, so the rate that matters to routing is
        ``1 / (1/fwd + 1/bwd)``; with only one kind measured so far, that one.
        """
        rates = [ema.value for ema in (self.forward_ema, self.backward_ema) if ema.count]
        return 1.0 / sum(1.0 / r for r in rates) if rates else 0.0

    async def params_digest(self) -> str:
        """Recompute the digest of the parameters now (``digest`` is the cached one)."""
        return await self._run(lambda: params_digest(self.module))

    # ---- compute ---------------------------------------------------------------------------

    async def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> ForwardResult:
        """Stage outputs (on the last stage with targets, the scalar mean loss) and their step."""
        return await self._run(lambda: self._forward_sync(inputs, targets))

    async def backward(
        self,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        step: int | None = None,
    ) -> BackwardResult:
        """Recompute the forward, backpropagate, accumulate parameter gradients.

        ``step`` is the step the microbatch's forward on this stage ran at (None: no check,
        as for the last stage's fused forward + backward).
        """
        return await self._run(lambda: self._backward_sync(inputs, grad_outputs, targets, step))

    # ---- steps: the averaging protocol's hooks (all on the worker thread) ------------------

    async def take_contribution(self) -> Contribution:
        """Move the accumulated gradients out for averaging; refuse backwards until settled."""
        return await self._run(self._take_contribution_sync)

    async def restore_contribution(self, contribution: Contribution) -> None:
        """The round failed: put the gradients back and accept backwards again."""
        await self._run(lambda: self._restore_contribution_sync(contribution))

    async def apply_average(self, mean_grads: torch.Tensor, step: int) -> float:
        """Apply the stage-wide mean gradient as the update from ``step`` to ``step + 1``."""
        return await self._run(lambda: self._apply_average_sync(mean_grads, step))

    async def snapshot_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """A consistent copy of parameters, optimizer state and step, for a joining peer."""
        return await self._run(self._snapshot_state_sync)

    async def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Adopt a neighbour's snapshot (parameters, optimizer state, step); drops local gradients."""
        await self._run(lambda: self._load_state_sync(meta, tensors))

    async def close(self) -> None:
        """Let queued jobs finish, then stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)

    # ---- internals ---------------------------------------------------------------------------

    def _init_worker(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)

    async def _run(self, fn: Callable[[], T]) -> T:
        if self._closed:
            raise RuntimeError("executor is closed")
        self._pending += 1
        try:
            return await asyncio.wrap_future(self._pool.submit(fn))
        finally:
            self._pending -= 1

    def _prepare(
        self, inputs: torch.Tensor, targets: torch.Tensor | None, *, targets_required: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Validate remote tensors against this stage and move them to its device and dtypes."""
        if inputs.dtype == torch.int32:  # token ids may travel as int32; the model takes int64
            inputs = inputs.long()
        if targets is not None and targets.dtype == torch.int32:
            targets = targets.long()
        if targets is None and targets_required:
            raise RequestError(f"stage {self.stage} is the last stage: a backward needs 'targets'")
        self.module.check_inputs(inputs, targets)
        batch, seq = inputs.shape[:2]
        if batch * seq > self.max_batch_tokens:
            raise LimitExceeded(
                f"a batch of {batch}x{seq} tokens exceeds this peer's limit of {self.max_batch_tokens} tokens; "
                "split it into smaller microbatches"
            )
        if inputs.is_floating_point():
            _check_finite(inputs, "inputs")
        x = inputs.to(self.device)
        return x, None if targets is None else targets.to(self.device)

    def _check_grad_outputs(self, grad_outputs: torch.Tensor | None, inputs: torch.Tensor) -> torch.Tensor | None:
        if self.module.is_last:
            if grad_outputs is not None:
                raise RequestError(
                    "the last stage computes its own loss gradient: send 'targets', not 'grad_outputs'"
                )
            return None
        if grad_outputs is None:
            raise RequestError("a backward needs 'grad_outputs'")
        expected = [inputs.shape[0], inputs.shape[1], self.spec.d_model]
        if not grad_outputs.is_floating_point() or list(grad_outputs.shape) != expected:
            raise RequestError(
                f"grad_outputs must be float of shape {expected}, got {grad_outputs.dtype} "
                f"{list(grad_outputs.shape)}"
            )
        _check_finite(grad_outputs, "grad_outputs")
        return grad_outputs.to(self.device, torch.float32)

    def _forward_sync(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> ForwardResult:
        x, y = self._prepare(inputs, targets, targets_required=False)
        started = time.perf_counter()
        with torch.no_grad():
            out = self.module(x, y)
        self.forward_ema.update(x.shape[0], time.perf_counter() - started)
        return ForwardResult(outputs=out.detach().cpu(), step=self.step)

    def _check_step(self, step: int | None) -> None:
        delayed = self.training.delay_updates
        if self.averaging and not delayed:
            raise Busy(f"stage {self.stage} is averaging the gradients of step {self.step}; retry shortly")
        if step is None or step == self.step:
            return
        if delayed and step == self.step - 1:
            self.stale_applied += 1  # delayed updates: staleness exactly 1 is part of the rule
            return
        if step < self.step:
            self.stale_dropped += 1
            raise StaleStep(
                f"this microbatch ran forward at step {step} but stage {self.stage} is at step {self.step}; "
                "its gradient is dropped: redo the microbatch"
            )
        raise PeerBehind(f"stage {self.stage} on this peer is at step {self.step}, behind step {step}")

    def _backward_sync(
        self,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        step: int | None,
    ) -> BackwardResult:
        self._check_step(step)
        x, y = self._prepare(inputs, targets, targets_required=self.module.is_last)
        g = self._check_grad_outputs(grad_outputs, inputs)
        batch = x.shape[0]
        started = time.perf_counter()
        if not self.module.is_first:
            x.requires_grad_(True)
        with torch.enable_grad():
            out = self.module(x, y)
            loss: float | None = None
            if self.module.is_last:
                loss = float(out.detach())
                if not math.isfinite(loss):
                    raise RequestError("the loss is not finite; the request was not applied")
                (out * batch).backward()
            else:
                torch.autograd.backward(out, g)
        self.grad_samples += batch
        self.backward_ema.update(batch, time.perf_counter() - started)
        grad_inputs = None if self.module.is_first else x.grad.detach().cpu()
        return BackwardResult(grad_inputs=grad_inputs, loss=loss, samples=batch, step=self.step)

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to("cpu", torch.float32)
                for p in self.params
            ]
        )

    def _take_contribution_sync(self) -> Contribution:
        if self.averaging:
            raise Busy(f"the gradients of stage {self.stage} are already out for averaging")
        self.averaging = True
        grads = self._flat_grads() if self.grad_samples else None
        contribution = Contribution(step=self.step, samples=self.grad_samples, grads=grads)
        for p in self.params:
            p.grad = None
        self.out_samples = self.grad_samples
        self.grad_samples = 0
        return contribution

    def _restore_contribution_sync(self, contribution: Contribution) -> None:
        if contribution.step == self.step and contribution.grads is not None:
            self._set_grads(contribution.grads, accumulate=True)
            self.grad_samples += contribution.samples
        self.averaging = False
        self.out_samples = 0

    def _set_grads(self, flat: torch.Tensor, *, accumulate: bool = False) -> None:
        if flat.numel() != self.grad_numel:
            raise ValueError(f"expected {self.grad_numel} gradient values, got {flat.numel()}")
        offset = 0
        for p in self.params:
            chunk = flat[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
            offset += p.numel()
            if accumulate and p.grad is not None:
                p.grad.add_(chunk)
            else:
                p.grad = chunk.clone()

    def _apply_average_sync(self, mean_grads: torch.Tensor, step: int) -> float:
        if step != self.step:
            self.averaging = False
            self.out_samples = 0
            raise StaleStep(f"an average for step {step} reached stage {self.stage} at step {self.step}")
        # Under delayed updates the stage kept serving during the round: what it accumulated
        # meanwhile belongs to the next update, so it is set aside and put back after this one.
        held = [p.grad for p in self.params]
        self._set_grads(mean_grads)
        norm = apply_step(self.optimizer, self.training, self.params, self.step)
        for p, grad in zip(self.params, held):
            p.grad = grad
        # the digest first: a reader on the event loop that sees the new step sees its digest
        self.digest = params_digest(self.module)
        self.step += 1
        self.averaging = False
        self.out_samples = 0
        self.last_grad_norm = norm
        return norm

    def _snapshot_state_sync(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        tensors = {f"param.{name}": p.detach().to("cpu").clone() for name, p in self.module.named_parameters()}
        opt_tensors, opt_meta = optimizer_state_tensors(self.optimizer)
        tensors.update({f"opt.{name}": t.detach().to("cpu").clone() for name, t in opt_tensors.items()})
        meta = {
            "stage": self.stage,
            "step": self.step,
            "model": self.spec.digest,
            "training": self.training.digest,
            "params_digest": params_digest(self.module),
            "optimizer": opt_meta,
        }
        return meta, tensors

    def _load_state_sync(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        names = {name for name, _ in self.module.named_parameters()}
        params = {k.removeprefix("param."): t for k, t in tensors.items() if k.startswith("param.")}
        if set(params) != names:
            raise ValueError("the state's parameters do not match this stage's")
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if params[name].shape != p.shape:
                    raise ValueError(f"parameter {name} has shape {list(params[name].shape)}, expected {list(p.shape)}")
                p.copy_(params[name])
                p.grad = None
        opt = {k.removeprefix("opt."): t for k, t in tensors.items() if k.startswith("opt.")}
        load_optimizer_state_tensors(self.optimizer, opt, meta["optimizer"])
        self.digest = params_digest(self.module)  # before the step, as in _apply_average_sync
        self.step = int(meta["step"])
        self.dropped_samples += self.grad_samples
        self.grad_samples = 0
        self.averaging = False
        self.out_samples = 0


def _check_finite(t: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise RequestError(f"{what} contain NaN or Inf; refused")


__all__ = ["BackwardResult", "Contribution", "ForwardResult", "StageExecutor", "ThroughputEMA"]
