"""Runs one pipeline stage's forward and backward passes on a worker thread of its own.

SWARM's backward is *stateless* (paper, section 3.2): a peer needs nothing from a
microbatch's forward to serve its backward, so any peer of the stage can serve it. A backward
request may therefore carry the stage inputs again, and the peer recomputes the forward before
backpropagating unless its activation cache (:mod:`swarmd.pipeline.stage.activation_cache`) still
holds the forward's graph. A forward the cache kept is said so in its result (``kept``), and
its backward may then come without the inputs: it is served from the cached entry, or refused
with ``InputsNotCached`` (nothing computed, nothing counted) when that entry is gone (issue #30).
Which step a backward may add its gradient to, how gradients and samples accumulate and how a
round takes them out is the step protocol
(:mod:`swarmd.pipeline.stage.step_protocol`). This module runs both on the stage's parameters: it
checks the remote tensors against the stage, and orchestrates forward, backward, the averaging
protocol's hooks and state snapshots.

Precision. ``precision`` (``--precision fp32|bf16|fp16``) runs the stage's forwards and the
recomputed forwards of its backwards under autocast, with float32 parameters, gradients and
optimizer state, and float32 outputs on the wire; fp16 adds a per-stage loss scale
(:mod:`swarmd.pipeline.stage.precision`): an overflowing backward is recomputed at half the scale.

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

Its parts, each run on the worker thread: :mod:`swarmd.pipeline.stage.passes` (forward and
backward: remote tensors checked, autocast and the loss scale, the cached forwards) and
:mod:`swarmd.pipeline.stage.updates` (gradients in and out for averaging, the update, the state
snapshot and its adoption). Here: the thread, the jobs it runs, and what it publishes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from swarmd.errors import RequestError
from swarmd.pipeline.averaging.error_feedback import ErrorFeedback, needs_feedback
from swarmd.pipeline.averaging.trust.recomputation import KeptInputs, PastParams
from swarmd.pipeline.model import StageModule, build_stage, params_digest
from swarmd.pipeline.reservations import LeaseBook
from swarmd.pipeline.spec import ModelSpec, TrainingSpec
from swarmd.pipeline.stage.activation_cache import ActivationCache, CacheStats
from swarmd.pipeline.stage.optimizer import build_optimizer
from swarmd.pipeline.stage.passes import BackwardResult, ForwardResult, StagePasses
from swarmd.pipeline.stage.precision import LossScale, check_precision
from swarmd.pipeline.stage.step_protocol import GradientAccumulator, StepProtocol
from swarmd.pipeline.stage.updates import Contribution, StageUpdates
from swarmd.pipeline.stage.worker import StageWorker
from swarmd.pipeline.throughput import ThroughputEMA
from swarmd.tasks import wait_event

__all__ = ["BackwardResult", "Contribution", "ForwardResult", "ProgressSnapshot", "StageExecutor"]

T = TypeVar("T")


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
        # the last stage keeps each microbatch's gradients apart, to open its contributions after each round
        # (swarmd.pipeline.averaging.trust.contribution_proofs; earlier stages' gradients follow others' input
        # gradients)
        self._grads = GradientAccumulator(self.params, keep_parts=stage == spec.n_stages - 1)
        # the residual of this peer's compressed contributions (lossy grad codecs only)
        self._feedback = ErrorFeedback(needs_feedback(self.training.grad_codec))
        self._cache = ActivationCache(activation_cache_entries, activation_cache_bytes, activation_cache_ttl_s)
        # ... and the inputs of each microbatch it counted, for a leader to recompute one (recomputation; not
        # under delayed updates, where a microbatch may have run at the step before)
        self._kept_inputs = KeptInputs() if self._grads.keep_parts and not self.training.delay_updates else None
        # ... and its parameters from before its last updates, to check a stage-mate's conviction by recomputation
        # with (it comes a step later: recomputation, "Seconded")
        self._past_params = PastParams() if self._kept_inputs is not None else None
        # the worker thread's jobs, on the objects above (shared, not copied)
        self.passes = StagePasses(spec, stage, self.module, self.device, precision=self.precision,
                                  loss_scale=self.loss_scale, max_batch_tokens=max_batch_tokens, steps=self._steps,
                                  grads=self._grads, cache=self._cache, forward_ema=self.forward_ema,
                                  backward_ema=self.backward_ema, kept_inputs=self._kept_inputs)
        self.updates = StageUpdates(spec, stage, self.module, training=self.training, optimizer=self.optimizer,
                                    steps=self._steps, grads=self._grads, feedback=self._feedback, cache=self._cache)
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
        # a round's hooks run before queued microbatches (swarmd.pipeline.stage.worker says why)
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
        """The exactly-once counts for ``/status`` (``swarmd.pipeline.stage.step_protocol``): repeats
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
        added only before it (``swarmd.pipeline.stage.step_protocol``, exactly once). ``verify``: a
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
        await self._run(lambda: self.updates.receive_gradients(flat, samples, step))

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
            if not await wait_event(self._progressed, left):
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
        await self._run(lambda: self.updates.restore_contribution(contribution), urgent=True)

    async def keep_residual(self, sent: torch.Tensor | None, decoded: torch.Tensor | None) -> None:
        """The round applied this peer's contribution ``sent`` as the leader decoded it: keep what
        the codec dropped for the next contribution (:mod:`swarmd.pipeline.averaging.error_feedback`)."""
        await self._run(lambda: self.updates.keep_residual(sent, decoded), urgent=True)

    async def apply_average(self, mean_grads: torch.Tensor, step: int) -> float:
        """Apply the stage-wide mean gradient as the update from ``step`` to ``step + 1``."""
        return await self._run(lambda: self._apply_average_sync(mean_grads, step), urgent=True)

    async def recompute(self, inputs: torch.Tensor, targets: torch.Tensor, precision: str,
                        step: int) -> torch.Tensor | None:
        """A stage-mate's microbatch's flat parameter gradient on this peer's parameters at ``step`` (None:
        they moved on), for checking its opening (``swarmd.pipeline.averaging.trust.recomputation``); no held
        gradient changes."""
        return await self._run(lambda: self.passes.recompute(inputs, targets, precision, step), urgent=True)

    async def recompute_past(self, inputs: torch.Tensor, targets: torch.Tensor, precision: str, step: int,
                             digest: str) -> torch.Tensor | None:
        """A microbatch's flat parameter gradient on this peer's parameters of ``digest`` at ``step``: the
        current ones, or a copy kept from before one of its last updates (None: neither), for checking a
        stage-mate's conviction by recomputation (``swarmd.pipeline.averaging.trust.recomputation``)."""
        def job() -> torch.Tensor | None:
            if self._steps.step == step and self.updates.digest == digest:
                return self.passes.recompute(inputs, targets, precision, step)
            at = self._past_params.at(step, digest) if self._past_params is not None else None
            return None if at is None else self.passes.recompute(inputs, targets, precision, step, at=at)

        return await self._run(job, urgent=True)

    @property
    def past_params_bytes(self) -> int:
        """What the kept copies of past parameters take (read on the loop: a sum of sizes)."""
        return self._past_params.nbytes if self._past_params is not None else 0

    async def snapshot_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """A consistent copy of parameters, optimizer state and step, for a joining peer."""
        return await self._run(self.updates.snapshot_state, urgent=True)

    async def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Adopt a neighbour's snapshot (parameters, optimizer state, step); drops local gradients.

        A state that does not fit this stage raises ValueError and changes nothing.
        """
        await self._run(lambda: self._load_state_sync(meta, tensors))

    def _load_state_sync(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.updates.load_state(meta, tensors)
        if self._kept_inputs is not None:
            self._kept_inputs.clear()  # its gradients are dropped, and the parameters are another's

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
            digest=self.updates.digest,
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

    # ---- jobs the worker runs under names of their own (worker thread only) -------------------------
    # The parts do the work; these names are what a liar in tests replaces (tests/support/liars.py),
    # what scripts/trace_step_end.py times and what tests/unit/test_step_protocol.py runs as a job.
    # The other jobs call the parts directly.

    def _forward_sync(
        self, inputs: torch.Tensor, targets: torch.Tensor | None, mb: int | None, source: str = ""
    ) -> ForwardResult:
        return self.passes.forward(inputs, targets, mb, source)

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
        return self.passes.backward(inputs, grad_outputs, targets, step, mb, deadline, verify, attempt, source)

    def _add_gradients_sync(self, flat: torch.Tensor, samples: int) -> None:
        self.updates.add_gradients(flat, samples)

    def _take_contribution_sync(self) -> Contribution:
        taken = self.updates.take_contribution()
        mbs = [mb for mb, _ in taken.parts if mb is not None]
        if self._kept_inputs is None or not mbs:
            return taken
        inputs = self._kept_inputs.of(taken.step, mbs)  # None: one is missing (nothing shipped, the leader strikes)
        return taken if inputs is None else dataclasses.replace(taken, inputs=inputs)

    def _apply_average_sync(self, mean_grads: torch.Tensor, step: int) -> float:
        if self._past_params is not None and self._steps.step == step:
            self._past_params.keep_copy(step, self.updates.digest, self.params)
        norm = self.updates.apply_average(mean_grads, step)
        if self._kept_inputs is not None:
            self._kept_inputs.prune(self._steps.step)
        return norm


def _on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> Callable[[Future[Any]], None]:
    """A future's done-callback (run on the worker thread) that runs ``callback`` on ``loop``."""

    def done(_: Future[Any]) -> None:
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed: nobody is left to read the snapshot
            pass

    return done
