"""What one-step-old gradients cost in held-out loss, in one process, side by side with sync training.

Delayed parameter updates (``--delay-updates``, ``swarmd.pipeline.stage.delayed_updates``) let a stage
keep computing while its averaging round is on the wire, so the backwards it runs meanwhile are
computed at the parameters of step ``s`` and join the update applied to those of ``s + 1``:
they are one update old. ``scripts/bench_wan.py --compare-loss`` measures the whole swarm's loss
against ``--sync``; this script takes the swarm out of the question. The same model, data, batch
split and AdamW as ``swarmd.train.reference`` (what a ``--sync`` swarm computes), trained in this
process under each of these rules, from the same initial weights and the same microbatches:

- ``sync``: every microbatch at the current parameters (the reference);
- ``stale``: the first ``--stale-fraction`` of each step's microbatches computed at the previous
  step's parameters, forward and backward alike (weight stashing: a consistent but one-update-old
  gradient; what delayed updates do to the backwards run during a round);
- ``predicted``: the same microbatches computed at ``2 x theta_s - theta_(s-1)``, the previous
  parameters moved once more by the last update (weight prediction, as PipeMare and SpecTrain do);
- ``recomputed``: the same microbatches' forwards at the previous step's parameters, their
  backwards recomputed at the current ones (each stage but the last; the last one's forward and
  backward are one call at the current parameters), against the next stage's input gradients of
  the old forward: what a swarmd stage does with a backward one step old whose graph an update
  dropped (``swarmd.pipeline.stage.passes``: it recomputes from the kept inputs);
- ``delayed``: each step's whole gradient applied one update later (the paper's description of
  delayed updates: the update of step ``s`` runs while step ``s + 1`` computes);
- ``delayed-predicted``: ``delayed``, each step computed at the parameters moved once more by the
  last update (``2 x theta - theta_before_it``: weight prediction for the update still on the wire).

Each run's held-out loss (``--val-batches`` microbatches of the corpus's held-out part every
``--val-every`` steps) and its ratio to ``sync``'s at the last validation, as one JSON object::

    .venv/bin/python scripts/bench_staleness.py --json
    .venv/bin/python scripts/bench_staleness.py --json --steps 150 --modes sync stale predicted

Nothing here is timed: the result is a ratio of losses, so load on the machine changes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.func import functional_call

from swarmd.finite import strict_json_dumps
from swarmd.pipeline.model import StageModule, build_stage
from swarmd.pipeline.stage.optimizer import apply_step, build_optimizer
from swarmd.pipeline.spec import TrainingSpec
from swarmd.pipeline.spec_files import load_spec, with_partition
from swarmd.train.corpus import Corpus
from swarmd.train.data import BatchSampler, load_corpus, val_batches
from swarmd.train.reference import apply_mean_step

MODES = ("sync", "stale", "predicted", "recomputed", "delayed", "delayed-predicted")
CORPUS_BYTES = 8 * 2**20  # the trainer's default
Params = list[dict[str, torch.Tensor]]


def _run(stages: Sequence[StageModule], params: Params | None, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of ``(x, y)`` through every stage, at ``params`` (None: the stages' own)."""
    h = x
    for k, stage in enumerate(stages):
        args = (h,) if k < len(stages) - 1 else (h, y)
        h = stage(*args) if params is None else functional_call(stage, params[k], args)
    return h


def _recomputed(stages: Sequence[StageModule], old: Params, x: torch.Tensor, y: torch.Tensor) -> None:
    """Accumulate the gradients of ``(x, y)`` as a swarm computes a backward one step old: every
    stage's forward at ``old``, the last stage's forward and backward at the current parameters, then
    each earlier stage's backward recomputed at the current parameters from its old inputs."""
    inputs = [x]
    with torch.no_grad():
        for k, stage in enumerate(stages[:-1]):
            inputs.append(functional_call(stage, old[k], (inputs[-1],)))
    grad: torch.Tensor | None = None
    for k in range(len(stages) - 1, -1, -1):
        h = inputs[k].detach().requires_grad_(k > 0)
        if k == len(stages) - 1:
            (stages[k](h, y) * x.shape[0]).backward()
        else:
            torch.autograd.backward(stages[k](h), grad)
        grad = h.grad if k > 0 else None


def _snapshot(stages: Sequence[StageModule]) -> Params:
    return [{n: p.detach().clone() for n, p in st.named_parameters()} for st in stages]


