"""Training throughput of a swarm of separate hosts over a shaped WAN, against the same swarm unshaped.

SWARM's claim C2: with many microbatches in flight, training stays competitive under internet
latency (100 ms) where GPipe loses 2-3x. This benchmark runs one training job on the network lab
(``scripts/netlab.py``: one Linux network namespace per peer, needs root) in several network
settings, each on a fresh lab and a fresh swarm:

- ``lan``: no shaping (the lab's veths and bridge; RTT ~0.05 ms);
- ``wan50``: 50 ms RTT (25 ms one-way egress delay on every host) and every host's egress capped at 500 Mbit/s;
- ``wan100``: 100 ms RTT (50 ms per host) and 100 Mbit/s;
- ``nat``: no shaping, but the last host (a stage-1 peer) sits behind a masquerading NAT: nobody can
  dial it, so it serves through a relay (a reachable peer; ``swarmd.net.relay``). Against ``lan``:
  what the relayed hop costs the swarm, and (``daemons[].throughput``, ``relayed_for_others``) what
  relaying costs the relay's own serving;
- ``lan8`` and ``wan100x8``: stage 0 served by 8 peers (the other stages by ``--peers-per-stage``), unshaped
  and at 100 ms / 100 Mbit/s: one stage's averaging round among 8; ``wan100x8``'s ratio is over ``lan8``'s.

The swarm averages with ``--grad-codec`` (default ``auto``, swarmd's own default: the codec chosen per link from
its measured throughput; each daemon's ``averaging.codecs_sent`` and ``links_mbit_s`` say what it chose).
``--no-slow-start-after-idle`` sets ``net.ipv4.tcp_slow_start_after_idle=0`` in the lab's hosts (their own
network namespaces; the machine's stays as it is): what an operator can set for a swarm over the internet.

The job: ``--preset`` (small: 2 stages) with ``--peers-per-stage`` daemons per stage (2), one per lab
host, started through the real CLI bound to the host's own address (``--host A --dht-host A
--api-host 127.0.0.1``), ``--rebalance-policy none`` so the 2 x 2 layout stays put, 1 torch thread
each; the trainer (activations in ``--codec`` 8bit, ``--sync`` by default, ``--window`` microbatches in
flight) runs inside the founder's host, as a volunteer would run it (the control plane stays on that
host's loopback). Timed like ``bench_pipeline.py``: samples completed between the end of warm-up step
W and the end of step W + N, over that wall time; ``ratio`` is a shaped run's samples/s over the
``lan`` run's. Each scenario also reports the lab's measured link (TCP RTT and throughput from host 1
to host 0), the trainer's mean call latency per stage and kind, how much of the window was spent
waiting for the stages to step (sync mode), and every daemon's CPU time over the run.

    sudo .venv/bin/python scripts/bench_wan.py --json
    sudo .venv/bin/python scripts/bench_wan.py --scenarios lan wan100 --no-sync --window 16
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # netlab.py beside this file, run as a script

import netlab  # noqa: E402
from swarmd.finite import strict_json_dumps  # noqa: E402
from swarmd.local_swarm import DaemonProcess, DaemonStartError, stopping  # noqa: E402

SEED = 0
CORPUS_BYTES = 8 * 2**20
TRAINER_TIMEOUT_S = 1800.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Scenario:
    """A network setting: the RTT between any two hosts (half of it on each host's egress) and a cap."""

    name: str
    rtt_ms: float
    rate: str | None
    nat: tuple[int, ...] = ()  # hosts behind a masquerading NAT: they serve through a relay (swarmd.net.relay)
    stage0_peers: int | None = None  # peers serving stage 0 (None: --peers-per-stage, like every other stage)
    baseline: str = "lan"  # the scenario whose samples/s this one's ratio is over

    @property
    def delay_s(self) -> float:
        return self.rtt_ms / 2 / 1e3


SCENARIOS = {s.name: s for s in (Scenario("lan", 0.0, None), Scenario("wan50", 50.0, "500mbit"),
                                 Scenario("wan100", 100.0, "100mbit"),
                                 # the last host (a stage-1 peer with 2 peers per stage) behind NAT, relayed
                                 Scenario("nat", 0.0, None, nat=(-1,)),
                                 # 8 peers averaging in one stage (issue 28): over the WAN, and its own LAN baseline
                                 Scenario("lan8", 0.0, None, stage0_peers=8, baseline="lan8"),
                                 Scenario("wan100x8", 100.0, "100mbit", stage0_peers=8, baseline="lan8"))}


@dataclass(frozen=True)
class Settings:
    preset: str = "small"
    peers_per_stage: int = 2
    steps: int = 10
    warmup: int = 3
    batch_size: int = 32
    microbatch_size: int = 8
    window: int = 4
    codec: str = "8bit"
    sync: bool = True
    grad_codec: str = "auto"  # how the stage's peers send gradients to each other when they average
    delay_updates: bool = False  # the swarm's delayed parameter updates (paper 3.3): averaging overlaps serving
    val_every: int = 0  # held-out loss every this many steps (0: none); the scenario's val_curve
    val_batches: int = 4  # microbatches of held-out samples per validation
    data_shards: int = 16  # an asynchronous trainer draws from one of this many shards at a time (TrainerConfig)
    slow_start_after_idle: bool = True  # the hosts' net.ipv4.tcp_slow_start_after_idle (Linux's default: 1)


class BenchError(Exception):
    """A run could not be completed (a daemon or the trainer failed)."""


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process (pids are global: the lab separates networks only)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


# ---- the trainer, inside the founder's host ---------------------------------------------------------


@dataclass
class Window:
    """The trainer's view between the end of warm-up step W and the end of step W + N."""

    warmup: int
    last: int
    open: bool = False
    t0: float = 0.0
    t1: float = 0.0
    samples0: int = 0
    samples1: int = 0
    wait_s: float = 0.0
    step_ends: list[float] = field(default_factory=list)
    calls: dict[str, list[float]] = field(default_factory=dict)
    val_every: int = 0
    val_curve: list[tuple[int, int, float]] = field(default_factory=list)  # (step done, samples, held-out loss)

    def observe(self, event: Any) -> None:
        from swarmd.train.events import CallDone, StepDone, StepWait

        if isinstance(event, StepDone):
            if self.val_every and event.done % self.val_every == 0 and event.progress.get("val_loss") is not None:
                self.val_curve.append((event.done, int(event.progress["samples"]), float(event.progress["val_loss"])))
            if event.done == self.warmup:
                self.open, self.t0, self.samples0 = True, event.at, int(event.progress["samples"])
            if self.open:
                self.step_ends.append(event.at)
            if event.done == self.last and self.open:
                self.open, self.t1, self.samples1 = False, event.at, int(event.progress["samples"])
        elif isinstance(event, StepWait) and self.open:
            self.wait_s += event.ended - event.started
        elif isinstance(event, CallDone) and self.open:
            self.calls.setdefault(f"stage{event.stage}.{event.kind}", []).append(event.ended - event.started)


def trainer_child(s: Settings, api: str) -> dict[str, Any]:
    """Run the trainer (this process is inside the founder's host) and report its timed window."""
    import asyncio

    import torch

    from swarmd.train.trainer import Trainer, TrainerConfig

    torch.set_num_threads(1)
    window = Window(warmup=s.warmup, last=s.warmup + s.steps, val_every=s.val_every)
    config = TrainerConfig(api=api, steps=s.warmup + s.steps, batch_size=s.batch_size,
                           microbatch_size=s.microbatch_size, codec=s.codec, seed=SEED, window=s.window,
                           sync=s.sync, val_every=s.val_every, val_batches=s.val_batches, data_shards=s.data_shards,
                           max_corpus_bytes=CORPUS_BYTES, name="bench-wan")
    summary = asyncio.run(Trainer(config, events=window.observe).run())
    last = window.val_curve[-1][0] if window.val_curve else None
    if s.val_every and summary.val_loss is not None and last != summary.steps:
        window.val_curve.append((summary.steps, summary.samples, summary.val_loss))  # the run's last validation
    if window.t1 == 0.0:
        raise BenchError(f"the trainer finished without reaching step {window.last}")
    wall = window.t1 - window.t0
    step_s = [b - a for a, b in itertools.pairwise(window.step_ends)]
    return {
        "samples_per_s": (window.samples1 - window.samples0) / wall,
        "samples": window.samples1 - window.samples0,
        "wall_s": wall,
        "step_ms_median": statistics.median(step_s) * 1e3 if step_s else None,
        "step_ms_max": max(step_s) * 1e3 if step_s else None,
        "wait_all_stepped_s": window.wait_s,  # sync mode: every microbatch done, the stages still stepping
        "calls": {k: {"count": len(v), "mean_ms": statistics.fmean(v) * 1e3, "max_ms": max(v) * 1e3}
                  for k, v in sorted(window.calls.items())},
        "retries": summary.retries,
        "stale_redos": summary.stale_redos,
        "topup_microbatches": summary.topup_microbatches,
        "step_losses": summary.step_losses,
        "samples_total": summary.samples,
        "val_loss": summary.val_loss,  # the held-out loss at the end of the run
        "val_curve": window.val_curve,
    }


# ---- one scenario: a lab, a swarm in it, the trainer -------------------------------------------------


def run_scenario(s: Settings, sc: Scenario, workdir: Path,
                 trainer_timeout_s: float = TRAINER_TIMEOUT_S) -> dict[str, Any]:
    stage_of = host_stages(_stages(s.preset), s.peers_per_stage, sc.stage0_peers)
    hosts = len(stage_of)
    daemons: list[DaemonProcess] = []
    nat = tuple(h % hosts for h in sc.nat)
    with netlab.Lab(hosts, rate=sc.rate, delay_s=sc.delay_s, nat=nat) as lab:
        if not s.slow_start_after_idle:
            for i in range(hosts):
                lab.sysctl(i, {"net.ipv4.tcp_slow_start_after_idle": "0"})
        link = netlab.measure(lab, 1, 0, nbytes=4 << 20)
        with stopping(daemons) as codes:
            for i in range(hosts):  # host i serves stage stage_of[i]; host 0 founds the swarm
                addr = lab.addr(i)
                args = ["--host", addr, "--dht-host", addr, "--api-host", "127.0.0.1", "--swarm", "bench-wan",
                        "--device", "cpu", "--drain-timeout", "5", "--log-level", "WARNING",
                        "--announce-period", "2", "--rebalance-policy", "none", "--stage", str(stage_of[i])]
                if i == 0:
                    args += ["--model", s.preset, "--target-batch-size", str(s.batch_size),
                             "--grad-codec", s.grad_codec, *(["--delay-updates"] if s.delay_updates else [])]
                else:
                    args += ["--join", daemons[0].info["dht_addr"]]
                daemons.append(DaemonProcess(args, workdir, name=f"{sc.name}-host{i}", env={"OMP_NUM_THREADS": "1"},
                                             command=lab.command(i, [sys.executable, "-m", "swarmd"]), threads=1))
                if i == 0:
                    daemons[0].wait_ready(300)
            for d in daemons[1:]:
                d.wait_ready(300)
            cpu0 = [cpu_seconds(d.pid) for d in daemons]
            api = f"http://{daemons[0].info['api_addr']}"
            trainer = lab.popen(0, [sys.executable, str(Path(__file__).resolve()), "--trainer-child",
                                    json.dumps({"settings": asdict(s), "api": api})],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                stdout, stderr = trainer.communicate(timeout=trainer_timeout_s)
            except subprocess.TimeoutExpired:
                # what it waits on: every asyncio task's stack (swarmd.task_dump), then the daemons' state
                trainer.send_signal(signal.SIGUSR1)
                time.sleep(2.0)
                trainer.kill()
                stdout, stderr = trainer.communicate()
                statuses = [host_status(lab, i, d) for i, d in enumerate(daemons)]
                raise BenchError(f"the trainer did not finish within {trainer_timeout_s:.0f}s; its stderr:\n"
                                 f"{stderr[-20000:]}\nthe daemons' /status:\n"
                                 + "\n".join(strict_json_dumps(_stall_view(st)) for st in statuses)) from None
            cpu1 = [cpu_seconds(d.pid) for d in daemons]
            statuses = [host_status(lab, i, d) for i, d in enumerate(daemons)]
            if trainer.returncode != 0:
                raise BenchError(f"the trainer exited with {trainer.returncode}: {stderr[-3000:]}")
            result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    result.update({
        "scenario": sc.name, "rtt_ms": sc.rtt_ms, "rate": sc.rate, "link": link,
        "daemons": [{"host": i, "stage": stage_of[i], "addr": st.get("data_addr"), "exit_code": code,
                     "behind_nat": i in nat, "cpu_s": None if a is None or b is None else b - a,
                     "throughput": st.get("throughput"), "served": st.get("served"),
                     "relay_client": (st.get("relay") or {}).get("client"),
                     "averaging": _averaging_view(st), "stale_applied": st.get("stale_applied"),
                     "stale_dropped": st.get("stale_dropped"),
                     "state_downloads_ok": (st.get("state_transfer") or {}).get("downloads_ok"),
                     "relayed_for_others": {k: v for k, v in ((st.get("relay") or {}).get("server") or {}).items()
                                            if k in ("peers", "requests", "bytes", "over_budget")}}
                    for i, (d, a, b, code, st) in enumerate(zip(daemons, cpu0, cpu1, codes, statuses, strict=True))],
    })
    return result


def host_stages(stages: int, peers_per_stage: int, stage0_peers: int | None = None) -> list[int]:
    """The stage each lab host serves: ``peers_per_stage`` on every stage (``stage0_peers`` on stage 0
    when given), dealt round-robin, so host 0 (the founder) serves stage 0 and host 1 stage 1."""
    left = [peers_per_stage] * stages
    if stage0_peers is not None:
        left[0] = stage0_peers
    out: list[int] = []
    while any(left):
        for stage in range(stages):
            if left[stage]:
                out.append(stage)
                left[stage] -= 1
    return out


def host_status(lab: netlab.Lab, host: int, d: DaemonProcess) -> dict[str, Any]:
    """A daemon's ``/status``, read from inside its own host (its control plane is on that loopback)."""
    port = d.info["api_addr"].rsplit(":", 1)[1]
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/status').read().decode())"
    done = lab.run(host, [sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    try:
        return json.loads(done.stdout) if done.returncode == 0 else {}
    except ValueError:
        return {}


def _stall_view(st: dict[str, Any]) -> dict[str, Any]:
    """What a stalled run's daemon says about where it stands (its ``/status``, the parts that matter)."""
    keys = ("peer_id", "stage", "state", "step", "queue", "in_flight", "grad_samples", "stale_dropped",
            "stale_applied", "exactly_once", "task_crashes")
    view = {k: st.get(k) for k in keys}
    view["peer_id"] = (view["peer_id"] or "")[:12]
    averaging = st.get("averaging") or {}
    view["averaging"] = {k: averaging.get(k) for k in ("rounds_ok", "rounds_aborted", "last_round")}
    return view


def _averaging_view(st: dict[str, Any]) -> dict[str, Any] | None:
    """A daemon's averaging rounds in short: how many it stepped in, aborted, and the recent ones (step,
    status, leader, contributors, missing, seconds), to see a peer left out of its leader's rounds."""
    averaging = st.get("averaging")
    if not averaging:
        return None
    keep = ("rounds_ok", "rounds_aborted", "silent_contributors", "rounds_refused", "excluded", "codecs_sent",
            "links_mbit_s")
    recent = [[r.get("step"), r.get("status"), (r.get("leader") or "")[:8], r.get("contributors"),
               [m[:8] for m in r.get("missing") or []], r.get("duration_s")] for r in averaging.get("recent") or []]
    return {**{k: averaging.get(k) for k in keep}, "recent": recent}


def _stages(preset: str) -> int:
    from swarmd.pipeline.spec import PRESETS

    return PRESETS[preset].n_stages


def run(s: Settings, scenarios: Sequence[Scenario], trainer_timeout_s: float = TRAINER_TIMEOUT_S) -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory(prefix="swarmd-bench-wan-") as tmp:
        for sc in scenarios:
            print(f"bench_wan: {sc.name} (RTT {sc.rtt_ms:g} ms, rate {sc.rate or 'unlimited'})", file=sys.stderr)
            results.append(run_scenario(s, sc, Path(tmp), trainer_timeout_s))
    speed = {r["scenario"]: r["samples_per_s"] for r in results}
    for r in results:
        base = speed.get(SCENARIOS[r["scenario"]].baseline)
        r["ratio"] = r["samples_per_s"] / base if base else None
    lan_losses = next((r["step_losses"] for r in results if r["scenario"] == "lan"), None)
    for r in results:
        losses = r.pop("step_losses")
        if lan_losses is not None and s.sync:  # sync mode computes the same steps whatever the network
            diffs = [abs(a - b) for a, b in zip(losses, lan_losses, strict=False)]  # same steps, unless one failed
            r["step_losses_max_abs_diff_vs_lan"] = max(diffs, default=None)
        r["final_loss"] = losses[-1] if losses else None
    return {"settings": asdict(s), "mode": "sync" if s.sync else "async", "scenarios": results,
            "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
            "load_average_1m_at_end": os.getloadavg()[0]}


def val_loss_at(curve: Sequence[Sequence[float]], samples: float) -> float | None:
    """The held-out loss of a ``val_curve`` ((step, samples, loss) points) at ``samples``, linearly
    interpolated between its points (None outside them)."""
    points = sorted((p[1], p[2]) for p in curve)
    for (s0, l0), (s1, l1) in itertools.pairwise(points):
        if s0 <= samples <= s1:
            return l0 if s1 == s0 else l0 + (l1 - l0) * (samples - s0) / (s1 - s0)
    return points[0][1] if len(points) == 1 and points[0][0] == samples else None


def compare_loss(reference: dict[str, Any], other: dict[str, Any], scenario: str) -> dict[str, Any]:
    """The held-out loss of ``other``'s run against ``reference``'s (two ``--json`` results of runs with
    ``--val-every``) at equal samples: at each of the reference's validations that ``other``'s curve
    spans, ``other`` interpolated there, and the relative difference (positive: ``other`` is worse)."""
    def curve(result: dict[str, Any]) -> list[list[float]]:
        sc = next((x for x in result["scenarios"] if x["scenario"] == scenario), None)
        if sc is None or not sc.get("val_curve"):
            raise BenchError(f"no val_curve of scenario {scenario!r} (run with --val-every)")
        return [list(p) for p in sc["val_curve"]]

    ref, oth = curve(reference), curve(other)
    points = []
    for _, samples, ref_loss in ref:
        loss = val_loss_at(oth, samples)
        if loss is not None:
            points.append({"samples": samples, "reference_val_loss": ref_loss, "other_val_loss": loss,
                           "rel_diff": (loss - ref_loss) / ref_loss})
    return {"scenario": scenario, "reference": {"settings": reference["settings"], "mode": reference["mode"]},
            "other": {"settings": other["settings"], "mode": other["mode"]}, "points": points,
            "last": points[-1] if points else None,
            "max_abs_rel_diff": max((abs(p["rel_diff"]) for p in points), default=None)}


def print_summary(r: dict[str, Any]) -> None:
    st = r["settings"]
    print(f"preset {st['preset']}, {st['peers_per_stage']} peers per stage, batch {st['batch_size']} in "
          f"microbatches of {st['microbatch_size']}, window {st['window']}, codec {st['codec']} "
          f"(gradients between peers: {st['grad_codec']}), {r['mode']}, "
          f"{st['steps']} timed steps after {st['warmup']} warm-up")
    for sc in r["scenarios"]:
        link = sc["link"]
        ratio = "" if sc["ratio"] is None else f"  ratio {sc['ratio']:.2f}"
        print(f"{sc['scenario']:<7} measured RTT {link['rtt_ms_median']:.1f} ms, "
              f"{link['throughput_mbit_s'] or 0:.0f} Mbit/s: {sc['samples_per_s']:.1f} samples/s{ratio}, "
              f"step {sc['step_ms_median']:.0f} ms median, waiting for steps {sc['wait_all_stepped_s']:.1f}s "
              f"of {sc['wall_s']:.1f}s")
        for name, c in sc["calls"].items():
            print(f"    {name:<18} {c['count']:4d} calls, {c['mean_ms']:7.1f} ms mean, {c['max_ms']:7.1f} ms max")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=["lan", "wan50", "wan100"],
                   help="network settings to run, in order (default: lan wan50 wan100; ratios need lan, or lan8 for "
                   "wan100x8: 8 peers on stage 0)")
    p.add_argument("--slow-start-after-idle", action=argparse.BooleanOptionalAction, default=True,
                   help="the hosts' net.ipv4.tcp_slow_start_after_idle, set in their own network namespaces "
                   "(default: on, Linux's default; --no-slow-start-after-idle: what an operator can set)")
    p.add_argument("--preset", default="small", help="model preset (default: small)")
    p.add_argument("--peers-per-stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default: 3)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=8)
    p.add_argument("--window", type=int, default=4, help="the trainer's microbatches in flight (default: 4)")
    p.add_argument("--codec", choices=("none", "fp16", "bf16", "8bit", "4bit"), default="8bit")
    p.add_argument("--grad-codec", choices=("auto", "none", "fp16", "8bit", "4bit", "3bit", "5level", "2bit"),
                   default="auto", help="the swarm's codec for gradients between a stage's peers when they average "
                   "(default: auto, swarmd's: chosen per link from its measured throughput)")
    p.add_argument("--delay-updates", action="store_true",
                   help="the swarm uses delayed parameter updates: stages keep serving while they average "
                   "(use with --no-sync)")
    p.add_argument("--sync", action=argparse.BooleanOptionalAction, default=True,
                   help="one global batch per step, wait for every stage (default: --sync)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--trainer-timeout", type=float, default=TRAINER_TIMEOUT_S, metavar="S",
                   help="a trainer still running after S seconds has stalled: its asyncio tasks' stacks "
                   f"(SIGUSR1) and the daemons' state are printed and the run fails (default: {TRAINER_TIMEOUT_S:.0f})")
    p.add_argument("--val-every", type=int, default=0, metavar="K",
                   help="the held-out loss every K steps (and at the end), reported as each scenario's val_curve "
                   "(default: 0, none: validation costs the timed window time)")
    p.add_argument("--val-batches", type=int, default=4, help="microbatches per validation (default: 4)")
    p.add_argument("--data-shards", type=int, default=16, metavar="N",
                   help="an asynchronous trainer draws from one of N shards of the corpus at a time, as "
                   "`swarmd train` does (default: 16); 1: the whole corpus, as a --sync trainer does (for a loss "
                   "comparison: the same data)")
    p.add_argument("--compare-loss", nargs=2, metavar=("REFERENCE", "OTHER"),
                   help="no run: compare the held-out loss of two --json results (run with --val-every) at equal "
                   "samples, e.g. --sync against --no-sync --delay-updates; prints JSON")
    p.add_argument("--compare-scenario", default="lan", help="the scenario --compare-loss compares (default: lan)")
    p.add_argument("--trainer-child", metavar="JSON", help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.trainer_child is not None:
        spec = json.loads(args.trainer_child)
        print(strict_json_dumps(trainer_child(Settings(**spec["settings"]), spec["api"])))
        return 0
    if args.compare_loss is not None:
        try:
            loaded = [json.loads(Path(f).read_text()) for f in args.compare_loss]
            print(strict_json_dumps(compare_loss(loaded[0], loaded[1], args.compare_scenario)))
        except (OSError, ValueError, KeyError, BenchError) as exc:
            print(f"bench_wan: error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.val_every < 0 or args.val_batches < 1 or args.data_shards < 1:
        print("bench_wan: --val-every must be at least 0, --val-batches and --data-shards at least 1", file=sys.stderr)
        return 2
    problem = netlab.support_problem()
    if problem is not None:
        print(f"bench_wan: {problem}", file=sys.stderr)
        return 2
    settings = Settings(preset=args.preset, peers_per_stage=args.peers_per_stage, steps=args.steps,
                        warmup=args.warmup, batch_size=args.batch_size, microbatch_size=args.microbatch_size,
                        window=args.window, codec=args.codec, sync=args.sync, grad_codec=args.grad_codec,
                        delay_updates=args.delay_updates, val_every=args.val_every, val_batches=args.val_batches,
                        data_shards=args.data_shards, slow_start_after_idle=args.slow_start_after_idle)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the daemons and removes the lab like Ctrl-C does

    signal.signal(signal.SIGTERM, interrupt)
    started = time.monotonic()
    try:
        result = run(settings, [SCENARIOS[n] for n in args.scenarios], args.trainer_timeout)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (BenchError, DaemonStartError, netlab.LabError, subprocess.TimeoutExpired) as exc:
        print(f"bench_wan: error: {exc}", file=sys.stderr)
        return 1
    result["bench_wall_s"] = time.monotonic() - started
    if args.json:
        print(strict_json_dumps(result))
    else:
        print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
