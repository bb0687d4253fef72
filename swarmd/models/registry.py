"""Which code builds the stages of a spec's ``arch``: built-ins and the ``swarmd.models`` group.

``gpt`` and ``llama`` are built in. Another installed package adds an architecture by naming
its stage builder under the ``swarmd.models`` entry-point group (docs/models.md has a complete
example)::

    [options.entry_points]
    swarmd.models =
        mini = mypkg.mini:MiniStage

The entry point's name is the ``arch`` a model spec names; its object is a subclass of
:class:`swarmd.models.base.StageModule` (which then handles deterministic init, input checks,
layer sharing and the loss), or any callable ``build(spec, stage, *, device, dtype)`` returning
one. An optional ``piece_flops(spec)`` on it lets ``partition: "balanced"`` weigh its pieces
(:mod:`swarmd.pipeline.partition`).

:func:`arch_names` reads only the entry points' names and imports nothing, so the spec can
validate ``arch`` without torch; :func:`stage_builder` imports the module that builds it. The
entry points are read on every call, not cached: a package installed while the process runs
(as the tests do) is seen.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from swarmd.errors import ConfigError

__all__ = ["BUILTIN_ARCHS", "ENTRY_POINT_GROUP", "arch_names", "stage_builder"]

ENTRY_POINT_GROUP = "swarmd.models"

log = logging.getLogger(__name__)

_BUILTIN_TARGETS = {"gpt": ("swarmd.models.gpt", "GPTStage"), "llama": ("swarmd.models.llama", "LlamaStage")}
#: Architectures this package builds itself; others come from entry points. Read by
#: ``swarmd.pipeline.spec`` to check a spec's ``arch`` (this module imports neither torch nor the specs).
BUILTIN_ARCHS: tuple[str, ...] = tuple(_BUILTIN_TARGETS)


def _registered() -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN_ARCHS:
            log.warning("ignoring entry point %s = %s: %r is a built-in architecture", ep.name, ep.value, ep.name)
        elif ep.name not in found:  # the first distribution on sys.path wins, as for imports
            found[ep.name] = ep
    return found


def arch_names() -> list[str]:
    """Every architecture this process can build: the built-ins, then registered ones (sorted)."""
    return [*BUILTIN_ARCHS, *sorted(_registered())]


def stage_builder(arch: str) -> Callable[..., Any]:
    """The stage class (or builder) of ``arch``; ConfigError with a sentence if it cannot be loaded."""
    if arch in _BUILTIN_TARGETS:
        module, attr = _BUILTIN_TARGETS[arch]
        builder: Callable[..., Any] = getattr(importlib.import_module(module), attr)
        return builder
    ep = _registered().get(arch)
    if ep is None:
        raise ConfigError(
            f"arch {arch!r} is unknown: this build has {', '.join(arch_names())} (another architecture "
            f"needs the package that registers it under the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    try:
        loaded = ep.load()
    except Exception as exc:  # a third-party module: any import error is its, reported as ours
        raise ConfigError(f"arch {arch!r}: cannot load its entry point {ep.value!r}: {exc}") from exc
    if not callable(loaded):
        raise ConfigError(f"arch {arch!r}: entry point {ep.value!r} is not a stage class or builder")
    return loaded
