"""The model specification every peer of a swarm must agree on.

SWARM (Ryabinin et al., 2023, section 3) cuts one model into pipeline stages and lets a
swarm of peers serve each stage. Peers that never talked to each other must still build
*identical* stages: the same architecture, the same cut points and the same initial
parameters. ``ModelSpec`` is that shared contract. Its :attr:`ModelSpec.digest` is a
version-prefixed SHA-256 of every field that affects the computation, so peers can compare
specs (in DHT records, in wire frames) without shipping the whole thing, and the digest also
seeds the deterministic parameter initialisation in :mod:`swarmd.pipeline.model`.

``name`` is a human label only; it is deliberately left out of the digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from swarmd.errors import ConfigError

__all__ = ["DIGEST_VERSION", "ModelSpec", "PRESETS", "load_spec"]

#: Bumped whenever the digest's canonical form changes; hashed in front of the payload so
#: two formats can never collide.
DIGEST_VERSION = "swarmd.ModelSpec/1"

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# (minimum, maximum) for each integer field. The maxima are far beyond anything swarmd can
# train; they exist to turn typos (an extra zero or three) into a clear error instead of an
# out-of-memory crash minutes later.
_INT_BOUNDS: Mapping[str, tuple[int, int]] = MappingProxyType(
    {
        "d_model": (1, 65_536),
        "n_heads": (1, 1_024),
        "d_ff": (1, 262_144),
        "layers_per_stage": (1, 1_024),
        "n_stages": (1, 1_024),
        "vocab_size": (1, 1_048_576),
        "seq_len": (1, 1_048_576),
        "seed": (0, 2**63 - 1),
    }
)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a GPT-style decoder cut into ``n_stages`` equal pipeline stages.

    Every field is validated on construction, so a ``ModelSpec`` that exists is buildable.
    """

    name: str
    d_model: int
    n_heads: int
    d_ff: int
    layers_per_stage: int
    n_stages: int
    vocab_size: int = 256
    seq_len: int = 128
    share_layers: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(
                f"model spec field 'name' must be a string, got {type(self.name).__name__}"
            )
        if not _NAME_RE.fullmatch(self.name):
            raise ConfigError(
                f"model spec name {self.name!r} is invalid: use 1-64 letters, digits, '.', '_' "
                "or '-', starting with a letter or digit"
            )
        for field_name, (low, high) in _INT_BOUNDS.items():
            value = getattr(self, field_name)
            # bool is a subclass of int; `true` in a model file is a typo, not the number 1.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(
                    f"model spec field {field_name!r} must be an integer, "
                    f"got {type(value).__name__} {value!r}"
                )
            if not low <= value <= high:
                raise ConfigError(
                    f"model spec field {field_name!r} must be between {low} and {high}, "
                    f"got {value}"
                )
        if not isinstance(self.share_layers, bool):
            raise ConfigError(
                "model spec field 'share_layers' must be true or false, "
                f"got {type(self.share_layers).__name__} {self.share_layers!r}"
            )
        if self.d_model % self.n_heads != 0:
            raise ConfigError(
                f"model spec d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                "(each attention head gets d_model / n_heads dimensions)"
            )

    @property
    def n_layers(self) -> int:
        """Transformer blocks applied end to end (applications, even when weights are shared)."""
        return self.layers_per_stage * self.n_stages

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def digest(self) -> str:
        """Stable SHA-256 hex of everything but ``name``: equal digests mean identical models.

        The payload is canonical JSON (sorted keys, no whitespace, ASCII) of ints and bools
        only, prefixed with :data:`DIGEST_VERSION`, so it does not depend on the Python or
        torch version that computes it.
        """
        fields = self.to_dict()
        del fields["name"]
        payload = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(f"{DIGEST_VERSION}\n{payload}".encode("ascii")).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON-compatible values (the inverse of :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSpec:
        """Build a spec from a mapping of field values, e.g. a parsed model file.

        Unknown keys are an error rather than ignored: a typo such as ``n_head`` in a model
        file must not silently fall back to a default and build a different model.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"a model spec must be a mapping of field names to values, got {type(d).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(repr(k) for k in d if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown model spec field(s) {', '.join(unknown)}; "
                f"valid fields are: {', '.join(known)}"
            )
        required = [
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in d]
        if missing:
            raise ConfigError(f"model spec is missing required field(s): {', '.join(missing)}")
        return cls(**{str(k): v for k, v in d.items()})

    def stage_range(self, stage: int) -> range:
        """Global indices of the transformer blocks owned by ``stage``."""
        if not isinstance(stage, int) or isinstance(stage, bool):
            raise ConfigError(f"stage must be an integer, got {type(stage).__name__} {stage!r}")
        if not 0 <= stage < self.n_stages:
            raise ConfigError(
                f"stage {stage} is out of range: model {self.name!r} has stages "
                f"0..{self.n_stages - 1}"
            )
        start = stage * self.layers_per_stage
        return range(start, start + self.layers_per_stage)


PRESETS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        # Trains in seconds on a laptop CPU; the default for tests and demos.
        "tiny": ModelSpec(
            name="tiny", d_model=64, n_heads=4, d_ff=256, layers_per_stage=1, n_stages=2,
            vocab_size=256, seq_len=64,
        ),
        # A few million parameters: visible learning on CPUs in minutes.
        "small": ModelSpec(
            name="small", d_model=256, n_heads=8, d_ff=1024, layers_per_stage=2, n_stages=2,
            vocab_size=256, seq_len=128,
        ),
        # GPT-2-small-like width and depth (12 blocks), byte-level vocabulary.
        "base": ModelSpec(
            name="base", d_model=768, n_heads=12, d_ff=3072, layers_per_stage=3, n_stages=4,
            vocab_size=256, seq_len=256,
        ),
    }
)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A key given twice in a model file is a mistake; json.loads would keep the last one."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"field {key!r} appears more than once")
        out[key] = value
    return out


def load_spec(preset_or_path: str) -> ModelSpec:
    """Resolve a preset name (see :data:`PRESETS`) or a JSON model file into a spec.

    A model file holds a JSON object of :class:`ModelSpec` fields; ``name`` defaults to the
    file's stem. Preset names win over files of the same name in the working directory.
    """
    if preset_or_path in PRESETS:
        return PRESETS[preset_or_path]
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
    try:
        return ModelSpec.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"model file {str(path)!r} is invalid: {exc}") from exc
