"""What every message shares: the limits on remote input, the receiving peer's :class:`StageTarget`,
and the validators that turn a malformed field into a typed error (never an ``assert``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from swarmd.errors import MalformedFrame, RequestError, WrongStage
from swarmd.net.codecs import CODECS
from swarmd.net.wire import Frame

#: The precisions a stage computes in (``--precision``, ``swarmd.pipeline.stage.precision``), as a reply names
#: the one that computed it: spot checks compare answers of like precision only.
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")

#: The longest a ``/v1/progress`` long-poll (``?wait_step=``) is held open, in seconds.
MAX_PROGRESS_WAIT_S = 10.0
#: A peer id is 64 hex characters; a contribution naming a longer one is refused.
MAX_PEER_ID_LEN = 64
#: The most peer ids a progress reply's ``excluded`` (or ``suspected``) may list.
MAX_EXCLUDED = 1024
#: The most microbatch ids a contribution may name (``AverageRequest.mbs``, an int64 tensor: 8 MiB
#: at most). A peer holding more sends none: the ids feed a counter (exactly once), never the mean.
MAX_CONTRIBUTION_MBS = 1 << 20
#: The highest attempt number a backward or claim may carry (a trainer retries a few times).
MAX_ATTEMPT = 1 << 20
#: Peer to peer (issue #31): the most next hops a forward may carry, the longest hop address, the
#: longest wait for a hop, the longest ``origin`` (an IP address) and a reply's ``hop_error``.
MAX_HOPS = 64
MAX_HOP_ADDR_LEN = 300
MAX_HOP_TIMEOUT_MS = 3_600_000
MAX_ORIGIN_LEN = 64
MAX_HOP_ERROR_LEN = 200
#: What a peer keeps of its own budget to answer its sender after its next hop gave up (peer to peer).
HOP_MARGIN_MS = 250


@dataclass(frozen=True)
class StageTarget:
    """What the receiving peer serves: a request for another stage or model is refused (409)."""

    stage: int
    model: str  # the ModelSpec digest
    grad_numel: int | None = None  # the stage's gradient size, for /v1/average


# ---- validation helpers (remote input: typed errors, never assert) ---------------------------


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(meta: Mapping[str, Any], key: str, what: str) -> int:
    value = meta.get(key)
    if not _is_int(value) or value < 0:
        raise RequestError(f"meta.{key} must be a non-negative integer ({what}), got {value!r:.60}")
    return int(value)


def _optional_count(meta: Mapping[str, Any], key: str, what: str) -> int | None:
    return None if meta.get(key) is None else _count(meta, key, what)


def _stage(meta: Mapping[str, Any]) -> int:
    stage = meta.get("stage")
    if not _is_int(stage):
        raise RequestError("meta.stage (an integer) is required")
    return int(stage)


def _check_target(stage: int, model: Any, target: StageTarget | None) -> None:
    if target is None:
        return
    if stage != target.stage:
        raise WrongStage(f"this peer serves stage {target.stage}, not stage {stage}")
    if model is not None and model != target.model:
        raise WrongStage(f"this peer serves model {target.model[:12]}, not {str(model)[:12]}")


def _codec(meta: Mapping[str, Any]) -> str:
    codec = meta.get("codec", "none")
    if not isinstance(codec, str) or codec not in CODECS:  # a list or map is unhashable: no 500
        raise RequestError(f"meta.codec must be one of {sorted(CODECS)}, got {codec!r:.60}")
    return codec


def _model(model: Any) -> str | None:
    if model is not None and not isinstance(model, str):
        raise RequestError(f"meta.model must be a model digest (a string), got {model!r:.60}")
    return model


def _microbatch_id(meta: Mapping[str, Any]) -> int | None:
    """``meta.mb``: the trainer's id of the microbatch (keys the peer's activation cache)."""
    mb = meta.get("mb")
    if mb is not None and (not _is_int(mb) or not 0 <= mb < 2**64):
        raise RequestError(f"meta.mb must be an integer in [0, 2**64) (a microbatch id), got {mb!r:.60}")
    return mb


def _attempt(meta: Mapping[str, Any]) -> int:
    """``meta.attempt``: the trainer's number of this attempt at the microbatch (default 0)."""
    attempt = meta.get("attempt", 0)
    if not _is_int(attempt) or not 0 <= attempt <= MAX_ATTEMPT:
        raise RequestError(f"meta.attempt must be an integer in [0, {MAX_ATTEMPT}], got {attempt!r:.40}")
    return int(attempt)


def _required(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise RequestError(f"the frame has no '{name}' tensor (it has {sorted(tensors) or 'none'})") from None


def _kind(frame: Frame, kind: str) -> None:
    if frame.kind != kind:
        raise RequestError(f"this endpoint takes a '{kind}' frame, got '{frame.kind}'")


def _reply_fields(frame: Frame, kind: str) -> tuple[int, int]:
    """``(stage, step)`` of a reply frame; MalformedFrame when the peer sent something else."""
    if frame.kind != kind:
        raise MalformedFrame(f"expected a '{kind}' reply, got a '{frame.kind}' frame")
    stage, step = frame.meta.get("stage"), frame.meta.get("step")
    if not _is_int(stage) or not _is_int(step) or step < 0:
        raise MalformedFrame(
            f"a '{kind}' reply needs integer meta.stage and meta.step, got {stage!r:.30}, {step!r:.30}"
        )
    return int(stage), int(step)


def _reply_float(meta: Mapping[str, Any], key: str) -> float | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedFrame(f"a reply's meta.{key} must be a number, got {value!r:.30}")
    return float(value)


def _reply_int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not _is_int(value) or value < 0:
        raise MalformedFrame(f"a reply's meta.{key} must be a non-negative integer, got {value!r:.30}")
    return int(value)


def _json_field(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedFrame(f"{where}: '{key}' is missing or of the wrong type ({value!r:.40})")
    return value
