"""Export the trained model from the live swarm or from checkpoints, load it as a FullModel, sample from it."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from swarmd.cli import main as swarmd_main
from swarmd.config import CheckpointConfig
from swarmd.daemon import Daemon
from swarmd.export import ExportError, from_checkpoints, from_swarm, load_model, write_model
from swarmd.generate import generate, sample_text
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.support.swarms import config

TINY = PRESETS["tiny"]
TRAINING = TrainingSpec(target_batch_size=8, lr=3e-3, warmup_steps=1, averaging_timeout_s=10.0)


async def test_export_then_full_model_computes_the_swarms_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    daemons: list[Daemon] = []
    try:
        for stage in range(2):
            base = config(stage, TINY, TRAINING, (daemons[0].dht.address,) if daemons else ())
            cfg = replace(base, dht=replace(base.dht, state_dir=tmp_path / f"peer{stage}"),
                          checkpoint=CheckpointConfig(every=1, keep=2))
            d = Daemon(cfg)
            daemons.append(d)
            await d.start()
        api = f"http://{daemons[0].status()['api_addr']}"
        await Trainer(TrainerConfig(api=api, steps=2, sync=True, codec="none", microbatch_size=4, val_every=0,
                                    max_corpus_bytes=1 << 20)).run()
        model = await from_swarm(api)
        assert model.steps == {0: 2, 1: 2}
        out = tmp_path / "model.safetensors"
        write_model(model, out)
        full = load_model(out)
        tokens = torch.randint(0, 256, (3, TINY.seq_len), generator=torch.Generator().manual_seed(1))
        targets = torch.randint(0, 256, (3, TINY.seq_len), generator=torch.Generator().manual_seed(2))
        hidden = (await daemons[0].executor.forward(tokens)).outputs  # type: ignore[union-attr]
        swarm_loss = float((await daemons[1].executor.forward(hidden, targets)).outputs)  # type: ignore[union-attr]
        with torch.no_grad():
            assert float(full(tokens, targets)) == pytest.approx(swarm_loss, rel=1e-6)

        # the same model from the checkpoint folders, through the CLI
        await daemons[1].checkpoints.save(daemons[1].executor, TRAINING)  # type: ignore[union-attr,arg-type]
        again = tmp_path / "again.safetensors"
        code = swarmd_main(["export", "--from", str(tmp_path / "peer0"), str(tmp_path / "peer1"), "--out", str(again),
                            "--no-progress"])
        assert code == 0 and "stage 1: step 2" in capsys.readouterr().out
        assert from_checkpoints([tmp_path / "peer0", tmp_path / "peer1"]).digests == model.digests
        with pytest.raises(ExportError, match=r"stage\(s\) 1"):
            from_checkpoints([tmp_path / "peer0"])
    finally:
        await asyncio.gather(*(d.shutdown() for d in daemons))  # at once: ~1 s each one by one

    # sampling: reproducible from the seed, greedy at temperature 0, one byte per token
    first, second = (generate(full, b"def ", 20, seed=7) for _ in range(2))
    assert first == second and first.startswith(b"def ") and len(first) == 24
    assert generate(full, b"x", 5, temperature=0) == generate(full, b"x", 5, temperature=0, seed=99)
    assert len(sample_text(full, "", 10).encode("utf-8", errors="replace")) >= 1
    assert swarmd_main(["generate", "--model", str(again), "--prompt", "import ", "--tokens", "8", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("import ")


def test_a_file_that_is_not_an_export_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ExportError, match="not a swarmd model file"):
        load_model(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(ExportError, match="junk.safetensors is not a swarmd model file .*: it is not a safetensors"):
        load_model(tmp_path / "junk.safetensors")
    with pytest.raises(ExportError, match="the model file .*missing.safetensors does not exist"):
        load_model(tmp_path / "missing.safetensors")
