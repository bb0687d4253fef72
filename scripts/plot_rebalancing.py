"""Plot pipeline throughput over time per rebalancing policy: ``docs/rebalancing.png``.

Replays both shared traces with the simulator's own functions (first run, ``--seed``) for the
configurations of ``docs/REBALANCING.md``: none, swarm@300 and swarm@60 with random joins (the
paper's protocol) and adaptive@300 with weakest-stage joins. Top row: throughput and the LPT
optimum, time-averaged over ``--bin-s`` windows; bottom row: their ratio per window. Needs
matplotlib (not a swarmd dependency: ``.venv/bin/pip install -e '.[plot]'``).

    .venv/bin/python scripts/plot_rebalancing.py --out docs/rebalancing.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulate_rebalancing as sim  # noqa: E402

CONFIGS = [  # (label, policy, period, join)
    ("none (random joins)", "none", 300.0, "random"),
    ("swarm@300 (random joins)", "swarm", 300.0, "random"),
    ("swarm@60 (random joins)", "swarm", 60.0, "random"),
    ("adaptive@300 (weakest joins)", "adaptive", 300.0, "weakest"),
]
TRACES = ["../shared/data/fleet-homogeneous-32h.csv", "../shared/data/fleet-mixed-32h.csv"]


def binned(series: Sequence[tuple[float, float, float]], end: float, bin_s: float) -> tuple[list[float], list[float], list[float]]:
    """Time-weighted means of the step functions throughput(t), optimum(t) per window."""
    n = int(end // bin_s) + 1
    tp = [0.0] * n
    opt = [0.0] * n
    points = [*series, (end, 0.0, 0.0)]
    for (t0, a, b), (t1, _, _) in zip(points, points[1:]):
        t = t0
        while t < t1:
            k = int(t // bin_s)
            edge = min(t1, (k + 1) * bin_s)
            tp[k] += a * (edge - t)
            opt[k] += b * (edge - t)
            t = edge
    widths = [min(bin_s, end - k * bin_s) for k in range(n)]  # the last window may be short
    keep = [k for k in range(n) if widths[k] > 0]
    return ([(k * bin_s + widths[k] / 2) / 3600 for k in keep], [tp[k] / widths[k] for k in keep],
            [opt[k] / widths[k] for k in keep])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/rebalancing.png")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--download-s", type=float, default=sim.DEFAULT_DOWNLOAD_S)
    ap.add_argument("--bin-s", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", nargs="+", default=TRACES)
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(args.traces), figsize=(7 * len(args.traces), 8), sharex=True, squeeze=False)
    for col, path in enumerate(args.traces):
        trace = sim.load_trace(path)
        end = trace[-1].time_s
        top, bottom = axes[0][col], axes[1][col]
        for label, policy, period, join in CONFIGS:
            r = sim.simulate(trace, args.stages, policy, period, join, args.download_s, args.seed, record=True)
            hours, tp, opt = binned(r.timeseries, end, args.bin_s)
            line, = top.plot(hours, tp, label=f"{label}: {r.relative_throughput:.3f}, {r.migrations} moves")
            bottom.plot(hours, [a / b if b > 0 else float("nan") for a, b in zip(tp, opt)], color=line.get_color())
        top.plot(hours, opt, "k--", linewidth=1, label="optimum (LPT, no download)")
        top.set_title(f"{Path(path).name}, {args.stages} stages, download {args.download_s:g} s (seed {args.seed})")
        top.set_ylabel(f"throughput (summed speed), {args.bin_s / 60:g}-min mean")
        top.legend(fontsize=8, loc="lower left")
        bottom.set_ylabel("throughput / optimum")
        bottom.set_xlabel("hours into the trace")
        bottom.set_ylim(0.5, 1.02)
        bottom.grid(alpha=0.3)
        top.grid(alpha=0.3)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
