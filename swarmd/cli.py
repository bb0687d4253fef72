"""``swarmd``: the command line, mapped onto ``swarmd.config`` and nothing else.

Bad flags exit 2 with one sentence; an environment failure (a port already taken) exits 1
with one sentence; SIGTERM/SIGINT drain gracefully and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from swarmd import __version__
from swarmd.config import DEFAULT_API_PORT, ApiConfig, Config, DHTConfig, NetConfig, PipelineConfig, RebalanceConfig
from swarmd.errors import ConfigError, SwarmdError

log = logging.getLogger("swarmd")

EXIT_USAGE = 2
EXIT_RUNTIME = 1


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one sentence (plus a hint), exit code 2."""

    def error(self, message: str) -> NoReturn:
        _fail_usage(message, self.prog)


def _fail_usage(message: str, prog: str = "swarmd") -> NoReturn:
    message = message.rstrip(".")
    print(f"{prog}: error: {message}. See '{prog} --help'.", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535; 0 picks a free port)")
    return value


def _stage(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a stage: give a number or 'auto'") from None


def _addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:31337)")
    value = _port(port)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} has port 0; give the port the peer's DHT listens on")
    return host, value


def _positive_number(what: str):  # -> Callable[[str], float]
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text} must be a positive {what.removeprefix('a ')}")
        return value

    return parse


