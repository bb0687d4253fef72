"""The specifications every peer of a swarm must agree on: the model and how it trains.

SWARM (Ryabinin et al., 2023, section 3) cuts one model into pipeline stages and lets a
swarm of peers serve each stage. Peers that never talked to each other must still build
*identical* stages: the same architecture, the same cut points and the same initial
parameters. ``ModelSpec`` is that shared contract. Its :attr:`ModelSpec.digest` is a
version-prefixed SHA-256 of every field that affects the computation, so peers can compare
specs (in DHT records, in wire frames) without shipping the whole thing, and the digest also
seeds the deterministic parameter initialisation in :mod:`swarmd.pipeline.model`.
``name`` is a human label only; it is deliberately left out of the digest.

Section 3.2 makes each stage's optimizer step synchronous: every peer of a stage applies the
same step to the same averaged gradient, so the settings of that step must be shared as
exactly as the model. :class:`TrainingSpec` holds them (batch size, optimizer, schedule,
clipping, averaging), read by every peer from the swarm's DHT record, validated and digested
like ``ModelSpec``; :meth:`TrainingSpec.lr_at` is the learning-rate schedule as a pure
function of the swarm's step. How a step is taken is :mod:`swarmd.pipeline.stage.optimizer`.

Both specs are plain data: this module imports neither torch nor anything that does, so the
configuration and the CLI can build and check them without loading torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from swarmd.errors import ConfigError
from swarmd.models.registry import BUILTIN_ARCHS, arch_names  # torch-free: names and entry points only

__all__ = [
    "BUILTIN_ARCHS",
    "COMPUTED_PARTITIONS",
    "GRAD_CODECS",
    "MODEL_DIGEST_VERSION",
    "OPTIMIZERS",
    "PRESETS",
    "SCHEDULES",
    "TRAINING_DIGEST_VERSION",
    "ModelSpec",
    "TrainingSpec",
]

#: Bumped whenever a digest's canonical form changes; hashed in front of the payload so
#: two formats can never collide.
MODEL_DIGEST_VERSION = "swarmd.ModelSpec/1"
TRAINING_DIGEST_VERSION = "swarmd.TrainingSpec/2"  # /2: grad_codec

OPTIMIZERS: tuple[str, ...] = ("adamw", "lamb")
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
#: How a stage's averaging traffic carries gradients (codecs of ``swarmd.net.codecs``).
#: ``auto``: chosen per link from its measured speed (``swarmd.pipeline.averaging.codec_choice``).
GRAD_CODECS: tuple[str, ...] = ("auto", "none", "fp16", "8bit", "4bit", "3bit", "5level", "2bit")
#: How a stage averages its gradients (TrainingSpec.averaging): one leader, or a chunked all-reduce.
AVERAGING_MODES: tuple[str, ...] = ("leader", "allreduce")

Scalar = bool | int | float | str

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ARCH_RE = re.compile(r"[a-z][a-z0-9_-]{0,63}")

#: Partitions computed from the model rather than given (``swarmd.pipeline.spec_files.with_partition``).
COMPUTED_PARTITIONS: tuple[str, ...] = ("balanced", "measured")


# (minimum, maximum) for each integer field. The maxima are far beyond anything swarmd can
# train; they exist to turn typos (an extra zero or three) into a clear error instead of an
# out-of-memory crash minutes later.
_MODEL_INT_BOUNDS: Mapping[str, tuple[int, int]] = MappingProxyType(
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
    """A decoder-only transformer of ``layers_per_stage * n_stages`` blocks cut into ``n_stages``
    pipeline stages: equal cuts by default, or the blocks per stage that ``partition`` names.

    Every field is validated on construction, so a ``ModelSpec`` that exists is buildable.
    Equal models have one canonical form, so their digests agree: ``n_kv_heads == n_heads``
    is stored as 0 (plain multi-head attention) and a partition that equals the equal cut as
    ``()``. ``partition: "balanced"`` in a model file (or ``spec_files.with_partition``) is resolved to
    explicit numbers by the cost model of :mod:`swarmd.pipeline.partition` before the spec
    exists, so the digest covers the numbers and every peer builds the same cut whatever its
    own cost model would say later; a spec decoded from the network never runs a cost model.
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
    #: SHA-256 hex of the tokenizer's canonical JSON (``swarmd.train.tokenizer``), or "" for
    #: the default byte-level vocabulary (ids 0..255). Trainers and peers of one swarm must
    #: tokenize alike, so it is part of the digest.
    tokenizer: str = ""
    #: The architecture of the blocks: "gpt" (nanoGPT: LayerNorm, learned positions, GELU,
    #: biases) or "llama" (RMSNorm, rotary positions, SwiGLU, no biases), or the name of an
    #: architecture another package registers under the ``swarmd.models`` entry-point group.
    arch: str = "gpt"
    #: Key/value heads for grouped-query attention (``llama``): must divide ``n_heads``;
    #: 0 means as many as ``n_heads`` (plain multi-head attention).
    n_kv_heads: int = 0
    #: Blocks per stage, stage 0 first, summing to ``layers_per_stage * n_stages``; ``()`` is the
    #: equal cut. Given as a tuple or list of ints, a "2,3" string (the form ``to_dict`` writes,
    #: since DHT records hold scalars only) or "equal". "balanced" and "measured" are resolved
    #: to numbers by ``spec_files.with_partition`` (and ``load_spec``) before a spec is built.
    partition: tuple[int, ...] = ()
    #: Width of what crosses each stage boundary (the paper's Appendix I, "compression-aware
    #: architecture"): every stage but the last ends with a learned projection d_model ->
    #: boundary_dim and every stage but the first begins with one back, so activations and their
    #: gradients travel boundary_dim wide. 0 (the default): no projection, d_model wide.
    boundary_dim: int = 0

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
        for field_name, (low, high) in _MODEL_INT_BOUNDS.items():
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
        if not isinstance(self.tokenizer, str) or not (
            self.tokenizer == "" or re.fullmatch(r"[0-9a-f]{64}", self.tokenizer)
        ):
            raise ConfigError(
                "model spec field 'tokenizer' must be \"\" (byte-level) or a tokenizer's "
                f"64-hex-digit SHA-256 digest, got {self.tokenizer!r}"
            )
        if self.d_model % self.n_heads != 0:
            raise ConfigError(
                f"model spec d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                "(each attention head gets d_model / n_heads dimensions)"
            )
        self._check_arch()
        self._check_kv_heads()
        self._check_boundary()
        object.__setattr__(self, "partition", self._resolve_partition(self.partition))

    def _check_arch(self) -> None:
        if not isinstance(self.arch, str) or not _ARCH_RE.fullmatch(self.arch):
            raise ConfigError(
                f"model spec field 'arch' must be an architecture name (lowercase letters, digits, "
                f"'_' or '-', at most 64), got {self.arch!r}"
            )
        if self.arch in BUILTIN_ARCHS:
            return
        known = arch_names()
        if self.arch not in known:
            raise ConfigError(
                f"model spec arch {self.arch!r} is unknown: this build has {', '.join(known)} "
                "(another architecture needs the package that registers it under the "
                "'swarmd.models' entry-point group installed)"
            )

    def _check_kv_heads(self) -> None:
        kv = self.n_kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool):
            raise ConfigError(
                f"model spec field 'n_kv_heads' must be an integer, got {type(kv).__name__} {kv!r}"
            )
        if not 0 <= kv <= self.n_heads or (kv and self.n_heads % kv):
            raise ConfigError(
                f"model spec n_kv_heads={kv} must divide n_heads={self.n_heads} (grouped-query "
                "attention shares each key/value head among n_heads / n_kv_heads query heads), "
                "or be 0 for one key/value head per query head"
            )
        if kv == self.n_heads:
            kv = 0
            object.__setattr__(self, "n_kv_heads", 0)
        if self.arch == "llama" and self.head_dim % 2:
            raise ConfigError(
                f"model spec arch 'llama' needs an even head width for its rotary position "
                f"embeddings, but d_model / n_heads = {self.d_model} / {self.n_heads} = {self.head_dim}"
            )
        if kv and self.arch == "gpt":
            raise ConfigError(
                f"model spec n_kv_heads={kv}: arch 'gpt' has no grouped-query attention; "
                "use arch 'llama', or n_kv_heads 0"
            )

    def _check_boundary(self) -> None:
        dim = self.boundary_dim
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ConfigError(
                f"model spec field 'boundary_dim' must be an integer, got {type(dim).__name__} {dim!r}"
            )
        if not 0 <= dim < self.d_model:
            raise ConfigError(
                f"model spec boundary_dim={dim} must be 0 (no bottleneck) or narrower than "
                f"d_model={self.d_model}: it is the width activations cross stage boundaries at"
            )

    def _resolve_partition(self, given: object) -> tuple[int, ...]:
        """The canonical partition: explicit blocks per stage, or () for the equal cut."""
        total = self.layers_per_stage * self.n_stages
        if isinstance(given, str):
            text = given.strip()
            if text in ("", "equal"):
                return ()
            if text in COMPUTED_PARTITIONS:
                # computed only where a person asks for it (spec_files), never while
                # decoding a record from the network: a peer must not run a cost model (let alone a
                # measurement) because a DHT record says so
                raise ConfigError(
                    f"model spec partition {text!r} must be resolved to numbers before the spec is built: "
                    "load_spec and with_partition (swarmd.pipeline.spec_files) do that"
                )
            else:
                try:
                    given = [int(part) for part in text.split(",")]
                except ValueError:
                    raise ConfigError(
                        "model spec field 'partition' must be \"equal\", \"balanced\", \"measured\", a "
                        f"list of blocks per stage or a string such as \"3,1\", got {given!r}"
                    ) from None
        if not isinstance(given, (tuple, list)) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in given
        ):
            raise ConfigError(
                "model spec field 'partition' must be \"equal\", \"balanced\", \"measured\" or a list of "
                f"integers (blocks per stage), got {given!r}"
            )
        blocks = tuple(given)
        if not blocks:
            return ()
        if len(blocks) != self.n_stages:
            raise ConfigError(
                f"model spec partition {list(blocks)} names {len(blocks)} stage(s), but the model "
                f"has n_stages={self.n_stages}"
            )
        if min(blocks) < 1:
            raise ConfigError(
                f"model spec partition {list(blocks)}: every stage needs at least one block"
            )
        if sum(blocks) != total:
            raise ConfigError(
                f"model spec partition {list(blocks)} holds {sum(blocks)} blocks, but the model has "
                f"layers_per_stage x n_stages = {self.layers_per_stage} x {self.n_stages} = {total}: "
                "a partition redistributes the blocks, it does not add or remove any"
            )
        if all(n == self.layers_per_stage for n in blocks):
            return ()  # the equal cut has one spelling, so its digest is the plain spec's
        return blocks

    @property
    def n_layers(self) -> int:
        """Transformer blocks applied end to end (applications, even when weights are shared)."""
        return self.layers_per_stage * self.n_stages

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def boundary_width(self) -> int:
        """Width of the hidden states that cross a stage boundary (``boundary_dim`` or ``d_model``)."""
        return self.boundary_dim or self.d_model

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the attention (``n_heads`` unless grouped-query attention)."""
        return self.n_kv_heads or self.n_heads

    @property
    def blocks_per_stage(self) -> tuple[int, ...]:
        """Blocks of each stage, stage 0 first (the partition, or the equal cut)."""
        return self.partition or (self.layers_per_stage,) * self.n_stages

    @property
    def digest(self) -> str:
        """Stable SHA-256 hex of everything but ``name``: equal digests mean identical models.

        The payload is canonical JSON (sorted keys, no whitespace, ASCII) of ints and bools
        only, prefixed with :data:`MODEL_DIGEST_VERSION`, so it does not depend on the Python or
        torch version that computes it.
        """
        fields = self.to_dict()
        del fields["name"]
        # Fields added after digest format /1 enter the payload only when they differ from
        # their default (to_dict leaves them out), so every spec that existed before them
        # keeps its digest (and its deterministic initial parameters, and its checkpoints).
        payload = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(f"{MODEL_DIGEST_VERSION}\n{payload}".encode("ascii")).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain scalars (the inverse of :meth:`from_dict`).

        Scalars only, because the swarm's DHT record carries this map: ``partition`` is written
        as a "3,1" string ("" for the equal cut).
        """
        fields = dataclasses.asdict(self)
        fields["partition"] = ",".join(str(n) for n in self.partition)
        # Fields added after digest /1 are written only when set: the swarm record stays as
        # small as it was (the DHT carries it in one UDP datagram), and a build that predates
        # them can still read the spec of a swarm that does not use them.
        for late, default in _LATE_DEFAULTS.items():
            if fields[late] == default:
                del fields[late]
        return fields

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
        blocks = self.blocks_per_stage
        start = sum(blocks[:stage])
        return range(start, start + blocks[stage])


