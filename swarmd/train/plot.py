"""A run's training curves as a PNG: loss and validation loss by step, samples/s over time.

Reads the CSV that ``swarmd train --log-csv`` writes (``swarmd.cli.train.CSV_COLUMNS``). Needs
matplotlib, which swarmd does not depend on (``pip install 'swarmd[plot]'``): :func:`have_matplotlib`
says whether it is there, so the demo can skip the picture rather than fail.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

__all__ = ["have_matplotlib", "plot_training", "read_csv"]


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _num(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def read_csv(path: Path) -> dict[str, list[float | None]]:
    """The CSV's columns by name (empty cells: None)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    names = rows[0].keys() if rows else ()
    return {name: [_num(row.get(name)) for row in rows] for name in names}


def plot_training(csv_path: Path, png_path: Path, title: str | None = None) -> Path:
    """Draw ``csv_path`` into ``png_path`` (two panels) and return ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    cols = read_csv(csv_path)
    steps = cols.get("step", [])
    fig, (ax_loss, ax_rate) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for name, style, label in (("loss", "-", "training loss"), ("val_loss", "o--", "validation loss")):
        pts = [(s, v) for s, v in zip(steps, cols.get(name, []), strict=False) if s is not None and v is not None]
        if pts:
            ax_loss.plot(*zip(*pts, strict=True), style, label=label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (cross-entropy, nats)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    pts = [(t, r) for t, r in zip(cols.get("elapsed_s", []), cols.get("samples_per_s", []), strict=False)
           if t is not None and r is not None]
    if pts:
        ax_rate.plot(*zip(*pts, strict=True), color="tab:green")
    ax_rate.set_xlabel("seconds since the start")
    ax_rate.set_ylabel("samples/s (mean since the start)")
    ax_rate.grid(alpha=0.3)
    fig.suptitle(title or csv_path.stem)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
