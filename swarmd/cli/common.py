"""What every ``swarmd`` command shares: the parser that fails in one sentence, argument types, logging.

Nothing here imports torch, fastapi or bitsandbytes (``swarmd --help`` stays fast): the argument
types are plain functions of a string, and the swarm key is loaded through a lazy import. Every
type raises :class:`argparse.ArgumentTypeError` with a message that completes the sentence
"argument --flag: ...", which is also what a config file's bad value reports (``config_file``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from swarmd.errors import ConfigError

if TYPE_CHECKING:
    from swarmd.swarm_key import SwarmKey

EXIT_RUNTIME = 1  # the environment failed (a port taken, no bootstrap peer answered)
EXIT_USAGE = 2  # the user asked for something impossible (a bad flag, a bad file)
EXIT_INTERRUPTED = 130  # a second Ctrl-C during shutdown

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
JSON_LOG_KEYS = ("ts", "level", "logger", "msg", "pid", "task")


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one sentence (plus a hint), exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail_usage(message, self.prog)


def fail_usage(message: str, prog: str = "swarmd") -> NoReturn:
    """Print ``prog: error: <message>. See 'prog --help'.`` on one line and exit 2."""
    message = " ".join(message.split()).rstrip(".")  # one line, whatever the message held
    print(f"{prog}: error: {message}. See '{prog} --help'.", file=sys.stderr)
    sys.exit(EXIT_USAGE)


# ---- argument types -----------------------------------------------------------------------------


def port(text: str) -> int:
    """A TCP/UDP port; 0 asks the OS for a free one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535; 0 picks a free port)")
    return value


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` of a live peer (``[v6]:port`` too); port 0 cannot be dialled."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:31337)")
    value = port(port_text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} has port 0; give the port the peer's DHT listens on")
    return host, value


def api_url(text: str) -> str:
    """A daemon's control plane: ``http(s)://HOST:PORT``, or ``HOST:PORT`` alone (http then), as a user
    types it after reading the daemon's log; no trailing slash, so that paths can be appended."""
    from urllib.parse import urlsplit

    url = text.strip()
    if "://" not in url:
        url = f"http://{url}"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL (e.g. http://127.0.0.1:8080)") from None
    if parts.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"{text!r}: the control plane speaks http or https, not {parts.scheme}")
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} has no host (e.g. http://127.0.0.1:8080)")
    return url.rstrip("/")


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


def positive_number(what: str) -> Callable[[str], float]:
    """A type for a finite number > 0; ``what`` names it in errors ("a number of seconds")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text} must be a positive {what.removeprefix('a ')}")
        return value

    parse.__name__ = what.removeprefix("a ").replace(" ", "_")  # what argparse calls it in "invalid ... value"
    return parse


seconds = positive_number("a number of seconds")
learning_rate = positive_number("a learning rate")


# ---- secrets ------------------------------------------------------------------------------------


def read_token(path: Path) -> str:
    """The first line of ``path``: a secret of at least 16 characters; ConfigError otherwise."""
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read --api-token-file {path}: {exc.strerror or exc}") from exc
    token = text.splitlines()[0].strip() if text else ""
    if len(token) < 16:
        raise ConfigError(f"the token in {path} is shorter than 16 characters; use a long random secret "
                          "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def load_swarm_key(path: Path | str | None) -> SwarmKey | None:
    """The ``--swarm-key`` file's key (None without the flag); ConfigError if it is unusable."""
    if path is None:
        return None
    from swarmd.swarm_key import SwarmKey

    return SwarmKey.load(path)


# ---- logging ------------------------------------------------------------------------------------


def add_text_source(parser: argparse.ArgumentParser, *,
                    data_help: str = "a text file, .jsonl file or folder (default: the Python standard library's "
                    "sources)") -> None:
    """``--data`` and ``--text-field``: where a command reads text, spelled alike in every command
    (``swarmd train``, ``swarmd data prepare``, ``swarmd tokenizer train``)."""
    parser.add_argument("--data", default=None, metavar="PATH", help=data_help)
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the field of a .jsonl record that holds its text (default: text)")


def add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    """``--log-level`` and ``--log-format`` with one spelling and one set of choices for every command."""
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default,
                        help=f"log verbosity (default: {default})")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text: timestamped lines; json: one JSON object per line with the stable keys "
                        f"{', '.join(JSON_LOG_KEYS)} (+ exc when there is a traceback) (default: text)")


class JsonFormatter(logging.Formatter):
    """One JSON object per line, stable keys (:data:`JSON_LOG_KEYS`), for log shippers (Loki, journald, jq)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
            "task": record.threadName if record.threadName != "MainThread" else None,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(level: str, log_format: str = "text") -> None:
    """Lines on stderr (timestamped text, or JSON objects); kademlia's chatter only from WARNING up."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler])
    logging.getLogger("kademlia").setLevel(max(logging.WARNING, logging.getLogger().level))
