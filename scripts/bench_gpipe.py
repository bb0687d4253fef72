"""swarmd against GPipe on the same machines, side by side: the paper's claim C2 (section 4.1, issue #31).

"SWARM is competitive with GPipe without latency, and under 100 ms latency GPipe's throughput degrades
2-3x while SWARM's holds." One invocation trains the same model (``--model`` cut into ``--stages``
equal stages, the same deterministic initial weights), with the same AdamW (``build_optimizer`` /
``apply_step``), on the same samples (corpus, seed and sampler of ``bench_pipeline.py``), the same
global batch split into the same microbatches, one torch thread per stage process, in five ways:

- ``swarmd``: one daemon per stage through the real CLI (``swarmd.local_swarm.DaemonProcess``), a
  trainer (``swarmd.train.trainer.Trainer``, ``--sync``, codec none, untapered unless ``--taper``) in
  its own process: activations go stage -> trainer -> next stage over HTTP;
- ``swarmd_p2p``: the same with the trainer's ``--p2p``: each stage's outputs go straight to the next
  stage's peer and the backwards chain back, only token ids and meta through the trainer;
- ``pipelining_gpipe`` / ``pipelining_1f1b``: ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and
  ``Schedule1F1B`` over gloo, one process per stage (``scale_grads``: the mean of equal microbatches'
  losses, the same gradient as the reference; needs a batch that the microbatch size divides);
- ``gpipe_prepost``: a hand-written GPipe that posts all of a step's receives (activations from the
  stage before, gradients from the stage after) up front with ``irecv``, then runs every forward and
  every backward, sending with ``isend``: the round trips of a step overlap instead of adding up.

Every variant is timed the same way: samples completed between the end of warm-up step W and the end
of step W + N (for the GPipe variants, the latest stage to finish each), over that wall time.
Scenarios: ``loopback`` (127.0.0.1, no latency) always; in the network lab (``scripts/netlab.py``:
one network namespace per stage, root needed, latency added in user space because this kernel has no
netem) ``rtt50``/``rtt100`` at 50/100 ms RTT and ``rtt50cap``/``rtt100cap`` with every host's egress
also capped at 100 Mbit/s; those are skipped with the reason when the lab cannot run. In the lab,
stage k (its daemon, or its GPipe rank) runs in host k, and swarmd's trainer in host 0 beside stage 0,
as a volunteer runs a trainer beside its own daemon: its calls to stage 0 cross no link, those to the
other stages cross one each way, while GPipe's activations cross one link per stage boundary. The report
gives every rate in samples/s, ``ratios`` (swarmd over each GPipe variant), each variant's rate over
its own ``loopback`` rate, every variant's per-step losses and how far they are from
``gpipe_prepost``'s (the same math: float rounding only), each swarmd stage's median averaging round
(``round_s_median``, by its ``/status``; None in the lab, whose hosts' control planes are out of reach), and
the load average.

Defaults: ``tiny`` (64 wide, one block per stage: per-call overheads dominate, so it is the hard case
for swarmd's HTTP hops), 2 stages, batch 32 in microbatches of 8, 3 timed steps after 2 warm-up. Most
of the time is process start-up: on the loaded 2-core development machine one scenario (four variants)
took 1-2 minutes, so ``--scenarios loopback`` is the quick run and all five take about ten. The issue's
own measurement used ``--model small --steps 10 --warmup 3``; take the median of 3 runs on a quiet
machine before believing a ratio.

    sudo .venv/bin/python scripts/bench_gpipe.py --json
    .venv/bin/python scripts/bench_gpipe.py --scenarios loopback --stages 4 --json
    sudo .venv/bin/python scripts/bench_gpipe.py --model small --steps 10 --warmup 3 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))  # netlab.py and bench_wan.py beside this file

import bench_wan  # noqa: E402
import netlab  # noqa: E402
from swarmd.finite import strict_json_dumps  # noqa: E402
from swarmd.local_swarm import DaemonProcess, DaemonStartError, stopping  # noqa: E402

SEED = 0
CORPUS_BYTES = 8 * 2**20  # as bench_pipeline.py: both the trainer and the GPipe ranks load this much
CHILD_TIMEOUT_S = 1800.0
VARIANTS = ("swarmd", "swarmd_p2p", "pipelining_gpipe", "pipelining_1f1b", "gpipe_prepost")
SWARMD = ("swarmd", "swarmd_p2p")  # the variants that run swarmd (the second with the trainer's --p2p)
REFERENCE = "gpipe_prepost"  # the losses of the others are compared with this one's


class BenchError(Exception):
    """A variant could not be completed (a daemon, the trainer or a GPipe rank failed)."""


@dataclass(frozen=True)
class Scenario:
    """A network setting: ``rtt_ms`` between any two hosts (half on each host's egress), an egress cap."""

    name: str
    rtt_ms: float
    rate: str | None
    lab: bool = True

    @property
    def delay_s(self) -> float:
        return self.rtt_ms / 2 / 1e3


SCENARIOS = {s.name: s for s in (
    Scenario("loopback", 0.0, None, lab=False),
    Scenario("rtt50", 50.0, None), Scenario("rtt50cap", 50.0, "100mbit"),
    Scenario("rtt100", 100.0, None), Scenario("rtt100cap", 100.0, "100mbit"),
)}


@dataclass(frozen=True)
class Settings:
    model: str = "tiny"
    stages: int = 2
    steps: int = 3
    warmup: int = 2
    batch_size: int = 32
    microbatch_size: int = 8
    window: int | None = 4  # the swarmd trainer's microbatches in flight (None: auto, swarmd.train.window)
    taper: bool = False  # the swarmd trainer tapers a step's ends (then its microbatches differ from GPipe's)

    def spec(self) -> Any:
        """The preset with ``stages`` stages of its ``layers_per_stage`` blocks, cut equally."""
        from swarmd.pipeline.spec import PRESETS
        from swarmd.pipeline.spec_files import with_partition

        return with_partition(dataclasses.replace(PRESETS[self.model], n_stages=self.stages), "equal")

    def sizes(self) -> list[int]:
        from swarmd.train.sync_steps import split_batch

        return split_batch(self.batch_size, self.microbatch_size)


class Net(Protocol):
    """Where the processes run: this host's loopback, or one lab host per stage."""

    def addr(self, host: int) -> str: ...

    def command(self, host: int, argv: Sequence[str]) -> list[str]: ...


class Loopback:
    ifname = "lo"

    def addr(self, host: int) -> str:
        return "127.0.0.1"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        return list(argv)


# ---- swarmd: daemons through the real CLI, the trainer in a child process --------------------------


def swarm_trainer_child(s: Settings, api: str, p2p: bool = False) -> dict[str, Any]:
    """The swarm's trainer (inside host 0): ``bench_wan``'s window over a sync, codec-none trainer
    (``p2p``: its forwards and backwards go peer to peer, ``swarmd train --p2p``)."""
    import asyncio

    import torch

    from swarmd.train.trainer import Trainer, TrainerConfig

    torch.set_num_threads(1)
    window = bench_wan.Window(warmup=s.warmup, last=s.warmup + s.steps)
    config = TrainerConfig(api=api, steps=s.warmup + s.steps, batch_size=s.batch_size,
                           microbatch_size=s.microbatch_size, codec="none", seed=SEED, window=s.window,
                           sync=True, val_every=0, max_corpus_bytes=CORPUS_BYTES, name="bench-gpipe",
                           taper=s.taper, p2p=p2p)
    summary = asyncio.run(Trainer(config, events=window.observe).run())
    if window.t1 == 0.0:
        raise BenchError(f"the trainer finished without reaching step {window.last}")
    return {"window_s": window.t1 - window.t0, "samples": window.samples1 - window.samples0,
            "step_losses": summary.step_losses, "retries": summary.retries,
            "in_flight": summary.window, "in_flight_need": summary.window_need}


def run_swarmd(s: Settings, net: Net, workdir: Path, tag: str, p2p: bool = False) -> dict[str, Any]:
    model_file = workdir / "model.json"
    model_file.write_text(json.dumps(s.spec().to_dict()))
    daemons: list[DaemonProcess] = []
    with stopping(daemons):
        for k in range(s.stages):
            addr = net.addr(k)
            args = ["--host", addr, "--dht-host", addr, "--api-host", "127.0.0.1", "--swarm", "bench-gpipe",
                    "--device", "cpu", "--drain-timeout", "5", "--log-level", "WARNING", "--announce-period", "2",
                    "--rebalance-policy", "none", "--stage", str(k)]
            args += (["--model", str(model_file), "--target-batch-size", str(s.batch_size)] if k == 0
                     else ["--join", daemons[0].info["dht_addr"]])
            daemons.append(DaemonProcess(args, workdir, name=f"{tag}-stage{k}", env={"OMP_NUM_THREADS": "1"},
                                         command=net.command(k, [sys.executable, "-m", "swarmd"]), threads=1))
            if k == 0:
                daemons[0].wait_ready(300)
        for d in daemons[1:]:
            d.wait_ready(300)
        child = json.dumps({"settings": asdict(s), "api": f"http://{daemons[0].info['api_addr']}", "p2p": p2p})
        done = subprocess.run(net.command(0, [sys.executable, str(Path(__file__).resolve()), "--trainer-child", child]),
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        if done.returncode != 0:
            raise BenchError(f"the swarmd trainer exited with {done.returncode}: {done.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        result["round_s_median"] = [_round_median(d) for d in daemons]
    return result


def _round_median(d: DaemonProcess) -> float | None:
    """A stage's median averaging round by its ``/status`` (its last rounds, warm-up ones included), None
    where its control plane is out of reach from here (on a lab host's loopback)."""
    try:
        recent = d.status().get("averaging", {}).get("recent", [])
    except (OSError, ValueError):
        return None
    durations = [r["duration_s"] for r in recent
                 if r.get("status") == "ok" and isinstance(r.get("duration_s"), (int, float))]
    return round(statistics.median(durations), 4) if durations else None


# ---- GPipe: one gloo rank per stage -------------------------------------------------------------------


def _posted(work: Any) -> Any:
    """A point-to-point request's handle (torch types it optional: None when this rank is not in the group)."""
    if work is None:
        raise BenchError("a point-to-point request was not posted")
    return work


def _prepost_step(stage: Any, rank: int, world: int, microbatches: list[tuple[Any, Any]], d_model: int) -> float:
    """One GPipe step of this rank with every receive posted first; the step's loss on the last rank."""
    import torch
    import torch.distributed as dist

    first, last = rank == 0, rank == world - 1
    shapes = [(x.shape[0], x.shape[1], d_model) for x, _ in microbatches]
    acts = [torch.empty(sh) for sh in shapes] if not first else []
    grads = [torch.empty(sh) for sh in shapes] if not last else []
    act_reqs = [_posted(dist.irecv(b, rank - 1, tag=m)) for m, b in enumerate(acts)]
    grad_reqs = [_posted(dist.irecv(b, rank + 1, tag=m)) for m, b in enumerate(grads)]
    sends: list[Any] = []
    sent: list[Any] = []  # kept alive until their sends complete
    kept: list[tuple[Any, Any]] = []
    weighted = 0.0

    def send(t: Any, dst: int, m: int) -> None:
        sent.append(t)
        sends.append(_posted(dist.isend(t, dst, tag=m)))

    for m, (x, y) in enumerate(microbatches):
        if first:
            h = x
        else:
            act_reqs[m].wait()
            h = acts[m].requires_grad_()
        if last:
            loss = stage(h, y)
            (loss * x.shape[0]).backward()
            weighted += loss.item() * x.shape[0]
            if not first:
                send(h.grad, rank - 1, m)
        else:
            out = stage(h)
            send(out.detach(), rank + 1, m)
            kept.append((h, out))
    for m, (h, out) in enumerate(kept):
        grad_reqs[m].wait()
        out.backward(grads[m])
        if not first:
            send(h.grad, rank - 1, m)
    for w in sends:
        w.wait()
    return weighted / sum(sh[0] for sh in shapes)


def gpipe_rank_child(c: dict[str, Any]) -> dict[str, Any]:
    """One stage of a GPipe variant (this process is inside host ``rank``); its step ends and losses."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from swarmd.allocator import keep_freed_memory
    from swarmd.pipeline.model import build_stage
    from swarmd.pipeline.stage.optimizer import apply_step, build_optimizer
    from swarmd.pipeline.spec import TrainingSpec
    from swarmd.train.data import BatchSampler, load_corpus

    s, rank, variant = Settings(**c["settings"]), int(c["rank"]), c["variant"]
    world = s.stages
    torch.set_num_threads(1)
    keep_freed_memory()  # as the daemons do
    spec = s.spec()
    dist.init_process_group("gloo", init_method=c["init_method"], rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    stage = build_stage(spec, rank)
    training = TrainingSpec(target_batch_size=s.batch_size)  # what the swarm's founder publishes
    opt = build_optimizer(training, stage.named_parameters())
    params = list(stage.parameters())
    corpus = load_corpus(None, max_bytes=CORPUS_BYTES, seed=SEED, seq_len=spec.seq_len)
    sampler = BatchSampler(corpus.train, spec.seq_len, seed=SEED)
    sizes = s.sizes()
    schedule = None
    if variant != "gpipe_prepost":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        def loss_fn(logits: Any, targets: Any) -> Any:  # as the last stage computes it with targets
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

        kind = ScheduleGPipe if variant == "pipelining_gpipe" else Schedule1F1B
        schedule = kind(PipelineStage(stage, rank, world, torch.device("cpu")), len(sizes), loss_fn=loss_fn)
    losses: list[float] = []
    ends: list[float] = []
    for step in range(s.warmup + s.steps):
        microbatches = [sampler.sample(n) for n in sizes]  # every rank draws the same, as the trainer does
        if schedule is None:
            loss = _prepost_step(stage, rank, world, microbatches, spec.d_model)
        else:
            x, y = torch.cat([m[0] for m in microbatches]), torch.cat([m[1] for m in microbatches])
            mb_losses: list[Any] = []
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=mb_losses)
            else:
                schedule.step()
            loss = float(torch.stack([t.detach() for t in mb_losses]).mean()) if mb_losses else 0.0
        # the gradients hold the mean over the step's samples (scale_grads / division in _prepost_step)
        if schedule is None:
            for p in params:
                if p.grad is not None:
                    p.grad /= s.batch_size
        apply_step(opt, training, params, step)
        losses.append(loss)
        ends.append(time.perf_counter())  # CLOCK_MONOTONIC: comparable across this machine's processes
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "step_ends": ends, "step_losses": losses if rank == world - 1 else None}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_gpipe(s: Settings, net: Net, variant: str, ifname: str) -> dict[str, Any]:
    init = f"tcp://{net.addr(0)}:{_free_port()}"  # in the lab, a port free here is as good as any there
    env = {**os.environ, "GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(s.stages):
        child = json.dumps({"settings": asdict(s), "rank": rank, "variant": variant, "init_method": init})
        procs.append(subprocess.Popen(net.command(rank, [sys.executable, str(Path(__file__).resolve()),
                                                         "--gpipe-child", child]),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs: list[dict[str, Any]] = []
    errors = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=CHILD_TIMEOUT_S)
            if p.returncode != 0:
                errors.append(f"rank {rank} exited with {p.returncode}: {err[-2000:]}")
            else:
                outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if errors:
        raise BenchError(f"{variant}: " + "; ".join(errors))
    w = s.warmup
    t0 = max(o["step_ends"][w - 1] for o in outs)  # every stage has finished warm-up
    t1 = max(o["step_ends"][-1] for o in outs)  # every stage has taken the last step
    losses = next(o["step_losses"] for o in outs if o["step_losses"] is not None)
    return {"window_s": t1 - t0, "samples": s.steps * s.batch_size, "step_losses": losses}


# ---- scenarios and the report ---------------------------------------------------------------------------


def _max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float | None:
    pairs = list(zip(a, b, strict=False))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs) if pairs else None


def run_variants(s: Settings, net: Net, ifname: str, variants: Sequence[str], workdir: Path,
                 tag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in variants:
        print(f"bench_gpipe: {tag}: {v}", file=sys.stderr)
        try:
            # each swarmd variant its own daemons' directories: a second start in one would read the first's files
            r = (run_swarmd(s, net, workdir, f"{tag}-{v}", p2p=v == "swarmd_p2p") if v in SWARMD
                 else run_gpipe(s, net, v, ifname))
        except (BenchError, DaemonStartError, subprocess.TimeoutExpired, ValueError) as exc:
            out[v] = {"error": str(exc)[-3000:]}
            continue
        r["samples_per_s"] = r["samples"] / r["window_s"]
        out[v] = r
    return out


def run_scenario(s: Settings, sc: Scenario, variants: Sequence[str], workdir: Path) -> dict[str, Any]:
    base: dict[str, Any] = {"scenario": sc.name, "rtt_ms": sc.rtt_ms, "rate": sc.rate}
    if not sc.lab:
        return {**base, "variants": run_variants(s, Loopback(), "lo", variants, workdir, sc.name)}
    problem = netlab.support_problem()
    if problem is not None:
        return {**base, "skipped": problem}
    with netlab.Lab(s.stages, rate=sc.rate, delay_s=sc.delay_s) as lab:
        link = netlab.measure(lab, 1, 0, nbytes=1 << 20)
        return {**base, "link": link, "variants": run_variants(s, lab, "eth0", variants, workdir, sc.name)}


def report(s: Settings, scenarios: list[dict[str, Any]]) -> dict[str, Any]:
    """Rates, ratios (swarmd over each GPipe variant; each variant over its loopback rate), loss checks."""
    loop: dict[str, Any] = next((sc["variants"] for sc in scenarios if sc["scenario"] == "loopback"), {})
    for sc in scenarios:
        vs = sc.get("variants")
        if vs is None:
            continue
        rate = {v: r.get("samples_per_s") for v, r in vs.items()}
        sc["samples_per_s"] = rate
        sc["ratios"] = {f"{mine}/{v}": (rate[mine] / r if rate.get(mine) and r else None)
                        for mine in SWARMD if mine in rate for v, r in rate.items() if v not in SWARMD}
        sc["vs_loopback"] = {v: (r / loop[v]["samples_per_s"] if r and loop.get(v, {}).get("samples_per_s") else None)
                             for v, r in rate.items()}
        ref = vs.get(REFERENCE, {}).get("step_losses")
        sc["losses_max_rel_diff_vs_" + REFERENCE] = {
            v: (_max_rel_diff(r["step_losses"], ref) if ref and "step_losses" in r else None)
            for v, r in vs.items() if v != REFERENCE}
    return {"settings": asdict(s), "microbatch_sizes": s.sizes(), "scenarios": scenarios,
            "torch_threads_per_process": 1, "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
            "load_average_at_end": list(os.getloadavg())}


def print_summary(r: dict[str, Any]) -> None:
    st = r["settings"]
    print(f"model {st['model']}, {st['stages']} stages, batch {st['batch_size']} in microbatches "
          f"{r['microbatch_sizes']}, {st['steps']} timed steps after {st['warmup']} warm-up; "
          f"load average {', '.join(f'{x:.2f}' for x in r['load_average_at_end'])}")
    for sc in r["scenarios"]:
        if "skipped" in sc:
            print(f"{sc['scenario']:<10} skipped: {sc['skipped']}")
            continue
        rates = ", ".join(f"{v} {x:.1f}" if x else f"{v} failed" for v, x in sc["samples_per_s"].items())
        ratios = ", ".join(f"{k} {x:.2f}" for k, x in sc["ratios"].items() if x)
        diffs = ", ".join(f"{v} {d:.1e}" for v, d in sc["losses_max_rel_diff_vs_" + REFERENCE].items() if d is not None)
        print(f"{sc['scenario']:<10} samples/s: {rates}\n{'':<10} {ratios}\n{'':<10} losses vs {REFERENCE}: {diffs}")


def _window(text: str) -> int | None:
    if text == "auto":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("--window must be at least 1, or auto")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="model preset, cut into --stages equal stages (default: tiny)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages, one process each (default: 2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default: 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them, at least 1 (default: 2)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=8)
    p.add_argument("--window", type=_window, default=4, metavar="N|auto",
                   help="the swarmd trainer's microbatches in flight; auto: sized from what it measures "
                        "(swarmd.train.window) (default: 4)")
    p.add_argument("--taper", action="store_true",
                   help="let the swarmd trainer taper a step's ends (then its microbatches differ from GPipe's)")
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--trainer-child", metavar="JSON", help=argparse.SUPPRESS)  # internal
    p.add_argument("--gpipe-child", metavar="JSON", help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.trainer_child is not None:
        c = json.loads(args.trainer_child)
        print(strict_json_dumps(swarm_trainer_child(Settings(**c["settings"]), c["api"], c.get("p2p", False))))
        return 0
    if args.gpipe_child is not None:
        print(strict_json_dumps(gpipe_rank_child(json.loads(args.gpipe_child))))
        return 0
    from swarmd.pipeline.spec import PRESETS

    if args.model not in PRESETS:
        p.error(f"--model must be a preset: {', '.join(sorted(PRESETS))}")
    if args.stages < 2 or args.steps < 1 or args.warmup < 1:
        p.error("--stages must be at least 2, --steps and --warmup at least 1")
    if args.batch_size % args.microbatch_size:
        p.error("torch.distributed.pipelining splits a batch into equal microbatches: "
                "--microbatch-size must divide --batch-size")
    s = Settings(model=args.model, stages=args.stages, steps=args.steps, warmup=args.warmup,
                 batch_size=args.batch_size, microbatch_size=args.microbatch_size, window=args.window,
                 taper=args.taper)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the children and removes the lab like Ctrl-C does

    signal.signal(signal.SIGTERM, interrupt)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="swarmd-bench-gpipe-") as tmp:
            scenarios = [run_scenario(s, SCENARIOS[n], args.variants, Path(tmp)) for n in args.scenarios]
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except netlab.LabError as exc:
        print(f"bench_gpipe: error: {exc}", file=sys.stderr)
        return 1
    result = report(s, scenarios)
    result["bench_wall_s"] = time.monotonic() - started
    if args.json:
        print(strict_json_dumps(result))
    else:
        print_summary(result)
    failed = [f"{sc['scenario']}/{v}" for sc in scenarios for v, r in sc.get("variants", {}).items() if "error" in r]
    if failed:
        print(f"bench_gpipe: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
