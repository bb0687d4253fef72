"""Trainer settings the many-trainer tests share."""


from __future__ import annotations

import zlib
from typing import Any

from swarmd.train.trainer import TrainerConfig

MICRO = 8


def trainer_config(api: str, name: str, steps: int, **kw: Any) -> TrainerConfig:
    # a seed that is the same in every run (str hash() is salted per process: each run would draw other data)
    return TrainerConfig(api=api, steps=steps, microbatch_size=MICRO, window=4, codec="none",
                         seed=zlib.crc32(name.encode()) % 997, val_every=0, val_batches=1, max_corpus_bytes=1 << 20,
                         name=name, refresh_s=0.5, heartbeat_s=1.0, request_timeout_s=20.0, stage_wait_timeout_s=60.0,
                         **kw)
