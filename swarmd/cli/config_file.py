"""``--config FILE.toml``: any flag of a command, set in a file; flags on the command line win.

The file is flat TOML whose keys are the command's long flag names, with dashes or underscores
(``api-port = 8081`` or ``api_port = 8081``); a flag without a value (``--delay-updates``) takes
``true``/``false``, a repeatable flag (``--join``) a list. Nothing here knows swarmd's flags: the
file is read against the parser's own actions, and every value goes through the same ``type``
function and ``choices`` as the flag, so a flag added to a parser is settable in the file with no
extra code, and a bad value fails with the sentence the flag would give, naming the file and key.

How flags win: the file's values are put into the namespace *before* argparse parses the
command line, so an action that runs overwrites them and one that does not leaves them. A
repeatable flag is the exception (argparse would append to the file's list), so a list from the
file is used only when the command line gave the flag no value.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package (install_requires has it there)
    import tomli as tomllib

CONFIG_DEST = "config"


class ConfigFileError(Exception):
    """A config file that cannot be used; the message is one sentence naming the file (and key)."""


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` a ``--config FILE`` that :func:`parse_args` reads."""
    parser.add_argument(
        "--config", dest=CONFIG_DEST, type=Path, default=None, metavar="FILE.toml",
        help="read flags from a TOML file: keys are the long flag names (api-port = 8081, join = [\"HOST:PORT\"]); "
        "flags given on the command line override the file",
    )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with the values of its ``--config`` file under the flags.

    A bad file ends in ``parser.error`` (for swarmd's parsers: one sentence, exit 2).
    """
    args = parser.parse_args(argv)  # flags first: --help and a bad flag never need the file
    path = getattr(args, CONFIG_DEST, None)
    if path is None:
        return args
    try:
        values = read_config_file(parser, path)
    except ConfigFileError as exc:
        parser.error(str(exc))
    actions = {action.dest: action for action in parser._actions}
    appended = {dest: v for dest, v in values.items() if isinstance(actions[dest], argparse._AppendAction)}
    namespace = argparse.Namespace(**{dest: v for dest, v in values.items() if dest not in appended})
    args = parser.parse_args(argv, namespace=namespace)
    for dest, value in appended.items():
        if getattr(args, dest) is actions[dest].default:  # the command line did not give the flag
            setattr(args, dest, value)
    return args


def read_config_file(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The file's values by ``dest``, converted and checked like the flags; ConfigFileError if unusable."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"config file {path} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"config file {path} is not UTF-8 text (byte {exc.start})") from exc
    by_name = settable_options(parser)
    values: dict[str, Any] = {}
    keys: dict[str, str] = {}  # dest -> the key that set it
    for key, raw in table.items():
        name = key.replace("_", "-")
        action = by_name.get(name)
        if action is None:
            raise ConfigFileError(_unknown_key(path, key, name, by_name, parser))
        if action.dest in keys:
            raise ConfigFileError(f"{path}: {key!r} and {keys[action.dest]!r} both set --{name}; keep one")
        keys[action.dest] = key
        values[action.dest] = _convert(action, raw, f"{path}: {key}")
    return values


def settable_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every action a file may set, by its long name without dashes (``api-port``)."""
    options: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.dest == CONFIG_DEST:
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                options[option[2:]] = action
    return options


def _unknown_key(path: Path, key: str, name: str, by_name: dict[str, argparse.Action],
                 parser: argparse.ArgumentParser) -> str:
    if name in ("help", "version", CONFIG_DEST):
        return f"{path}: {key!r} cannot be set in a config file"
    close = difflib.get_close_matches(name, list(by_name), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (see '{parser.prog} --help' for the flags)"
    return f"{path}: unknown key {key!r}{hint}"


def _convert(action: argparse.Action, raw: Any, where: str) -> Any:
    """What argparse would have stored for this flag, from a TOML value."""
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(raw, bool):
            raise ConfigFileError(f"{where}: takes true or false, not {raw!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return raw
        if raw:
            return action.const
        return (not action.const) if isinstance(action.const, bool) else action.default
    if isinstance(action, argparse._AppendAction):
        items = raw if isinstance(raw, list) else [raw]
        return [_convert_one(action, item, where) for item in items]
    if isinstance(raw, list):
        raise ConfigFileError(f"{where}: takes one value, not a list")
    return _convert_one(action, raw, where)


def _convert_one(action: argparse.Action, raw: Any, where: str) -> Any:
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        kind = "true or false" if isinstance(raw, bool) else type(raw).__name__
        raise ConfigFileError(f"{where}: takes a value like {action.metavar or action.dest.upper()!s}, not {kind}")
    text = raw if isinstance(raw, str) else str(raw)  # what the flag would have been given
    convert = action.type
    try:
        value = convert(text) if callable(convert) else text
    except argparse.ArgumentTypeError as exc:
        raise ConfigFileError(f"{where}: {exc}") from None
    except (TypeError, ValueError):
        name = getattr(convert, "__name__", repr(convert))
        raise ConfigFileError(f"{where}: invalid {name} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ConfigFileError(f"{where}: invalid choice: {value!r} (choose from {choices})")
    return value
