"""The Llama architecture: RMSNorm, rotary positions, SwiGLU, no biases, grouped-query attention,
and the stage guarantees every architecture keeps (composition, deterministic init, causality,
layer sharing, learning)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from swarmd.models.llama import LlamaBlock, LlamaStage, RMSNorm, rotary_tables
from swarmd.pipeline.model import FullModel, build_stage, params_digest
from swarmd.pipeline.spec import PRESETS, ModelSpec

# three stages of unequal depth, grouped-query attention (2 query heads per key/value head)
SPEC = ModelSpec(
    name="llama-three", d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, layers_per_stage=2, n_stages=3,
    vocab_size=64, seq_len=16, arch="llama", partition=(1, 3, 2),
)


def _tokens(spec: ModelSpec, batch: int = 2, seq: int | None = None, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (batch, seq or spec.seq_len), generator=generator)


def test_stages_are_llama_stages_of_the_partition_and_compose_to_the_full_model() -> None:
    stages = [build_stage(SPEC, k) for k in range(SPEC.n_stages)]
    assert all(isinstance(s, LlamaStage) for s in stages)
    assert [len(s.blocks) for s in stages] == [1, 3, 2]
    full = FullModel(SPEC)
    tokens, targets = _tokens(SPEC, seed=1), _tokens(SPEC, seed=2)
    x: Tensor = tokens
    for k, stage in enumerate(stages):
        assert params_digest(stage) == params_digest(full.stages[k])
        x = stage(x, targets) if stage.is_last else stage(x)
    assert torch.equal(x, full(tokens, targets))


def test_no_biases_no_position_table_and_grouped_kv_projections() -> None:
    first, last = build_stage(SPEC, 0), build_stage(SPEC, 2)
    names = {n for s in (first, last) for n, _ in s.named_parameters()}
    assert not any("bias" in n for n in names)
    assert "tok_embeddings.weight" in names and "output.weight" in names and "norm.weight" in names
    attention = first.blocks[0].attention
    assert attention.wq.weight.shape == (32, 32)
    assert attention.wk.weight.shape == attention.wv.weight.shape == (2 * 8, 32)  # 2 kv heads of 8


def test_init_is_deterministic_and_scales_the_residual_projections() -> None:
    spec = dataclasses.replace(PRESETS["llama-small"], name="init", d_model=128, n_heads=4, n_kv_heads=2, d_ff=256)
    stage = build_stage(spec, 0)
    assert params_digest(build_stage(spec, 0)) == params_digest(stage)
    residual_std = 0.02 / math.sqrt(2 * spec.n_layers)
    for name, param in stage.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.all(param == 1.0), name
        else:
            expected = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else 0.02
            assert param.std().item() == pytest.approx(expected, rel=0.1), name
    # another arch, same sizes: another model
    assert params_digest(build_stage(dataclasses.replace(spec, arch="gpt", n_kv_heads=0), 1)) != params_digest(
        build_stage(spec, 1)
    )


def test_rms_norm() -> None:
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(3, 5, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.arange(1.0, 9.0)
    torch.testing.assert_close(norm(x), expected)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def test_rotary_embeddings_make_scores_depend_on_relative_position_only() -> None:
    head_dim, seq = 8, 12
    cos, sin = rotary_tables(seq, head_dim, torch.device("cpu"))
    from swarmd.models.llama import _rotate

    q, k = torch.randn(head_dim), torch.randn(head_dim)
    rq = _rotate(q.expand(seq, head_dim), cos, sin)
    rk = _rotate(k.expand(seq, head_dim), cos, sin)
    scores = rq @ rk.T  # [i, j]: query at position i, key at position j
    for offset in (0, 1, 5):
        diagonal = torch.diagonal(scores, offset=-offset)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(seq))  # a rotation keeps lengths
    assert not torch.allclose(rq[0], rq[3])


def test_grouped_query_attention_equals_multi_head_with_repeated_kv_weights() -> None:
    gqa_spec = dataclasses.replace(SPEC, partition=())
    mha_spec = dataclasses.replace(gqa_spec, n_kv_heads=0)
    gqa, mha = LlamaBlock(gqa_spec), LlamaBlock(mha_spec)
    group, head_dim = 2, gqa_spec.head_dim
    with torch.no_grad():
        for p in gqa.parameters():
            p.normal_(0, 0.1)
        mha.load_state_dict({k: v for k, v in gqa.state_dict().items() if "wk" not in k and "wv" not in k},
                            strict=False)
        for name in ("wk", "wv"):
            w = getattr(gqa.attention, name).weight.view(gqa_spec.kv_heads, head_dim, -1)
            getattr(mha.attention, name).weight.copy_(w.repeat_interleave(group, dim=0).reshape(32, 32))
    x = torch.randn(2, 10, 32)
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)


def test_feed_forward_is_swiglu() -> None:
    block = LlamaBlock(dataclasses.replace(SPEC, partition=()))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ff = block.feed_forward
    x = torch.randn(2, 3, 32)
    expected = (F.silu(x @ ff.w1.weight.T) * (x @ ff.w3.weight.T)) @ ff.w2.weight.T
    torch.testing.assert_close(ff(x), expected)


def test_forward_is_causal() -> None:
    model = FullModel(SPEC)
    tokens = _tokens(SPEC, batch=1)
    t = 6
    altered = tokens.clone()
    altered[0, t + 1:] = (altered[0, t + 1:] + 1) % SPEC.vocab_size
    before, after = model(tokens), model(altered)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1])
    assert not torch.allclose(before[:, t + 1], after[:, t + 1])


def test_positions_matter_without_a_position_table() -> None:
    # rotary positions: without them attention is blind to order, and swapping the two tokens
    # before the last would leave the last position's output as it was
    stage = build_stage(SPEC, 0)
    out, swapped = stage(torch.tensor([[3, 8, 5]])), stage(torch.tensor([[8, 3, 5]]))
    assert not torch.allclose(out[0, 2], swapped[0, 2], atol=1e-6)


def test_shared_layers_reuse_one_block() -> None:
    shared_spec = dataclasses.replace(SPEC, share_layers=True)
    shared = build_stage(shared_spec, 1)  # 3 applications of one block
    assert len(shared.blocks) == 1 and shared.n_applied == 3
    hidden = torch.randn(2, 16, 32, requires_grad=True)
    out = shared(hidden)
    manual = hidden
    for _ in range(3):
        manual = shared.blocks[0](manual)
    assert torch.equal(out, manual)
    out.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in shared.parameters())


def test_recomputed_forward_is_bit_identical() -> None:
    stage = build_stage(SPEC, 1)
    hidden = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    assert torch.equal(stage(hidden), stage(hidden))


@pytest.mark.parametrize("preset", ["llama-tiny", "llama-small"])
def test_untrained_loss_is_near_uniform_and_a_fixed_batch_is_learned(preset: str) -> None:
    spec = PRESETS[preset]
    model = FullModel(spec)
    tokens = _tokens(spec, batch=4, seq=17)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    assert model(inputs, targets).item() == pytest.approx(math.log(spec.vocab_size), abs=0.1)
    if preset != "llama-tiny":
        return
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_bfloat16_stage_and_check_inputs() -> None:
    stage = build_stage(SPEC, 2, dtype=torch.bfloat16)
    loss = stage(torch.randn(1, 4, 32), _tokens(SPEC, batch=1, seq=4))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    from swarmd.errors import RequestError

    with pytest.raises(RequestError, match="1 <= seq <= 16"):
        build_stage(SPEC, 0).check_inputs(torch.zeros(1, 17, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_build_matches_cpu() -> None:
    cpu, gpu = build_stage(SPEC, 0), build_stage(SPEC, 0, device="cuda")
    assert params_digest(gpu) == params_digest(cpu)
    tokens = _tokens(SPEC, batch=2)
    torch.testing.assert_close(gpu(tokens.cuda()).cpu(), cpu(tokens), atol=1e-4, rtol=1e-4)


def test_the_demo_takes_a_model_and_its_stage_count() -> None:
    from swarmd.cli.demo import _demo_spec, main

    spec = _demo_spec("llama-tiny", None)
    assert spec == PRESETS["llama-tiny"]
    three = _demo_spec("llama-tiny", 3)
    assert three.arch == "llama" and three.n_stages == 3 and three.layers_per_stage == 1
    assert main(["--model", "no-such-model"]) == 2
