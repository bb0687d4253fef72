"""Training throughput of a local swarm against single-process training of the same model.

**The headline comparison is** ``scripts/bench_gpipe.py`` (issue #31): swarmd against GPipe on the
same machines (``torch.distributed.pipelining``'s GPipe and 1F1B, and a hand-written GPipe), on
loopback and at 50/100 ms RTT, which is the paper's own anchor (claim C2). Three processes against
one that owns both cores is not a fair race; this script stays as the swarm's diagnostic: the
ceiling its stages' compute allows, wire bytes, CPU per process, where a step's time goes.

Two runs of the same training job, one after the other, each in its own process(es):

- **single**: every stage of ``--model`` (a preset, cut by ``--partition``) built with
  ``build_stage`` and chained in one child process, trained exactly like ``reference_run`` in ``tests/integration/test_training.py``: per step,
  the global batch of ``--batch-size`` samples split into microbatches of
  ``--microbatch-size``, ``(loss * n).backward()`` per microbatch, gradients divided by the
  step's sample count, then ``apply_step`` with ``build_optimizer``'s optimizer per stage.
  ``torch.set_num_threads(--threads)``.
- **swarm**: one daemon per stage, started as subprocesses through the real CLI (like
  ``swarmd demo``): the founder with ``--model FILE --stage 0 --target-batch-size B`` (FILE: the
  spec, its partition resolved to numbers), the
  others with ``--join <dht> --stage k``, each with ``--threads threads // stages`` so the
  daemons together get the same thread budget. A :class:`~swarmd.train.trainer.Trainer` in
  this process drives ``--warmup + --steps`` steps through them (``--sync`` by default: one
  global batch per step, then wait until every stage has stepped).

Why the comparison is fair: both draw the same samples (same corpus, seed, sampler and
order; the swarm's trainer tapers a sync step's ends unless ``--no-taper``: the first and last
microbatch halved, then, once it has measured the stages, a ramp in quarters, ``2 4 6 8 6 4 2``
for 32 in 8s (``swarmd.pipeline.partition.tapered_sizes``), which changes how the batch is
grouped, not what it holds), compute the same loss and take the same optimizer steps (with ``--sync --codec
none`` the per-step losses agree to float rounding, and the report says how closely), run
with the same total number of torch threads, and are timed over the same steps: from the end
of warm-up step ``W`` to the end of step ``W + N``, so start-up, corpus loading, first-call
allocations and the trainer's final validation are all outside the window. Samples/s is the
samples completed in that window over its wall time. What the swarm pays on top is exactly
what SWARM costs: a backward that misses the peer's activation cache recomputes the forward
(stateless backward; with one peer per stage every backward should hit, see each daemon's
``activation_cache``), activations and gradients are encoded and sent over HTTP, a stage steps
through its averaging protocol, the pipeline drains at every step in sync mode, and the
trainer process (a light client with one torch thread, outside the budget) needs CPU too;
per-process CPU time is reported so that cost is visible, and each daemon's is split into its
stage worker thread (the compute) and the rest.

``--no-sync`` runs the swarm in asynchronous mode (the trainer paces itself to the target
batch), ``--no-sync --delay-updates`` with delayed parameter updates: both no longer compute
exactly what the single run computes (``step_losses_max_rel_diff`` shows by how much); the
report's ``mode`` says which ran.

Memory: the peak RSS of every daemon (``VmHWM``, read just before it is stopped), of the
single-process child and of this process (the trainer; it never runs the baseline) are
reported, with the parameter and optimizer-state bytes of each stage for context.

Noise: on a shared machine another process taking a core ruins the single run in particular
(its two torch threads wait for each other at every kernel). Each timed window therefore
reports ``other_processes_cpu_cores``: the machine's busy CPU time (``/proc/stat``) minus this
benchmark's own, per second of wall time. Above ~0.1, rerun on a quiet machine.

``--profile`` runs the trainer's timed steps under cProfile and prints the top entries by
own time; ``--profile-daemons`` runs every daemon under cProfile (its event-loop thread, the
whole run, start-up included) and reports each one's top entries; without them, the report
still splits each step into the microbatch phase and the wait until every stage has stepped,
gives mean latencies of the trainer's calls per stage, and the daemons' own compute rate
(``/status`` ``throughput``).

    .venv/bin/python scripts/bench_pipeline.py                    # a readable summary
    .venv/bin/python scripts/bench_pipeline.py --json             # one JSON object
    .venv/bin/python scripts/bench_pipeline.py --model tiny --profile
    .venv/bin/python scripts/bench_pipeline.py --model llama-small --partition 3,1 --json

**The ceiling** (sync mode, on by default; ``--no-ceiling`` skips it): after the single run, in
its child process, every call of a sync step is timed alone on one thread through the daemon's
own ``StageExecutor`` (no transport, no averaging round), and the trainer's schedule is replayed
over those costs (``swarmd.pipeline.schedule.sync_step``): the report's ``ceiling`` is the step
that no transport, protocol or event-loop improvement could beat for that batch split, its
``ratio_to_single``, and ``swarm_share_of_ceiling``. ``--search`` also models every
rising-then-falling split of the batch and reports the best.

**Wire bytes** (``swarm.wire``): what each stage's peer received in the timed window (its
``/metrics``, ``swarmd_data_plane_received_bytes_total``), per trained sample and per microbatch, by
endpoint; with ``inputs_omitted`` / ``inputs_resent``, the backwards sent without their stage inputs
to the peer that kept them (issue #30) and those resent after a miss.
``--model scripts/models/small-4-stages.json`` has two middle stages, where that shows.

``--partition equal|balanced|N,N,...`` cuts the preset's blocks into stages: equal numbers,
the cost model's balanced cut (``swarmd.pipeline.partition``), or the blocks per stage given;
the report's ``partition`` and ``stage_flops`` show what ran.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

from swarmd.allocator import keep_freed_memory
from swarmd.errors import ConfigError
from swarmd.finite import strict_json_dumps
from swarmd.local_swarm import DaemonProcess, DaemonStartError
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.model import build_stage
from swarmd.pipeline.stage.optimizer import build_optimizer
from swarmd.pipeline.partition import flop_costs, stage_costs, tapered_sizes
from swarmd.pipeline.schedule import StageCalls, sync_step, unimodal_splits
from swarmd.pipeline.spec import PRESETS, ModelSpec, TrainingSpec
from swarmd.pipeline.spec_files import load_spec, with_partition
from swarmd.train.data import BatchSampler, load_corpus
from swarmd.train.events import CallDone, StepDone, StepWait, TrainerEvent
from swarmd.train.reference import single_process_step
from swarmd.train.trainer import Trainer, TrainerConfig, split_batch

CORPUS_BYTES = 8 * 2**20  # the trainer's default; passed explicitly to both runs
SEED = 0
PROFILE_TOP = 15
_CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """A run could not be completed (a daemon failed to start, a child crashed)."""


@dataclass(frozen=True)
class Settings:
    preset: str
    steps: int
    warmup: int
    batch_size: int
    microbatch_size: int
    window: int
    codec: str
    sync: bool
    threads: int
    delay_updates: bool = False
    taper: bool = True  # the trainer tapers a sync step's ends (swarmd.pipeline.partition.tapered_sizes)
    max_taper_depth: int = 2  # ... at most this finely (1: the halved ends only)
    partition: str = "equal"  # equal, balanced, or blocks per stage "3,1"
    ceiling: bool = True  # also measure each stage's calls alone and model the best possible sync step
    search: bool = False  # ... and search every rising-then-falling batch split for the best one

    @property
    def spec(self) -> ModelSpec:
        """The preset, cut as ``partition`` says (resolved to numbers)."""
        return with_partition(load_spec(self.preset), self.partition)

    @property
    def mode(self) -> str:
        """How the swarm steps: ``sync``, ``async`` or ``async+delay_updates``."""
        return ("sync" if self.sync else "async") + ("+delay_updates" if self.delay_updates else "")

    @property
    def stages(self) -> int:
        return self.spec.n_stages

    @property
    def daemon_threads(self) -> int:
        return max(1, self.threads // self.stages)

    def microbatch_sizes(self) -> list[int]:
        """How the single run splits one global batch: as the trainer's sync mode does, untapered."""
        return split_batch(self.batch_size, self.microbatch_size)

    def schedules(self) -> dict[int, list[int]]:
        """The batch splits the swarm trainer may use in sync mode, by taper depth."""
        depths = range(self.max_taper_depth + 1) if self.taper else range(1)
        return {d: tapered_sizes(self.batch_size, self.microbatch_size, d) for d in depths}

    @property
    def search_max_parts(self) -> int:
        """The most microbatches a searched split may have: twice the plain split's, and one."""
        return 2 * -(-self.batch_size // self.microbatch_size) + 1

    def measured_sizes(self) -> list[int]:
        """The microbatch sizes whose calls the ceiling times."""
        if self.search:
            return list(range(1, min(self.microbatch_size, self.batch_size) + 1))
        return sorted({n for sizes in self.schedules().values() for n in sizes})


# ---- process accounting ---------------------------------------------------------------------


def peak_rss_bytes(pid: int) -> int | None:
    """``VmHWM`` of a live process (its peak resident set), or None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU time of a live process so far, all its threads together (or of its
    thread ``tid`` alone: ``tid == pid`` is the main thread, a daemon's event loop)."""
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 onwards
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14 and 15)


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (``/proc/stat``; idle and iowait excluded).

    Compared with a run's own CPU time over the same window, this shows how much CPU other
    processes took meanwhile: on a shared machine, a timing to distrust.
    """
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def self_peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ---- single: every stage in one process -------------------------------------------------------


def single_run(s: Settings) -> dict[str, Any]:
    """Train the chained stages in this process; time steps ``warmup + 1 .. warmup + steps``.

    The loop is ``reference_run`` of tests/integration/test_training.py with the trainer's batch split;
    it runs in a child process of the benchmark so its memory and CPU are its own.
    """
    keep_freed_memory()  # as every daemon does at start-up (swarmd.allocator): the same allocator for both runs
    torch.set_num_threads(s.threads)
    spec = s.spec
    training = TrainingSpec(target_batch_size=s.batch_size)  # what the founder publishes
    corpus = load_corpus(None, max_bytes=CORPUS_BYTES, seed=SEED, seq_len=spec.seq_len)
    sampler = BatchSampler(corpus.train, spec.seq_len, seed=SEED)
    stages = [build_stage(spec, k) for k in range(spec.n_stages)]
    optimizers = [build_optimizer(training, stage.named_parameters()) for stage in stages]
    sizes = s.microbatch_sizes()
    losses: list[float] = []
    step_ends: list[float] = []
    cpu_at_start = wall_at_start = busy_at_start = 0.0
    for step in range(s.warmup + s.steps):
        if step == s.warmup:
            cpu_at_start, wall_at_start = time.process_time(), time.perf_counter()
            busy_at_start = machine_busy_seconds()
        microbatches = [sampler.sample(n) for n in sizes]  # drawn before computing, like the trainer
        losses.append(single_process_step(stages, optimizers, training, microbatches, step))
        step_ends.append(time.perf_counter())
    wall = time.perf_counter() - wall_at_start
    cpu = time.process_time() - cpu_at_start
    busy = machine_busy_seconds() - busy_at_start
    step_s = [b - a for a, b in zip(step_ends[s.warmup - 1 :], step_ends[s.warmup :])]
    samples = s.steps * s.batch_size
    return {
        "samples_per_s": samples / wall,
        "samples": samples,
        "wall_s": wall,
        "cpu_s": cpu,
        "other_processes_cpu_cores": max(0.0, busy - cpu) / wall,
        "step_ms_median": statistics.median(step_s) * 1e3,
        "step_ms_max": max(step_s) * 1e3,
        "torch_threads": torch.get_num_threads(),
        "peak_rss_bytes": self_peak_rss_bytes(),
        "step_losses": losses,
        "stage_param_bytes": [sum(p.numel() * p.element_size() for p in st.parameters()) for st in stages],
        "stage_optimizer_state_bytes": [
            sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor))
            for opt in optimizers
        ],
    }


def run_single_child(s: Settings, timeout_s: float = 3600.0) -> dict[str, Any]:
    """:func:`single_run` in a fresh interpreter (this script with ``--single-child``), then
    (in sync mode, unless ``--no-ceiling``) :func:`measure_calls` there, after the timed window."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--single-child", json.dumps(asdict(s))],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        _stop(proc)
    if proc.returncode != 0:
        raise BenchError(f"the single-process run exited with code {proc.returncode}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


# ---- the ceiling: each stage's calls alone, and the best sync step they allow -----------------

CEILING_REPEATS = 5  # timed calls per stage, kind and microbatch size (after one untimed)


def measure_calls(s: Settings) -> list[StageCalls]:
    """What every call of a sync step costs one stage on one thread, with nothing else running:
    the median worker-thread CPU of :data:`CEILING_REPEATS` calls per kind and microbatch size
    (forward, and backward from the activation cache, on every stage but the last; the fused
    call on the last) and of its update (take the gradients, apply the mean: the optimizer step
    and the parameter digest), through the daemon's own :class:`StageExecutor` (its input
    checks, activation cache and gradient accumulator; no transport, no averaging round)."""
    return asyncio.run(_measure_calls(s))


async def _measure_calls(s: Settings) -> list[StageCalls]:
    spec = s.spec
    sizes = s.measured_sizes()
    gen = torch.Generator().manual_seed(SEED)
    mbs = iter(range(1, 1 << 62))
    stages = []
    for k in range(spec.n_stages):
        ex = StageExecutor(spec, k, "cpu", training=TrainingSpec(target_batch_size=s.batch_size), threads=1)
        try:
            stages.append(await _measure_stage(ex, sizes, gen, mbs))
        finally:
            await ex.close()
    return stages


async def _measure_stage(ex: StageExecutor, sizes: list[int], gen: torch.Generator, mbs: Iterator[int]) -> StageCalls:
    spec, last = ex.spec, ex.module.is_last

    async def timed(call: Awaitable[Any]) -> float:
        before = ex.worker_cpu_s
        await call
        return ex.worker_cpu_s - before

    async def one(n: int) -> dict[str, float]:
        mb = next(mbs)
        x = (torch.randint(0, spec.vocab_size, (n, spec.seq_len), generator=gen) if ex.module.is_first
             else torch.randn(n, spec.seq_len, spec.d_model, generator=gen))
        if last:
            y = torch.randint(0, spec.vocab_size, (n, spec.seq_len), generator=gen)
            return {"fused": await timed(ex.backward(x, None, y, mb=mb))}
        cost = {"forward": await timed(ex.forward(x, None, mb=mb))}
        grad = torch.randn(n, spec.seq_len, spec.d_model, generator=gen)
        cost["backward"] = await timed(ex.backward(x, grad, None, step=ex.step, mb=mb))
        return cost

    async def update() -> float:
        before = ex.worker_cpu_s
        taken = await ex.take_contribution()
        if taken.grads is None:
            raise BenchError(f"stage {ex.stage} held no gradients to update with")
        await ex.apply_average(taken.grads / taken.samples, taken.step)
        return ex.worker_cpu_s - before

    costs: dict[str, dict[int, float]] = {"forward": {}, "backward": {}, "fused": {}}
    for n in sizes:
        runs = [await one(n) for _ in range(CEILING_REPEATS + 1)][1:]
        for kind in runs[0]:
            costs[kind][n] = statistics.median(r[kind] for r in runs)
    updates = []
    for _ in range(CEILING_REPEATS + 1):
        await one(sizes[0])
        updates.append(await update())
    return StageCalls(forward=costs["forward"], backward=costs["backward"], fused=costs["fused"],
                      update=statistics.median(updates[1:]))


def _stage_calls_json(calls: StageCalls) -> dict[str, Any]:
    return {
        **{kind: {str(n): round(c * 1e3, 3) for n, c in sorted(table.items())}
           for kind, table in (("forward", calls.forward), ("backward", calls.backward), ("fused", calls.fused))
           if table},
        "update": round(calls.update * 1e3, 3),
    }


def _stage_calls_from_json(d: dict[str, Any]) -> StageCalls:
    def table(kind: str) -> dict[int, float]:
        return {int(n): ms / 1e3 for n, ms in d.get(kind, {}).items()}
    return StageCalls(forward=table("forward"), backward=table("backward"), fused=table("fused"),
                      update=d["update"] / 1e3)


def ceiling_report(s: Settings, calls: list[StageCalls], single_sps: float, swarm_sps: float,
                   ran: list[int]) -> dict[str, Any]:
    """The modelled best sync step (:func:`swarmd.pipeline.schedule.sync_step`, no transport) for
    every batch split the trainer may use, and as the main figures for the one it ran (``ran``,
    from the timeline; else the finest), against the single run and the swarm."""
    def model(depth: int, sizes: list[int]) -> dict[str, Any]:
        # the trainer chains the microbatches under the finer taper (swarmd.train.sync_steps.SyncSteps.send_batch)
        sched = sync_step(sizes, calls, window=s.window, chained=depth >= 2, hop=0.0)
        sps = s.batch_size / sched.step_s
        return {"taper_depth": depth, "sizes": sizes, "step_ms": sched.step_s * 1e3, "samples_per_s": sps,
                "ratio_to_single": sps / single_sps, "busy_ms": [b * 1e3 for b in sched.busy_s],
                "idle_ms": [i * 1e3 for i in sched.idle_s]}
    by_depth = {d: model(d, sizes) for d, sizes in s.schedules().items()}
    main = next((m for m in by_depth.values() if m["sizes"] == ran), by_depth[max(by_depth)])
    report = {
        **main,
        "swarm_share_of_ceiling": swarm_sps / main["samples_per_s"],
        "by_taper_depth": {str(d): m for d, m in by_depth.items()},
        "call_cpu_ms": {f"stage{k}": _stage_calls_json(c) for k, c in enumerate(calls)},
    }
    if s.search:
        report["search"] = search_splits(s, calls, single_sps)
    return report


def search_splits(s: Settings, calls: list[StageCalls], single_sps: float, keep: int = 5) -> dict[str, Any]:
    """Every rising-then-falling split of the batch (:func:`swarmd.pipeline.schedule.unimodal_splits`,
    at most :attr:`Settings.search_max_parts` microbatches), chained and not, through the same
    model: the best ``keep`` and how many were tried."""
    scored = []
    for sizes in unimodal_splits(s.batch_size, min(s.microbatch_size, s.batch_size), s.search_max_parts):
        for chained in (True, False):
            step = sync_step(sizes, calls, window=s.window, chained=chained, hop=0.0).step_s
            scored.append((step, len(sizes), sizes, chained))
    scored.sort()
    return {
        "splits_tried": len(scored) // 2,
        "max_parts": s.search_max_parts,
        "best": [{"sizes": list(sizes), "chained": chained, "step_ms": step * 1e3,
                  "ratio_to_single": s.batch_size / step / single_sps} for step, _, sizes, chained in scored[:keep]],
    }


# ---- swarm: one daemon per stage, a trainer in this process -----------------------------------


def _stop(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> int | None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)


def received_bytes(daemon: DaemonProcess) -> dict[str, float]:
    """Request bytes the daemon's data plane received so far, by endpoint (its ``/metrics``:
    ``swarmd_data_plane_received_bytes_total``, all codecs), i.e. what crossed the wire into it."""
    with urllib.request.urlopen(f"{daemon.api}/metrics", timeout=5.0) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "swarmd_data_plane_received_bytes_total":
                endpoint = sample.labels.get("endpoint", "")
                out[endpoint] = out.get(endpoint, 0.0) + sample.value
    return out


def wire_report(window: Window, samples: int, microbatch_size: int) -> dict[str, Any]:
    """The bytes each stage's peer received in the timed window per trained sample, by endpoint,
    and per microbatch of ``microbatch_size`` samples (issue #30: a backward that omits its stage's
    inputs shrinks a middle stage's ``/v1/backward`` by one activation per microbatch)."""
    stages = []
    for i, (before, after) in enumerate(zip(window.wire0, window.wire1)):
        got = {e: after.get(e, 0.0) - before.get(e, 0.0) for e in ("/v1/forward", "/v1/backward", "/v1/average")}
        per_sample = {e: b / samples for e, b in got.items()}
        stages.append({"stage": i, "bytes_per_sample": per_sample,
                       "compute_bytes_per_microbatch": (per_sample["/v1/forward"] + per_sample["/v1/backward"])
                       * microbatch_size})
    compute = sum(st["compute_bytes_per_microbatch"] for st in stages)
    return {"stages": stages, "compute_bytes_per_microbatch": compute, "microbatch_size": microbatch_size}


class DaemonProc(DaemonProcess):
    """One daemon of the swarm run (the local-swarm harness): on CPU, files ``peerN.*`` in ``workdir``.

    With ``profile``, the child runs under cProfile: its main thread (the event loop: HTTP, codecs'
    hand-offs, the averaging protocol), written to ``peerN.prof`` when it exits; the worker
    thread's compute is not in it.
    """

    def __init__(self, index: int, workdir: Path, args: Sequence[str], *, profile: bool = False) -> None:
        self.index = index
        self.profile_path = workdir / f"peer{index}.prof" if profile else None
        command = [sys.executable, "-m", "cProfile", "-o", str(self.profile_path), "-m", "swarmd"] if profile else None
        super().__init__(["--device", "cpu", "--drain-timeout", "5", "--log-level", "WARNING", *args], workdir,
                         name=f"peer{index}", command=command, threads=None)  # --threads is in args


@dataclass
class CallStats:
    count: int = 0
    seconds: float = 0.0


@dataclass
class Window:
    """What happened between the end of warm-up step W and the end of step W + N."""

    warmup: int
    last: int
    daemons: list[DaemonProc]
    profiler: cProfile.Profile | None = None
    open: bool = False
    t0: float = 0.0
    t1: float = 0.0
    samples0: int = 0
    samples1: int = 0
    cpu0: dict[int, float | None] = field(default_factory=dict)  # per daemon pid
    worker_cpu0: list[float] = field(default_factory=list)  # per daemon: its stage worker thread's CPU
    cpu1: dict[int, float | None] = field(default_factory=dict)
    main_cpu0: dict[int, float | None] = field(default_factory=dict)  # per daemon pid: its main thread
    main_cpu1: dict[int, float | None] = field(default_factory=dict)
    trainer_cpu_s: float = 0.0  # this process's CPU time inside the window
    machine_busy_s: float = 0.0  # every process's, see machine_busy_seconds
    step_ends: list[float] = field(default_factory=list)
    wait_s: float = 0.0  # StepWait events: every microbatch done, waiting for the stages to step
    calls: dict[str, CallStats] = field(default_factory=dict)
    trace: list[tuple[int, str, int, float, float]] = field(default_factory=list)  # stage, kind, samples, start, end
    statuses: list[dict[str, Any]] = field(default_factory=list)
    wire0: list[dict[str, float]] = field(default_factory=list)  # per daemon: its data plane's bytes in, by endpoint
    wire1: list[dict[str, float]] = field(default_factory=list)

    def _daemon_cpu(self) -> dict[int, float | None]:
        return {d.pid: cpu_seconds(d.pid) for d in self.daemons}

    def _daemon_main_cpu(self) -> dict[int, float | None]:
        return {d.pid: cpu_seconds(d.pid, d.pid) for d in self.daemons}

    def observe(self, event: TrainerEvent) -> None:
        """The trainer's listener (``Trainer(config, events=window.observe)``): books steps,
        the waits for them and every stage call, inside the window."""
        if isinstance(event, StepDone):
            self.on_step(event.done, event.progress)
        elif isinstance(event, StepWait):
            if self.open:
                self.wait_s += event.ended - event.started
        elif isinstance(event, CallDone) and self.open:
            stats = self.calls.setdefault(f"stage{event.stage}.{event.kind}", CallStats())
            stats.count += 1
            stats.seconds += event.ended - event.started
            self.trace.append((event.stage, event.kind, event.samples, event.started, event.ended))

    def on_step(self, done: int, info: dict[str, Any]) -> None:
        if done == self.warmup:  # before the clock starts (in sync mode nothing runs at this moment)
            self.worker_cpu0 = [float(d.status().get("worker_cpu_s", 0.0)) for d in self.daemons]
        now = time.perf_counter()
        if self.open or done == self.warmup:
            self.step_ends.append(now)
        if done == self.warmup:
            self.t0, self.samples0, self.cpu0 = now, int(info["samples"]), self._daemon_cpu()
            self.wire0 = [received_bytes(d) for d in self.daemons]
            self.main_cpu0 = self._daemon_main_cpu()
            self.trainer_cpu_s = -time.process_time()
            self.machine_busy_s = -machine_busy_seconds()
            self.open = True
            if self.profiler is not None:
                self.profiler.enable()
        elif done == self.last and self.open:
            if self.profiler is not None:
                self.profiler.disable()
            self.open = False
            self.t1, self.samples1, self.cpu1 = now, int(info["samples"]), self._daemon_cpu()
            self.main_cpu1 = self._daemon_main_cpu()
            self.trainer_cpu_s += time.process_time()
            self.machine_busy_s += machine_busy_seconds()
            # before the trainer's final validation, which would feed the daemons' rate EMAs
            self.statuses = [d.status() for d in self.daemons]
            self.wire1 = [received_bytes(d) for d in self.daemons]


async def swarm_run(
    s: Settings, workdir: Path, daemons: list[DaemonProc], profile: bool, profile_daemons: bool = False
) -> dict[str, Any]:
    """Start one daemon per stage, train ``warmup + steps`` steps through them, stop them."""
    common = ["--swarm", "bench", "--announce-period", "2", "--threads", str(s.daemon_threads)]
    model_file = workdir / "model.json"
    model_file.write_text(json.dumps(s.spec.to_dict()))
    founder = DaemonProc(0, workdir, [*common, "--model", str(model_file), "--stage", "0",
                                      "--target-batch-size", str(s.batch_size),
                                      *(["--delay-updates"] if s.delay_updates else [])],
                         profile=profile_daemons)
    daemons.append(founder)
    await asyncio.to_thread(founder.wait_ready)
    for k in range(1, s.stages):
        daemons.append(DaemonProc(k, workdir, [*common, "--join", founder.info["dht_addr"], "--stage", str(k)],
                                  profile=profile_daemons))
    await asyncio.gather(*(asyncio.to_thread(d.wait_ready) for d in daemons[1:]))

    torch.set_num_threads(1)  # the trainer only samples, encodes and decodes
    keep_freed_memory()  # as `swarmd train` does
    window = Window(warmup=s.warmup, last=s.warmup + s.steps, daemons=daemons,
                    profiler=cProfile.Profile() if profile else None)
    config = TrainerConfig(
        api=f"http://{founder.info['api_addr']}", steps=s.warmup + s.steps, batch_size=s.batch_size,
        microbatch_size=s.microbatch_size, codec=s.codec, seed=SEED, window=s.window, sync=s.sync,
        val_every=0, max_corpus_bytes=CORPUS_BYTES, name="bench", taper=s.taper, max_taper_depth=s.max_taper_depth,
    )
    trainer = Trainer(config, events=window.observe)
    summary = await trainer.run()
    assert trainer.training is not None
    if window.t1 == 0.0:
        raise BenchError(f"the trainer finished without reaching step {window.last}")

    daemon_reports = []
    for i, (d, st) in enumerate(zip(daemons, window.statuses)):
        c0, c1 = window.cpu0.get(d.pid), window.cpu1.get(d.pid)
        throughput = float(st["throughput"])
        worker0 = window.worker_cpu0[i] if i < len(window.worker_cpu0) else None
        daemon_reports.append({
            "stage": st["stage"],
            "pid": d.pid,
            "threads": s.daemon_threads,
            "peak_rss_bytes": peak_rss_bytes(d.pid),  # just before it is stopped
            "cpu_s": None if c0 is None or c1 is None else c1 - c0,
            # of which the stage's worker thread (forward/backward/update compute); the rest is
            # the event loop, HTTP, codec threads and the averaging protocol
            "worker_cpu_s": None if worker0 is None else float(st.get("worker_cpu_s", 0.0)) - worker0,
            # the main thread: the event loop (HTTP, the averaging protocol, DHT)
            "event_loop_cpu_s": _delta(window.main_cpu0.get(d.pid), window.main_cpu1.get(d.pid)),
            "throughput_samples_per_s": throughput,  # its own forward + backward compute rate (EMA)
            "compute_s_per_step_est": s.batch_size / throughput if throughput else None,
            "served": st["served"],
            "step": st["step"],
            "averaging_rounds_ok": (st.get("averaging") or {}).get("rounds_ok"),
            "activation_cache": st.get("activation_cache"),  # hits, misses, bytes (whole run so far)
        })
    exit_codes = [d.stop() for d in daemons]
    for report, code, d in zip(daemon_reports, exit_codes, daemons):
        report["exit_code"] = code
        if d.profile_path is not None and d.profile_path.exists():
            report["event_loop_profile"] = _profile_report(pstats.Stats(str(d.profile_path)), top=10)

    wall = window.t1 - window.t0
    samples = window.samples1 - window.samples0
    step_s = [b - a for a, b in zip(window.step_ends, window.step_ends[1:])]
    timeline: list[list[Any]] = []
    if len(window.step_ends) > 2:  # the trainer's calls in the second timed step, ms from its start
        a, b = window.step_ends[1], window.step_ends[2]
        timeline = [[stage, kind, n, round((t0 - a) * 1e3, 1), round((t1 - a) * 1e3, 1)]
                    for stage, kind, n, t0, t1 in sorted(window.trace, key=lambda e: e[3]) if a <= t0 < b]
        timeline.append(["step_end", round((b - a) * 1e3, 1)])
    own_cpu = window.trainer_cpu_s + sum(r["cpu_s"] or 0.0 for r in daemon_reports)
    result: dict[str, Any] = {
        "samples_per_s": samples / wall,
        "samples": samples,
        "wall_s": wall,
        "other_processes_cpu_cores": max(0.0, window.machine_busy_s - own_cpu) / wall,
        "step_ms_median": statistics.median(step_s) * 1e3 if step_s else None,
        "step_ms_max": max(step_s) * 1e3 if step_s else None,
        "phases_s": {  # meaningful in sync mode: a step is its microbatches, then the wait to step
            "microbatches_and_bookkeeping": wall - window.wait_s,
            "wait_all_stepped": window.wait_s,
        },
        "calls": {
            name: {"count": c.count, "mean_ms": c.seconds / c.count * 1e3, "total_s": c.seconds}
            for name, c in sorted(window.calls.items())
        },
        "daemons": daemon_reports,
        # [stage, kind, samples, start_ms, end_ms] of every call of one step, as the trainer saw it
        # (latency: queueing, transfer and compute), then ["step_end", ms]
        "timeline_one_step": timeline,
        "trainer": {
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "cpu_s": window.trainer_cpu_s,
            "peak_rss_bytes": self_peak_rss_bytes(),
        },
        "training_spec_matches_single": trainer.training.digest == TrainingSpec(target_batch_size=s.batch_size).digest,
        "step_losses": summary.step_losses,
        "retries": summary.retries,
        "stale_redos": summary.stale_redos,
        "topup_microbatches": summary.topup_microbatches,
        "microbatches_issued": summary.microbatches_issued,
        "microbatches_completed": summary.microbatches_completed,
        # bytes into every stage's peer in the window (forward + backward requests: what the trainer sent)
        "wire": wire_report(window, samples, s.microbatch_size),
        "inputs_omitted": getattr(summary, "inputs_omitted", None),  # None: a build before issue #30
        "inputs_resent": getattr(summary, "inputs_resent", None),
    }
    if window.profiler is not None:
        result["profile"] = _profile_report(pstats.Stats(window.profiler))
    return result


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _profile_report(stats: pstats.Stats, top: int = PROFILE_TOP) -> dict[str, Any]:
    """The top entries by own time, as rows and as pstats' text."""
    text = io.StringIO()
    stats.stream = text  # type: ignore[attr-defined]
    stats.sort_stats(pstats.SortKey.TIME).print_stats(top)
    # pstats' own table: (file, line, function) -> (primitive calls, calls, own time, cumulative, callers)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = getattr(stats, "stats")
    total = sum(own for _, _, own, _, _ in raw.values())
    rows = []
    for (file, line, func), (_, calls, own, cumulative, _) in sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]:
        rows.append({
            "function": func if file == "~" else f"{Path(file).name}:{line}({func})",
            "calls": calls,
            "tottime_s": round(own, 4),
            "cumtime_s": round(cumulative, 4),
            "share_of_total": round(own / total, 4) if total else None,
        })
    return {"total_s": total, "top_by_tottime": rows, "text": text.getvalue()}


