"""Plot a training run's CSV (``swarmd train --log-csv FILE``) as a PNG: loss and validation
loss by step, samples/s over time. Needs matplotlib (``.venv/bin/pip install -e '.[plot]'``).

    .venv/bin/python scripts/plot_training.py run.csv --out run.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from swarmd.train.plot import have_matplotlib, plot_training


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="a CSV written by swarmd train --log-csv")
    p.add_argument("--out", type=Path, default=None, help="the PNG to write (default: the CSV's name, .png)")
    p.add_argument("--title", default=None, help="the figure's title (default: the CSV's name)")
    args = p.parse_args(argv)
    if not have_matplotlib():
        print("plot_training: error: matplotlib is not installed (pip install 'swarmd[plot]')", file=sys.stderr)
        return 2
    if not args.csv.is_file():
        print(f"plot_training: error: no such file {args.csv}", file=sys.stderr)
        return 2
    out = plot_training(args.csv, args.out or args.csv.with_suffix(".png"), args.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
