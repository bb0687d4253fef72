"""The square-cube law on this machine: a block's compute per microbatch against its bytes on the wire.

SWARM (Ryabinin et al., 2023, section 3.1 and Table 1) argues that model parallelism over the
internet gets *easier* as models grow: a transformer block's compute grows with ``d_model**2``
per token, the activations it sends only with ``d_model``, so a wider block spends longer
computing per byte it sends. This script measures both sides for one pre-norm block
(``d_ff = 4 * d_model``, 64-wide heads; swarmd's own middle stage, as in
``scripts/bench_rpc.py``) at ``d_model`` 256, 512, 1024 and 2048, on one CPU stage with
``--threads`` torch threads (default: every core):

- ``compute_s``: wall seconds of one microbatch's forward + backward (``--batch`` x ``--seq``
  tokens, input gradient and parameter gradients), the fastest of ``--repeats`` after a warm-up
  (``compute_s_median`` the median). Two torch threads on two cores that another process also
  uses run several times slower, and other processes only ever add time, hence the fastest; the
  report also gives ``other_processes_cpu_cores`` (the CPU the rest of the machine used per
  second, from ``/proc/stat``): above ~0.1 the median is unreliable;
- ``bytes``: per codec, the exact wire frames (``swarmd.net.wire.encode_frame``: payload,
  header, 8-bit absmax) crossing one stage boundary per microbatch. ``paper`` counts what
  SWARM's Table 1 counts, the activations forward plus the gradients backward (two
  ``batch x seq x d_model`` tensors). ``swarmd`` counts what swarmd's stateless backward sends:
  the backward request carries the stage inputs again, so three such tensors. Rows ``b/K+codec``
  are a compression-aware boundary (``ModelSpec.boundary_dim = d_model / K``, issue 30): the same
  block's frames ``d_model / K`` wide; the block's compute is taken unchanged (the two boundary
  projections add ``2 * d_model * d_model / K`` multiply-adds per token to the block's ~``12 *
  d_model**2``, 4% at K = 4).

Utilization of the stage at a link bandwidth ``B`` (bits/s), for each codec and accounting::

    transfer_s        = 8 * bytes / B
    utilization       = compute_s / (compute_s + transfer_s)        # compute waits for transfers
    utilization_ovl   = compute_s / max(compute_s, transfer_s)      # transfers overlap compute

The first is a stage that sends one microbatch at a time and waits; the second a stage with
enough microbatches in flight that communication hides behind compute (SWARM's setting),
limited only by whichever of the two is slower. Latency, HTTP framing and codec CPU time are
left out: this is the bandwidth side of the law only (``scripts/bench_rpc.py`` measures the
rest over loopback, ``scripts/bench_wan.py`` on a shaped network).

    .venv/bin/python scripts/bench_square_cube.py               # a table
    .venv/bin/python scripts/bench_square_cube.py --json        # one JSON object
    .venv/bin/python scripts/bench_square_cube.py --d-models 256 512 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

from swarmd.finite import strict_json_dumps
from swarmd.net.wire import encode_frame
from swarmd.pipeline.model import build_stage
from swarmd.pipeline.spec import ModelSpec

CODECS = ("none", "fp16", "8bit", "4bit")
#: Compression-aware boundaries (ModelSpec.boundary_dim, issue 30): (label, codec, d_model / width).
BOTTLENECKS = (("b/4+8bit", "8bit", 4), ("b/4+4bit", "4bit", 4), ("b/8+4bit", "4bit", 8))
BANDWIDTHS_MBIT = (100, 500)
STAGE = 1  # the middle of three stages: one bare block


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has used (user + nice + system + irq + softirq + steal)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def block_spec(d_model: int, seq: int) -> ModelSpec:
    return ModelSpec(name=f"square-cube-{d_model}", d_model=d_model, n_heads=max(1, d_model // 64),
                     d_ff=4 * d_model, layers_per_stage=1, n_stages=3, seq_len=seq)


def compute_seconds(spec: ModelSpec, batch: int, repeats: int) -> list[float]:
    """Forward + backward of one microbatch through the block, timed ``repeats`` times after a warm-up."""
    block = build_stage(spec, STAGE)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, spec.seq_len, spec.d_model, generator=gen)
    grad = torch.randn(batch, spec.seq_len, spec.d_model, generator=gen) * 1e-3
    took = []
    for r in range(repeats + 1):
        started = time.perf_counter()
        leaf = x.detach().requires_grad_(True)
        block(leaf).backward(grad)
        if r:
            took.append(time.perf_counter() - started)
    return took


def frame_bytes(spec: ModelSpec, batch: int, codec: str, width: int | None = None) -> int:
    """Bytes of one frame carrying one ``batch x seq x width`` (default d_model) float32 tensor with ``codec``."""
    t = torch.randn(batch, spec.seq_len, width or spec.d_model, generator=torch.Generator().manual_seed(1))
    return len(encode_frame("forward", {"stage": STAGE, "step": 0}, {"inputs": t}, codec))


def utilization(compute_s: float, nbytes: int, mbit: float) -> dict[str, float]:
    transfer = 8 * nbytes / (mbit * 1e6)
    return {"transfer_s": round(transfer, 5), "utilization": round(compute_s / (compute_s + transfer), 3),
            "utilization_overlap": round(compute_s / max(compute_s, transfer), 3)}


def measure(d_model: int, seq: int, batch: int, repeats: int) -> dict[str, Any]:
    spec = block_spec(d_model, seq)
    took = compute_seconds(spec, batch, repeats)
    compute = min(took)  # other processes only ever add time
    entry: dict[str, Any] = {
        "d_model": d_model, "n_heads": spec.n_heads, "d_ff": spec.d_ff, "seq": seq, "batch": batch,
        "params": sum(p.numel() for p in build_stage(spec, STAGE).parameters()),
        "compute_s": round(compute, 4), "compute_s_median": round(statistics.median(took), 4), "codecs": {},
    }
    rows = [(codec, codec, 1) for codec in CODECS] + list(BOTTLENECKS)
    for label, codec, divisor in rows:
        one = frame_bytes(spec, batch, codec, d_model // divisor)
        accountings = {"paper": 2 * one, "swarmd": 3 * one}
        entry["codecs"][label] = {
            "frame_bytes": one,
            **{f"bytes_{name}": n for name, n in accountings.items()},
            "at_mbit": {str(mbit): {name: utilization(compute, n, mbit) for name, n in accountings.items()}
                        for mbit in BANDWIDTHS_MBIT},
        }
    return entry


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-models", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    machine, own, started = machine_cpu_s(), time.process_time(), time.perf_counter()
    blocks = [measure(d, args.seq, args.batch, args.repeats) for d in args.d_models]
    other = (machine_cpu_s() - machine - (time.process_time() - own)) / (time.perf_counter() - started)
    out: dict[str, Any] = {"threads": args.threads, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                           "bandwidths_mbit": list(BANDWIDTHS_MBIT),
                           # CPU the rest of the machine used per second: above ~0.1, compute_s is unreliable
                           "other_processes_cpu_cores": round(max(other, 0.0), 3), "blocks": blocks}
    if args.json:
        print(strict_json_dumps(out, indent=2))
        print()
        return 0
    print(f"one block, batch {args.batch} x seq {args.seq}, {args.threads} torch thread(s); "
          "utilization = compute / (compute + transfer), [overlapped: compute / max(compute, transfer)]")
    print(f"{'d_model':>7} {'compute s':>9} {'codec':>8} {'MiB (paper)':>11} "
          + " ".join(f"{f'{mbit} Mbit/s':>17}" for mbit in BANDWIDTHS_MBIT))
    for b in out["blocks"]:
        for codec, e in b["codecs"].items():
            cells = " ".join(f"{e['at_mbit'][str(m)]['paper']['utilization']:7.3f} "
                             f"[{e['at_mbit'][str(m)]['paper']['utilization_overlap']:6.3f}]" for m in BANDWIDTHS_MBIT)
            print(f"{b['d_model']:7} {b['compute_s']:9.3f} {codec:>8} {e['bytes_paper'] / 2**20:11.2f} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