# ---- the comparison -------------------------------------------------------------------------


def _max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float | None:
    pairs = list(zip(a, b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs) if pairs else None


def run(s: Settings, profile: bool, profile_daemons: bool = False) -> dict[str, Any]:
    single = run_single_child(s)
    daemons: list[DaemonProc] = []
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-") as tmp:
        try:
            swarm = asyncio.run(swarm_run(s, Path(tmp), daemons, profile, profile_daemons))
        except BaseException:
            for d in daemons:
                tail = d.log_tail()
                if tail:
                    print(f"--- daemon {d.index} log (end) ---\n{tail}", file=sys.stderr)
            raise
        finally:
            for d in daemons:
                d.stop()
    single_losses, swarm_losses = single.pop("step_losses"), swarm.pop("step_losses")
    call_costs = single.pop("call_costs", None)
    ceiling = None
    if call_costs is not None:  # measured with two stages or more: stage 0's forwards give the split that ran
        ran = [row[2] for row in swarm["timeline_one_step"] if row[0] == 0 and row[1] == "forward"]
        ceiling = ceiling_report(s, [_stage_calls_from_json(c) for c in call_costs], single["samples_per_s"],
                                 swarm["samples_per_s"], ran)
    daemon_cpu = sum(d["cpu_s"] or 0.0 for d in swarm["daemons"])
    cpu_per_sample = {  # CPU seconds (all threads) per trained sample, inside the timed windows
        "single": single["cpu_s"] / single["samples"],
        "swarm_daemons": daemon_cpu / swarm["samples"],
        "swarm_trainer": swarm["trainer"]["cpu_s"] / swarm["samples"],
    }
    return {
        **asdict(s),
        "mode": s.mode,
        "stages": s.stages,
        "daemon_threads": s.daemon_threads,
        "single_samples_per_s": single["samples_per_s"],
        "swarm_samples_per_s": swarm["samples_per_s"],
        "ratio": swarm["samples_per_s"] / single["samples_per_s"],
        # the best sync step the stages' own compute allows (no transport): see ceiling_report
        "ceiling": ceiling,
        "step_losses_max_rel_diff": _max_rel_diff(swarm_losses, single_losses),
        "cpu_ms_per_sample": {k: v * 1e3 for k, v in cpu_per_sample.items()},
        "first_loss": single_losses[0],
        "final_loss": {"single": single_losses[-1], "swarm": swarm_losses[-1] if swarm_losses else None},
        "partition": list(s.spec.blocks_per_stage),
        "stage_flops": stage_costs(flop_costs(s.spec), s.spec.blocks_per_stage),
        "stage_param_bytes": single.pop("stage_param_bytes"),
        "stage_optimizer_state_bytes": single.pop("stage_optimizer_state_bytes"),
        "single": single,
        "swarm": swarm,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "load_average_1m_at_end": os.getloadavg()[0],
    }


def _mib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**20:.0f} MiB"