def train(mode: str, args: argparse.Namespace, corpus: Corpus) -> dict[str, Any]:
    """One run under ``mode``; its held-out loss curve."""
    torch.manual_seed(args.seed)
    spec = with_partition(load_spec(args.model), "equal")
    training = TrainingSpec(target_batch_size=args.batch_size, lr=args.lr)
    sampler = BatchSampler(corpus.train, spec.seq_len, seed=args.seed)
    held_out = val_batches(corpus.val, spec.seq_len, args.microbatch_size, args.val_batches)
    stages = [build_stage(spec, k) for k in range(spec.n_stages)]
    optimizers = [build_optimizer(training, st.named_parameters()) for st in stages]
    per_step = args.batch_size // args.microbatch_size
    n_old = round(args.stale_fraction * per_step) if mode in ("stale", "predicted", "recomputed") else 0
    if mode == "delayed-predicted":
        n_old = per_step  # every microbatch at the predicted parameters, once there are any
    predicted_next: Params | None = None  # delayed-predicted: 2 x theta - theta before the last update
    previous: Params | None = None  # the parameters of the step before this one
    before_previous: Params | None = None
    pending: list[list[torch.Tensor]] | None = None  # delayed: the last step's mean gradient
    curve: list[tuple[int, int, float]] = []
    for step in range(args.steps):
        microbatches = [sampler.sample(args.microbatch_size) for _ in range(per_step)]
        if mode == "predicted" and previous is not None and before_previous is not None:
            pairs = zip(previous, before_previous, strict=True)
            old: Params | None = [{n: 2 * p[n] - q[n] for n in p} for p, q in pairs]
        elif mode == "delayed-predicted":
            old = predicted_next
        else:
            old = previous
        for i, (x, y) in enumerate(microbatches):
            if i < n_old and old is not None and mode == "recomputed":
                _recomputed(stages, old, x, y)
            elif i < n_old and old is not None:
                leaves = [{n: t.clone().requires_grad_(True) for n, t in d.items()} for d in old]
                loss = _run(stages, leaves, x, y) * x.shape[0]
                grads = torch.autograd.grad(loss, [t for d in leaves for t in d.values()])
                for p, g in zip((p for st in stages for p in st.parameters()), grads, strict=True):
                    p.grad = g if p.grad is None else p.grad + g
            else:
                (_run(stages, None, x, y) * x.shape[0]).backward()
        before_previous, previous = previous, _snapshot(stages)
        samples = per_step * args.microbatch_size
        if mode in ("delayed", "delayed-predicted") and step >= args.delay_after:
            current = [[p.grad / samples for p in st.parameters()] for st in stages]
            for st in stages:
                st.zero_grad(set_to_none=True)
            if pending is not None:
                before_update = _snapshot(stages)
                for st, opt, grads_k in zip(stages, optimizers, pending, strict=True):
                    for p, g in zip(st.parameters(), grads_k, strict=True):
                        p.grad = g
                    apply_step(opt, training, list(st.parameters()), step - 1)
                after = _snapshot(stages)
                predicted_next = [{n: 2 * a[n] - b[n] for n in a} for a, b in zip(after, before_update, strict=True)]
            pending = current
        else:
            apply_mean_step(stages, optimizers, training, samples, step)
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            with torch.no_grad():
                val = sum(float(_run(stages, None, x, y)) for x, y in held_out) / len(held_out)
            curve.append((step + 1, (step + 1) * args.batch_size, round(val, 4)))
            print(f"bench_staleness: {mode} step {step + 1}: held-out {val:.4f}", file=sys.stderr)
    return {"mode": mode, "val_curve": curve, "val_loss": curve[-1][2]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", help="model preset (default: small)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--microbatch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=TrainingSpec().lr, help="peak learning rate (default: the swarm's)")
    p.add_argument("--stale-fraction", type=float, default=0.5,
                   help="share of each step's microbatches computed one update late (default: 0.5)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--delay-after", type=int, default=0, metavar="N",
                   help="the delayed modes take their first N updates at once, as sync does (default: 0)")
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--corpus-bytes", type=int, default=CORPUS_BYTES,
                   help="bytes of the standard library's sources to read (default: the trainer's 8 MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.batch_size % args.microbatch_size or args.steps < 1 or not 0 <= args.stale_fraction <= 1:
        p.error("--batch-size must be a multiple of --microbatch-size, --steps >= 1, --stale-fraction in [0, 1]")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    seq_len = load_spec(args.model).seq_len
    corpus = load_corpus(None, max_bytes=args.corpus_bytes, seed=args.seed, seq_len=seq_len)
    runs = [train(mode, args, corpus) for mode in args.modes]
    ref = next((r["val_loss"] for r in runs if r["mode"] == "sync"), None)
    for r in runs:
        r["vs_sync"] = None if ref is None else round(r["val_loss"] / ref - 1, 4)
    settings = {k: getattr(args, k) for k in ("model", "steps", "batch_size", "microbatch_size", "lr", "stale_fraction",
                                              "delay_after", "val_every", "val_batches", "corpus_bytes", "seed")}
    out = {"settings": settings, "runs": runs, "wall_s": round(time.perf_counter() - started, 1)}
    if args.json:
        print(strict_json_dumps(out))
    else:
        for r in runs:
            print(f"{r['mode']:>10}: held-out {r['val_loss']:.4f}  vs sync {r['vs_sync']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
