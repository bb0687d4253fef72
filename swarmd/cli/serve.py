"""``swarmd [serve]``: one daemon serving one pipeline stage, flags mapped onto ``swarmd.config``.

Bad flags exit 2 with one sentence; an environment failure (a port already taken) exits 1
with one sentence; SIGTERM/SIGINT drain gracefully and exit 0 (or the daemon's exit code,
non-zero when one of its background loops crashed). The parser imports nothing heavy: the
config tree, the model spec and the daemon (torch, fastapi) are imported once flags are valid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmd import __version__
from swarmd.allocator import keep_freed_memory
from swarmd.cli import config_file
from swarmd.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    Parser,
    add_log_level,
    fail_usage,
    host_port,
    learning_rate,
    load_swarm_key,
    non_negative_int,
    port,
    positive_int,
    positive_number,
    read_token,
    seconds,
    setup_logging,
)
from swarmd.config import DEFAULT_API_PORT, DEFAULT_BOOTSTRAP_TIMEOUT_S  # torch-free: --help stays fast
from swarmd.errors import ConfigError, PortUnavailable, SwarmdError
from swarmd.net.addresses import check_join_hosts
from swarmd.net.ports import Listeners, bind_listeners  # sockets only: binding comes before the heavy imports

if TYPE_CHECKING:
    from swarmd.config import Config
    from swarmd.pipeline.spec import ModelSpec


READY_KEYS = ("peer_id", "stage", "data_addr", "api_addr", "dht_addr", "swarm", "model")

# swarmd.dht.sources.GROUPINGS, spelled out so that --help imports no DHT code (a test keeps them equal)
DHT_GROUPINGS = ("auto", "prefix", "address", "endpoint")


def stage(text: str) -> int | None:
    """A stage number, or ``auto`` (None): the stage that needs this peer most."""
    if text == "auto":
        return None
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a stage: give a number or 'auto'") from None


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "swarmd"


def build_parser(prog: str = "swarmd", overview: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``swarmd [serve]``; ``overview``, for a bare ``swarmd --help``, replaces the
    description with swarmd's commands (``swarmd.cli.overview``)."""
    p = Parser(
        prog=prog,
        usage=f"{prog} [COMMAND] [FLAGS]" if overview else f"{prog} [FLAGS]",
        description=overview or "Serve one pipeline stage of a model in a SWARM-parallel training swarm.",
        epilog=None if overview else
        f"Example: {prog} --stage 0 --model tiny --api-port 8080, then curl 127.0.0.1:8080/status.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"swarmd {__version__}")
    config_file.add_config_option(p)
    p.add_argument("--join", type=host_port, action="append", default=[], metavar="HOST:PORT",
                   help="DHT address of any live member to join through (repeatable); without it, found a new swarm")
    p.add_argument("--stage", type=stage, default=None, metavar="N|auto",
                   help="pipeline stage to serve; auto picks the stage with the lowest total throughput "
                   "(default: auto)")
    p.add_argument("--model", default=None, metavar="PRESET|FILE",
                   help="model preset (tiny, small, base, llama-tiny, llama-small, llama-base) or a JSON file of "
                   "ModelSpec fields (arch, n_kv_heads, partition: [blocks per stage] or \"balanced\", ...); a "
                   "founder defaults to tiny, a joiner serves the swarm's model and refuses a --model that differs")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="FILE",
                   help="a founder's Hugging Face tokenizers JSON file (see 'swarmd tokenizer train'): the model's "
                   "vocabulary becomes the file's and its digest joins the model spec, so trainers with another "
                   "tokenizer are refused (default: byte-level)")
    p.add_argument("--partition", default=None, metavar="equal|balanced|measured|N,N,...",
                   help="blocks per stage of a founded model: equal, balanced by FLOP estimates, measured on this "
                   "machine, or numbers; resolved before the model is published (default: the model's)")
    p.add_argument("--swarm", default="default", help="name of the swarm to serve in (default: default)")
    founding = p.add_argument_group("training settings (a founder publishes them; joiners take the swarm's)")
    founding.add_argument("--target-batch-size", type=positive_int, default=None,
                          help="samples per optimizer step over the whole swarm (default: 32)")
    founding.add_argument("--lr", type=learning_rate, default=None, metavar="RATE",
                          help="peak learning rate (default: 1e-3)")
    founding.add_argument("--optimizer", choices=("adamw", "lamb"), default=None, help="(default: adamw)")
    founding.add_argument("--warmup-steps", type=non_negative_int, default=None, help="(default: 10)")
    founding.add_argument("--delay-updates", action="store_true", default=None,
                          help="delayed parameter updates: keep serving with the previous parameters while a "
                          "stage averages; gradients one step stale are applied to the next update (costs loss: "
                          "+15%% held-out after 40 steps of small, docs/BENCHMARKS.md)")
    founding.add_argument("--averaging-timeout", type=seconds, default=None, metavar="SECONDS",
                          help="a stage's all-reduce stops waiting for missing peers after this (default: 30)")
    founding.add_argument("--grad-codec", choices=("auto", "none", "fp16", "8bit", "4bit", "3bit", "5level", "2bit"),
                          default=None,
                          help="codec of the gradients a stage's peers average (lossy codecs keep the peers "
                          "bit-identical); auto: none on fast links, 8bit or 5level on slow ones, from each link's "
                          "measured throughput (default: auto)")
    founding.add_argument("--averaging", choices=("leader", "allreduce"), default=None,
                          help="how a stage's peers average: one leader receives every contribution, or a chunked "
                          "all-reduce whose per-peer traffic does not grow with the stage (default: allreduce)")
    p.add_argument("--host", default="127.0.0.1", help="data-plane listen address (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=0, help="data-plane port; 0 picks a free one (default: 0)")
    p.add_argument("--relay-max-peers", type=non_negative_int, default=8, metavar="N",
                   help="relay for at most N peers that nobody can dial (behind a NAT); 0: relay for none "
                   "(default: 8)")
    p.add_argument("--relay-budget", type=positive_number("a number of MiB/s"), default=50.0, metavar="MIB_S",
                   help="bytes per second (in MiB/s) this peer relays for others at most, over all of them; "
                   "requests beyond it are refused and go elsewhere (default: 50)")
    p.add_argument("--announce", type=announce_addr, default=None, metavar="HOST[:PORT]",
                   help="the address others dial for this peer's data plane (and its DHT contact host): behind a "
                   "port forward or with several interfaces. Without it, a specific --host is announced as is, and "
                   "a wildcard (0.0.0.0, ::) is replaced by the address the swarm's DHT contacts see this peer at")
    p.add_argument("--api-host", default="127.0.0.1", help="control-plane listen address (default: 127.0.0.1)")
    p.add_argument("--swarm-key", type=Path, default=None, metavar="FILE",
                   help="make the swarm private: a file holding a pre-shared secret (>= 16 bytes) that every peer "
                   "and trainer of the swarm is given; DHT messages and data-plane requests without it are refused "
                   "(create one: head -c 32 /dev/urandom | base64 > swarm.key; chmod 600 swarm.key)")
    p.add_argument("--api-token-file", type=Path, default=None, metavar="FILE",
                   help="a file holding the control plane's bearer token; required when --api-host is not a "
                   "loopback address (mutating endpoints then need 'Authorization: Bearer <token>')")
    p.add_argument("--api-port", type=port, default=DEFAULT_API_PORT,
                   help=f"control-plane port; 0 picks a free one (default: {DEFAULT_API_PORT})")
    p.add_argument("--dht-host", default="127.0.0.1", help="DHT (UDP) listen address (default: 127.0.0.1)")
    p.add_argument("--dht-port", type=port, default=0, help="DHT (UDP) port; 0 picks a free one (default: 0)")
    p.add_argument("--announce-period", type=seconds, default=10.0, metavar="SECONDS",
                   help="how often this peer refreshes its DHT record; records expire after 3 periods (default: 10)")
    p.add_argument("--bootstrap-timeout", type=seconds, default=DEFAULT_BOOTSTRAP_TIMEOUT_S, metavar="SECONDS",
                   help="give up joining when no --join address answers within this, retrying meanwhile (a "
                   f"peer started at the same moment may open its port a little later) (default: "
                   f"{DEFAULT_BOOTSTRAP_TIMEOUT_S:g})")
    p.add_argument("--dht-source-quota", type=positive_int, default=8, metavar="N",
                   help="how many new records one source (see --dht-source-grouping) may place under one DHT key "
                        "this node stores: a flood of fake peers from one place cannot crowd out real ones "
                        "(default: 8)")
    p.add_argument("--dht-source-grouping", choices=DHT_GROUPINGS, default="auto",
                   help="what counts as one source: prefix (IPv4 /24, IPv6 /64), address (one IP), endpoint "
                        "(IP and port), auto (endpoint on loopback, prefix for public addresses, address on a "
                        "LAN; default)")
    p.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help=f"where the peer's identity key and its checkpoints are kept, one directory per daemon "
                   f"(default: {default_state_dir()})")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=50, metavar="STEPS",
                   help="write the stage's state (parameters, optimizer, step) under --state-dir every STEPS steps "
                   "and on graceful shutdown; a restarted peer resumes from it; 0 disables (default: 50)")
    p.add_argument("--keep-checkpoints", type=positive_int, default=3, metavar="K",
                   help="keep the newest K checkpoints of each stage, delete older ones (default: 3)")
    p.add_argument("--rebalance-policy", choices=("adaptive", "swarm", "none"), default="adaptive",
                   help="how peers move between stages: adaptive (ours), swarm (the paper's Algorithm 2) or none; "
                   "every peer of a swarm should use the same (default: adaptive)")
    p.add_argument("--rebalance-period", type=seconds, default=300.0, metavar="SECONDS",
                   help="how often the policy runs (adaptive also runs when peers join or leave) (default: 300)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the stage computes: auto uses a GPU when torch sees one (default: auto)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the stage's compute: fp32, or bf16/fp16 autocast with float32 parameters, optimizer "
                   "state and activations on the wire; fp16 adds a per-stage loss scale (default: fp32)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch compute threads (default: torch's choice)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long to wait for in-flight requests (default: 30)")
    p.add_argument("--ready-file", type=Path, default=None, metavar="PATH",
                   help="once serving, write a JSON object with the bound addresses here (for scripts and tests)")
    add_log_level(p, "INFO")
    return p