#: ModelSpec fields added after MODEL_DIGEST_VERSION /1 (see ModelSpec.digest), with their
#: defaults as :meth:`ModelSpec.to_dict` writes them: at these values they stay out of the digest.
_LATE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"tokenizer": "", "arch": "gpt", "n_kv_heads": 0, "partition": "", "boundary_dim": 0}
)


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
        # The same sizes as Llama-style models (swarmd.models.llama): RMSNorm, rotary positions,
        # SwiGLU with d_ff about 8/3 d_model (as many parameters as a GELU MLP of 4 d_model),
        # grouped-query attention with half as many key/value heads.
        "llama-tiny": ModelSpec(
            name="llama-tiny", d_model=64, n_heads=4, d_ff=176, layers_per_stage=1, n_stages=2,
            vocab_size=256, seq_len=64, arch="llama", n_kv_heads=2,
        ),
        "llama-small": ModelSpec(
            name="llama-small", d_model=256, n_heads=8, d_ff=688, layers_per_stage=2, n_stages=2,
            vocab_size=256, seq_len=128, arch="llama", n_kv_heads=4,
        ),
        "llama-base": ModelSpec(
            name="llama-base", d_model=768, n_heads=12, d_ff=2048, layers_per_stage=3, n_stages=4,
            vocab_size=256, seq_len=256, arch="llama", n_kv_heads=4,
        ),
    }
)


