"""Swarms with liars in them: the spec, training settings and trainer settings the spot-check tests share."""


from __future__ import annotations

from dataclasses import replace

from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.train.trainer import TrainerConfig

SPEC = replace(PRESETS["tiny"], name="liars")


TRAINING = TrainingSpec(target_batch_size=16, lr=3e-3, warmup_steps=2, averaging_timeout_s=5.0)


FRACTION = 0.75


def trainer_config(api: str, name: str, steps: int, fraction: float = FRACTION, seed: int = 0) -> TrainerConfig:
    return TrainerConfig(api=api, steps=steps, microbatch_size=4, window=4, codec="8bit", val_every=0,
                         val_batches=2, max_corpus_bytes=1 << 20, name=name, refresh_s=0.5, heartbeat_s=1.0,
                         request_timeout_s=20.0, verify_fraction=fraction, seed=seed)
