"""Throughput of the wire codecs on one realistic activation, against a plain memory copy.

SWARM hides communication behind compute only if encoding and decoding an activation costs
little next to the stage's own work; this measures that cost. For each codec it times the full
round trip a peer pays, ``encode_frame`` then ``decode_frame`` of a 4x512x1024 float32 tensor
(batch x sequence x hidden, 8 MiB), and ``tensor.clone()`` of the same tensor as the yardstick.
After one warm-up round, the codecs and the copy are timed in turn (interleaved, so the memory
allocator's state treats them alike), and the median of ``--repeats`` rounds is reported.

    .venv/bin/python scripts/bench_codec.py            # a table
    .venv/bin/python scripts/bench_codec.py --json     # one JSON object, for docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import sys
import time
from typing import Any

import torch

from swarmd.finite import strict_json_dumps
from swarmd.net.codecs import CODECS
from swarmd.net.wire import decode_frame, encode_frame

SHAPE = (4, 512, 1024)


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def run(repeats: int, threads: int | None) -> dict[str, Any]:
    if threads is not None:
        torch.set_num_threads(threads)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    tensor_bytes = x.numel() * x.element_size()
    names = list(CODECS)
    copy_times: list[float] = []
    times: dict[str, dict[str, list[float]]] = {name: {"encode": [], "decode": [], "total": []} for name in names}
    frame_bytes: dict[str, int] = {}
    max_error: dict[str, float] = {}

    for round_index in range(repeats + 1):  # round 0 is the warm-up
        copy_seconds, _ = _timed(x.clone)
        for name in names:
            enc_seconds, frame = _timed(encode_frame, "forward", {}, {"x": x}, codec=name)
            dec_seconds, decoded = _timed(decode_frame, frame)
            if round_index == 0:
                frame_bytes[name] = len(frame)
                max_error[name] = float((decoded.tensors["x"] - x).abs().max())
                continue
            times[name]["encode"].append(enc_seconds)
            times[name]["decode"].append(dec_seconds)
            times[name]["total"].append(enc_seconds + dec_seconds)
        if round_index:
            copy_times.append(copy_seconds)

    copy_median = statistics.median(copy_times)
    codecs: dict[str, Any] = {}
    for name in names:
        seconds = statistics.median(times[name]["total"])
        codecs[name] = {
            "seconds": seconds,
            "gb_per_s": tensor_bytes / seconds / 1e9,
            "ratio_vs_copy": seconds / copy_median,
            "frame_bytes": frame_bytes[name],
            "max_abs_error": max_error[name],
            "encode_seconds": statistics.median(times[name]["encode"]),
            "decode_seconds": statistics.median(times[name]["decode"]),
        }
    return {
        "tensor_shape": list(SHAPE),
        "tensor_dtype": "float32",
        "tensor_bytes": tensor_bytes,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "bitsandbytes": importlib.metadata.version("bitsandbytes"),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],  # other work on the machine skews the timings
        "copy_seconds": copy_median,
        "copy_gb_per_s": tensor_bytes / copy_median / 1e9,
        "codecs": codecs,
    }


def print_table(result: dict[str, Any]) -> None:
    shape = "x".join(map(str, result["tensor_shape"]))
    print(
        f"encode_frame + decode_frame of a {shape} {result['tensor_dtype']} tensor "
        f"({result['tensor_bytes'] / 2**20:.0f} MiB), median of {result['repeats']}, "
        f"{result['threads']} threads, torch {result['torch']}, bitsandbytes {result['bitsandbytes']}"
    )
    header = "codec        ms   enc ms   dec ms    GB/s  x copy  frame MiB   max err"
    print(header)
    print("-" * len(header))
    copy_ms = result["copy_seconds"] * 1e3
    print(f"{'clone':<6} {copy_ms:>8.2f} {'':>8} {'':>8} {result['copy_gb_per_s']:>7.1f} {1.0:>7.1f} {'':>10} {'':>9}")
    for name, row in result["codecs"].items():
        print(
            f"{name:<6} {row['seconds'] * 1e3:>8.2f} {row['encode_seconds'] * 1e3:>8.2f} "
            f"{row['decode_seconds'] * 1e3:>8.2f} {row['gb_per_s']:>7.1f} {row['ratio_vs_copy']:>7.1f} "
            f"{row['frame_bytes'] / 2**20:>10.2f} {row['max_abs_error']:>9.2e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds after the warm-up (default 10)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    result = run(args.repeats, args.threads)
    if args.json:
        print(strict_json_dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
