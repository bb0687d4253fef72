"""Fidelity with a BPE tokenizer (issue #16 item 6): a 2x2 swarm founded with a tokenizer, in --sync mode
with codec none, trained on BPE ids streamed from ``swarmd data prepare`` shards, computes the losses
and parameters of single-process training on the same ids."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from swarmd.cli.serve import with_tokenizer
from swarmd.errors import ConfigError
from swarmd.pipeline.model import build_stage
from swarmd.pipeline.stage.optimizer import build_optimizer
from swarmd.train.data import BatchSampler, load_corpus, stdlib_root
from swarmd.train.reference import single_process_step
from swarmd.train.shards import ShardStream, prepare
from swarmd.train.tokenizer import HFTokenizer
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.support.swarms import MICRO, TRAINING, swarm
from tests.support.tokenizers import small_bpe

SOURCE = ("json", "textwrap.py", "string.py")  # stdlib text to prepare: ~150 KB, 50k BPE ids


async def test_swarm_training_on_bpe_shards_equals_single_process_training(tmp_path: Path) -> None:
    path = small_bpe(tmp_path)
    tok = HFTokenizer.from_file(path)
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCE:
        for file in sorted((stdlib_root() / name).glob("*.py")) if name.isidentifier() else [stdlib_root() / name]:
            (src / f"{name}_{file.name}").write_bytes(file.read_bytes())
    prepare(src, tmp_path / "shards", tokenizer=tok, shard_tokens=8192, val_fraction=0.05)
    # the founder's --tokenizer: the preset with the file's vocabulary and digest
    spec = replace(with_tokenizer("tiny", path, joining=False), name="eq-bpe")
    assert spec.vocab_size == tok.vocab_size and spec.tokenizer == tok.digest
    steps, seed = 3, 0
    async with swarm(spec, TRAINING) as daemons:  # 2 stages x 2 peers
        run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=steps, sync=True, codec="none",
                            microbatch_size=MICRO, window=4, val_every=0, seed=seed, data=str(tmp_path / "shards"),
                            tokenizer=str(path), verify_fraction=0.0)  # paired checks re-weight a sample (issue 29)
        summary = await Trainer(run).run()
        digests = {(d.stage, d.executor.digest) for d in daemons}
        params = {d.stage: {n: p.detach().clone() for n, p in d.executor.module.named_parameters()}
                  for d in daemons}
        assert all(d.executor.step == steps for d in daemons)
        # a byte-level trainer is refused by the live swarm's spec, naming its tokenizer's digest
        with pytest.raises(ConfigError, match=f"uses tokenizer {tok.digest}, but this trainer uses byte-level"):
            await Trainer(replace(run, data=None, tokenizer=None, steps=1)).run()

    corpus = load_corpus(tmp_path / "shards", seq_len=spec.seq_len, spec=spec)
    assert isinstance(corpus.train, ShardStream) and len(corpus.train.files) > 3  # streamed, across shards
    sampler = BatchSampler(corpus.train, spec.seq_len, seed=seed)
    stages = [build_stage(spec, k) for k in range(spec.n_stages)]
    optimizers = [build_optimizer(TRAINING, s.named_parameters()) for s in stages]
    expected = []
    for step in range(steps):
        microbatches = [sampler.sample(MICRO) for _ in range(TRAINING.target_batch_size // MICRO)]
        assert int(max(x.max() for x, _ in microbatches)) >= 256  # real BPE ids, beyond bytes
        expected.append(single_process_step(stages, optimizers, TRAINING, microbatches, step))

    assert summary.steps == steps and summary.stale_redos == 0
    assert summary.step_losses == pytest.approx(expected, rel=1e-4)
    assert expected[0] == pytest.approx(torch.log(torch.tensor(float(tok.vocab_size))).item(), rel=0.05)
    assert expected[-1] < expected[0]  # it learns
    assert len(digests) == spec.n_stages  # stage-mates bit-identical
    for k, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            torch.testing.assert_close(params[k][name], p.detach(), rtol=1e-4, atol=1e-5)
