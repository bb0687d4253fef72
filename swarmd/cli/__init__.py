"""``swarmd``: the command line, one module per command.

``swarmd [serve] FLAGS`` serves a stage (``serve`` is the default, so ``swarmd --stage 0`` works
as it always has), ``swarmd train`` runs a trainer, ``swarmd demo`` a local demo swarm. The first
word picks the command from :data:`COMMANDS`, whose module is imported only then; each command
owns a :class:`~swarmd.cli.common.Parser` and a ``main(argv, prog) -> int``. A dispatch table
rather than argparse sub-parsers because the default command takes its flags with no word in
front, and because each command reads its own ``--config`` file against its own parser
(``config_file``). A new command (``status``, ``export``) is one module and one entry here.

Layering, so there is no import circle and ``swarmd --help`` imports no torch: ``common`` and
``config_file`` import nothing of swarmd but ``errors``; the commands import those two, and the
heavy modules (daemon, trainer, torch, fastapi) only inside the functions that run them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_COMMAND = "serve"


@dataclass(frozen=True)
class Command:
    module: str  # imported on use: exposes main(argv: Sequence[str], prog: str) -> int
    summary: str


COMMANDS: dict[str, Command] = {
    "serve": Command("swarmd.cli.serve", "serve one pipeline stage (the default command)"),
    "train": Command("swarmd.cli.train", "train the swarm's model through its stages"),
    "demo": Command("swarmd.cli.demo", "a local demo swarm that trains, loses a peer and heals"),
    "export": Command("swarmd.cli.export", "the trained model as one safetensors file (from the swarm or checkpoints)"),
    "generate": Command("swarmd.cli.generate", "sample text from an exported model"),
    "status": Command("swarmd.cli.status", "the swarm's stages, peers and loss in a terminal (--watch, --json)"),
    "tokenizer": Command("swarmd.cli.tokenizer", "train a BPE tokenizer on local text (offline); a file's digest"),
    "data": Command("swarmd.cli.data", "pre-tokenize a corpus into memmapped shards that trainers stream"),
}


def overview() -> str:
    """What ``swarmd --help`` opens with: what swarmd is and every command on a line of its own, before
    the flags of the default command (a newcomer looks for the commands first, not for 40 flags)."""
    names = {name: "[serve]" if name == DEFAULT_COMMAND else name for name in COMMANDS}
    width = max(map(len, names.values()))
    lines = "\n".join(f"  swarmd {names[name]:<{width}}  {c.summary}" for name, c in COMMANDS.items())
    return ("Train one model on many unreliable machines with SWARM parallelism: each peer serves one stage\n"
            "of the model, trainers send their data through one peer per stage.\n\n"
            f"commands ('swarmd COMMAND --help' shows a command's flags):\n{lines}\n\n"
            "First look: swarmd demo. By hand: swarmd --stage 0 --model tiny --api-port 8080, then\n"
            "curl 127.0.0.1:8080/status. The flags below are those of swarmd [serve], the default command.")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv[:1] and argv[0] in COMMANDS else None
    rest = argv[1:] if name is not None else argv
    module = importlib.import_module(COMMANDS[name or DEFAULT_COMMAND].module)
    if (name or DEFAULT_COMMAND) == DEFAULT_COMMAND:
        code: int = module.main(rest, prog="swarmd serve" if name else "swarmd", overview=None if name else overview())
    else:
        code = module.main(rest, prog=f"swarmd {name}")
    return code
