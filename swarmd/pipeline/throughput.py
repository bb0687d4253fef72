"""Measured throughput: one bias-corrected moving average, shared by peers and trainers.

A peer measures its own compute rate (``StageExecutor``) and a trainer measures each peer it
calls (``swarmd.pipeline.routing``); both are the same estimator, kept here free of torch so
the routing logic stays a pure, light module.
"""

from __future__ import annotations


class ThroughputEMA:
    """Bias-corrected exponential moving average of a rate (samples per second).

    Bias correction (as in Adam) keeps the first few measurements from being dragged towards
    zero, so a fresh peer reports a meaningful number after its first job.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._raw = 0.0
        self._n = 0

    def update(self, samples: int, seconds: float) -> None:
        rate = samples / max(seconds, 1e-9)
        self._raw = (1.0 - self.alpha) * self._raw + self.alpha * rate
        self._n += 1

    @property
    def count(self) -> int:
        return self._n

    @property
    def value(self) -> float:
        if self._n == 0:
            return 0.0
        return self._raw / (1.0 - (1.0 - self.alpha) ** self._n)