def announce_addr(text: str) -> tuple[str, int | None]:
    """``--announce HOST[:PORT]``: a specific host (IPv6 in brackets with a port), never a wildcard."""
    from swarmd.net.addresses import is_wildcard, parse_host_port

    try:
        host, value = parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if is_wildcard(host):
        raise argparse.ArgumentTypeError(f"{text!r} is a wildcard address; announce the address others dial")
    return host, value


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but torch sees no CUDA device (try --device cpu)")
    return device


def with_tokenizer(model: str | None, path: Path, *, joining: bool) -> ModelSpec:
    """``--model``'s spec (a founder's default preset without it) with the tokenizer file's vocabulary
    size and digest, applied before a model file's ``"partition": "balanced"`` is resolved (the head's
    cost grows with the vocabulary); a joiner may name one only with ``--model``, which the swarm's
    must then equal."""
    from swarmd.pipeline.spec_files import load_spec
    from swarmd.train.tokenizer import HFTokenizer

    if model is None and joining:
        raise ConfigError("--tokenizer sets the model of a swarm being founded; a joiner serves the swarm's model "
                          "(drop --tokenizer, or give --model too to check that the swarm's model is that one)")
    tok = HFTokenizer.from_file(path)
    return load_spec(model or "tiny", vocab=(tok.vocab_size, tok.digest))


