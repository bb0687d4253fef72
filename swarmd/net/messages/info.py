"""``GET /v1/info``: what a peer serves and the limits it accepts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from swarmd.errors import MalformedFrame
from swarmd.net.messages.fields import (
    _json_field,
)
from swarmd.net.wire import WireLimits


@dataclass(frozen=True)
class ModelInfo:
    name: str
    digest: str
    spec: Mapping[str, Any]  # ModelSpec.to_dict()


@dataclass(frozen=True)
class InfoLimits:
    """What the peer's decoder accepts (its ``WireLimits``) and the most tokens per batch."""

    max_frame_bytes: int
    max_tensors: int
    max_rank: int
    max_elements: int
    max_batch_tokens: int

    @classmethod
    def of(cls, limits: WireLimits, max_batch_tokens: int) -> InfoLimits:
        return cls(limits.max_frame_bytes, limits.max_tensors, limits.max_rank, limits.max_elements, max_batch_tokens)


@dataclass(frozen=True)
class InfoReply:
    """``GET /v1/info``: what the peer serves and accepts."""

    wire_version: int
    stage: int
    n_stages: int
    model: ModelInfo
    step: int
    codecs: tuple[str, ...]
    limits: InfoLimits

    def to_json(self) -> dict[str, Any]:
        return {
            "wire_version": self.wire_version,
            "stage": self.stage,
            "n_stages": self.n_stages,
            "model": {"name": self.model.name, "digest": self.model.digest, "spec": dict(self.model.spec)},
            "step": self.step,
            "codecs": list(self.codecs),
            "limits": {
                "max_frame_bytes": self.limits.max_frame_bytes,
                "max_tensors": self.limits.max_tensors,
                "max_rank": self.limits.max_rank,
                "max_elements": self.limits.max_elements,
                "max_batch_tokens": self.limits.max_batch_tokens,
            },
        }

    @classmethod
    def from_json(cls, body: Any) -> InfoReply:
        where = "an info reply"
        if not isinstance(body, dict):
            raise MalformedFrame(f"{where} must be a JSON object")
        model = _json_field(body, "model", dict, where)
        limits = _json_field(body, "limits", dict, where)
        codecs = _json_field(body, "codecs", list, where)
        return cls(
            wire_version=_json_field(body, "wire_version", int, where),
            stage=_json_field(body, "stage", int, where),
            n_stages=_json_field(body, "n_stages", int, where),
            model=ModelInfo(
                name=_json_field(model, "name", str, where),
                digest=_json_field(model, "digest", str, where),
                spec=MappingProxyType(dict(_json_field(model, "spec", dict, where))),
            ),
            step=_json_field(body, "step", int, where),
            codecs=tuple(str(c) for c in codecs),
            limits=InfoLimits(
                *(
                    _json_field(limits, k, int, where)
                    for k in ("max_frame_bytes", "max_tensors", "max_rank", "max_elements", "max_batch_tokens")
                )
            ),
        )
