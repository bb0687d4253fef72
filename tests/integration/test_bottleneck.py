"""Compression-aware stage boundaries (``ModelSpec.boundary_dim``, the paper's Appendix I)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from swarmd.errors import ConfigError, RequestError
from swarmd.pipeline.model import FullModel, build_stage
from swarmd.pipeline.spec import PRESETS, ModelSpec
from swarmd.train.trainer import Trainer, TrainerConfig
from tests.support.swarms import CORPUS_BYTES, MICRO, TRAINING, swarm

TINY = PRESETS["tiny"]
NARROW = replace(TINY, boundary_dim=16)


def test_the_digest_covers_the_bottleneck_and_old_digests_stay() -> None:
    assert NARROW.digest != TINY.digest
    assert replace(TINY, boundary_dim=8).digest not in (NARROW.digest, TINY.digest)
    assert replace(TINY, boundary_dim=0).digest == TINY.digest  # 0 is the default: left out
    assert "boundary_dim" not in TINY.to_dict()
    assert NARROW.to_dict()["boundary_dim"] == 16
    assert ModelSpec.from_dict(NARROW.to_dict()) == NARROW


@pytest.mark.parametrize("dim", [-1, 64, 65, True, 1.5, "16"])
def test_bad_widths_are_refused(dim: object) -> None:
    with pytest.raises(ConfigError, match="boundary_dim"):
        replace(TINY, boundary_dim=dim)


@pytest.mark.parametrize("base", ["tiny", "llama-tiny"])
def test_stages_talk_through_the_bottleneck(base: str) -> None:
    spec = replace(PRESETS[base], layers_per_stage=1, n_stages=3, boundary_dim=8)
    stages = [build_stage(spec, k) for k in range(3)]
    assert stages[0].boundary_in is None and stages[0].boundary_out is not None
    assert stages[1].boundary_in is not None and stages[1].boundary_out is not None
    assert stages[2].boundary_in is not None and stages[2].boundary_out is None
    tokens = torch.randint(0, spec.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    h0 = stages[0](tokens)
    assert h0.shape == (2, 10, 8)
    h1 = stages[1](h0)
    assert h1.shape == (2, 10, 8)
    loss = stages[2](h1, tokens)
    loss.backward()
    assert all(p.grad is not None for s in stages for p in s.parameters())
    with pytest.raises(RequestError, match=r"\[batch, seq, 8\]"):
        stages[1].check_inputs(torch.zeros(2, 10, spec.d_model))
    stages[1].check_inputs(torch.zeros(2, 10, 8))


def test_the_boundary_starts_as_a_projection_and_is_deterministic() -> None:
    a, b = build_stage(NARROW, 0), build_stage(NARROW, 1)
    assert a.boundary_out is not None and b.boundary_in is not None
    # boundary_in starts as the transpose of the previous stage's boundary_out: what crosses is
    # a projection of the hidden state that the next stage reads back into the same subspace
    assert torch.equal(b.boundary_in.weight, a.boundary_out.weight.t())
    assert torch.equal(build_stage(NARROW, 1).boundary_in.weight, b.boundary_in.weight)
    with torch.no_grad():
        x = torch.randn(3, 64)
        through = b.boundary_in(a.boundary_out(x))
        assert float(torch.linalg.vector_norm(through)) < 2 * float(torch.linalg.vector_norm(x))
        full = FullModel(NARROW)
        tokens = torch.randint(0, 256, (2, 16))
        assert torch.isfinite(full(tokens, tokens))


async def test_a_bottleneck_model_trains_through_real_daemons_with_4bit_traffic() -> None:
    """Two stages, one peer each, 4-bit activations over a 16-wide boundary (d_model 64): the
    loss falls, and the wire carried boundary_dim-wide tensors (the stage refuses others)."""
    steps = 6
    async with swarm(NARROW, replace(TRAINING, grad_codec="4bit"), peers_per_stage=1) as daemons:
        run = TrainerConfig(api=f"http://{daemons[0].status()['api_addr']}", steps=steps, sync=True, codec="4bit",
                            microbatch_size=MICRO, window=4, val_every=0, max_corpus_bytes=CORPUS_BYTES)
        summary = await Trainer(run).run()
        assert all(d.executor.spec.boundary_dim == 16 for d in daemons)
        assert all(d.executor.step == steps for d in daemons)
    assert summary.steps == steps and summary.microbatches_issued == summary.microbatches_completed
    assert summary.step_losses[-1] < summary.step_losses[0]
