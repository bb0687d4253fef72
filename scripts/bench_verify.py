"""Spot checks against each kind of liar of issue #29's table: how soon it is excluded, what the
checks cost, and the held-out loss against an honest run.

Each run is a fresh swarm of 2 stages x 3 in-process daemons on loopback (``tiny``, target batch
16, the fixture of tests/adversarial/test_spot_checks.py), one of them patched at start-up to lie
(``tests.liars``: ``make_liar`` for answers, ``poison_contributions`` for averaging
contributions), and two asynchronous trainers (microbatch 4, window 4, 8-bit codec) training
``--steps`` steps with ``--verify-fraction``. Reported per liar (and for an honest run of the same
seeds):

* ``first_lie_at`` / ``caught_at`` / ``excluded_at``: the trainers' step count (the most steps
  either trainer had done) when the liar first lied (the check-aware one answers its first dozen
  honestly), when a trainer first convicted it, and when every honest peer excluded it (two
  independent reports); None: not within the run; ``lies``: the answers it told wrong in all;
  ``excluded_after_lying``: steps from its first lie to its exclusion (a liar that waits out the
  first checks does no harm meanwhile, and no check can see a lie before it is told);
* ``extra_compute``: what the checks' calls (their pairs', arbiters' and probes') cost the peers, in
  forward passes (a forward 1 a sample, a backward 2, the last stage's fused call 3:
  ``swarmd.train.verify.call_passes``), per pass of the microbatches' own calls; ``extra_samples``:
  the measure used before, samples per sample, a probe's forward counted as the fused call it
  checks; ``extra_traffic``: the bodies of the checks' requests and replies on the wire per byte of the
  trainers' own calls (``swarmd.net.client.metered``); ``extra_requests``: the measure used before, requests
  per call;
* ``val_loss`` and ``vs_honest``: a fresh trainer's held-out loss (16 batches, checks off, routing
  around excluded peers) after the run, and its ratio to the honest run's;
* ``honest_blamed``: honest peers any trainer convicted (must be none);
* ``suspicions``: unpaired answers checked after they came for their size (``verify.AnswerSizes``).

The all-reduce's part owners (``ownpart``: -20x in its own slice of the part it owns, honest to the other
owners; ``ownflip``: publishes the part it owns sign-flipped, honest otherwise; ``ownhide``: the same, and
refuses every audit; all on the first stage): the first is left out of its own part by the median rule and
never convicted; the second is convicted when an audit draws its part
(``swarmd.pipeline.averaging.allreduce.audit``), the third excluded as unaccountable then
(``allreduce.auditor``), ``excluded_at``, and ``routed_out_at`` once a stage-mate seconded it.

The averaging liars (``minus20``, ``flipped``) send their true gradient times -20 / -1 as their
contribution: spot checks cannot see them (what a peer accumulates never leaves it in a reply);
the leader's reduction bounds and scores them (``swarmd.pipeline.averaging.reduction``), and their
``excluded_at`` is when a leader convicted them (``hostile_contributions``); ``routed_out_at`` when
two of its stage-mates excluded it (the leader, and a stage-mate that seconded the leader's signed
evidence: ``swarmd.pipeline.averaging.trust.accusations``), after which the trainers route nothing to it
(``swarmd.train.verify.excluded_by_stage``); ``seconded``: accusations the honest peers seconded.
Each such liar is its stage's largest peer id, so it never leads (a leader's own contribution is
not scored). ``clipped`` and ``struck``: contributions the honest leaders' robust mean clipped,
and left out of the mean (their samples counted), over ``rounds`` rounds; ``honest_blamed``
includes honest peers convicted by a leader or excluded on a stage-mate's accusation.

With ``--plain-averaging`` the leaders average as before issue 29 (the plain sample-weighted mean
of every contribution inside the 64x band: no robust mean, no scores, no convictions), to measure
what the robust rule changes (``--lies`` with no liar: honest runs only).

    .venv/bin/python scripts/bench_verify.py --json
    .venv/bin/python scripts/bench_verify.py --lies --steps 40 --repeats 3 [--plain-averaging]
    .venv/bin/python scripts/bench_verify.py --lies aware far --steps 40 --verify-fraction 0.02
    .venv/bin/python scripts/bench_verify.py --lies flipped aware --steps 40 --repeats 3 --directions --json
    .venv/bin/python scripts/bench_verify.py --lies --steps 40 --joins 4 --json   # churn: 4 peers join meanwhile

``--joins N``: N peers join each run while it trains (evenly spaced in steps, stage 1 then 0 in turn): what a
trainer's first checks of newcomers cost (``first_checks``: microbatches paired for them; ``first_opinions``: a
newcomer's first answers checked by an opinion).

``--directions`` adds, per stage, what a rule convicting on direction alone would have done (issue 29,
the sign-flip liar): the most *against* strikes an honest peer had in any window, the steps where an
honest peer reached a conviction's count, the liar's first such step, and the largest honest ``far``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.liars import lie_as_owner, make_liar, poison_contributions  # noqa: E402
from tests.support.checks import SPEC, TRAINING, trainer_config  # noqa: E402
from tests.support.swarms import config, fast_swarm  # noqa: E402

from swarmd.daemon import Daemon  # noqa: E402
from swarmd.finite import strict_json_dumps  # noqa: E402
from swarmd.train.events import StepDone, TrainerEvent  # noqa: E402
from swarmd.train.trainer import Trainer  # noqa: E402

#: The stage each liar serves (input-gradient liars: the last one, whose fused backward answers them).
STAGE = {"aware": 1, "awareflip": 1, "gradnoise": 1, "grad": 1, "sometimes": 0, "stale": 0, "ahead": 0, "far": 0, "scale": 0,
         "minus20": 1, "flipped": 1, "flipsigned": 1, "ownpart": 0, "ownflip": 0, "ownhide": 0}
#: (``ownpart``: -20x in its own slice of the part it owns only; ``ownflip``: publishes the part it owns
#: sign-flipped; ``ownhide``: the same, and refuses every audit: the all-reduce's owners, issue 29; on the first
#: stage, where no opening checks a contribution)
#: (``flipsigned``: ``flipped``, its openings signing the sketch of its true contribution as the one sent: consistent,
#: and in the all-reduce no owner holds all of what it sent to check that against)
AVERAGING = ("minus20", "flipped", "flipsigned", "ownpart", "ownflip", "ownhide")


def plain_averaging() -> None:
    """Make every leader in this process average as before issue 29 (see the module docstring)."""
    from swarmd.pipeline.averaging import leader as averaging_leader
    from swarmd.pipeline.averaging import reduction as round_reduction

    original = round_reduction.reduce_contributions

    def plain(contributions: Any, digests: Any, *, leader: str, target: int, numel: int, watch: Any = None,
              score: bool = False) -> round_reduction.Reduction:
        red = original(contributions, digests, leader=leader, target=target, numel=numel)
        if red.mean is not None and red.robust:
            used = {u.peer_id for u in red.used}
            red.mean = round_reduction.plain_mean({p: c for p, c in contributions.items() if p in used}, numel,
                                                  red.total)
            red.robust = False
        return red

    averaging_leader.reduce_contributions = plain  # type: ignore[assignment]


#: (leader, step, peer id, far, cos) of every contribution a leader scored, with ``--directions``
SCORED: list[tuple[str, int, str, float, float]] = []


def record_scores() -> None:
    """Make every leader in this process record its scores in SCORED (see ``--directions``)."""
    from swarmd.pipeline.averaging import leader as averaging_leader

    original = averaging_leader.reduce_contributions

    def recording(contributions: Any, digests: Any, *, leader: str, target: int, numel: int, watch: Any = None,
                  score: bool = False) -> Any:
        red = original(contributions, digests, leader=leader, target=target, numel=numel, watch=watch, score=score)
        step = next((c.step for c in contributions.values()), -1)
        SCORED.extend((leader, step, pid, sc.far, sc.cos) for pid, sc in sorted(red.scores.items()))
        return red

    averaging_leader.reduce_contributions = recording  # type: ignore[assignment]


def directions(daemons: list[Any], liar: Any) -> dict[str, Any]:
    """Per stage, from SCORED: the most *against* strikes (cosine below -AGAINST_COS) any honest peer had
    in a window of WINDOW scored rounds and the steps where an honest peer reached STRIKES of them,
    the liar's first such step, the largest honest ``far`` and the most *far* strikes an honest peer had in
    a window (STRIKES of them convict): what a direction rule would convict, and how near honest peers came."""
    from swarmd.pipeline.averaging.trust.hostile_contributions import AGAINST_COS, FAR_FACTOR, STRIKES, WINDOW

    stage_of = {d.peer_id: d.stage for d in daemons}
    out: dict[str, Any] = {}
    for stage in sorted({s for s in stage_of.values() if s is not None}):
        rows: dict[str, list[tuple[int, float, float]]] = {}
        for leader, step, pid, far, cos in SCORED:
            if stage_of.get(leader) == stage:
                rows.setdefault(pid, []).append((step, far, cos))
        honest_max, honest_at, liar_at, far_max, far_strikes = 0, [], None, 0.0, 0
        for pid, scored in rows.items():
            against = [cos < -AGAINST_COS for _, _, cos in scored]
            first = next((scored[i][0] for i in range(len(scored))
                          if sum(against[max(0, i - WINDOW + 1): i + 1]) >= STRIKES), None)
            if liar is not None and pid == liar.peer_id:
                liar_at = first
                continue
            honest_max = max(honest_max, max((sum(against[max(0, i - WINDOW + 1): i + 1])
                                              for i in range(len(scored))), default=0))
            far_max = max(far_max, max((far for _, far, _ in scored), default=0.0))
            far_hits = [far > FAR_FACTOR for _, far, _ in scored]
            far_strikes = max(far_strikes, max((sum(far_hits[max(0, i - WINDOW + 1): i + 1])
                                                for i in range(len(scored))), default=0))
            if first is not None:
                honest_at.append(first)
        out[str(stage)] = {"honest_max_against": honest_max, "honest_reaching": sorted(honest_at),
                           "liar_reaching": liar_at, "honest_max_far": round(far_max, 2),
                           "honest_max_far_strikes": far_strikes}
    return out


def trace_lies(liar: Daemon, stage0: list[Daemon], told: Any) -> Callable[[], int]:
    """Count the lies that reached the model: the liar's backward answers told wrong whose microbatch a
    stage-0 peer then ran its backward on with that wrong gradient (not the one a check put in its place).
    Returns the counter, read at the end of the run. A microbatch's stage-1 answer comes before its stage-0
    backward, so only the backwards of microbatches lied about are kept."""
    lied: dict[int, torch.Tensor] = {}
    received: list[tuple[int, torch.Tensor]] = []
    assert liar.executor is not None
    lying = liar.executor._backward_sync

    def liar_backward(inputs: Any, grad_outputs: Any, targets: Any, step: Any, mb: Any, *a: Any, **k: Any) -> Any:
        before = told.lies
        result = lying(inputs, grad_outputs, targets, step, mb, *a, **k)
        if told.lies > before and mb is not None and result.grad_inputs is not None:
            lied[mb] = result.grad_inputs.detach().float().flatten().clone()
        return result

    liar.executor._backward_sync = liar_backward  # type: ignore[method-assign]
    for d in stage0:
        assert d.executor is not None
        own = d.executor._backward_sync

        def stage0_backward(inputs: Any, grad_outputs: Any, targets: Any, step: Any, mb: Any,
                            deadline: float | None = None, verify: bool = False, attempt: int = 0, source: str = "",
                            _own: Any = own) -> Any:
            if not verify and mb in lied and grad_outputs is not None:
                received.append((mb, grad_outputs.detach().float().flatten().clone()))
            return _own(inputs, grad_outputs, targets, step, mb, deadline, verify, attempt, source)

        d.executor._backward_sync = stage0_backward  # type: ignore[method-assign]

    def used() -> int:
        return sum(1 for mb, g in received if g.shape == lied[mb].shape
                   and float(torch.nn.functional.cosine_similarity(g, lied[mb], dim=0)) > 0.5)

    return used


async def one_run(lie: str | None, args: argparse.Namespace) -> dict[str, Any]:
    SCORED.clear()
    async with fast_swarm(SPEC, TRAINING, peers_per_stage=args.peers_per_stage) as daemons:
        if args.audit_share is not None:  # (the all-reduce's audits of part owners: audit.AUDIT_SHARE by default)
            for d in daemons:
                auditor = getattr(d.averager, "auditor", None)
                if auditor is not None:
                    auditor.share = args.audit_share
        liar = None
        told = None
        if lie is not None:
            liar = [d for d in daemons if d.stage == STAGE[lie]][1]
            if lie in AVERAGING:  # the largest id of its stage: a liar that leads is not scored (SECURITY.md)
                liar = max((d for d in daemons if d.stage == STAGE[lie]), key=lambda d: d.peer_id or "")
                assert liar.averager is not None
                if lie in ("ownflip", "ownhide"):
                    lie_as_owner(liar.averager, -1.0, hide="refuse" if lie == "ownhide" else "")  # type: ignore[arg-type]
                else:
                    poison_contributions(liar.averager, {"ownpart": "minus20", "flipsigned": "flipped"}.get(lie, lie),
                                         own_part_only=lie == "ownpart", open_true=lie == "flipsigned")
            else:
                assert liar.executor is not None
                told = make_liar(liar.executor, lie)
        honest = [d for d in daemons if d is not liar]
        used = trace_lies(liar, [d for d in honest if d.stage == 0], told) if told is not None else None
        api = f"http://{daemons[0].status()['api_addr']}"
        done = [0]
        marks: dict[str, int | None] = {"first_lie_at": None, "caught_at": None, "excluded_at": None,
                                        "routed_out_at": None}
        mates = [d for d in honest if liar is not None and d.stage == liar.stage]

        def on_event(event: TrainerEvent) -> None:
            if isinstance(event, StepDone):
                done[0] = max(done[0], event.done)

        trainers = [Trainer(trainer_config(api, f"t{k}", steps=args.steps, fraction=args.verify_fraction,
                                           seed=args.seed + k), events=on_event) for k in range(2)]

        async def watch() -> None:
            while liar is not None:
                if marks["first_lie_at"] is None and told is not None and told.lies:
                    marks["first_lie_at"] = done[0]
                if marks["caught_at"] is None and any(t.checks.liars for t in trainers):
                    marks["caught_at"] = done[0]
                if all(liar.peer_id in d.status()["reports"]["excluded"] for d in honest):
                    marks["excluded_at"] = done[0]
                    return
                if lie in AVERAGING and marks["excluded_at"] is None and any(
                        liar.peer_id in d.averager.hostile_convictions for d in honest if d.averager is not None):
                    marks["excluded_at"] = done[0]  # convicted by its leader (hostile_contributions)
                if lie in AVERAGING and sum(1 for d in mates if d.averager is not None
                                            and liar.peer_id in d.averager.excluded()) >= 2:
                    marks["routed_out_at"] = done[0]  # two stage-mates name it: trainers stop routing to it
                    return
                await asyncio.sleep(0.1)

        joined: list[Daemon] = []

        async def churn() -> None:
            """``--joins``: new peers join during the run, evenly spaced in steps, stage 1 then 0 in turn (churn:
            what a trainer's first checks of each newcomer cost)."""
            for k in range(args.joins):
                while done[0] < (k + 1) * args.steps // (args.joins + 1):
                    await asyncio.sleep(0.1)
                d = Daemon(config(1 - k % 2, SPEC, TRAINING, (daemons[0].dht.address,)))
                joined.append(d)
                await d.start()

        watcher, joiner = asyncio.create_task(watch()), asyncio.create_task(churn())
        started = time.perf_counter()
        try:
            summaries = await asyncio.gather(*(t.run() for t in trainers))
        finally:
            for task in (watcher, joiner):
                task.cancel()
            await asyncio.gather(watcher, joiner, return_exceptions=True)
            await asyncio.gather(*(d.shutdown() for d in joined), return_exceptions=True)
        wall = time.perf_counter() - started
        final = await Trainer(dataclasses.replace(trainer_config(api, "val", steps=1, fraction=0.0, seed=99),
                                                  val_batches=16)).run()
        mb = trainer_config(api, "x", 1).microbatch_size
        calls = sum(s.verify["calls"] for s in summaries)
        work = sum(s.verify["work_passes"] for s in summaries)
        wire = sum(s.wire_bytes for s in summaries)  # the bodies of the trainers' own calls on the wire
        caught = {p for s in summaries for p in s.verify["caught"]}
        averagers = [d.averager for d in honest if d.averager is not None]
        convicted = {p for a in averagers for p in a.hostile_convictions}
        # and the peers a stage-mate excluded on another's accusation (swarmd.pipeline.averaging.trust.accusations)
        convicted |= {p for a in averagers for p, e in a.suspicions.status().items()
                      if e["reason"].startswith("hostile")}
        # opened contributions (contribution_proofs): their checks, and their cost on the last stage
        last = [d for d in daemons if d.stage == SPEC.n_stages - 1 and d.averager is not None and d.executor is not None]
        openings: dict[str, int] = {}
        for d in last:
            if d is not liar:
                for k, v in d.averager.openings.items():  # type: ignore[union-attr]
                    openings[k] = openings.get(k, 0) + v
        honest_last = [d for d in last if d is not liar]
        grad_bytes = sum(sum(d.averager.codecs_sent.values()) for d in honest_last  # type: ignore[union-attr]
                         ) * 4 * (honest_last[0].executor.grad_numel if honest_last else 0)  # type: ignore[union-attr]
        opening_cpu = sum(d.averager.opening_costs["cpu_s"] for d in honest_last)  # type: ignore[union-attr]
        worker_cpu = sum(d.executor.worker_cpu_s for d in honest_last)  # type: ignore[union-attr]
        return {
            "lie": lie or "honest",
            "stage": STAGE.get(lie or "", None),
            "first_lie_at": marks["first_lie_at"],
            "lies": told.lies if told is not None else None,
            # the liar's backward lies a stage-0 peer then ran its own backward on: lies that reached the model
            "lies_used": used() if used is not None else None,
            "caught_at": marks["caught_at"],
            "excluded_at": marks["excluded_at"],
            "routed_out_at": marks["routed_out_at"],
            "excluded_after_lying": (marks["excluded_at"] - marks["first_lie_at"]
                                     if marks["excluded_at"] is not None and marks["first_lie_at"] is not None
                                     else None),
            "seconded": sum(a.accusations["seconded"] for a in averagers),
            "honest_blamed": sorted(p[:12] for p in caught | convicted if liar is None or p != liar.peer_id),
            # the honest leaders' robust averaging: contributions clipped, and left out of the mean
            "clipped": sum(a.contributions_clipped for a in averagers),
            "struck": sum(a.contributions_struck for a in averagers),
            "rounds": sum(a.rounds_ok for a in averagers),
            # the all-reduce's audits of part owners (summed over the honest peers), and the parts whose own slice
            # their owner's median rule left out (the liar's, for ownpart: it reduces honestly)
            "audits": dict(sum((Counter(a.checks_status().get("audits", {})) for a in averagers), Counter())),
            "own_slices_struck": {"liar": liar.status()["averaging"].get("own_slices_struck", 0)
                                  if liar is not None and liar.averager is not None else None,
                                  "honest": sum(a.checks_status().get("own_slices_struck", 0) for a in averagers)},
            # the checks' compute in forward passes (a forward 1, a backward 2, the last stage's fused call 3,
            # swarmd.train.verify.call_passes) per pass of the microbatches' own calls
            "extra_compute": round(sum(s.verify["extra_passes"] for s in summaries) / max(1, work), 4),
            # by what the checks' calls were for: pairs' halves, second and third opinions, probes
            "extra_by_reason": {why: round(sum(s.verify["extra_passes_by_reason"].get(why, 0) for s in summaries)
                                           / max(1, work), 4) for why in ("pair", "opinion", "probe")},
            # the measure used before: samples the checks' calls carried per sample of the calls judged (a probe's
            # forward counts as much as the fused call it checks)
            "extra_samples": round(sum(s.verify["extra_samples"] for s in summaries) / max(1, calls * mb), 4),
            "extra_samples_by_reason": {
                why: round(sum(s.verify.get("extra_by_reason", {}).get(why, 0) for s in summaries) / max(1, calls * mb),
                           4) for why in ("pair", "opinion", "probe")},
            # the checks' traffic: their requests' and replies' bodies on the wire per byte of the microbatches'
            # and validations' own calls (swarmd.net.client.metered), and the measure used before, requests per call
            "extra_traffic": round(sum(s.verify["extra_wire_bytes"] for s in summaries) / max(1, wire), 4),
            "extra_traffic_by_reason": {
                why: round(sum(s.verify["extra_wire_by_reason"].get(why, 0) for s in summaries) / max(1, wire), 4)
                for why in ("pair", "opinion", "probe")},
            "extra_requests": round(sum(s.verify["extra_requests"] for s in summaries) / max(1, calls), 4),
            "paired": sum(s.verify["paired"] for s in summaries),
            "first_checks": sum(s.verify["first_checks"] for s in summaries),
            "first_opinions": sum(s.verify.get("first_opinions", 0) for s in summaries),
            "suspicion_checks": sum(s.verify.get("suspicion_checks", 0) for s in summaries),
            "mismatches": sum(s.verify["mismatches"] for s in summaries),
            "redone": sum(s.verify["redone"] for s in summaries),
            "suspicions": sum(s.verify["suspicions"] for s in summaries),
            "probes": sum(s.verify["probes"] for s in summaries),
            # of which: last-stage answers out of a thin size reference's band (verify.Outlier.THIN)
            "outlier_probes": sum(s.verify.get("outlier_probes", 0) for s in summaries),
            "probes_missed": sum(s.verify.get("probes_missed", 0) for s in summaries),  # unanswered, or another step
            "openings": openings,
            # sketching CPU on the honest last-stage peers, per CPU second of their stage work; opening bytes
            # per byte of the gradients they sent
            "opening_compute": round(opening_cpu / max(worker_cpu, 1e-9), 4),
            "opening_traffic": round(sum(d.averager.opening_costs["bytes"] for d in honest_last)  # type: ignore[union-attr]
                                     / max(grad_bytes, 1), 6),
            # the largest gap of an opening found consistent (tolerance 1e-3 exact; per codec when lossy; a sign flip: 1.0)
            "opening_max_gap": max((d.averager.opening_costs["max_gap"] for d in last), default=0.0),  # type: ignore[union-attr]
            # every honest peer's stage compute (CPU seconds of its worker's jobs: passes, accumulation, steps), per
            # sample the trainers trained: held side by side with a run without checks (--verify-fraction 0), the
            # checks' extra compute as measured on the peers rather than counted in samples by the trainers
            "worker_cpu_s": round(sum(d.executor.worker_cpu_s for d in honest if d.executor is not None), 3),
            "trained_samples": sum(s.samples for s in summaries),
            "steps": min(s.steps for s in summaries),
            "joined": len(joined),
            "val_loss": final.val_loss,
            "wall_s": round(wall, 1),
            **({"directions": directions(daemons, liar)} if args.directions else {}),
        }


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for _ in range(args.repeats):
        honest = await one_run(None, args)
        results.append(honest)
        for lie in args.lies:
            row = await one_run(lie, args)
            if honest["val_loss"] and row["val_loss"]:
                row["vs_honest"] = round(row["val_loss"] / honest["val_loss"], 4)
            results.append(row)
            if not args.json:
                print(row, flush=True)
        args.seed += 100
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lies", nargs="*", default=["aware", "far", "ahead", "sometimes", "gradnoise", "stale",
                                                      "minus20", "flipped"], choices=sorted(STAGE))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--verify-fraction", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plain-averaging", action="store_true", help="average as before issue 29 (plain mean)")
    parser.add_argument("--peers-per-stage", type=int, default=3, help="peers serving each of the 2 stages")
    parser.add_argument("--joins", type=int, default=0, help="peers that join during each run (churn), evenly spaced")
    parser.add_argument("--audit-share", type=float, default=None,
                        help="the share of all-reduce commits audited (default: the daemon's, audit.AUDIT_SHARE)")
    parser.add_argument("--log", action="store_true", help="warnings to stderr (the checks' verdicts)")
    parser.add_argument("--directions", action="store_true", help="per stage, what a rule convicting on direction "
                        "(STRIKES cosines below -AGAINST_COS in WINDOW rounds) would have convicted")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING if args.log else logging.ERROR)
    load = os.getloadavg()
    seed = args.seed
    if args.plain_averaging:
        plain_averaging()
    if args.directions:
        record_scores()
    out = asyncio.run(main(args))
    args.seed = seed  # the first repeat's (each next one adds 100)
    report = {"load_before": [round(x, 2) for x in load], "load_after": [round(x, 2) for x in os.getloadavg()],
              "args": {k: v for k, v in vars(args).items() if k != "json"}, "runs": out}
    print(strict_json_dumps(report) if args.json else report)
