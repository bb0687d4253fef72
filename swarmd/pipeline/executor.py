"""Runs one pipeline stage's forward and backward passes on a worker thread of its own.

SWARM's backward is *stateless* (paper, section 3.2): a peer needs nothing from a
microbatch's forward to serve its backward, so any peer of the stage can serve it. A backward
request may therefore carry the stage inputs again, and the peer recomputes the forward before
backpropagating unless its activation cache (:mod:`swarmd.pipeline.activation_cache`) still
holds the forward's graph. A forward the cache kept is said so in its result (``kept``), and
its backward may then come without the inputs: it is served from the cached entry, or refused
with ``InputsNotCached`` (nothing computed, nothing counted) when that entry is gone (issue #30).
Which step a backward may add its gradient to, how gradients and samples accumulate and how a
round takes them out is the step protocol
(:mod:`swarmd.pipeline.step_protocol`). This module runs both on the stage's parameters: it
checks the remote tensors against the stage, and orchestrates forward, backward, the averaging
protocol's hooks and state snapshots.

Precision. ``precision`` (``--precision fp32|bf16|fp16``) runs the stage's forwards and the
recomputed forwards of its backwards under autocast, with float32 parameters, gradients and
optimizer state, and float32 outputs on the wire; fp16 adds a per-stage loss scale
(:mod:`swarmd.pipeline.precision`): an overflowing backward is recomputed at half the scale.

Threads. All torch work runs on one worker thread owned by the executor: the event loop never
blocks on compute, and jobs on one stage never race on ``.grad``. The step protocol, the
gradient accumulator and the activation cache belong to that thread. What other threads may
read is a frozen :class:`ProgressSnapshot` that the worker publishes after every job (one
reference assignment) and the event loop adopts when it collects the job's result: the
executor's attributes (``step``, ``grad_samples``, ``out_samples``, ``averaging``, ``digest``,
...) read that snapshot, so loop code sees them change only between its awaits, all together,
never half-way through a job (a take moves ``grad_samples`` into ``out_samples``; their sum is
what ``/v1/progress`` reports). One call skips the worker: :meth:`StageExecutor.claim` (exactly
once) answers at once on the event loop, through the step protocol's lock on its microbatch books.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from swarmd.errors import InputsNotCached, LimitExceeded, RequestError, RequestTimeout
from swarmd.finite import all_finite
from swarmd.pipeline.activation_cache import ActivationCache, CachedForward, CacheStats, capture_forward
from swarmd.pipeline.error_feedback import ErrorFeedback, needs_feedback
from swarmd.pipeline.model import StageModule, build_stage, params_digest
from swarmd.pipeline.optimizer import apply_step, build_optimizer
from swarmd.pipeline.optimizer_state import load_optimizer_state_tensors, optimizer_state_tensors
from swarmd.pipeline.precision import LossScale, autocast, check_precision
from swarmd.pipeline.reservations import LeaseBook
from swarmd.pipeline.spec import ModelSpec, TrainingSpec
from swarmd.pipeline.stage_worker import StageWorker
from swarmd.pipeline.step_protocol import GradientAccumulator, StepProtocol, Verdict, judge_backward
from swarmd.pipeline.throughput import ThroughputEMA

__all__ = ["BackwardResult", "Contribution", "ForwardResult", "ProgressSnapshot", "StageExecutor"]

T = TypeVar("T")


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


@dataclass(frozen=True)
class Contribution:
    """A stage's accumulated gradients, taken out for averaging (``grads`` None: no samples)."""

    step: int
    samples: int
    grads: torch.Tensor | None  # flat float32 sum over samples, parameters in name order
    mbs: tuple[int, ...] = ()  # the microbatch ids it holds (a leader counts repeats: step_protocol)


