"""Stages (GPT-style here; tests/unit/test_llama.py for Llama): composition, deterministic init,
causality, learning, validation, partitions and the architecture registry."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import Tensor

from swarmd.errors import ConfigError, RequestError
from swarmd.models.registry import arch_names
from swarmd.pipeline.model import FullModel, StageModule, build_stage, params_digest
from swarmd.pipeline.spec import PRESETS, ModelSpec
from swarmd.pipeline.spec_files import with_partition

TINY = PRESETS["tiny"]
# Three stages so there is a middle stage; small enough to keep the file fast.
THREE = ModelSpec(
    name="three", d_model=32, n_heads=4, d_ff=64, layers_per_stage=2, n_stages=3,
    vocab_size=64, seq_len=16,
)


def _tokens(spec: ModelSpec, batch: int = 2, seq: int | None = None, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (batch, seq or spec.seq_len), generator=generator)


def _stage_digests(spec: ModelSpec, order: list[int]) -> dict[int, str]:
    return {k: params_digest(build_stage(spec, k)) for k in order}


# ---- composition ----------------------------------------------------------------------------


def test_composed_stages_equal_full_model_exactly() -> None:
    full = FullModel(THREE)
    stages = [build_stage(THREE, k) for k in range(THREE.n_stages)]
    for k, stage in enumerate(stages):
        assert params_digest(stage) == params_digest(full.stages[k])
    tokens, targets = _tokens(THREE, seed=1), _tokens(THREE, seed=2)
    x: Tensor = tokens
    for stage in stages[:-1]:
        x = stage(x)
    assert torch.equal(stages[-1](x), full(tokens))
    assert torch.equal(stages[-1](x, targets), full(tokens, targets))


def test_single_stage_model_is_first_and_last() -> None:
    spec = ModelSpec(name="one", d_model=16, n_heads=2, d_ff=32, layers_per_stage=2, n_stages=1,
                     vocab_size=32, seq_len=8)
    stage = build_stage(spec, 0)
    assert stage.is_first and stage.is_last and stage.expects_tokens
    tokens = _tokens(spec)
    assert stage(tokens).shape == (2, 8, 32)
    assert stage(tokens, tokens).dim() == 0


# ---- deterministic initialisation -----------------------------------------------------------


def test_init_is_independent_of_order_global_rng_and_thread() -> None:
    reference = _stage_digests(TINY, [0, 1])
    assert _stage_digests(TINY, [1, 0]) == reference
    torch.manual_seed(12345)
    torch.rand(1000)
    assert _stage_digests(TINY, [1, 0]) == reference

    from_thread: dict[int, str] = {}

    def build() -> None:
        torch.manual_seed(999)
        from_thread.update(_stage_digests(TINY, [1, 0]))

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert from_thread == reference
    assert params_digest(FullModel(TINY).stages[1]) == reference[1]


def test_build_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    build_stage(TINY, 0)
    assert torch.equal(torch.rand(4), expected)


def test_different_stages_and_seeds_differ_but_names_do_not_matter() -> None:
    digests = {
        params_digest(build_stage(THREE, 1)),
        params_digest(build_stage(THREE, 2)),
        params_digest(build_stage(ModelSpec.from_dict(THREE.to_dict() | {"seed": 1}), 1)),
    }
    assert len(digests) == 3
    renamed = ModelSpec.from_dict(THREE.to_dict() | {"name": "renamed"})
    assert params_digest(build_stage(renamed, 1)) == params_digest(build_stage(THREE, 1))
    # Stages of one spec with identical shapes still get different weights.
    w1 = build_stage(THREE, 1).blocks[0].attn.c_attn.weight
    w2 = build_stage(THREE, 2).blocks[0].attn.c_attn.weight
    assert not torch.equal(w1, w2)


def test_init_follows_gpt2() -> None:
    spec = ModelSpec(name="init", d_model=128, n_heads=4, d_ff=512, layers_per_stage=2,
                     n_stages=2, vocab_size=512, seq_len=64)
    stage = build_stage(spec, 0)
    named = dict(stage.named_parameters())
    residual_std = 0.02 / math.sqrt(2 * spec.n_layers)
    for name, param in named.items():
        if ".ln_" in name or name.startswith("ln_"):
            assert torch.all(param == (1.0 if name.endswith("weight") else 0.0)), name
        elif name.endswith("bias"):
            assert torch.all(param == 0), name
        else:
            expected = residual_std if "c_proj" in name else 0.02
            assert param.std().item() == pytest.approx(expected, rel=0.1), name
            assert abs(param.mean().item()) < expected / 10, name
    # Parameters of one shape are not copies of each other.
    assert not torch.equal(named["blocks.0.mlp.c_fc.weight"], named["blocks.1.mlp.c_fc.weight"])


def test_params_digest_tracks_values_dtype_and_names() -> None:
    stage = build_stage(TINY, 1)
    digest = params_digest(stage)
    assert params_digest(stage) == digest and len(digest) == 64
    bias = stage.blocks[0].mlp.c_fc.bias
    with torch.no_grad():
        bias[3] = 1e-6
    assert params_digest(stage) != digest
    with torch.no_grad():
        bias[3] = 0.0
    assert params_digest(stage) == digest
    assert params_digest(build_stage(TINY, 1, dtype=torch.bfloat16)) != digest
    # Same values under different parameter names must not collide.
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with torch.no_grad():
        b.weight.copy_(a.weight)
        b.bias.copy_(a.bias)
    assert params_digest(a) == params_digest(b)
    assert params_digest(torch.nn.Sequential(a)) != params_digest(a)


# ---- behaviour ------------------------------------------------------------------------------


def test_untrained_loss_is_near_uniform() -> None:
    loss = FullModel(TINY)(_tokens(TINY, batch=8), _tokens(TINY, batch=8, seed=1))
    assert loss.item() == pytest.approx(math.log(TINY.vocab_size), abs=0.1)


def test_forward_is_causal() -> None:
    model = FullModel(THREE)
    tokens = _tokens(THREE, batch=1)
    t = 6
    altered = tokens.clone()
    altered[0, t + 1:] = (altered[0, t + 1:] + 1) % THREE.vocab_size
    before, after = model(tokens), model(altered)
    assert torch.equal(before[:, : t + 1], after[:, : t + 1])
    assert not torch.allclose(before[:, t + 1], after[:, t + 1])


def test_forward_is_deterministic_for_recomputation() -> None:
    # The stateless backward recomputes the forward: it must match bit for bit, in both modes.
    stage = build_stage(THREE, 1)
    hidden = torch.randn(2, 16, THREE.d_model, generator=torch.Generator().manual_seed(3))
    first = stage.train()(hidden)
    assert torch.equal(stage.train()(hidden), first)
    assert torch.equal(stage.eval()(hidden), first)


def test_shared_layers_reuse_one_block() -> None:
    shared_spec = ModelSpec.from_dict(THREE.to_dict() | {"share_layers": True, "name": "shared"})
    shared = build_stage(shared_spec, 1)
    plain = build_stage(THREE, 1)
    block_params = sum(p.numel() for p in plain.blocks[0].parameters())
    assert len(shared.blocks) == 1
    assert sum(p.numel() for p in shared.parameters()) == block_params
    assert sum(p.numel() for p in plain.parameters()) == 2 * block_params

    hidden = torch.randn(2, 16, THREE.d_model, requires_grad=True)
    out = shared(hidden)
    manual = hidden
    for _ in range(shared_spec.layers_per_stage):
        manual = shared.blocks[0](manual)
    assert torch.equal(out, manual)
    assert not torch.allclose(out, shared.blocks[0](hidden))

    out.square().mean().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    for name, param in shared.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_full_model_learns_a_fixed_batch() -> None:
    model = FullModel(TINY)
    tokens = _tokens(TINY, batch=4, seq=32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("seq", [1, 5, 16])
def test_stage_output_shapes_and_dtypes(seq: int) -> None:
    tokens = _tokens(THREE, batch=3, seq=seq)
    x: Tensor = tokens
    for k in range(THREE.n_stages):
        stage = build_stage(THREE, k)
        assert stage.expects_tokens == (k == 0)
        out = stage(x)
        if stage.is_last:
            assert out.shape == (3, seq, THREE.vocab_size) and out.dtype == torch.float32
            loss = stage(x, tokens)
            assert loss.shape == () and loss.dtype == torch.float32
        else:
            assert out.shape == (3, seq, THREE.d_model) and out.dtype == torch.float32
        x = out


def test_backward_through_middle_stage_gives_input_grads() -> None:
    stage = build_stage(THREE, 1)
    assert not stage.is_first and not stage.is_last
    hidden = torch.randn(2, 16, THREE.d_model, requires_grad=True)
    out = stage(hidden)
    grad = torch.randn_like(out)
    torch.autograd.backward(out, grad)
    assert hidden.grad is not None and hidden.grad.shape == hidden.shape
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0
    assert all(p.grad is not None for p in stage.parameters())
    # Same result as a vector-Jacobian product, computed independently.
    _, vjp = torch.autograd.functional.vjp(stage, hidden.detach(), grad)
    assert torch.allclose(hidden.grad, vjp, atol=1e-6)


def test_bfloat16_stage_accepts_float32_hidden() -> None:
    stage = build_stage(THREE, 2, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in stage.parameters())
    hidden = torch.randn(1, 4, THREE.d_model)
    loss = stage(hidden, _tokens(THREE, batch=1, seq=4))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_build_matches_cpu() -> None:
    cpu, gpu = build_stage(TINY, 0), build_stage(TINY, 0, device="cuda")
    assert params_digest(gpu) == params_digest(cpu)
    tokens = _tokens(TINY, batch=2)
    assert torch.allclose(gpu(tokens.cuda()).cpu(), cpu(tokens), atol=1e-4)


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [-1, 3])
def test_build_stage_rejects_bad_stage(stage: int) -> None:
    with pytest.raises(ConfigError, match="out of range"):
        build_stage(THREE, stage)


def test_build_stage_rejects_integer_dtype() -> None:
    with pytest.raises(ConfigError, match="floating point"):
        build_stage(THREE, 0, dtype=torch.int32)


@pytest.mark.parametrize(
    ("stage", "inputs", "targets", "needle"),
    [
        (0, torch.zeros(2, 4), None, "expects int64 token ids"),
        (0, torch.zeros(2, 4, 2, dtype=torch.int64), None, "expects int64 token ids"),
        (0, torch.full((2, 4), 64), None, "token ids must lie in [0, 64)"),
        (0, torch.full((2, 4), -1), None, "token ids must lie in [0, 64)"),
        (0, torch.zeros(2, 17, dtype=torch.int64), None, "1 <= seq <= 16"),
        (0, torch.zeros(0, 4, dtype=torch.int64), None, "non-empty batch"),
        (0, torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64),
         "not the last stage"),
        (1, torch.zeros(2, 4, dtype=torch.int64), None, "expects float hidden states"),
        (1, torch.zeros(2, 4, 31), None, "expects float hidden states [batch, seq, 32]"),
        (2, torch.zeros(2, 4, 32), torch.zeros(2, 5, dtype=torch.int64), "targets must be int64"),
        (2, torch.zeros(2, 4, 32), torch.zeros(2, 4), "targets must be int64"),
        (2, torch.zeros(2, 4, 32), torch.full((2, 4), 99), "targets must lie in [0, 64)"),
    ],
)
def test_check_inputs_rejects_inputs_that_do_not_fit(
    stage: int, inputs: Tensor, targets: Tensor | None, needle: str
) -> None:
    module: StageModule = build_stage(THREE, stage)
    with pytest.raises(RequestError) as exc:
        module.check_inputs(inputs, targets)
    assert needle in str(exc.value)


# ---- partitions and the architecture registry -------------------------------------------------


def test_unequal_partition_composes_to_the_full_model() -> None:
    spec = ModelSpec.from_dict(THREE.to_dict() | {"name": "uneven", "partition": [3, 2, 1]})
    stages = [build_stage(spec, k) for k in range(3)]
    assert [len(s.blocks) for s in stages] == [3, 2, 1]
    full = FullModel(spec)
    tokens, targets = _tokens(spec, seed=1), _tokens(spec, seed=2)
    x: Tensor = tokens
    for stage in stages[:-1]:
        x = stage(x)
    assert torch.equal(stages[-1](x, targets), full(tokens, targets))
    # another cut of the same blocks is another model: other digest, other initial weights
    assert params_digest(stages[1]) != params_digest(build_stage(THREE, 1))
    shared = build_stage(ModelSpec.from_dict(spec.to_dict() | {"share_layers": True}), 0)
    assert len(shared.blocks) == 1 and shared.n_applied == 3


def _example_from_docs() -> str:
    """The plug-in architecture of docs/models.md, verbatim (its first python block)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def _install_dist(root: Path, module: str, source: str, entry: str) -> None:
    """A real installed distribution under ``root``: the module, METADATA and entry_points.txt."""
    (root / f"{module}.py").write_text(source, encoding="utf-8")
    info = root / f"{module.replace('_', '-')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[swarmd.models]\n{entry}\n")