# --- how a swarm trains -----------------------------------------------------------------------

# Inclusive (minimum, maximum) of each integer field. As in ModelSpec, the maxima only turn
# typos (a few extra zeros) into a clear error.
_TRAINING_INT_BOUNDS: Mapping[str, tuple[int, int]] = MappingProxyType(
    {
        "target_batch_size": (1, 2**24),
        "warmup_steps": (0, 10**9),
        "total_steps": (1, 10**9),
    }
)

# (minimum, maximum, minimum excluded, maximum excluded) of each float field.
_TRAINING_FLOAT_BOUNDS: Mapping[str, tuple[float, float, bool, bool]] = MappingProxyType(
    {
        "lr": (0.0, 10.0, True, False),
        "beta1": (0.0, 1.0, False, True),
        "beta2": (0.0, 1.0, False, True),
        "eps": (0.0, 1.0, True, False),
        "weight_decay": (0.0, 1.0, False, False),
        "min_lr_ratio": (0.0, 1.0, False, False),
        "clip_norm": (0.0, 1e6, False, False),
        "averaging_timeout_s": (0.0, 3600.0, True, False),
    }
)

_TRAINING_CHOICES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"optimizer": OPTIMIZERS, "schedule": SCHEDULES, "grad_codec": GRAD_CODECS, "averaging": AVERAGING_MODES}
)


