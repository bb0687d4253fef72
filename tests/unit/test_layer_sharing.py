"""swarmd.models.layer_sharing: one block applied at every layer of a stage (pure), and a stage built so."""

from __future__ import annotations

from dataclasses import replace

import torch

from swarmd.models.layer_sharing import block_applied, blocks_built
from swarmd.pipeline.model import build_stage
from tests.conftest import TINY


def test_a_shared_stage_holds_one_block_and_applies_it_at_every_layer() -> None:
    assert blocks_built(4, shared=True) == 1 and blocks_built(4, shared=False) == 4
    assert [block_applied(i, shared=True) for i in range(4)] == [0, 0, 0, 0]
    assert [block_applied(i, shared=False) for i in range(4)] == [0, 1, 2, 3]
    deep = replace(TINY, layers_per_stage=3)
    shared = replace(deep, share_layers=True)
    unshared_stage, shared_stage = build_stage(deep, 0), build_stage(shared, 0)
    assert len(shared_stage.blocks) == 1 and len(unshared_stage.blocks) == unshared_stage.n_applied > 1
    n_shared = sum(p.numel() for p in shared_stage.parameters())
    assert n_shared < sum(p.numel() for p in unshared_stage.parameters())
    assert shared.digest != deep.digest  # peers of a shared and an unshared model never mix
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    assert shared_stage(x).shape == unshared_stage(x).shape