def test_a_package_registers_its_own_architecture_through_an_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = {"name": "mini", "d_model": 16, "n_heads": 2, "d_ff": 32, "layers_per_stage": 2, "n_stages": 2,
              "vocab_size": 32, "seq_len": 8, "arch": "mini"}
    with pytest.raises(ConfigError, match="arch 'mini' is unknown: this build has gpt, llama"):
        ModelSpec.from_dict(fields)
    _install_dist(tmp_path, "mini_arch", _example_from_docs(), "mini = mini_arch:MiniStage")
    _install_dist(tmp_path, "broken_arch", "raise ImportError('no such thing')\n", "broken = broken_arch:Stage")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert arch_names() == ["gpt", "llama", "broken", "mini"]
        spec = ModelSpec.from_dict(fields)
        stages = [build_stage(spec, k) for k in range(2)]
        assert type(stages[0]).__name__ == "MiniStage" and stages[0].embedding.weight.shape == (32, 16)
        assert params_digest(build_stage(spec, 1)) == params_digest(stages[1])  # deterministic init
        model = FullModel(spec)
        tokens = _tokens(spec, batch=4)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(20):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.5
        # its piece_flops feed the balanced partition: a costly head moves a block to stage 0
        wide = with_partition(ModelSpec.from_dict(fields | {"vocab_size": 4096, "seq_len": 8}), "balanced")
        assert wide.partition == (3, 1)
        broken = ModelSpec.from_dict(fields | {"arch": "broken"})  # its name is known: loading fails
        with pytest.raises(ConfigError, match="arch 'broken': cannot load its entry point 'broken_arch:Stage'"):
            build_stage(broken, 0)
    finally:
        for name in ("mini_arch", "broken_arch"):
            sys.modules.pop(name, None)