_seconds = _positive_number("a number of seconds")
_rate = _positive_number("a learning rate")


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "swarmd"


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must not be negative")
    return value


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("0 must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="swarmd",
        description="Serve one pipeline stage of a model in a SWARM-parallel training swarm.",
        epilog="Example: swarmd --stage 0 --model tiny --api-port 8080, then curl 127.0.0.1:8080/status. "
        "Also: 'swarmd train --help' (a trainer) and 'swarmd demo --help' (a local demo swarm).",
    )
    p.add_argument("--version", action="version", version=f"swarmd {__version__}")
    p.add_argument(
        "--join",
        type=_addr,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="DHT address of any live member to join through (repeatable); without it, found a new swarm",
    )
    p.add_argument(
        "--stage",
        type=_stage,
        default=None,
        metavar="N|auto",
        help="pipeline stage to serve; auto picks the stage with the lowest total throughput (default: auto)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="PRESET|FILE",
        help="model preset (tiny, small, base) or a JSON file of ModelSpec fields; a founder defaults to "
        "tiny, a joiner serves the swarm's model and refuses a --model that differs",
    )
    p.add_argument("--swarm", default="default", help="name of the swarm to serve in (default: default)")
    founding = p.add_argument_group("training settings (a founder publishes them; joiners take the swarm's)")
    founding.add_argument("--target-batch-size", type=positive_int, default=None,
                          help="samples per optimizer step over the whole swarm (default: 32)")
    founding.add_argument("--lr", type=_rate, default=None, metavar="RATE",
                          help="peak learning rate (default: 1e-3)")
    founding.add_argument("--optimizer", choices=("adamw", "lamb"), default=None, help="(default: adamw)")
    founding.add_argument("--warmup-steps", type=non_negative_int, default=None, help="(default: 10)")
    founding.add_argument("--delay-updates", action="store_true", default=None,
                          help="delayed parameter updates: keep serving with the previous parameters while a "
                          "stage averages; gradients one step stale are applied to the next update")
    founding.add_argument("--averaging-timeout", type=_seconds, default=None, metavar="SECONDS",
                          help="a stage's all-reduce stops waiting for missing peers after this (default: 30)")
    founding.add_argument("--grad-codec", choices=("none", "fp16", "8bit"), default=None,
                          help="codec of the gradients a stage's peers average (lossy codecs keep the peers "
                          "bit-identical; default: none)")
    p.add_argument("--host", default="127.0.0.1", help="data-plane listen address (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=0, help="data-plane port; 0 picks a free one (default: 0)")
    p.add_argument("--api-host", default="127.0.0.1", help="control-plane listen address (default: 127.0.0.1)")
    p.add_argument("--swarm-key", type=Path, default=None, metavar="FILE",
                   help="make the swarm private: a file holding a pre-shared secret (>= 16 bytes) that every peer "
                   "and trainer of the swarm is given; DHT messages and data-plane requests without it are refused "
                   "(create one: head -c 32 /dev/urandom | base64 > swarm.key; chmod 600 swarm.key)")
    p.add_argument("--api-token-file", type=Path, default=None, metavar="FILE",
                   help="a file holding the control plane's bearer token; required when --api-host is not a "
                   "loopback address (mutating endpoints then need 'Authorization: Bearer <token>')")
    p.add_argument(
        "--api-port", type=_port, default=DEFAULT_API_PORT, help=f"control-plane port; 0 picks a free one (default: {DEFAULT_API_PORT})"
    )
    p.add_argument("--dht-host", default="127.0.0.1", help="DHT (UDP) listen address (default: 127.0.0.1)")
    p.add_argument("--dht-port", type=_port, default=0, help="DHT (UDP) port; 0 picks a free one (default: 0)")
    p.add_argument(
        "--announce-period",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="how often this peer refreshes its DHT record; records expire after 3 periods (default: 10)",
    )
    p.add_argument(
        "--bootstrap-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="give up joining when no --join address answers within this (default: 30)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where the peer's identity key is kept, one directory per daemon (default: {default_state_dir()})",
    )
    p.add_argument("--rebalance-policy", choices=("adaptive", "swarm", "none"), default="adaptive",
                   help="how peers move between stages: adaptive (ours), swarm (the paper's Algorithm 2) or none; "
                   "every peer of a swarm should use the same (default: adaptive)")
    p.add_argument("--rebalance-period", type=_seconds, default=300.0, metavar="SECONDS",
                   help="how often the policy runs (adaptive also runs when peers join or leave) (default: 300)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the stage computes: auto uses a GPU when torch sees one (default: auto)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch compute threads (default: torch's choice)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long to wait for in-flight requests (default: 30)",
    )
    p.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="once serving, write a JSON object with the bound addresses here (for scripts and tests)",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="INFO",
        help="log verbosity (default: INFO)",
    )
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(path: Path) -> str:
    """The first line of ``path``: a secret of at least 16 characters."""
    try:
        token = path.read_text().strip().splitlines()[0].strip() if path.read_text().strip() else ""
    except OSError as exc:
        raise ConfigError(f"cannot read --api-token-file {path}: {exc.strerror or exc}") from exc
    if len(token) < 16:
        raise ConfigError(f"the token in {path} is shorter than 16 characters; use a long random secret "
                          "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def load_swarm_key(path: Path | str | None):  # -> SwarmKey | None
    """The ``--swarm-key`` file's key (None without the flag); ConfigError if it is unusable."""
    if path is None:
        return None
    from swarmd.swarm_key import SwarmKey

    return SwarmKey.load(path)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but torch sees no CUDA device (try --device cpu)")
    return device


def config_from_args(args: argparse.Namespace) -> Config:
    """Map parsed flags onto the frozen config tree; ConfigError on impossible combinations."""
    from swarmd.pipeline.spec import load_spec

    from swarmd.pipeline.optimizer import TrainingSpec

    spec = load_spec(args.model) if args.model is not None else None
    given = {
        "target_batch_size": args.target_batch_size,
        "lr": args.lr,
        "optimizer": args.optimizer,
        "warmup_steps": args.warmup_steps,
        "averaging_timeout_s": args.averaging_timeout,
        "delay_updates": args.delay_updates,
        "grad_codec": args.grad_codec,
    }
    given = {k: v for k, v in given.items() if v is not None}
    training = TrainingSpec(**given) if given else None
    if spec is not None and args.stage is not None and args.stage >= spec.n_stages:
        raise ConfigError(f"--stage {args.stage} is out of range: model {spec.name} has stages 0..{spec.n_stages - 1}")
    if not args.drain_timeout >= 0:
        raise ConfigError("--drain-timeout must be a non-negative number of seconds")
    token = read_token(args.api_token_file) if args.api_token_file else None
    swarm_key = load_swarm_key(args.swarm_key)
    if token is None and not is_loopback(args.api_host):
        raise ConfigError(
            f"--api-host {args.api_host} exposes the control plane beyond this machine: give --api-token-file FILE "
            "so that migrating or registering needs the token"
        )
    return Config(
        swarm=args.swarm,
        net=NetConfig(host=args.host, port=args.port, drain_timeout_s=args.drain_timeout),
        api=ApiConfig(host=args.api_host, port=args.api_port, token=token),
        dht=DHTConfig(
            host=args.dht_host,
            port=args.dht_port,
            join=tuple(args.join),
            announce_period_s=args.announce_period,
            bootstrap_timeout_s=args.bootstrap_timeout,
            state_dir=args.state_dir or default_state_dir(),
        ),
        rebalance=RebalanceConfig(policy=args.rebalance_policy, period_s=args.rebalance_period),
        swarm_key=swarm_key,
        pipeline=PipelineConfig(
            spec=spec, stage=args.stage, training=training, device=resolve_device(args.device), threads=args.threads
        ),
    )


async def _serve(config: Config, ready_file: Path | None) -> int:
    from swarmd.daemon import Daemon

    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    try:
        runner = asyncio.create_task(daemon.run(), name="swarmd-daemon")
        ready = asyncio.create_task(daemon.ready.wait())
        await asyncio.wait({runner, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready_file is not None:
            _write_ready_file(ready_file, daemon.status())
        ready.cancel()
        await runner
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0


def _write_ready_file(path: Path, status: dict) -> None:
    keys = ("peer_id", "stage", "data_addr", "api_addr", "dht_addr", "swarm", "model")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: status[k] for k in keys}) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from swarmd.train.cli import main as train_main

        return train_main(argv[1:], _Parser)
    if argv[:1] == ["demo"]:
        from swarmd.demo import main as demo_main

        return demo_main(argv[1:], _Parser)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("kademlia").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        _fail_usage(str(exc))
    try:
        return asyncio.run(_serve(config, args.ready_file))
    except ConfigError as exc:
        _fail_usage(str(exc))
    except SwarmdError as exc:  # e.g. no bootstrap peer answered
        print(f"swarmd: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except OSError as exc:
        print(f"swarmd: error: cannot start: {exc.strerror or exc}. "
              "Pick another port (0 picks a free one) or check the address.", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return 130


if __name__ == "__main__":
    sys.exit(main())
