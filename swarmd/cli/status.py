"""``swarmd status``: the dashboard's picture in a terminal, for a server without a browser.

Reads one daemon's control plane (``/status``, ``/swarm``, ``/training``) with the standard
library's HTTP client (no torch, no aiohttp: it starts in a blink) and prints a table per stage
and a one-line loss summary; ``--watch`` redraws it every ``--interval`` seconds, ``--json``
prints the three documents as one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmd.cli.common import EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USAGE, Parser, api_url, read_token, seconds
from swarmd.errors import ConfigError
from swarmd.finite import strict_json_dumps

__all__ = ["build_parser", "fetch", "main", "render"]

TIMEOUT_S = 5.0


def build_parser(prog: str = "swarmd status") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description="Show a swarm as one daemon sees it: its stages, peers and loss.",
               epilog=f"Example: {prog} --api http://127.0.0.1:8080 --watch")
    p.add_argument("--api", type=api_url, default="http://127.0.0.1:8080", metavar="URL",
                   help="control plane of any daemon of the swarm, http://HOST:PORT or HOST:PORT "
                   "(default: http://127.0.0.1:8080)")
    p.add_argument("--api-token-file", default=None, metavar="FILE",
                   help="a file holding the daemon's control-plane token, if its read-only endpoints need one")
    p.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    p.add_argument("--interval", type=seconds, default=2.0, metavar="SECONDS",
                   help="seconds between redraws with --watch (default: 2)")
    p.add_argument("--json", action="store_true", help="print /status, /swarm and /training as one JSON object")
    return p


class Unreachable(Exception):
    """The daemon did not answer /status."""


def _get(api: str, path: str, token: str | None) -> Any:
    request = urllib.request.Request(f"{api}{path}", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())


def fetch(api: str, token: str | None = None) -> dict[str, Any]:
    """``{"status", "swarm", "training"}`` from the daemon at ``api``; ``swarm`` and ``training``
    are None when it cannot give them (not serving yet, an older build). Unreachable if
    ``/status`` does not answer."""
    api = api.rstrip("/")
    try:
        status = _get(api, "/status", token)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise Unreachable(f"cannot read {api}/status: {getattr(exc, 'reason', exc)}") from exc
    out: dict[str, Any] = {"status": status, "swarm": None, "training": None}
    for name in ("swarm", "training"):
        try:
            out[name] = _get(api, f"/{name}", token)
        except (urllib.error.URLError, OSError, ValueError):
            pass
    return out


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def loss_line(training: dict[str, Any] | None, now: float | None = None) -> str:
    """One line: the swarm's loss (or this daemon's trainers' while the swarm's curve has fewer than two
    points), and how old its newest point is."""
    now = time.time() if now is None else now
    if not training:
        return "loss: this daemon keeps no training log"
    swarm = [p for p in training.get("swarm", []) if p.get("loss") is not None]
    local = [p for p in training.get("local", []) if p.get("loss") is not None]
    points, where = (swarm, "the swarm") if swarm else (local, "trainers registered here")
    if not points:
        return "loss: no trainer has reported yet"
    if len(swarm) < 2 and local:  # the swarm's curve gains a point an announce period: a short run has one
        points, where = local, "trainers registered here"
    first, last = points[0], points[-1]
    history = training.get("swarm") if points is swarm else training.get("local")
    vals = [p["val_loss"] for p in (history or []) if p.get("val_loss")]
    line = (f"loss {last['loss']:.4f} at step {last['step']}" if len(points) == 1 or first is last
            else f"loss {first['loss']:.4f} -> {last['loss']:.4f} at step {last['step']}")
    if vals:
        line += f", validation {vals[-1]:.4f}"
    line += f", {_num(last.get('samples_per_s'))} samples/s ({where}"
    if points is swarm:
        line += f": {last.get('trainers', 0)} trainer(s) via {last.get('publishers', 0)} daemon(s)"
    if isinstance(last.get("t"), (int, float)):
        line += f"; reported {_ago(now - last['t'])}"
    return line + ")"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def _precision(info: dict[str, Any] | None) -> str:
    """``, precision bf16`` (and fp16's current loss scale) for the header; nothing from older daemons."""
    if not info:
        return ""
    scale = info.get("loss_scale")
    return f", precision {info.get('mode', '-')}" + ("" if scale is None else f" (loss scale {scale:g})")


def render(picture: dict[str, Any]) -> str:
    """The text ``swarmd status`` prints for :func:`fetch`'s result."""
    s, swarm = picture["status"], picture["swarm"]
    model = s.get("model") or {}
    lines = [f"swarm {s['swarm']!r}, model {model.get('name', '-')} ({str(model.get('digest', ''))[:12]}): "
             f"this peer {str(s.get('peer_id') or '-')[:12]} is {s['state']} on stage {s['stage']}, step {s['step']}"
             + _precision(s.get("precision"))]
    if swarm is None:
        lines.append("(no stage map: the daemon is not serving yet)")
        lines.extend(f"  ! stage {h['stage']} is {h['health']}: {h['hint']}" for h in s.get("stages") or []
                     if h.get("health") != "ok")
    else:
        for stage in swarm["stages"]:
            peers = stage["peers"]
            serving = sum(p["state"] == "serving" for p in peers)
            health = stage.get("health") or {}
            step = "" if health.get("step") is None else (
                f", step {health['step']} (reported {_ago(health['step_age_s'] or 0.0)})")
            lines.append(f"stage {stage['stage']}: {health.get('health', '-')}, {serving} serving of {len(peers)}"
                         f"{step}, {_num(stage['throughput'])} samples/s")
            if health.get("hint"):
                lines.append(f"  ! {health['hint']}")
            rows = [["PEER", "STATE", "SAMPLES/S", "QUEUE", "STEP", "REACHABLE", "SEEN", "DATA ADDRESS"]]
            for p in peers:
                me = "*" if p["peer_id"] == s.get("peer_id") else ""
                reach = p["reachable"] + (" (relayed)" if "@" in p["data_addr"] else "")
                rows.append([p["peer_id"][:12] + me, p["state"], _num(p["throughput"]), str(p["queue"]),
                             str(p["step"]), reach, f"{p['age_s']:.0f}s ago", p["data_addr"]])
            lines.extend(_table(rows) if peers else ["  (no live peer)"])
    lines.append(loss_line(picture["training"]))
    return "\n".join(lines)


def main(argv: Sequence[str], prog: str = "swarmd status") -> int:
    args = build_parser(prog).parse_args(list(argv))
    try:
        token = read_token(Path(args.api_token_file)) if args.api_token_file else None
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        while True:
            try:
                picture = fetch(args.api, token)
            except Unreachable as exc:
                if not args.watch:
                    print(f"{prog}: error: {exc}", file=sys.stderr)
                    return EXIT_RUNTIME
                text = f"{exc} (retrying every {args.interval:g}s)"
            else:
                text = strict_json_dumps(picture) if args.json else render(picture)  # NaN: null
            if args.watch and not args.json and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")  # home, clear: redraw in place
            print(text, flush=True)
            if not args.watch:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED if not args.watch else 0
