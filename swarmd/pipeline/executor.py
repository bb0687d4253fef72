"""Runs one pipeline stage's forward and backward passes off the event loop.

SWARM's backward is *stateless* (paper, section 3.2): a peer needs nothing from a
microbatch's forward to serve its backward, so any peer of the stage can serve the backward. The
backward request therefore carries the stage inputs again and the peer recomputes the forward
before backpropagating. Parameter gradients accumulate in place together with a sample count,
which the averaging step (later) divides by.

Activation cache (an optimisation on top, never needed for correctness): a forward that names
its microbatch (``mb``, a random 64-bit id the trainer picks) keeps its autograd graph for a
short while, so the backward of the same microbatch arriving at the *same* peer at the *same*
step skips the recomputed forward. The graph is used only if the backward names the same
``mb``, the stage is still at the step the forward ran at (any change of the parameters, an
update or an adopted snapshot, empties the cache: the graph saved the old values), and its
``inputs`` are equal to the forward's (``torch.equal``); otherwise the backward recomputes as
above. Both paths run the same kernels on the same values, so they give bit-identical
gradients. The cache is bounded by entries and by the bytes of the saved activations
(parameters not counted: they are shared); entries expire after ``activation_cache_ttl_s``
and all go at every step. When a forward's graph does not fit, it is the new one that is not
kept (counted as ``skipped``), not the oldest that is evicted: backwards come back in about the
order of their forwards, so the oldest entry is the next one needed, and evicting it would
turn one miss into a miss for every microbatch in flight. Its counters are in
:meth:`StageExecutor.cache_stats`.

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
from collections import OrderedDict
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


@dataclass
class _CachedForward:
    """A forward's autograd graph, kept until its backward (see the module docstring)."""

    inputs: torch.Tensor  # the prepared inputs the forward ran on (for the equality check)
    leaf: torch.Tensor  # the graph's input leaf (requires grad), or the token ids on the first stage
    out: torch.Tensor  # the stage outputs, with their graph
    step: int
    nbytes: int  # saved activations, parameters not counted
    created: float  # time.monotonic()


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
        activation_cache_entries: int = 64,
        activation_cache_bytes: int = 256 * 2**20,
        activation_cache_ttl_s: float = 60.0,
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
        self.worker_cpu_s = 0.0  # CPU time of the worker thread's jobs (the stage's compute)
        # activation cache: only the worker thread touches it; the counters are read anywhere
        self.cache_max_entries = max(0, activation_cache_entries)
        self.cache_max_bytes = max(0, activation_cache_bytes)
        self.cache_ttl_s = activation_cache_ttl_s
        self._cache: OrderedDict[int, _CachedForward] = OrderedDict()
        self.cache_bytes = 0
        self.cache_hits = 0  # backwards that reused their forward's graph
        self.cache_misses = 0  # backwards naming an mb with no usable entry here: recomputed
        self.cache_mismatches = 0  # of the misses: an entry for the mb, but other inputs
        self.cache_evictions = 0  # entries dropped unused (expiry, step change, a retried forward)
        self.cache_skipped = 0  # forwards whose graph was not kept: the cache was full
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.params}
        self._progressed: asyncio.Event | None = None  # set (and replaced) when samples or the step change
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

    def cache_stats(self) -> dict[str, int]:
        """The activation cache's counters and current size (for ``/status``)."""
        return {
            "entries": len(self._cache),
            "bytes": self.cache_bytes,
            "max_entries": self.cache_max_entries,
            "max_bytes": self.cache_max_bytes,
            "hits": self.cache_hits,
            "misses": self.cache_misses,
            "mismatches": self.cache_mismatches,
            "evictions": self.cache_evictions,
            "skipped": self.cache_skipped,
        }

    async def params_digest(self) -> str:
        """Recompute the digest of the parameters now (``digest`` is the cached one)."""
        return await self._run(lambda: params_digest(self.module))

    # ---- compute ---------------------------------------------------------------------------

    async def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None, mb: int | None = None
    ) -> ForwardResult:
        """Stage outputs (on the last stage with targets, the scalar mean loss) and their step.

        ``mb`` names the microbatch: its graph is kept for the backward (not on the last stage,
        whose backward is a fused forward + backward).
        """
        return await self._run(lambda: self._forward_sync(inputs, targets, mb))

    async def backward(
        self,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        step: int | None = None,
        mb: int | None = None,
    ) -> BackwardResult:
        """Recompute the forward (or reuse the cached graph of ``mb``), backpropagate, accumulate.

        ``step`` is the step the microbatch's forward on this stage ran at (None: no check,
        as for the last stage's fused forward + backward).
        """
        result = await self._run(lambda: self._backward_sync(inputs, grad_outputs, targets, step, mb))
        self._notify()
        return result

    async def wait_progress(self, timeout: float, *, samples: int | None = None, step: int | None = None) -> bool:
        """Sleep until ``grad_samples >= samples`` or ``self.step >= step`` (whichever is given),
        or ``timeout`` seconds; True if the condition holds. With neither, until the next change
        of the accumulated samples or the step.

        Lets the averaging loop start a round the moment the batch is complete, and a
        ``/v1/progress`` long-poll answer the moment the stage steps, instead of a poll period later.
        """
        deadline = time.monotonic() + timeout

        def reached() -> bool:
            return (samples is not None and self.grad_samples >= samples) or (step is not None and self.step >= step)

        while not reached():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._progressed is None:
                self._progressed = asyncio.Event()
            try:
                await asyncio.wait_for(self._progressed.wait(), left)
            except asyncio.TimeoutError:
                return reached()
            if samples is None and step is None:
                return True
        return True

    def _notify(self) -> None:
        """Wake :meth:`wait_progress` (on the event loop, after a job that changed the progress)."""
        event, self._progressed = self._progressed, None
        if event is not None:
            event.set()

    # ---- steps: the averaging protocol's hooks (all on the worker thread) ------------------

    async def take_contribution(self) -> Contribution:
        """Move the accumulated gradients out for averaging; refuse backwards until settled."""
        try:
            return await self._run(self._take_contribution_sync)
        finally:
            self._notify()

    async def restore_contribution(self, contribution: Contribution) -> None:
        """The round failed: put the gradients back and accept backwards again."""
        try:
            await self._run(lambda: self._restore_contribution_sync(contribution))
        finally:
            self._notify()

    async def apply_average(self, mean_grads: torch.Tensor, step: int) -> float:
        """Apply the stage-wide mean gradient as the update from ``step`` to ``step + 1``."""
        try:
            return await self._run(lambda: self._apply_average_sync(mean_grads, step))
        finally:
            self._notify()

    async def snapshot_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """A consistent copy of parameters, optimizer state and step, for a joining peer."""
        return await self._run(self._snapshot_state_sync)

    async def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Adopt a neighbour's snapshot (parameters, optimizer state, step); drops local gradients."""
        try:
            await self._run(lambda: self._load_state_sync(meta, tensors))
        finally:
            self._notify()

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

        def job() -> T:
            started = time.thread_time()
            try:
                return fn()
            finally:
                self.worker_cpu_s += time.thread_time() - started

        try:
            return await asyncio.wrap_future(self._pool.submit(job))
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

    def _forward_sync(self, inputs: torch.Tensor, targets: torch.Tensor | None, mb: int | None = None) -> ForwardResult:
        x, y = self._prepare(inputs, targets, targets_required=False)
        started = time.perf_counter()
        if mb is not None and self._caching and not self.module.is_last:
            out = self._forward_cached(x, mb)
        else:
            with torch.no_grad():
                out = self.module(x, y)
        self.forward_ema.update(x.shape[0], time.perf_counter() - started)
        return ForwardResult(outputs=out.detach().cpu(), step=self.step)

    # ---- the activation cache (worker thread only) ---------------------------------------------

    @property
    def _caching(self) -> bool:
        return self.cache_max_entries > 0 and self.cache_max_bytes > 0

    def _forward_cached(self, x: torch.Tensor, mb: int) -> torch.Tensor:
        """The forward with its graph, stored under ``mb`` (within the bounds) for the backward."""
        self._cache_drop(mb, evicted=True)  # a retried forward replaces the earlier one
        leaf = x if self.module.is_first else x.detach().requires_grad_(True)
        seen: set[int] = set()
        nbytes = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen and ptr not in self._param_ptrs:
                seen.add(ptr)
                nbytes += t.untyped_storage().nbytes()
            # detached: the same storage and version counter (in-place changes are still caught),
            # but no grad_fn. Keeping ``t`` itself would, for a saved *output*, make a reference
            # cycle node -> saved tensor -> node that only a backward breaks: an entry dropped
            # unused (evicted, or its step passed) would leak its whole graph.
            return t.detach()

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = self.module(leaf)
        if out.untyped_storage().data_ptr() not in seen:
            nbytes += out.untyped_storage().nbytes()
        now = time.monotonic()
        self._cache_expire(now)
        if len(self._cache) < self.cache_max_entries and self.cache_bytes + nbytes <= self.cache_max_bytes:
            self._cache[mb] = _CachedForward(inputs=x, leaf=leaf, out=out, step=self.step, nbytes=nbytes, created=now)
            self.cache_bytes += nbytes
        else:
            self.cache_skipped += 1  # the graph is freed when ``out`` goes; its backward recomputes
        return out

    def _cache_take(self, mb: int | None, x: torch.Tensor) -> _CachedForward | None:
        """The usable entry for this backward, removed from the cache; None: recompute."""
        if mb is None:
            return None
        self._cache_expire(time.monotonic())
        entry = self._cache_drop(mb, evicted=False)
        if entry is None or entry.step != self.step:
            self.cache_misses += 1
            if entry is not None:
                self.cache_evictions += 1
            return None
        if entry.inputs.dtype != x.dtype or entry.inputs.shape != x.shape or not torch.equal(entry.inputs, x):
            self.cache_misses += 1
            self.cache_mismatches += 1
            self.cache_evictions += 1
            return None
        self.cache_hits += 1
        return entry

    def _cache_drop(self, mb: int, *, evicted: bool) -> _CachedForward | None:
        entry = self._cache.pop(mb, None)
        if entry is not None:
            self.cache_bytes -= entry.nbytes
            if evicted:
                self.cache_evictions += 1
        return entry

    def _cache_expire(self, now: float) -> None:
        while self._cache:
            mb, entry = next(iter(self._cache.items()))
            if now - entry.created <= self.cache_ttl_s:
                break
            self._cache_drop(mb, evicted=True)

    def _cache_clear(self) -> None:
        """The parameters changed: every saved graph is stale."""
        self.cache_evictions += len(self._cache)
        self._cache.clear()
        self.cache_bytes = 0

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
        mb: int | None = None,
    ) -> BackwardResult:
        self._check_step(step)
        x, y = self._prepare(inputs, targets, targets_required=self.module.is_last)
        g = self._check_grad_outputs(grad_outputs, inputs)
        batch = x.shape[0]
        started = time.perf_counter()
        cached = None if self.module.is_last else self._cache_take(mb, x)
        if cached is not None:
            self._accumulate(lambda: torch.autograd.backward(cached.out, g))
            self.grad_samples += batch
            self.backward_ema.update(batch, time.perf_counter() - started)
            grad_inputs = None if self.module.is_first else _grad(cached.leaf).detach().cpu()
            return BackwardResult(grad_inputs=grad_inputs, loss=None, samples=batch, step=self.step)
        if not self.module.is_first:
            x.requires_grad_(True)
        with torch.enable_grad():
            out = self.module(x, y)
            loss: float | None = None
            if self.module.is_last:
                loss = float(out.detach())
                if not math.isfinite(loss):
                    raise RequestError("the loss is not finite; the request was not applied")
                self._accumulate(lambda: (out * batch).backward())
            else:
                self._accumulate(lambda: torch.autograd.backward(out, g))
        self.grad_samples += batch
        self.backward_ema.update(batch, time.perf_counter() - started)
        grad_inputs = None if self.module.is_first else x.grad.detach().cpu()
        return BackwardResult(grad_inputs=grad_inputs, loss=loss, samples=batch, step=self.step)

    def _accumulate(self, backward: Callable[[], None]) -> None:
        """Run ``backward`` into fresh gradients; add them to the accumulated ones only if the sum
        is finite everywhere, else refuse the request and leave the accumulator as it was.

        Inputs and ``grad_outputs`` are checked for NaN/Inf, but finite ones can still overflow
        (``grad_outputs`` of 3e38 give parameter gradients of Inf), and one Inf would poison the
        stage's next update. ``old + new`` is the very addition autograd's accumulation does, so
        accepted gradients are bit-identical to letting it accumulate; the sums replace the held
        gradients only once all of them are known to be finite.
        """
        held = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            backward()
            fresh = [p.grad for p in self.params]
        finally:
            for p, grad in zip(self.params, held):
                p.grad = grad
        summed = [new if old is None or new is None else old + new for old, new in zip(held, fresh)]
        for total in summed:
            if total is not None and not bool(torch.isfinite(total).all()):
                raise RequestError("the request's gradients overflow to Inf or NaN; refused and not applied")
        for p, total in zip(self.params, summed):
            if total is not None:
                p.grad = total

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
        self._cache_clear()
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
        self._cache_clear()
        self.step = int(meta["step"])
        self.dropped_samples += self.grad_samples
        self.grad_samples = 0
        self.averaging = False
        self.out_samples = 0


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    assert leaf.grad is not None
    return leaf.grad


def _check_finite(t: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise RequestError(f"{what} contain NaN or Inf; refused")


__all__ = ["BackwardResult", "Contribution", "ForwardResult", "StageExecutor", "ThroughputEMA"]
