"""Model specs as a person gives them: a preset name, a JSON file, and partitions to compute.

``swarmd.pipeline.spec`` is the contract every peer checks (plain data, no cost model); this module
is where a spec a person named becomes one: a preset or a JSON file of ``ModelSpec`` fields
(:func:`load_spec`), and a partition given as ``"balanced"`` (the FLOP cost model of
``swarmd.pipeline.partition``) or ``"measured"`` (each piece timed on this machine,
``swarmd.models.measure``: imports torch, so only then) resolved to blocks per stage
(:func:`with_partition`) before the spec is published. Only a person's request computes one: a peer
never runs a cost model because a DHT record says so.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmd.errors import ConfigError
from swarmd.pipeline.partition import balanced_partition, balanced_partition_of
from swarmd.pipeline.spec import COMPUTED_PARTITIONS, PRESETS, ModelSpec

__all__ = ["load_spec", "with_partition"]


def with_partition(spec: ModelSpec, partition: str | Sequence[int]) -> ModelSpec:
    """``spec`` cut as ``partition`` says: "equal", "balanced" (the FLOP cost model of
    :mod:`swarmd.pipeline.partition`), "measured" (its pieces timed on this machine: imports
    torch), or blocks per stage. The result holds numbers, which the digest covers."""
    given: Any = partition  # the field holds a tuple; ModelSpec parses the other spellings
    if isinstance(partition, str) and partition.strip() in COMPUTED_PARTITIONS:
        equal = dataclasses.replace(spec, partition=())
        if partition.strip() == "balanced":
            given = balanced_partition_of(equal)
        else:
            from swarmd.models.measure import measured_costs  # torch, for this one request only

            given = balanced_partition(measured_costs(equal), spec.n_stages)
    return dataclasses.replace(spec, partition=given)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A key given twice in a model file is a mistake; json.loads would keep the last one."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"field {key!r} appears more than once")
        out[key] = value
    return out


def load_spec(preset_or_path: str, *, vocab: tuple[int, str] | None = None) -> ModelSpec:
    """Resolve a preset name (see :data:`PRESETS`) or a JSON model file into a spec.

    A model file holds a JSON object of :class:`ModelSpec` fields; ``name`` defaults to the
    file's stem. Preset names win over files of the same name in the working directory.

    ``vocab``: ``(vocab_size, tokenizer digest)`` of a tokenizer file (``--tokenizer``), which
    replace the model's own. They are applied before a file's ``"partition": "balanced"`` (or
    ``"measured"``) is resolved, since the head's cost grows with the vocabulary: applied
    afterwards, the cut would balance a model that is not the one trained.
    """
    if preset_or_path in PRESETS:
        preset = PRESETS[preset_or_path]
        if vocab is None:
            return preset
        return dataclasses.replace(preset, vocab_size=vocab[0], tokenizer=vocab[1])
    path = Path(preset_or_path)
    presets = ", ".join(sorted(PRESETS))
    if not path.exists():
        if path.suffix or len(path.parts) > 1:
            raise ConfigError(f"model file {str(path)!r} does not exist")
        raise ConfigError(
            f"unknown model {preset_or_path!r}: not a preset ({presets}) and no such file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read model file {str(path)!r}: {exc}") from exc
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model file {str(path)!r} is not valid JSON: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(f"model file {str(path)!r} is invalid: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"model file {str(path)!r} must hold a JSON object of model spec fields, "
            f"got {type(data).__name__}"
        )
    data.setdefault("name", path.stem)
    if vocab is not None:
        data["vocab_size"], data["tokenizer"] = vocab
    partition = data.get("partition")
    computed = partition if isinstance(partition, str) and partition.strip() in COMPUTED_PARTITIONS else None
    if computed is not None:
        del data["partition"]  # resolved below, once the rest of the spec is known to be valid
    try:
        spec = ModelSpec.from_dict(data)
        return spec if computed is None else with_partition(spec, computed)
    except ConfigError as exc:
        raise ConfigError(f"model file {str(path)!r} is invalid: {exc}") from exc
