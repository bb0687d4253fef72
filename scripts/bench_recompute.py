"""What recomputing a sampled microbatch of each contribution costs (``swarmd.pipeline.averaging.trust.recomputation``),
and whether an honest swarm ever convicts on it.

Each run is a fresh swarm of 2 stages x 3 in-process daemons on loopback (``--model``, default
``tiny``; target batch 16, the fixture of tests/adversarial/test_accountable_contributions.py) and two
asynchronous trainers (microbatch 4, window 4, 8-bit activations, no spot checks) training
``--steps`` steps. With ``--liar`` the last stage's largest peer id lies about one microbatch of each
contribution, consistently (``tests.support.liars.lie_about_a_microbatch``). Reported per run:

* ``recomputed`` / ``mismatch`` / ``unchecked``: the last stage's leaders' recomputations, convictions on
  them, and contributions computed at other parameters (not recomputed); ``convicted``: peers convicted
  by any leader, and the step (must be none in an honest run); ``max_honest_gap``: the largest gap between
  an honest opened part and its recomputation (tolerance ``RECOMPUTE_TOLERANCE``);
  ``max_honest_extra_share``: the largest share of an honest opening's extra term (bound ``EXTRA_BOUND``);
* ``recompute_s``: wall seconds the leaders spent recomputing and sketching (before answering their
  rounds: on the critical path), per recomputation and against the last stage's worker CPU seconds (its
  forwards and backwards, the recomputations included): ``extra_compute``; ``extra_compute_samples``: the
  samples recomputed per sample the stage computed (``rounds x target batch``), the share of compute;
* ``input_bytes``: the inputs shipped with contributions, per contribution and against the bytes of the
  float32 gradients a contribution carries (``extra_traffic``; loopback under ``auto`` sends them raw).
* with ``--liar``: ``steps_per_s_before`` / ``steps_per_s_after``: the honest last-stage peers' steps a
  second before the liar's first conviction and after it, in the same run, and ``after_vs_before``, their
  ratio (the pace the stage keeps once the liar is convicted: seconded and routed around, or not);
  ``excluded_by_honest``: how many honest stage-mates excluded it (the convicting leader, and those that
  seconded), ``excluded_by_all_at_s``: when they all did.

``--share`` sets the leaders' ``recompute_share`` (default swarmd's ``RECOMPUTE_SHARE``), ``--grad-codec``
the swarm's averaging codec (a lossy one leaves a residual in the extra term), ``--averaging`` the mode
(default the swarm's, the chunked all-reduce: its coordinators recompute a drawn microbatch whose inputs they
ask the member for after its opening, ``swarmd.pipeline.averaging.allreduce.recompute``; there ``input_bytes``
are those fetched, one microbatch per recomputation, and the 32-byte digests committed per microbatch are not
counted; ``leader``: the single leader's, from inputs shipped with every contribution).

    .venv/bin/python scripts/bench_recompute.py --repeats 3 --json [--share 1]
    .venv/bin/python scripts/bench_recompute.py --liar --steps 12 --repeats 3
    .venv/bin/python scripts/bench_recompute.py --averaging leader --repeats 3 --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.checks import TRAINING, trainer_config  # noqa: E402
from tests.support.liars import lie_about_a_microbatch  # noqa: E402
from tests.support.swarms import fast_swarm  # noqa: E402

from swarmd.finite import strict_json_dumps  # noqa: E402
from swarmd.pipeline.spec import PRESETS  # noqa: E402
from swarmd.train.trainer import Trainer  # noqa: E402


async def one_run(model: str, steps: int, liar: bool, seed: int, share: float | None, codec: str,
                  averaging: str) -> dict[str, Any]:
    spec = dataclasses.replace(PRESETS[model], name=f"bench-{model}")
    training = dataclasses.replace(TRAINING, grad_codec=codec, averaging=averaging)
    async with fast_swarm(spec, training, peers_per_stage=3) as daemons:
        last = sorted((d for d in daemons if d.stage == spec.n_stages - 1), key=lambda d: d.peer_id or "")
        cheat = last[-1] if liar else None
        if cheat is not None and cheat.averager is not None:
            lie_about_a_microbatch(cheat.averager)
        for d in daemons:
            if share is not None and d.averager is not None:
                d.averager.recompute_share = share
        api = f"http://{daemons[0].status()['api_addr']}"
        honest = [d for d in last if d is not cheat and d.averager is not None]
        timeline: list[tuple[float, int, bool, int]] = []  # (time, honest step, convicted yet, honest excluding)
        watcher = asyncio.ensure_future(_watch(honest, cheat, timeline))
        started = time.monotonic()
        try:
            await asyncio.gather(*(Trainer(trainer_config(api, f"t{k}", steps=steps, fraction=0.0, seed=seed * 10 + k))
                                   .run() for k in range(2)))
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        wall = time.monotonic() - started
        pace = _pace(timeline, started, time.monotonic(), min(d.executor.step for d in honest))
        openings: dict[str, int] = {}
        for d in honest:
            for k, v in d.averager.openings.items():  # type: ignore[union-attr]
                openings[k] = openings.get(k, 0) + v
        convicted: dict[str, int] = {}
        rounds_led = 0
        for d in daemons:
            for rnd in d.averager.history if d.averager is not None else ():
                rounds_led += d.stage == spec.n_stages - 1 and rnd.get("leader") == d.peer_id
                for pid in rnd.get("convicted", {}):
                    who = "liar" if cheat is not None and pid == cheat.peer_id else pid[:12]
                    convicted[who] = min(convicted.get(who, rnd["step"]), rnd["step"])
        costs = [d.averager.opening_costs for d in honest]  # type: ignore[union-attr]
        senders = [d for d in last if d.averager is not None]
        recompute_s = sum(c["recompute_s"] for c in costs)
        worker_s = sum(d.executor.worker_cpu_s for d in honest)
        input_bytes = sum(d.averager.opening_costs["input_bytes"] for d in senders)  # type: ignore[union-attr]
        sent = sum(sum(d.averager.codecs_sent.values()) for d in senders)  # type: ignore[union-attr]
        grad_bytes = sent * 4 * last[0].executor.grad_numel
        # the stage computes every sample of each step once (forward + backward, as a recomputation does)
        computed = max(1, max(d.executor.step for d in last) * TRAINING.target_batch_size)
        return {
            "model": model, "averaging": averaging, "grad_codec": codec, "steps": steps, "liar": liar, "seed": seed, "wall_s": round(wall, 2),
            "rounds": max(d.executor.step for d in last),
            "recomputed": openings.get("recomputed", 0), "mismatch": openings.get("mismatch", 0),
            "unchecked": openings.get("unchecked", 0), "openings_ok": openings.get("ok", 0),
            "inputs_refused": openings.get("inputs_refused", 0),
            "inputs_unanswered": openings.get("inputs_unanswered", 0),
            "convicted": convicted,
            "max_honest_gap": max((c["max_recompute_gap"] for c in costs), default=0.0),
            "max_honest_extra_share": round(max((c["max_extra_share"] for c in costs), default=0.0), 4),
            "recompute_s": round(recompute_s, 4),
            "recompute_ms_per_recomputation": round(1e3 * recompute_s / max(1, openings.get("recomputed", 0)), 2),
            "recomputed_samples": int(sum(c["recomputed_samples"] for c in costs)),
            "extra_compute_samples": round(sum(c["recomputed_samples"] for c in costs) / computed, 4),
            "last_stage_worker_cpu_s": round(worker_s, 3),
            "extra_compute": round(recompute_s / worker_s, 4) if worker_s else None,
            "contributions_sent": sent, "grad_numel": last[0].executor.grad_numel,
            "input_bytes_per_contribution": round(input_bytes / max(1, sent)),
            "extra_traffic": round(input_bytes / grad_bytes, 4) if grad_bytes else None,
            **pace,
            # each honest last-stage peer's accusations (sent, seconded, rechecked, ...) and why it excludes the liar
            "accusations": [dict(d.averager.accusations) for d in honest],  # type: ignore[union-attr]
            "liar_excluded_for": [d.averager.checks_status()["excluded"].get(cheat.peer_id, {}).get("reason", "")[:60]
                                  for d in honest] if cheat is not None else [],
        }


async def _watch(honest: list[Any], cheat: Any, timeline: list[tuple[float, int, bool, int]]) -> None:
    """Every 50 ms: the honest last-stage peers' step, whether one convicted the liar yet, and how many of them
    exclude it as hostile (for the pace before and after the conviction)."""
    pid = cheat.peer_id if cheat is not None else None
    while True:
        convicted = pid is not None and any(pid in (rnd.get("convicted") or {}) for d in honest
                                            for rnd in d.averager.history)
        excluding = sum(d.averager.checks_status()["excluded"].get(pid, {}).get("reason", "").startswith("hostile")
                        for d in honest) if pid is not None else 0
        timeline.append((time.monotonic(), min(d.executor.step for d in honest), convicted, excluding))
        await asyncio.sleep(0.05)


def _pace(timeline: list[tuple[float, int, bool, int]], started: float, ended: float, last_step: int) -> dict[str, Any]:
    """Steps a second of the honest last-stage peers before the liar's conviction and after it, in one run
    (``after_vs_before``: their ratio), and when every honest peer excluded it."""
    convicted = next(((t, step) for t, step, c, _ in timeline if c), None)
    everyone = next((round(t - started, 2) for t, _, _, n in timeline if n and n == max(x[3] for x in timeline)),
                    None)
    if convicted is None:
        return {"convicted_at_s": None, "steps_per_s_before": None, "steps_per_s_after": None,
                "after_vs_before": None, "excluded_by_honest": 0, "excluded_by_all_at_s": None}
    t, step = convicted
    before = step / (t - started) if t > started else None
    after = (last_step - step) / (ended - t) if ended > t else None
    return {"convicted_at_s": round(t - started, 2), "convicted_at_step": step,
            "steps_per_s_before": round(before, 3) if before else None,
            "steps_per_s_after": round(after, 3) if after is not None else None,
            "after_vs_before": round(after / before, 3) if before and after is not None else None,
            "excluded_by_honest": max(x[3] for x in timeline), "excluded_by_all_at_s": everyone}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--liar", action="store_true", help="the last stage's largest id lies about a microbatch")
    parser.add_argument("--share", type=float, default=None,
                        help="the leaders' recompute_share (default: swarmd's, RECOMPUTE_SHARE)")
    parser.add_argument("--grad-codec", default="auto", help="the swarm's grad_codec (default auto: none on loopback)")
    parser.add_argument("--averaging", default=TRAINING.averaging, choices=["allreduce", "leader"],
                        help="the swarm's averaging (default: the chunked all-reduce)")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    if args.share is not None and not 0.0 <= args.share <= 1.0:
        parser.error("--share must be within [0, 1]")
    logging.basicConfig(level=logging.ERROR)
    for seed in range(args.repeats):
        row = asyncio.run(one_run(args.model, args.steps, args.liar, seed, args.share, args.grad_codec,
                                  args.averaging))
        print(strict_json_dumps(row) if args.json else row, flush=True)


if __name__ == "__main__":
    main()
