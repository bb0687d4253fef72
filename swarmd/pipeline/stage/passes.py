"""A stage's forward and backward passes, as the executor's worker thread runs them.

SWARM's backward is *stateless* (paper, section 3.2): any peer of the stage can serve it, by
recomputing the forward from the inputs the request carries again, unless the activation cache
(:mod:`swarmd.pipeline.stage.activation_cache`) still holds the forward's graph (issue #30). Here the
remote tensors are checked against the stage, the forward and the backward run under the
precision's autocast (fp16: a backward that overflows is recomputed at half the loss scale), and
the backward's gradient is added to the step the step protocol admits
(:mod:`swarmd.pipeline.stage.step_protocol`). Worker thread only: ``StageExecutor``
(:mod:`swarmd.pipeline.stage.executor`) owns the thread and every object this one is handed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmd.errors import InputsNotCached, LimitExceeded, NonFinite, RequestError, RequestTimeout
from swarmd.finite import all_finite
from swarmd.pipeline.averaging.trust.recomputation import KeptInputs, recompute_gradient
from swarmd.pipeline.model import StageModule
from swarmd.pipeline.spec import ModelSpec
from swarmd.pipeline.stage.activation_cache import ActivationCache, CachedForward, capture_forward
from swarmd.pipeline.stage.precision import LossScale, autocast
from swarmd.pipeline.stage.step_protocol import GradientAccumulator, StepProtocol, Verdict, judge_backward
from swarmd.pipeline.throughput import ThroughputEMA

__all__ = ["BackwardResult", "ForwardResult", "StagePasses"]


@dataclass(frozen=True)
class ForwardResult:
    outputs: torch.Tensor  # hidden states, logits, or the scalar loss
    step: int  # the optimizer step the parameters were at
    kept: bool = False  # the activation cache keeps it: its backward may omit the inputs


@dataclass(frozen=True)
class BackwardResult:
    grad_inputs: torch.Tensor | None  # None on the first stage (token ids have no gradient)
    loss: float | None  # the last stage reports the microbatch's mean loss
    samples: int
    step: int  # the step whose accumulator the gradient went into
    duplicate: bool = False  # the microbatch was counted at this step already: answered, not added


class StagePasses:
    """Forward and backward jobs on one stage's parameters (run on the executor's worker thread)."""

    def __init__(
        self,
        spec: ModelSpec,
        stage: int,
        module: StageModule,
        device: torch.device,
        *,
        precision: str,
        loss_scale: LossScale | None,
        max_batch_tokens: int,
        steps: StepProtocol,
        grads: GradientAccumulator,
        cache: ActivationCache,
        forward_ema: ThroughputEMA,
        backward_ema: ThroughputEMA,
        kept_inputs: KeptInputs | None = None,
    ) -> None:
        """Every argument is the executor's own object, shared: the step protocol, the gradient
        accumulator and the activation cache are the worker thread's; the EMAs are published."""
        self.spec = spec
        self.stage = stage
        self.module = module
        self.device = device
        self.precision = precision
        self.loss_scale = loss_scale
        self.max_batch_tokens = max_batch_tokens
        self.forward_ema = forward_ema
        self.backward_ema = backward_ema
        self.params = [p for _, p in module.named_parameters()]
        self._steps = steps
        self._grads = grads
        self._cache = cache
        # the last stage's counted microbatches' inputs, for a leader to recompute one (recomputation)
        self.kept_inputs = kept_inputs
        self._shared = frozenset(p.untyped_storage().data_ptr() for p in self.params)

    def prepare(
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

    def check_grad_outputs(self, grad_outputs: torch.Tensor | None, inputs: torch.Tensor) -> torch.Tensor | None:
        if self.module.is_last:
            if grad_outputs is not None:
                raise RequestError(
                    "the last stage computes its own loss gradient: send 'targets', not 'grad_outputs'"
                )
            return None
        if grad_outputs is None:
            raise RequestError("a backward needs 'grad_outputs'")
        expected = [inputs.shape[0], inputs.shape[1], self.spec.boundary_width]
        if not grad_outputs.is_floating_point() or list(grad_outputs.shape) != expected:
            raise RequestError(
                f"grad_outputs must be float of shape {expected}, got {grad_outputs.dtype} "
                f"{list(grad_outputs.shape)}"
            )
        _check_finite(grad_outputs, "grad_outputs")
        return grad_outputs.to(self.device, torch.float32)

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None, mb: int | None, source: str = ""
    ) -> ForwardResult:
        x, y = self.prepare(inputs, targets, targets_required=False)
        started = time.perf_counter()
        kept = False
        if mb is not None and self._cache.enabled and not self.module.is_last:
            self._cache.discard(mb)  # a retried forward replaces the earlier one
            with self._autocast():
                captured = capture_forward(self.module, x, shared=self._shared)
            kept = self._cache.put(mb, x, captured, self._steps.step, source)
            out = captured.out
        else:
            with torch.no_grad(), self._autocast():
                out = self.module(x, y)
        self.forward_ema.update(x.shape[0], time.perf_counter() - started)
        return ForwardResult(outputs=_on_the_wire(out), step=self._steps.step, kept=kept)

    def backward(
        self,
        inputs: torch.Tensor | None,
        grad_outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        step: int | None,
        mb: int | None,
        deadline: float | None = None,
        verify: bool = False,
        attempt: int = 0,
        source: str = "",
    ) -> BackwardResult:
        held: CachedForward | None = None
        steps = self._steps
        if inputs is None and judge_backward(steps.step, step, averaging=steps.averaging,
                                             delayed=steps.delay_updates) in _ADMITTED:
            # the inputs of the forward this peer kept, or InputsNotCached before the step rule counts
            # anything (a refusal of the step rule itself, below, comes first: it asks for a redo)
            held = self._held_forward(mb, steps.step if step is None else step, targets, source)
        current = steps.admit(step)  # the step rule comes first, cache or not
        if held is not None:
            x, y = held.inputs, None
        elif inputs is not None:
            x, y = self.prepare(inputs, targets, targets_required=self.module.is_last)
        else:  # not reached: admit() refused what the step rule did not admit
            raise RequestError("a backward without 'inputs' that the step rule does not admit")
        g = self.check_grad_outputs(grad_outputs, x)
        batch = x.shape[0]
        started = time.perf_counter()
        # a repeat is answered, not added again; so is a spot check's second opinion (verify), which
        # must not mark the microbatch as counted either (its own backward may be retried here)
        first = not verify and self._steps.first_count(mb, current)

        def commit() -> None:
            if deadline is not None and time.monotonic() > deadline:
                self._steps.late()
                raise RequestTimeout("this backward finished after its sender stopped waiting; not applied "
                                     "(the sender retries it elsewhere)")
            self._steps.commit(mb, current, attempt, source)  # or refused: a claim fenced this attempt off

        def run(backward: Callable[[], None]) -> None:
            if first:
                self._grads.add(backward, commit=commit, mb=mb)
            else:
                self._grads.discard(backward)

        cached: CachedForward | None
        if held is not None:  # spent whether it counts or not (a repeat, a spot check's): the entry was its inputs
            cached = held if held.out is not None else None  # no graph (an update came between): recompute
        else:
            cached = None if self.module.is_last or not first else self._cache.take(mb, x, current)
        loss: float | None = None
        while True:  # once, unless fp16's loss scale overflows: then again at half the scale
            scale = self.loss_scale.scale if self.loss_scale is not None else None
            try:
                if cached is not None and cached.out is not None and cached.leaf is not None:
                    leaf = cached.leaf
                    run(self._scaled(cached.out, g, batch, scale, leaf))
                else:
                    leaf = x
                    if not self.module.is_first:
                        x.grad = None  # an overflowed attempt's
                        x.requires_grad_(True)
                    with torch.enable_grad():
                        with self._autocast():
                            out = self.module(x, y)
                        if self.module.is_last:
                            loss = float(out.detach())
                            if not math.isfinite(loss):
                                raise RequestError("the loss is not finite; the request was not applied")
                        run(self._scaled(out, g, batch, scale, leaf))
                break
            except _ScaledOverflow:
                assert self.loss_scale is not None  # only a scaled backward raises it
                cached = None  # its graph is spent: recompute
                if not self.loss_scale.overflowed():
                    raise RequestError("the request's gradients overflow float16 even at the smallest loss "
                                       "scale; refused and not applied") from None
        if self.loss_scale is not None:
            self.loss_scale.succeeded()
        if first:
            self._steps.accumulated(batch, mb, current)
            if self.kept_inputs is not None and mb is not None and y is not None and x.dtype == torch.float32:
                self.kept_inputs.keep(current, mb, x, y)
        self.backward_ema.update(batch, time.perf_counter() - started)
        grad_inputs = None if self.module.is_first else _grad(leaf).detach().cpu()
        return BackwardResult(grad_inputs=grad_inputs, loss=loss, samples=batch, step=current, duplicate=not first)

    def recompute(self, inputs: torch.Tensor, targets: torch.Tensor, precision: str, step: int,
                  at: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """A stage-mate's microbatch's parameter gradient on this peer's parameters (``recomputation``), or
        None when they are no longer those of ``step``; ``at``: on these past values of them instead (kept
        from ``step``: ``recomputation.PastParams``). ``RequestError`` for inputs that do not fit the stage."""
        if at is None and self._steps.step != step:
            return None
        x, y = self.prepare(inputs, targets, targets_required=True)
        if y is None:  # prepare() requires them
            raise RequestError("a recomputation needs the microbatch's targets")
        return recompute_gradient(self.module, self.params, self.device, precision, x, y, at=at)

    def _held_forward(self, mb: int | None, step: int, targets: torch.Tensor | None, source: str) -> CachedForward:
        """The cached forward a backward without inputs is served from (see ``StageExecutor.backward``)."""
        if self.module.is_last or targets is not None:
            raise RequestError(f"stage {self.stage}'s backward computes its own forward: send its 'inputs'")
        if mb is None:  # the request's decoder refuses this already; callers in-process too
            raise RequestError("a backward without 'inputs' must name its microbatch (mb)")
        entry = self._cache.take_held(mb, step, source)
        if entry is None:
            raise InputsNotCached(f"this peer holds no forward of microbatch {mb:#x} at step {step} for this "
                                  "sender (restarted, evicted, or never ran it here): resend the backward with "
                                  "its inputs")
        return entry

    def _autocast(self) -> Any:
        return autocast(self.device.type, self.precision)

    def _scaled(
        self, out: torch.Tensor, g: torch.Tensor | None, batch: int, scale: float | None, leaf: torch.Tensor
    ) -> Callable[[], None]:
        """The backward of ``out``: of ``loss * batch`` on the last stage, else with ``grad_outputs``
        ``g``; with a loss scale (fp16), ``scale`` times that, and the fresh parameter and input
        gradients divided by it again (raising :class:`_ScaledOverflow` if they are not finite).
        Runs inside the gradient accumulator, so ``.grad`` holds this backward's gradients only."""

        def backward() -> None:
            if g is None:
                (out * batch if scale is None else out * (batch * scale)).backward()
            else:
                torch.autograd.backward(out, g if scale is None else g.to(out.dtype) * scale)
            if scale is None:
                return
            for t in (*self.params, leaf):
                if t.grad is not None:
                    t.grad.mul_(1.0 / scale)  # a power of two: exact
                    if not all_finite(t.grad):
                        raise _ScaledOverflow
        return backward


#: The step rule's verdicts under which a backward is computed (a backward without inputs then needs its entry).
_ADMITTED = frozenset({Verdict.ACCEPT, Verdict.ACCEPT_STALE})


class _ScaledOverflow(Exception):
    """An fp16 backward's gradients overflowed at the current loss scale (retried at half of it)."""


def _on_the_wire(out: torch.Tensor) -> torch.Tensor:
    """Outputs as they travel: detached, on the CPU, float32 (under autocast logits come out in
    the compute dtype; activations on the wire stay what they are in fp32)."""
    out = out.detach()
    if out.is_floating_point() and out.dtype != torch.float32:
        out = out.float()
    return out.cpu()


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    if leaf.grad is None:  # autograd always fills a leaf that requires grad; this is a bug
        raise RuntimeError("the backward left no gradient on the stage inputs")
    return leaf.grad


def _check_finite(t: torch.Tensor, what: str) -> None:
    if not all_finite(t):
        raise NonFinite(f"{what} contain NaN or Inf; refused")
