"""Checkpoints on disk (swarmd.checkpoint): atomic files, suspicious reads, and the pure decisions."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from swarmd.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoint_dir,
    find_checkpoints,
    mismatch,
    newest_valid,
    prune,
    read_checkpoint,
    write_checkpoint,
)
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.spec import PRESETS, TrainingSpec

TINY = PRESETS["tiny"]
TRAINING = TrainingSpec(target_batch_size=4, warmup_steps=1)


async def trained_executor(steps: int, stage: int = 1) -> StageExecutor:
    """A last-stage executor stepped ``steps`` times on fixed batches (real optimizer state)."""
    ex = StageExecutor(TINY, stage, training=TRAINING)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(4, TINY.seq_len, TINY.d_model, generator=gen)
        y = torch.randint(0, 256, (4, TINY.seq_len), generator=gen)
        await ex.backward(x, targets=y)
        contribution = await ex.take_contribution()
        assert contribution.grads is not None
        await ex.apply_average(contribution.grads / contribution.samples, step)
    return ex


async def save(ex: StageExecutor, directory: Path, swarm: str = "s") -> Path:
    meta, tensors = await ex.snapshot_state()
    return write_checkpoint(directory, swarm=swarm, spec=ex.spec, training=ex.training, meta=meta,
                            tensors=tensors).path


async def test_a_checkpoint_round_trips_into_a_fresh_executor(tmp_path: Path) -> None:
    ex = await trained_executor(2)
    path = await save(ex, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1-0000000002.json", "s1-0000000002.safetensors"]
    sidecar = json.loads(path.read_text())
    assert sidecar["step"] == 2 and sidecar["model_digest"] == TINY.digest and sidecar["swarm"] == "s"
    assert sidecar["training_digest"] == TRAINING.digest and sidecar["params_digest"] == ex.digest
    info, tensors = read_checkpoint(path)
    fresh = StageExecutor(TINY, 1, training=TRAINING)
    assert fresh.digest != ex.digest
    await fresh.load_state(info.state_meta, tensors)
    assert fresh.step == 2 and fresh.digest == ex.digest
    # the optimizer state came back too: the next step is bit-identical on both
    x, y = torch.randn(4, TINY.seq_len, TINY.d_model), torch.randint(0, 256, (4, TINY.seq_len))
    for e in (ex, fresh):
        await e.backward(x.clone(), targets=y)
        c = await e.take_contribution()
        assert c.grads is not None
        await e.apply_average(c.grads / c.samples, 2)
    assert fresh.digest == ex.digest
    await ex.close()
    await fresh.close()


async def test_a_truncated_checkpoint_falls_back_to_the_previous_one(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    ex = await trained_executor(1)
    older = await save(ex, tmp_path)
    ex2 = await trained_executor(2)
    newer = await save(ex2, tmp_path)
    blob = newer.with_suffix(".safetensors")
    blob.write_bytes(blob.read_bytes()[:-100])  # a power cut mid-copy, say
    found = find_checkpoints(tmp_path)
    assert [c.step for c in found] == [2, 1]
    with caplog.at_level(logging.WARNING):
        chosen = newest_valid(found, accept=lambda c: None)
    assert chosen is not None and chosen[0].path == older
    refusals = [r.getMessage() for r in caplog.records]
    assert len(refusals) == 1 and str(blob) in refusals[0] and "truncated" in refusals[0]
    # same size, one flipped byte: corrupt
    data = bytearray(older.with_suffix(".safetensors").read_bytes())
    data[-1] ^= 0xFF
    older.with_suffix(".safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        read_checkpoint(older)
    assert newest_valid(found, accept=lambda c: None, on_refused=lambda _: None) is None
    await ex.close()
    await ex2.close()


@pytest.mark.parametrize("sidecar", [b"{", b'{"format": "swarmd-checkpoint/1", "step": NaN}', b"\xff\xfe",
                                     b'{"format": "swarmd-checkpoint/1", "format": "x"}', b"[]"])
def test_a_sidecar_that_is_not_strict_json_is_refused(tmp_path: Path, sidecar: bytes) -> None:
    (tmp_path / "s0-0000000001.json").write_bytes(sidecar)
    refused: list[str] = []
    assert find_checkpoints(tmp_path, on_refused=refused.append) == []
    assert len(refused) == 1 and "s0-0000000001.json" in refused[0]


async def test_a_checkpoint_of_another_model_or_swarm_is_refused_with_a_sentence(tmp_path: Path) -> None:
    ex = await trained_executor(1)
    info = find_checkpoints(checkpoint_dir(tmp_path)) or [read_checkpoint(await save(ex, tmp_path))[0]]
    c = info[0]
    assert mismatch(c, swarm="s", model_digest=TINY.digest, training_digest=TRAINING.digest) is None
    other_model = mismatch(c, swarm="s", model_digest=replace(TINY, d_model=32, d_ff=64).digest)
    assert other_model is not None and "another model" in other_model and str(c.path) in other_model
    other_swarm = mismatch(c, swarm="t", model_digest=TINY.digest)
    assert other_swarm is not None and "of swarm 's', not 't'" in other_swarm
    other_training = mismatch(c, swarm="s", model_digest=TINY.digest, training_digest=TrainingSpec().digest)
    assert other_training is not None and "other training settings" in other_training
    await ex.close()


def test_prune_keeps_the_newest_k_per_stage(tmp_path: Path) -> None:
    def info(stage: int, step: int, swarm: str = "s") -> object:
        from swarmd.checkpoint import CheckpointInfo

        return CheckpointInfo(path=tmp_path / f"s{stage}-{step:010d}.json", swarm=swarm, stage=stage, step=step,
                              model={}, model_digest="m", training={}, training_digest="t", params_digest="p",
                              state_meta={}, created=float(step), tensors_bytes=0, tensors_sha256="")

    every = [info(0, s) for s in (10, 20, 30, 40)] + [info(1, s) for s in (20, 40)] + [info(0, 5, swarm="old")]
    doomed = prune(every, keep=2)  # type: ignore[arg-type]
    assert [(c.stage, c.step) for c in doomed] == [(0, 10), (0, 20)]
    assert prune(every, keep=10) == []  # type: ignore[arg-type]


async def test_an_unwritable_state_dir_warns_once_and_the_stage_serves_on(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    checkpoint_dir(tmp_path).write_text("a file where the checkpoints folder should be")
    checkpointer = Checkpointer(tmp_path, swarm="s", every=1, keep=2)
    ex = await trained_executor(1)
    with caplog.at_level(logging.WARNING):
        assert await checkpointer.save(ex, TRAINING) is None
        await ex.add_gradients(torch.zeros(ex.grad_numel), 1)
        c = await ex.take_contribution()
        assert c.grads is not None
        await ex.apply_average(c.grads, 1)
        assert await checkpointer.save(ex, TRAINING) is None
    assert checkpointer.failures == 2 and checkpointer.status()["last_error"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "serving on without one" in warnings[0]
    out = await ex.forward(torch.randn(1, TINY.seq_len, TINY.d_model))  # still computing
    assert out.step == 2
    await ex.close()


async def test_the_checkpointer_keeps_k_and_skips_an_unchanged_step(tmp_path: Path) -> None:
    checkpointer = Checkpointer(tmp_path, swarm="s", every=1, keep=2)
    ex = StageExecutor(TINY, 0, training=TRAINING)
    for step in range(4):
        first = await checkpointer.save(ex, TRAINING)
        assert first is not None and first.step == step
        assert await checkpointer.save(ex, TRAINING) is first  # nothing new: not written again
        await ex.add_gradients(torch.ones(ex.grad_numel) * 1e-3, 1)
        c = await ex.take_contribution()
        assert c.grads is not None
        await ex.apply_average(c.grads, step)
    assert [c.step for c in find_checkpoints(checkpoint_dir(tmp_path))] == [3, 2]
    assert checkpointer.writes == 4 and checkpointer.status()["newest"]["step"] == 3
    await ex.close()