@dataclass(frozen=True)
class ProgressSnapshot:
    """The executor's state after one job, as every reader off the worker thread sees it."""

    step: int  # the optimizer step the parameters are at
    grad_samples: int  # samples accumulated since the last take
    out_samples: int  # samples of the contribution out for averaging
    averaging: bool  # gradients are out for averaging: backwards are refused (Busy) unless delayed
    digest: str  # of the parameters at ``step``
    stale_dropped: int  # backwards refused because they were computed at an older step
    stale_applied: int  # delayed updates: backwards one step old, accumulated into the next update
    dropped_samples: int  # accumulated samples discarded by adopting a stage-mate's state
    handed_in_samples: int  # samples whose gradients leaving stage-mates handed to this peer
    duplicates: int  # backwards of a microbatch already counted at that step (answered, not added)
    late_refused: int  # backwards past their sender's deadline (not added: it retried elsewhere)
    fenced_refused: int  # attempts a trainer's claim fenced off (not added: it asked, then retried)
    throughput: float  # samples/s for a forward + backward (see StageExecutor.throughput)
    worker_cpu_s: float  # CPU time of the worker thread's jobs (the stage's compute)
    cache: CacheStats

    @property
    def held_samples(self) -> int:
        """Samples this peer holds gradients of, accumulating or out for averaging."""
        return self.grad_samples + self.out_samples

    def _progress_key(self) -> tuple[int, int, int, bool]:
        return self.step, self.grad_samples, self.out_samples, self.averaging


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
        precision: str = "fp32",
    ) -> None:
        self.spec = spec
        self.stage = stage
        self.device = torch.device(device)
        self.precision = check_precision(precision)
        # fp16's per-stage loss scale (the worker thread's); None in fp32 and bf16, which need none
        self.loss_scale: LossScale | None = LossScale() if precision == "fp16" else None
        self.max_batch_tokens = max_batch_tokens
        self.training = training or TrainingSpec()
        self.module: StageModule = build_stage(spec, stage, device=self.device)
        self.params = [p for _, p in self.module.named_parameters()]
        self.optimizer = build_optimizer(self.training, self.module.named_parameters())
        self.forward_ema = ThroughputEMA()
        self.backward_ema = ThroughputEMA()
        # the worker thread's own state: nothing else touches it
        self._steps = StepProtocol(stage, delay_updates=self.training.delay_updates)
        self._grads = GradientAccumulator(self.params)
        # the residual of this peer's compressed contributions (lossy grad codecs only)
        self._feedback = ErrorFeedback(needs_feedback(self.training.grad_codec))
        self._cache = ActivationCache(activation_cache_entries, activation_cache_bytes, activation_cache_ttl_s)
        self._shared = frozenset(p.untyped_storage().data_ptr() for p in self.params)
        self._digest = params_digest(self.module)  # of the parameters at the step; refreshed on every change
        self._cpu_s = 0.0
        self.grad_numel = self._grads.numel
        # the stage's sample reservations for its current step (swarmd.pipeline.reservations);
        # event-loop state, not the worker's: POST /v1/reserve reads and changes it between awaits
        self.reservations = LeaseBook(self.training.target_batch_size)
        # what other threads read: published by the worker, adopted on the event loop
        self._published = self._snapshot_now()
        self.progress_snapshot = self._published
        self._pending = 0
        self._threads = threads
        self._progressed: asyncio.Event | None = None  # set (and replaced) when the progress changes
        # a round's hooks run before queued microbatches (swarmd.pipeline.stage_worker says why)
        self._pool = StageWorker(f"swarmd-stage{stage}", initializer=self._init_worker)
        self._closed = False

    # ---- introspection (from the progress snapshot) ---------------------------------------

    @property
    def step(self) -> int:
        return self.progress_snapshot.step

    @property
    def grad_samples(self) -> int:
        return self.progress_snapshot.grad_samples

    @property
    def out_samples(self) -> int:
        return self.progress_snapshot.out_samples

    @property
    def averaging(self) -> bool:
        return self.progress_snapshot.averaging

    @property
    def digest(self) -> str:
        return self.progress_snapshot.digest

    @property
    def stale_dropped(self) -> int:
        return self.progress_snapshot.stale_dropped

    @property
    def stale_applied(self) -> int:
        return self.progress_snapshot.stale_applied

    @property
    def dropped_samples(self) -> int:
        return self.progress_snapshot.dropped_samples

    @property
    def handed_in_samples(self) -> int:
        return self.progress_snapshot.handed_in_samples

    @property
    def duplicates(self) -> int:
        return self.progress_snapshot.duplicates

    @property
    def late_refused(self) -> int:
        return self.progress_snapshot.late_refused

    def exactly_once(self) -> dict[str, int]:
        """The exactly-once counts for ``/status`` (``swarmd.pipeline.step_protocol``): repeats
        answered but not added, attempts refused past their deadline or fenced off by a claim,
        and the claims answered (how many found the microbatch counted here)."""
        s = self.progress_snapshot
        # the claim counts are the event loop's own (claim() runs on it), not the worker's: read as they are
        return {"duplicates": s.duplicates, "late_refused": s.late_refused, "fenced_refused": s.fenced_refused,
                "claims": self._steps.claims, "claims_counted": self._steps.claims_counted}

    @property
    def worker_cpu_s(self) -> float:
        return self.progress_snapshot.worker_cpu_s

    @property
    def throughput(self) -> float:
        """Samples per second for a full forward + backward, from the two EMAs.

        A microbatch needs both passes on this stage, so the rate that matters to routing is
        ``1 / (1/fwd + 1/bwd)``; with only one kind measured so far, that one.
        """
        return self.progress_snapshot.throughput

    @property
    def queue(self) -> int:
        """Jobs submitted to the worker and not finished yet (the one running included)."""
        return self._pending

    @property
    def cache_bytes(self) -> int:
        """Bytes of saved activations the activation cache holds now."""
        return self.progress_snapshot.cache.bytes

    @property
    def cache_max_bytes(self) -> int:
        return self.progress_snapshot.cache.max_bytes

    def cache_stats(self) -> dict[str, int]:
        """The activation cache's counters and current size (for ``/status``)."""
        return self.progress_snapshot.cache.to_dict()

    async def params_digest(self) -> str:
        """Recompute the digest of the parameters now (``digest`` is the cached one)."""
        return await self._run(lambda: params_digest(self.module))

    # ---- compute ---------------------------------------------------------------------------

    async def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None, mb: int | None = None, source: str = ""
    ) -> ForwardResult:
        """Stage outputs (on the last stage with targets, the scalar mean loss) and their step.

        ``mb`` names the microbatch: its graph and inputs are kept for the backward if they fit
        (``kept``; never on the last stage, whose backward is a fused forward + backward), for a
        backward from ``source`` (the sender's IP) only when it omits the inputs.
        """
        return await self._run(lambda: self._forward_sync(inputs, targets, mb, source))

    async def backward(
        self,
        inputs: torch.Tensor | None,
        grad_outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        step: int | None = None,
        mb: int | None = None,
        deadline: float | None = None,
        verify: bool = False,
        attempt: int = 0,
        source: str = "",
    ) -> BackwardResult:
        """Recompute the forward (or reuse the cached graph of ``mb``), backpropagate, accumulate.

        ``inputs`` None: those of the forward this stage kept under ``mb`` for ``source``, or
        ``InputsNotCached`` when it holds none (before anything is computed or counted).

        ``step`` is the step the microbatch's forward on this stage ran at (None: no check,
        as for the last stage's fused forward + backward). ``mb`` is counted once per step (a
        repeat is answered, not added); ``deadline`` (``time.monotonic()``): the gradient is
        added only before it (``swarmd.pipeline.step_protocol``, exactly once). ``verify``: a
        trainer's spot check: computed and answered, never accumulated nor counted. ``attempt``:
        the trainer's number of this attempt at ``mb`` (a :meth:`claim` from the same ``source``,
        the sender's IP, may fence it off).
        """
        return await self._run(lambda: self._backward_sync(inputs, grad_outputs, targets, step, mb, deadline, verify,
                                                           attempt, source))

    def claim(self, mb: int, attempt: int, source: str = "") -> tuple[bool, int]:
        """Whether microbatch ``mb`` is counted here, and the step; if not, its attempts below
        ``attempt`` never will be (``StepProtocol.claim``). Answered at once on the event loop,
        not queued behind the worker's jobs: the step protocol's books take a lock for it."""
        return self._steps.claim(mb, attempt, source), self.progress_snapshot.step

    async def add_gradients(self, flat: torch.Tensor, samples: int) -> None:
        """Accumulate a flat gradient sum over ``samples`` samples as a backward would, under the
        same step rule: for benchmarks and tests that need gradients without computing them."""
        if samples < 1:
            raise ValueError(f"a gradient sum covers at least one sample, got {samples}")
        await self._run(lambda: self._add_gradients_sync(flat, samples))

    async def receive_gradients(self, flat: torch.Tensor, samples: int, step: int) -> None:
        """Accumulate a leaving stage-mate's gradient sum of ``samples`` samples computed at ``step``
        (the step protocol's ``receive``: the same step only, never while averaging)."""
        if samples < 1:
            raise RequestError(f"handed-over gradients cover at least one sample, got {samples}")
        if flat.numel() != self.grad_numel:
            raise RequestError(f"handed-over gradients must have {self.grad_numel} values, got {flat.numel()}")
        await self._run(lambda: self._receive_gradients_sync(flat, samples, step))

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

    # ---- steps: the averaging protocol's hooks (all on the worker thread) ------------------

    async def take_contribution(self) -> Contribution:
        """Move the accumulated gradients out for averaging; refuse backwards until settled."""
        return await self._run(self._take_contribution_sync, urgent=True)

    async def restore_contribution(self, contribution: Contribution) -> None:
        """The round failed: put the gradients back and accept backwards again."""
        await self._run(lambda: self._restore_contribution_sync(contribution), urgent=True)

    async def keep_residual(self, sent: torch.Tensor | None, decoded: torch.Tensor | None) -> None:
        """The round applied this peer's contribution ``sent`` as the leader decoded it: keep what
        the codec dropped for the next contribution (:mod:`swarmd.pipeline.error_feedback`)."""
        await self._run(lambda: self._feedback.keep(sent, decoded), urgent=True)

    async def apply_average(self, mean_grads: torch.Tensor, step: int) -> float:
        """Apply the stage-wide mean gradient as the update from ``step`` to ``step + 1``."""
        return await self._run(lambda: self._apply_average_sync(mean_grads, step), urgent=True)

    async def snapshot_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """A consistent copy of parameters, optimizer state and step, for a joining peer."""
        return await self._run(self._snapshot_state_sync, urgent=True)

    async def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Adopt a neighbour's snapshot (parameters, optimizer state, step); drops local gradients.

        A state that does not fit this stage raises ValueError and changes nothing.
        """
        await self._run(lambda: self._load_state_sync(meta, tensors))

    async def close(self) -> None:
        """Let queued jobs finish, then stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self._adopt()

    # ---- the worker and what it publishes -------------------------------------------------------

    def _init_worker(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)

    async def _run(self, fn: Callable[[], T], *, urgent: bool = False) -> T:
        if self._closed:
            raise RuntimeError("executor is closed")
        self._pending += 1

        def job() -> T:
            started = time.thread_time()
            try:
                return fn()
            finally:  # a refused request may have changed counters too
                self._cpu_s += time.thread_time() - started
                self._published = self._snapshot_now()

        future = self._pool.submit(job, urgent=urgent)
        try:
            return await asyncio.wrap_future(future)
        finally:
            self._pending -= 1
            if future.done():
                self._adopt()
            else:  # our caller was cancelled while the job runs: adopt its outcome when it ends
                future.add_done_callback(_on_loop(asyncio.get_running_loop(), self._adopt))

    def _snapshot_now(self) -> ProgressSnapshot:
        """The worker's state now (on the worker thread, or before it starts)."""
        rates = [ema.value for ema in (self.forward_ema, self.backward_ema) if ema.count]
        steps = self._steps
        return ProgressSnapshot(
            step=steps.step,
            grad_samples=steps.grad_samples,
            out_samples=steps.out_samples,
            averaging=steps.averaging,
            digest=self._digest,
            stale_dropped=steps.stale_dropped,
            stale_applied=steps.stale_applied,
            dropped_samples=steps.dropped_samples,
            handed_in_samples=steps.handed_in_samples,
            duplicates=steps.duplicates,
            late_refused=steps.late_refused,
            fenced_refused=steps.fenced_refused,
            throughput=1.0 / sum(1.0 / r for r in rates) if rates else 0.0,
            worker_cpu_s=self._cpu_s,
            cache=self._cache.stats(),
        )

    def _adopt(self) -> None:
        """Take the worker's latest snapshot as the event loop's view; wake waiters on progress."""
        new, old = self._published, self.progress_snapshot
        if new is old:
            return
        self.progress_snapshot = new
        if new._progress_key() != old._progress_key():
            event, self._progressed = self._progressed, None
            if event is not None:
                event.set()

    # ---- input checks -----------------------------------------------------------------------------

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
        expected = [inputs.shape[0], inputs.shape[1], self.spec.boundary_width]
        if not grad_outputs.is_floating_point() or list(grad_outputs.shape) != expected:
            raise RequestError(
                f"grad_outputs must be float of shape {expected}, got {grad_outputs.dtype} "
                f"{list(grad_outputs.shape)}"
            )
        _check_finite(grad_outputs, "grad_outputs")
        return grad_outputs.to(self.device, torch.float32)

    # ---- jobs (worker thread only) -----------------------------------------------------------------

    def _forward_sync(
        self, inputs: torch.Tensor, targets: torch.Tensor | None, mb: int | None, source: str = ""
    ) -> ForwardResult:
        x, y = self._prepare(inputs, targets, targets_required=False)
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

    def _backward_sync(
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
            x, y = self._prepare(inputs, targets, targets_required=self.module.is_last)
        else:  # not reached: admit() refused what the step rule did not admit
            raise RequestError("a backward without 'inputs' that the step rule does not admit")
        g = self._check_grad_outputs(grad_outputs, x)
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
                self._grads.add(backward, commit=commit)
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
        self.backward_ema.update(batch, time.perf_counter() - started)
        grad_inputs = None if self.module.is_first else _grad(leaf).detach().cpu()
        return BackwardResult(grad_inputs=grad_inputs, loss=loss, samples=batch, step=current, duplicate=not first)

    def _held_forward(self, mb: int | None, step: int, targets: torch.Tensor | None, source: str) -> CachedForward:
        """The cached forward a backward without inputs is served from (see :meth:`backward`)."""
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

    def _add_gradients_sync(self, flat: torch.Tensor, samples: int) -> None:
        self._steps.admit(None)
        self._grads.put(flat, accumulate=True)
        self._steps.accumulated(samples)

    def _receive_gradients_sync(self, flat: torch.Tensor, samples: int, step: int) -> None:
        self._steps.receive(step, samples)  # the step rule first: a refused hand-over changes nothing
        self._grads.put(flat, accumulate=True)

    def _take_contribution_sync(self) -> Contribution:
        taken = self._steps.take()
        if taken.samples:
            grads: torch.Tensor | None = self._feedback.compensate(self._grads.take())
        else:
            grads = None
            self._grads.clear()
        return Contribution(step=taken.step, samples=taken.samples, grads=grads, mbs=taken.mbs)

    def _restore_contribution_sync(self, contribution: Contribution) -> None:
        if self._steps.restore(contribution.step, contribution.samples) and contribution.grads is not None:
            self._grads.put(contribution.grads, accumulate=True)

    def _apply_average_sync(self, mean_grads: torch.Tensor, step: int) -> float:
        self._steps.begin_update(step)
        # Under delayed updates the stage kept serving during the round: what it accumulated
        # meanwhile belongs to the next update, so it is set aside and put back after this one.
        held = self._grads.hold()
        try:
            self._grads.put(mean_grads)
            norm = apply_step(self.optimizer, self.training, self.params, step)
        finally:
            self._grads.reinstate(held)
        self._digest = params_digest(self.module)
        # every saved graph holds the old parameters; under delayed updates a backward one step old
        # still counts, so its forward's inputs stay (it recomputes rather than asking for them again)
        self._cache.clear(keep_inputs=self._steps.delay_updates)
        self._steps.finish_update()
        return norm

    def _snapshot_state_sync(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
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

    def _load_state_sync(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
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
        self._digest = params_digest(self.module)
        self._cache.clear()
        self._steps.adopt(step)


def _on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> Callable[[Future[Any]], None]:
    """A future's done-callback (run on the worker thread) that runs ``callback`` on ``loop``."""

    def done(_: Future[Any]) -> None:
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed: nobody is left to read the snapshot
            pass

    return done


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
        raise RequestError(f"{what} contain NaN or Inf; refused")