def with_partition(spec: ModelSpec | None, partition: str, *, joining: bool) -> ModelSpec:
    """``--model``'s spec (a founder's default preset without it) cut as ``--partition`` says, resolved
    to numbers here, before the founder publishes it (a joiner may give it only with ``--model``)."""
    from swarmd.pipeline.spec import PRESETS

    if spec is None and joining:
        raise ConfigError("--partition sets the model of a swarm being founded; a joiner serves the swarm's model "
                          "(drop --partition, or give --model too to check that the swarm's model is that one)")
    from swarmd.pipeline.spec_files import with_partition as resolve

    return resolve(spec or PRESETS["tiny"], partition)


def config_from_args(args: argparse.Namespace) -> Config:
    """Map parsed flags onto the frozen config tree; ConfigError on impossible combinations."""
    from swarmd.config import ApiConfig, CheckpointConfig, Config, DHTConfig, NetConfig, PipelineConfig, RebalanceConfig
    from swarmd.net.addresses import is_loopback
    from swarmd.pipeline.spec import TrainingSpec
    from swarmd.pipeline.spec_files import load_spec

    spec: ModelSpec | None
    if args.tokenizer is not None:
        spec = with_tokenizer(args.model, args.tokenizer, joining=bool(args.join))
    else:
        spec = load_spec(args.model) if args.model is not None else None
    if args.partition is not None:  # last: "balanced" weighs the final vocabulary (the tokenizer's)
        spec = with_partition(spec, args.partition, joining=bool(args.join))
    given = {
        "target_batch_size": args.target_batch_size,
        "lr": args.lr,
        "optimizer": args.optimizer,
        "warmup_steps": args.warmup_steps,
        "averaging_timeout_s": args.averaging_timeout,
        "delay_updates": args.delay_updates,
        "grad_codec": args.grad_codec,
        "averaging": args.averaging,
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
        net=NetConfig(host=args.host, port=args.port, drain_timeout_s=args.drain_timeout,
                      announce_host=args.announce[0] if args.announce else None,
                      announce_port=args.announce[1] if args.announce else None,
                      relay_max_peers=args.relay_max_peers, relay_budget_bytes_s=args.relay_budget * 2**20),
        api=ApiConfig(host=args.api_host, port=args.api_port, token=token),
        dht=DHTConfig(
            host=args.dht_host,
            port=args.dht_port,
            join=tuple(args.join),
            announce_period_s=args.announce_period,
            bootstrap_timeout_s=args.bootstrap_timeout,
            max_per_source=args.dht_source_quota,
            source_grouping=args.dht_source_grouping,
            state_dir=args.state_dir or default_state_dir(),
        ),
        rebalance=RebalanceConfig(policy=args.rebalance_policy, period_s=args.rebalance_period),
        checkpoint=CheckpointConfig(every=args.checkpoint_every, keep=args.keep_checkpoints),
        swarm_key=swarm_key,
        pipeline=PipelineConfig(
            spec=spec, stage=args.stage, training=training, device=resolve_device(args.device), threads=args.threads,
            precision=args.precision
        ),
    )


