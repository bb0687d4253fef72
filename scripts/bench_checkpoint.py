"""Checkpoint cost: write time, the longest step stall a checkpoint causes while a stage serves, export time.

For each preset, one stage executor serves forwards back to back (as under load) while
``Checkpointer.save`` snapshots it (on the worker thread, between jobs) and writes it (on its
own thread); the longest gap between two forwards during the save is compared with the longest
gap without one. Then every stage is checkpointed and ``swarmd export --from`` is timed. One JSON
line per preset on stdout.

    .venv/bin/python scripts/bench_checkpoint.py --presets small base
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from swarmd.checkpoint import Checkpointer
from swarmd.export import from_checkpoints, write_model
from swarmd.finite import strict_json_dumps
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.spec import PRESETS, TrainingSpec


async def longest_gap(ex: StageExecutor, x: torch.Tensor, during: asyncio.Future[Any] | None, n: int) -> float:
    """The longest time between two consecutive forwards, over ``n`` of them or until ``during`` ends."""
    last, worst, done = time.perf_counter(), 0.0, 0
    while (during is not None and not during.done()) or (during is None and done < n):
        await ex.forward(x)
        now = time.perf_counter()
        worst, last, done = max(worst, now - last), now, done + 1
    return worst


async def bench(preset: str, workdir: Path, batch: int) -> dict[str, object]:
    spec = PRESETS[preset]
    training = TrainingSpec()
    stage = 1 if spec.n_stages > 1 else 0
    ex = StageExecutor(spec, stage, training=training, threads=1)
    await ex.add_gradients(torch.zeros(ex.grad_numel), 1)  # real optimizer state: step once
    c = await ex.take_contribution()
    assert c.grads is not None
    await ex.apply_average(c.grads, 0)
    x = torch.randn(batch, spec.seq_len, spec.d_model)
    baseline = await longest_gap(ex, x, None, 20)
    checkpointer = Checkpointer(workdir / "peer", swarm="bench", every=1, keep=1)
    started = time.perf_counter()
    save = asyncio.ensure_future(checkpointer.save(ex, training))
    stall = await longest_gap(ex, x, save, 0)
    info = await save
    total_s = time.perf_counter() - started
    await ex.close()
    assert info is not None
    for k in range(spec.n_stages):  # every stage's checkpoint, for the export
        if k == stage:
            continue
        other = StageExecutor(spec, k, training=training, threads=1)
        await Checkpointer(workdir / "peer", swarm="bench", every=1, keep=1).save(other, training)
        await other.close()
    started = time.perf_counter()
    model = from_checkpoints([workdir / "peer"])
    size = write_model(model, workdir / "model.safetensors")
    export_s = time.perf_counter() - started
    return {
        "preset": preset, "stage": stage, "checkpoint_bytes": info.bytes, "checkpoint_s": round(total_s, 3),
        "write_s": round(checkpointer.last_write_s or 0.0, 3), "longest_gap_without_s": round(baseline, 4),
        "longest_gap_during_s": round(stall, 4), "forward_batch": batch, "export_s": round(export_s, 3),
        "export_bytes": size, "torch": torch.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["small", "base"], choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=2, help="samples per forward of the serving loop (default: 2)")
    args = p.parse_args()
    torch.set_num_threads(1)
    for preset in args.presets:
        with tempfile.TemporaryDirectory(prefix="swarmd-bench-ckpt-") as tmp:
            print(strict_json_dumps(asyncio.run(bench(preset, Path(tmp), args.batch))), flush=True)


if __name__ == "__main__":
    main()