def print_summary(r: dict[str, Any]) -> None:
    sw, si = r["swarm"], r["single"]
    print(f"model {r['preset']} ({r['stages']} stages of {r['partition']} blocks), batch {r['batch_size']} "
          "in microbatches of "
          f"{r['microbatch_size']}, window {r['window']}, codec {r['codec']}, {r['mode']}, "
          f"{r['steps']} timed steps after {r['warmup']} warm-up, {r['threads']} threads "
          f"({r['daemon_threads']} per daemon)")
    print(f"single: {r['single_samples_per_s']:8.1f} samples/s  (step {si['step_ms_median']:.0f} ms median, "
          f"{si['step_ms_max']:.0f} ms max, CPU {si['cpu_s'] / si['wall_s']:.2f} cores, "
          f"peak RSS {_mib(si['peak_rss_bytes'])})")
    print(f"swarm:  {r['swarm_samples_per_s']:8.1f} samples/s  (step {sw['step_ms_median']:.0f} ms median, "
          f"{sw['step_ms_max']:.0f} ms max)")
    busy = max(si["other_processes_cpu_cores"], sw["other_processes_cpu_cores"])
    if busy > 0.1:
        print(f"WARNING: other processes used up to {busy:.2f} cores during the timed steps; "
              "the numbers are skewed")
    print(f"ratio swarm/single: {r['ratio']:.2f}; step losses agree to {r['step_losses_max_rel_diff']:.1e} (relative)")
    c = r.get("ceiling")
    if c:
        print(f"ceiling (each stage's calls alone on one thread, no transport, microbatches {c['sizes']}): "
              f"{c['samples_per_s']:.1f} samples/s, step {c['step_ms']:.0f} ms, {c['ratio_to_single']:.2f} of single; "
              f"the swarm reached {c['swarm_share_of_ceiling']:.2f} of it")
        print("  stage idle in the modelled step: " + ", ".join(f"{i:.0f} ms" for i in c["idle_ms"])
              + "; by taper depth: " + ", ".join(f"{d}: {m['ratio_to_single']:.2f}"
                                                 for d, m in c["by_taper_depth"].items()))
        if "search" in c:
            best = c["search"]["best"][0]
            print(f"  best of {c['search']['splits_tried']} rising-then-falling splits: {best['sizes']} "
                  f"({'chained' if best['chained'] else 'unchained'}), {best['ratio_to_single']:.2f} of single")
    cpu = r["cpu_ms_per_sample"]
    print(f"CPU per sample: single {cpu['single']:.1f} ms, swarm {cpu['swarm_daemons']:.1f} ms in the daemons "
          f"+ {cpu['swarm_trainer']:.1f} ms in the trainer")
    wall = sw["wall_s"]
    ph = sw["phases_s"]
    print(f"swarm window {wall:.1f}s: microbatches {ph['microbatches_and_bookkeeping']:.1f}s, "
          f"waiting for the stages to step {ph['wait_all_stepped']:.1f}s")
    for name, c in sw["calls"].items():
        print(f"  {name:<18} {c['count']:5d} calls, {c['mean_ms']:7.1f} ms mean")
    for d in sw["daemons"]:
        print(f"  daemon stage {d['stage']}: compute {d['throughput_samples_per_s']:.0f} samples/s "
              f"(~{d['compute_s_per_step_est'] or 0:.2f}s per step), CPU {d['cpu_s'] or 0:.1f}s "
              f"({(d['cpu_s'] or 0) / wall:.2f} cores; worker thread {d['worker_cpu_s'] or 0:.1f}s, "
              f"event loop {d['event_loop_cpu_s'] or 0:.1f}s), "
              f"peak RSS {_mib(d['peak_rss_bytes'])}")
        cache = d.get("activation_cache")
        if cache:
            print(f"    activation cache: {cache['hits']} hits, {cache['misses']} misses, "
                  f"{cache['evictions']} evicted, {_mib(cache['bytes'])} held at the end")
    wire = sw.get("wire")
    if wire:
        print(f"  bytes into the stages' peers per microbatch of {wire['microbatch_size']} (forward + backward): "
              + ", ".join(f"stage {st['stage']} {st['compute_bytes_per_microbatch'] / 2**10:.0f} KiB"
                          for st in wire["stages"])
              + f"; all {wire['compute_bytes_per_microbatch'] / 2**10:.0f} KiB")
    tr = sw["trainer"]
    print(f"  trainer: CPU {tr['cpu_s']:.1f}s ({tr['cpu_s'] / wall:.2f} cores), peak RSS {_mib(tr['peak_rss_bytes'])}")
    print("stage parameters: " + ", ".join(_mib(b) for b in r["stage_param_bytes"])
          + "; optimizer state: " + ", ".join(_mib(b) for b in r["stage_optimizer_state_bytes"]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Run from the repository root with the project's .venv.")
    p.add_argument("--model", "--preset", dest="preset", default="small", metavar="PRESET|FILE",
                   help=f"model preset ({', '.join(sorted(PRESETS))}) or a JSON model file (default: small)")
    p.add_argument("--partition", default="equal", metavar="equal|balanced|N,N,...",
                   help="blocks per stage: equal, the cost model's balanced cut, or numbers (default: equal)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them, at least 1 (default: 3)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step (default: 32)")
    p.add_argument("--microbatch-size", type=int, default=8, help="samples per microbatch (default: 8)")
    p.add_argument("--window", type=int, default=4, help="the trainer's microbatches in flight (default: 4)")
    p.add_argument("--codec", choices=("none", "fp16", "bf16", "8bit", "4bit"), default="none",
                   help="activation codec between stages (default: none)")
    p.add_argument("--sync", action=argparse.BooleanOptionalAction, default=True,
                   help="sync mode: one global batch per step, wait for every stage (default: --sync)")
    p.add_argument("--delay-updates", action="store_true",
                   help="the swarm uses delayed parameter updates (staleness 1; meaningful without --sync, "
                   "and then not the same computation as the single run)")
    p.add_argument("--taper", action=argparse.BooleanOptionalAction, default=True,
                   help="the swarm trainer tapers a sync step's ends (halves, then quarters once measured), "
                   "which shortens the pipeline's fill and drain; same samples, same gradient (default: --taper)")
    p.add_argument("--max-taper-depth", type=int, choices=(1, 2), default=2,
                   help="the finest taper the trainer may use: 1 halves the ends only, 2 also ramps them in "
                   "quarters once it has measured that a small microbatch is worth its request (default: 2)")
    p.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                   help="in sync mode, also time each stage's calls alone on one thread (after the single run) "
                   "and model the best sync step they allow: the report's 'ceiling' (default: --ceiling)")
    p.add_argument("--search", action="store_true",
                   help="with --ceiling: also time every microbatch size up to --microbatch-size and model every "
                   "rising-then-falling split of the batch, reporting the best (slower: ~30,000 splits)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the single run, split evenly over the daemons (default: CPU count)")
    p.add_argument("--profile", action="store_true", help="run the trainer's timed steps under cProfile")
    p.add_argument("--profile-daemons", action="store_true",
                   help="run each daemon under cProfile (its event-loop thread, the whole run) and report the top entries")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--single-child", metavar="SETTINGS", help=argparse.SUPPRESS)  # internal
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.single_child is not None:
        child = Settings(**json.loads(args.single_child))
        single = single_run(child)
        if child.sync and child.ceiling and child.stages > 1:
            single["call_costs"] = [_stage_calls_json(c) for c in measure_calls(child)]
        print(strict_json_dumps(single))
        return 0
    for name in ("steps", "warmup", "batch_size", "microbatch_size", "window", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        with_partition(load_spec(args.preset), args.partition)
    except ConfigError as exc:
        parser.error(f"--model {args.preset} --partition {args.partition}: {exc}")
    settings = Settings(partition=args.partition,
                        preset=args.preset, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
                        microbatch_size=args.microbatch_size, window=args.window, codec=args.codec,
                        sync=args.sync, threads=args.threads, delay_updates=args.delay_updates,
                        taper=args.taper, max_taper_depth=args.max_taper_depth, ceiling=args.ceiling,
                        search=args.search)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the children like Ctrl-C does

    signal.signal(signal.SIGTERM, interrupt)
    try:
        result = run(settings, args.profile, args.profile_daemons)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (BenchError, DaemonStartError) as exc:
        print(f"bench_pipeline: error: {exc}", file=sys.stderr)
        return 1
    profile_text = result["swarm"].get("profile", {}).pop("text", None)
    for d in result["swarm"]["daemons"]:
        text = (d.get("event_loop_profile") or {}).pop("text", None)
        if text:
            print(f"daemon stage {d['stage']}, event-loop thread, whole run (top 10 by own time):\n{text}",
                  file=sys.stderr)
    if args.json:
        if profile_text:
            print(profile_text, file=sys.stderr)
        print(strict_json_dumps(result))
    else:
        print_summary(result)
        if profile_text:
            print(f"\ntrainer profile over the timed steps (top {PROFILE_TOP} by own time):\n{profile_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