@dataclass(frozen=True)
class TrainingSpec:
    """How a swarm trains: batch size, optimizer, schedule, clipping, averaging.

    Every field is validated on construction, so a ``TrainingSpec`` that exists is usable.
    Float fields also accept ints (``lr=1`` becomes ``1.0``), so a value that went through
    JSON or a hand-written config has the same digest as the float it means.
    """

    target_batch_size: int = 32  # samples per optimizer step, over the whole swarm
    optimizer: str = "adamw"  # one of OPTIMIZERS
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01  # applied to parameters with two or more dimensions only
    warmup_steps: int = 10
    schedule: str = "cosine"  # one of SCHEDULES; see lr_at
    total_steps: int = 10_000
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0  # max L2 norm of a stage's gradient; 0 disables clipping
    delay_updates: bool = False  # the paper's delayed parameter updates (a flag here)
    averaging_timeout_s: float = 30.0  # a stage's all-reduce gives up on missing peers after this
    # codec of the gradients a stage's peers send to the round's leader and of the mean it sends
    # back (one of GRAD_CODECS). Lossy codecs keep the peers bit-identical: the leader encodes
    # the mean once and every peer, the leader included, applies the decoded mean. "auto": none on
    # fast links (and loopback), 8bit or 5level on slow ones, from each link's measured throughput
    # (swarmd.pipeline.averaging.codec_choice); a founder pins one by naming it.
    grad_codec: str = "auto"
    # how a stage's peers average (one of AVERAGING_MODES): "leader", one peer receives every
    # contribution and answers everyone (swarmd.pipeline.averaging.averager); "allreduce", a chunked
    # all-reduce with one atomic decision (swarmd.pipeline.averaging.allreduce.averager), per-peer traffic ~2 x |grads|
    # whatever the stage's size. A swarm record without the field was written before the all-reduce
    # existed (or by a founder who chose the leader): it reads as "leader" (from_dict).
    averaging: str = "allreduce"

    def __post_init__(self) -> None:
        for name, (low, high) in _TRAINING_INT_BOUNDS.items():
            value = getattr(self, name)
            # bool is a subclass of int; `true` for a step count is a typo, not the number 1.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(
                    f"training field {name!r} must be an integer, got {type(value).__name__} "
                    f"{value!r}"
                )
            if not low <= value <= high:
                raise ConfigError(
                    f"training field {name!r} must be between {low} and {high}, got {value}"
                )
        for name, (low_f, high_f, low_open, high_open) in _TRAINING_FLOAT_BOUNDS.items():
            given = getattr(self, name)
            if not isinstance(given, (int, float)) or isinstance(given, bool):
                raise ConfigError(
                    f"training field {name!r} must be a number, got {type(given).__name__} "
                    f"{given!r}"
                )
            number = float(given)
            above = number > low_f if low_open else number >= low_f
            below = number < high_f if high_open else number <= high_f
            if not (math.isfinite(number) and above and below):
                interval = f"{'(' if low_open else '['}{low_f:g}, {high_f:g}{')' if high_open else ']'}"
                raise ConfigError(f"training field {name!r} must lie in {interval}, got {number!r}")
            object.__setattr__(self, name, number)
        for name, choices in _TRAINING_CHOICES.items():
            value = getattr(self, name)
            if not isinstance(value, str) or value not in choices:
                raise ConfigError(
                    f"training field {name!r} must be one of {', '.join(choices)}, got {value!r}"
                )
        if not isinstance(self.delay_updates, bool):
            raise ConfigError(
                "training field 'delay_updates' must be true or false, "
                f"got {type(self.delay_updates).__name__} {self.delay_updates!r}"
            )
        if self.warmup_steps > self.total_steps:
            raise ConfigError(
                f"training warmup_steps={self.warmup_steps} must not exceed "
                f"total_steps={self.total_steps}"
            )

    @property
    def digest(self) -> str:
        """Stable SHA-256 hex of every field: equal digests mean identical training settings.

        The payload is canonical JSON (sorted keys, no whitespace, ASCII) of the scalars from
        :meth:`to_dict`, prefixed with :data:`TRAINING_DIGEST_VERSION`. Floats are written as Python's
        shortest round-tripping repr, which does not depend on the platform.
        """
        payload = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(f"{TRAINING_DIGEST_VERSION}\n{payload}".encode("ascii")).hexdigest()

    def to_dict(self) -> dict[str, Scalar]:
        """Every field as an int, float, bool or str: what the swarm record's ``training`` holds.
        ``averaging`` is left out when it is ``leader``, so swarms founded before it existed keep their
        digest (and peers of older builds can read the record); :meth:`from_dict` reads its absence
        from a record as ``leader``."""
        out = dataclasses.asdict(self)
        if out["averaging"] == "leader":
            del out["averaging"]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, strict: bool = False) -> TrainingSpec:
        """Build a spec from a swarm record's ``training`` map (or a config file's).

        Missing keys take their defaults. Unknown keys are *ignored* by default, unlike
        :meth:`ModelSpec.from_dict`: the map comes
        from the DHT, where a newer peer may have added settings this build does not know,
        and an old peer must still be able to join. Known keys are validated as usual. An old
        peer that ignored a setting computes a different :attr:`digest` than the newer peers
        (theirs covers the new field), so comparing digests still tells the two apart. Pass
        ``strict=True`` for input a person typed, where an unknown key is a typo.

        A record (``strict=False``) without ``averaging`` means ``leader``: :meth:`to_dict` leaves
        that value out, and records written before the all-reduce existed lack the field. Input a
        person typed takes the default (``allreduce``) instead.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"training settings must be a mapping of names to values, got {type(d).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        if strict:
            unknown = sorted(repr(k) for k in d if k not in known)
            if unknown:
                raise ConfigError(
                    f"unknown training field(s) {', '.join(unknown)}; "
                    f"valid fields are: {', '.join(known)}"
                )
        given = {name: d[name] for name in known if name in d}
        if not strict:
            given.setdefault("averaging", "leader")
        return cls(**given)

    def lr_at(self, step: int) -> float:
        """Learning rate of the update that takes the parameters from ``step`` to ``step + 1``.

        With ``W = warmup_steps``, ``T = total_steps``, ``m = min_lr_ratio``:

        - warmup, ``step < W``: ``lr * ((step + 1) / W)``, so the first update already moves
          (``lr / W``) and update ``W - 1`` uses the full ``lr``;
        - afterwards, with progress ``p = min(1, (step - W) / (T - W))`` (``p = 1`` when
          ``T == W``): ``constant`` gives ``lr``; ``linear`` gives ``lr * (1 - (1 - m) * p)``;
          ``cosine`` gives ``lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)``. Both decaying
          schedules start at ``lr`` on step ``W``, reach ``m * lr`` on step ``T`` and stay
          there.

        A pure function of ``step`` rather than a scheduler object: the step number is the
        swarm's (every peer of a stage agrees on it), so a peer that joins at step 5000 needs
        no scheduler state to use the right rate.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"a training step must be a non-negative integer, got {step!r}")
        warmup, total = self.warmup_steps, self.total_steps
        if step < warmup:
            # The ratio first, so the last warmup step gives exactly lr (lr * W / W may not).
            return self.lr * ((step + 1) / warmup)
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - warmup) / (total - warmup)) if total > warmup else 1.0
        if self.schedule == "linear":
            factor = 1.0 - (1.0 - self.min_lr_ratio) * progress
        else:
            factor = self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (
                1.0 + math.cos(math.pi * progress)
            )
        # Clamped so that rounding can never leave [min_lr_ratio * lr, lr].
        return self.lr * min(1.0, max(self.min_lr_ratio, factor))
