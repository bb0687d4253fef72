"""The wire's hard limits, in a module of their own so that the config tree (``swarmd.config``)
can name them without importing torch; ``swarmd.net.wire`` enforces them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WireLimits:
    """What a decoder accepts; a receiving peer's limits, reported by its ``/v1/info``."""

    max_frame_bytes: int = 256 * 2**20
    max_tensors: int = 16
    max_rank: int = 6
    max_elements: int = 2**27  # per tensor
    max_meta_bytes: int = 64 * 2**10
    max_kind_len: int = 32

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WireLimits.{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = WireLimits()
