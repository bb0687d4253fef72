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
  ``batch x seq x d_model`` tensors). ``swarmd`` counts what a middle stage's peer receives in
  swarmd (each direction of its link carries as much): the same two tensors since issue 30 (a
  backward to the peer that kept its forward omits the inputs; before, three), plus its share of
  the stage's gradient averaging per microbatch: a contributor sends its gradients and receives the
  mean once per step (``--grad-codec`` frames of the block's parameters), and a step of
  ``--samples-per-step`` samples over ``--peers-per-stage`` peers gives each peer
  ``samples / (peers * batch)`` microbatches to spread that over. Rows ``b/K+codec`` are a
  compression-aware boundary (``ModelSpec.boundary_dim = d_model / K``, issue 30): the same
  block's frames ``d_model / K`` wide; the block's compute is taken unchanged (the two boundary
  projections add ``2 * d_model * d_model / K`` multiply-adds per token to the block's ~``12 *
  d_model**2``, 4% at K = 4). A row's grad codec is its activation codec unless it names one
  (``+g3bit``: 3-bit averaging, ``+g5level``: 5-level, 2.58 bits, ``+g2bit``: 2-bit).

``--compute-s D=SECONDS ...`` takes a block's compute time from an earlier (quieter) run instead
of timing it: the bytes are exact frames and do not depend on the machine's load, the compute does.

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
#: Compression-aware boundaries (ModelSpec.boundary_dim, issue 30) and coarser averaging:
#: (label, activation codec, d_model / width, grad codec).
BOTTLENECKS = (("b/4+8bit", "8bit", 4, "8bit"), ("b/4+4bit", "4bit", 4, "4bit"), ("b/8+4bit", "4bit", 8, "4bit"),
               ("b/4+4bit+g3bit", "4bit", 4, "3bit"), ("b/8+4bit+g3bit", "4bit", 8, "3bit"),
               ("b/4+4bit+g5level", "4bit", 4, "5level"), ("b/8+4bit+g5level", "4bit", 8, "5level"),
               ("b/4+4bit+g2bit", "4bit", 4, "2bit"))
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


def grad_frame_bytes(params: int, codec: str) -> int:
    """Bytes of one averaging frame carrying ``params`` float32 gradients with ``codec``."""
    t = torch.randn(params, generator=torch.Generator().manual_seed(2)) * 1e-3
    return len(encode_frame("average", {"stage": STAGE, "step": 0, "samples": 1}, {"grads": t}, codec))


def utilization(compute_s: float, nbytes: int, mbit: float) -> dict[str, float]:
    transfer = 8 * nbytes / (mbit * 1e6)
    return {"transfer_s": round(transfer, 5), "utilization": round(compute_s / (compute_s + transfer), 3),
            "utilization_overlap": round(compute_s / max(compute_s, transfer), 3)}


def measure(d_model: int, args: argparse.Namespace) -> dict[str, Any]:
    seq, batch = args.seq, args.batch
    spec = block_spec(d_model, seq)
    given = dict(args.compute_s or {})
    took = [given[d_model]] if d_model in given else compute_seconds(spec, batch, args.repeats)
    compute = min(took)  # other processes only ever add time
    params = sum(p.numel() for p in build_stage(spec, STAGE).parameters())
    microbatches = max(1.0, args.samples_per_step / (args.peers_per_stage * batch))  # per peer and step
    entry: dict[str, Any] = {
        "d_model": d_model, "n_heads": spec.n_heads, "d_ff": spec.d_ff, "seq": seq, "batch": batch,
        "params": params, "compute_s": round(compute, 4), "compute_s_median": round(statistics.median(took), 4),
        "compute_given": d_model in given, "microbatches_per_peer_step": microbatches, "codecs": {},
    }
    rows = [(codec, codec, 1, codec) for codec in CODECS] + list(BOTTLENECKS)
    for label, codec, divisor, grad_codec in rows:
        one = frame_bytes(spec, batch, codec, d_model // divisor)
        # the boundary projections' parameters are averaged too
        averaged = params + (2 * d_model * (d_model // divisor) if divisor > 1 else 0)
        averaging = round(grad_frame_bytes(averaged, grad_codec) / microbatches)
        accountings = {"paper": 2 * one, "swarmd": 2 * one + averaging}
        entry["codecs"][label] = {
            "frame_bytes": one, "grad_codec": grad_codec, "averaging_bytes_per_microbatch": averaging,
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
    p.add_argument("--samples-per-step", type=int, default=256, help="a step's batch over the whole stage")
    p.add_argument("--peers-per-stage", type=int, default=2)
    p.add_argument("--compute-s", type=_given, nargs="+", metavar="D=SECONDS",
                   help="a block's compute time from an earlier run (not timed here)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    machine, own, started = machine_cpu_s(), time.process_time(), time.perf_counter()
    blocks = [measure(d, args) for d in args.d_models]
    other = (machine_cpu_s() - machine - (time.process_time() - own)) / (time.perf_counter() - started)
    out: dict[str, Any] = {"samples_per_step": args.samples_per_step, "peers_per_stage": args.peers_per_stage,
                           "load_average": [round(x, 2) for x in os.getloadavg()],
                           "threads": args.threads, "cpu_count": os.cpu_count(), "torch": torch.__version__,
                           "bandwidths_mbit": list(BANDWIDTHS_MBIT),
                           # CPU the rest of the machine used per second: above ~0.1, compute_s is unreliable
                           "other_processes_cpu_cores": round(max(other, 0.0), 3), "blocks": blocks}
    if args.json:
        print(strict_json_dumps(out, indent=2))
        print()
        return 0
    print(f"one block, batch {args.batch} x seq {args.seq}, {args.threads} torch thread(s); "
          "utilization = compute / (compute + transfer), [overlapped: compute / max(compute, transfer)]")
    print(f"{'d_model':>7} {'compute s':>9} {'codec':>15} {'MiB (swarmd)':>12} "
          + " ".join(f"{f'{mbit} Mbit/s':>17}" for mbit in BANDWIDTHS_MBIT))
    for b in out["blocks"]:
        for codec, e in b["codecs"].items():
            cells = " ".join(f"{e['at_mbit'][str(m)]['swarmd']['utilization']:7.3f} "
                             f"[{e['at_mbit'][str(m)]['swarmd']['utilization_overlap']:6.3f}]" for m in BANDWIDTHS_MBIT)
            print(f"{b['d_model']:7} {b['compute_s']:9.3f} {codec:>15} {e['bytes_swarmd'] / 2**20:12.2f} {cells}")
    return 0


def _given(text: str) -> tuple[int, float]:
    """``D=SECONDS`` of ``--compute-s``."""
    d_model, _, seconds = text.partition("=")
    try:
        return int(d_model), float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected D_MODEL=SECONDS, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