async def serve(config: Config, ready_file: Path | None, listeners: Listeners | None = None) -> int:
    """Run a daemon until SIGTERM/SIGINT; write ``ready_file`` once it serves. Its exit code.
    ``listeners``: its ports, bound already (:func:`main` binds them before importing torch)."""
    from swarmd.daemon import Daemon

    daemon = Daemon(config, listeners=listeners)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    try:
        runner = asyncio.create_task(daemon.run(), name="swarmd-daemon")
        ready = asyncio.create_task(daemon.ready.wait())
        await asyncio.wait({runner, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready_file is not None:
            write_ready_file(ready_file, daemon.status())
        ready.cancel()
        await runner
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    # a daemon that exposes one: non-zero when a background loop crashed and stopped it
    code = getattr(daemon, "exit_code", 0)
    return code if isinstance(code, int) else EXIT_RUNTIME


def write_ready_file(path: Path, status: Mapping[str, Any]) -> None:
    """The bound addresses as one JSON object, written atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: status[k] for k in READY_KEYS}) + "\n")
    os.replace(tmp, path)


def main(argv: Sequence[str], prog: str = "swarmd", overview: str | None = None) -> int:
    args = config_file.parse_args(build_parser(prog, overview), argv)
    setup_logging(args.log_level, args.log_format)
    try:  # first of all, and before torch is imported: a taken port fails in a blink, naming its flag
        listeners = bind_listeners((args.host, args.port), (args.api_host, args.api_port),
                                   (args.dht_host, args.dht_port))
    except ConfigError as exc:
        fail_usage(str(exc), prog)
    except PortUnavailable as exc:
        print(f"swarmd: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    try:
        args.join, problems = asyncio.run(check_join_hosts(args.join))  # a misspelt host: "cannot resolve", exit 2
        for problem in problems:
            logging.getLogger(__name__).warning("%s; joining through the other --join addresses", problem)
        config = config_from_args(args)
    except ConfigError as exc:
        listeners.close()
        fail_usage(str(exc), prog)
    keep_freed_memory()  # before the stage's first tensors: see swarmd.allocator
    try:
        return asyncio.run(serve(config, args.ready_file, listeners))
    except ConfigError as exc:
        fail_usage(str(exc), prog)
    except SwarmdError as exc:  # e.g. no bootstrap peer answered
        print(f"swarmd: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except OSError as exc:
        print(f"swarmd: error: cannot start: {exc.strerror or exc}. "
              "Pick another port (0 picks a free one) or check the address.", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return EXIT_INTERRUPTED
