"""Where a sync step's end goes on each stage: ``bench_pipeline.py`` with its daemons traced.

Runs ``scripts/bench_pipeline.py --json`` (extra arguments are passed on) with a
``sitecustomize`` hook on the daemons' ``PYTHONPATH`` that records, with ``time.monotonic()``
(one clock for every process on the machine), when each stage worker job and each step of the
averaging protocol began and ended: the worker's forwards and backwards, the contribution's
take, the round's reduction (off the loop), the update (optimizer step and parameter digest).
The hook only wraps functions; it changes nothing they compute.

For every timed step and stage it then reports, in milliseconds, the stretch from the stage's
last backward of the step to the first job of the next step: the wait before the round starts
(``to_round``), taking the gradients out (``take``), the reduction (``reduce``: a lone peer's
checks, digest and quotient), the update (``apply``) and the wait until the next step's first
job arrives (``to_next``: on stage 0 the trainer noticing the step and sending the next forward,
on later stages also stage 0's own end of step and first forward). Medians over the steps are
printed with the bench's own report, and per stage the median per step of its worker jobs' thread
CPU, minor page faults and system time (``RUSAGE_THREAD``: a step that hands memory back to the
kernel and maps it again shows here; see ``swarmd.allocator``).

    .venv/bin/python scripts/trace_step_end.py                 # small, sync, codec none, 20 steps
    .venv/bin/python scripts/trace_step_end.py --steps 10
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from swarmd.finite import strict_json_dumps

HOOK = r'''
import functools, inspect, json, os, resource, threading, time

_dir = os.environ.get("SWARMD_STEP_TRACE_DIR")
if _dir:
    _out = open(os.path.join(_dir, f"trace-{os.getpid()}.jsonl"), "a", buffering=1)
    _lock = threading.Lock()

    def _log(name, began, ended, usage=None):
        with _lock:
            _out.write(json.dumps([name, began, ended, *(usage or ())]) + "\n")

    def _usage():
        r = resource.getrusage(resource.RUSAGE_THREAD)
        return time.thread_time(), r.ru_minflt, r.ru_stime

    def _wrap(cls, name):
        f = getattr(cls, name)
        label = f"{cls.__name__}.{name}"
        if inspect.iscoroutinefunction(f):
            async def w(*args, **kw):
                t = time.monotonic()
                try:
                    return await f(*args, **kw)
                finally:
                    _log(label, t, time.monotonic())
        else:  # a job on its thread: also its thread CPU, minor page faults and system time
            def w(*args, **kw):
                t, u = time.monotonic(), _usage()
                try:
                    return f(*args, **kw)
                finally:
                    v = _usage()
                    _log(label, t, time.monotonic(), [b - a for a, b in zip(u, v)])
        setattr(cls, name, functools.wraps(f)(w))

    import importlib.abc, sys

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "swarmd.daemon":
                sys.meta_path.remove(self)
                from swarmd.pipeline.stage import executor
                from swarmd.pipeline.averaging import averager as averaging
                for n in ("_forward_sync", "_backward_sync", "_take_contribution_sync", "_apply_average_sync"):
                    _wrap(executor.StageExecutor, n)
                for n in ("_tick", "_reduce"):
                    _wrap(averaging.StageAverager, n)
            return None

    sys.meta_path.insert(0, _Finder())
'''

JOBS = ("StageExecutor._forward_sync", "StageExecutor._backward_sync")
WORK = (*JOBS, "StageExecutor._take_contribution_sync", "StageExecutor._apply_average_sync")


def work_per_step(events: list[list[Any]], warmup: int) -> dict[str, float]:
    """Medians per timed step of a daemon's worker jobs (steps cut at each round's take): the
    jobs' thread CPU, minor page faults and system time, in ms and counts."""
    takes = sorted(e[1] for e in events if e[0] == "StageExecutor._take_contribution_sync")[warmup:]
    jobs = [e for e in events if e[0] in WORK and len(e) >= 6]
    rows = []
    for a, b in zip(takes, takes[1:]):
        mine = [e for e in jobs if a <= e[1] < b]
        rows.append({"thread_cpu_ms": sum(e[3] for e in mine) * 1e3, "minor_faults": sum(e[4] for e in mine),
                     "system_ms": sum(e[5] for e in mine) * 1e3})
    return {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]} if rows else {}


def step_ends(events: list[list[Any]]) -> list[dict[str, float]]:
    """Per round of one daemon: the stretch from its last backward to its next step's first job."""
    events = sorted(events, key=lambda e: e[1])
    takes = [e for e in events if e[0] == "StageExecutor._take_contribution_sync"]
    rows = []
    for take in takes:
        backwards = [e for e in events if e[0] == "StageExecutor._backward_sync" and e[2] <= take[1]]
        applies = [e for e in events if e[0] == "StageExecutor._apply_average_sync" and e[1] >= take[2]]
        if not backwards or not applies:
            continue
        last_bw, apply = max(backwards, key=lambda e: e[2]), min(applies, key=lambda e: e[1])
        reduces = [e for e in events if e[0] == "StageAverager._reduce" and take[2] <= e[1] <= apply[1]]
        following = [e for e in events if e[0] in JOBS and e[1] >= apply[2]]
        if not reduces or not following:
            continue
        reduce, nxt = reduces[0], min(following, key=lambda e: e[1])

        def ms(a: float, b: float) -> float:
            return round((b - a) * 1000, 1)

        rows.append({"to_round": ms(last_bw[2], take[1]), "take": ms(take[1], take[2]),
                     "reduce": ms(reduce[1], reduce[2]), "apply": ms(apply[1], apply[2]),
                     "to_next": ms(apply[2], nxt[1]), "total": ms(last_bw[2], nxt[1])})
    return rows


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        hook, traces = Path(tmp) / "hook", Path(tmp) / "traces"
        hook.mkdir()
        traces.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK)
        env = {**os.environ, "SWARMD_STEP_TRACE_DIR": str(traces),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, str(root / "scripts" / "bench_pipeline.py"), "--json", *argv],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            return done.returncode
        report = json.loads(done.stdout.strip().splitlines()[-1])
        warmup = int(report["warmup"])
        stages: dict[str, Any] = {}
        by_pid = {d["pid"]: d["stage"] for d in report["swarm"]["daemons"]}
        for path in traces.glob("trace-*.jsonl"):
            pid = int(path.stem.split("-")[1])
            if pid not in by_pid:  # the single-process child, or the trainer: not traced
                continue
            events = [json.loads(line) for line in path.read_text().splitlines() if line]
            rows = step_ends(events)[warmup:]
            stages[str(by_pid[pid])] = {
                "steps": len(rows),
                "median_ms": {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {},
                "worker_jobs_per_step": work_per_step(events, warmup),
            }
    print(strict_json_dumps({"bench": {k: report[k] for k in ("preset", "steps", "ratio", "single_samples_per_s",
                                                             "swarm_samples_per_s")},
                             "step_ms_median": report["swarm"]["step_ms_median"],
                             "step_end_by_stage": dict(sorted(stages.items()))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
