"""TrainingSpec, the learning-rate schedule, stage-wide steps and the optimizer-state hand-over.

The property everything here protects: peers of one stage that start from the same
parameters and apply the same averaged gradients stay bit-identical, step after step, and
across a hand-over of the optimizer state to a joining peer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from swarmd.dht.identity import Identity
from swarmd.dht.records import MAX_RECORD_BYTES, SwarmRecord, open_record, sign_record
from swarmd.errors import ConfigError
from swarmd.net.wire import WireLimits, decode_frame, encode_frame
from swarmd.pipeline.model import FullModel, StageModule, build_stage, params_digest
from swarmd.pipeline.optimizer import (
    STATE_FORMAT,
    Lamb,
    TrainingSpec,
    apply_step,
    build_optimizer,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
)
from swarmd.pipeline.spec import PRESETS, ModelSpec

TINY = PRESETS["tiny"]
# Smaller than tiny, for the tests that train: a few milliseconds per step.
MINI = ModelSpec(
    name="mini", d_model=32, n_heads=2, d_ff=64, layers_per_stage=1, n_stages=2,
    vocab_size=32, seq_len=16,
)
KINDS = ("adamw", "lamb")

# Changing this literal changes what every deployed peer computes for the default settings;
# only do it on purpose, together with DIGEST_VERSION.
DEFAULT_DIGEST = "e7778e29b1ef10b3fbf944520dfb67f8f6819efe320b810195f6ac267467416d"


def _grads(module: nn.Module, seed: int, scale: float = 1.0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) * scale for p in module.parameters()]


def _set_grads(module: nn.Module, grads: list[Tensor]) -> None:
    for param, grad in zip(module.parameters(), grads):
        param.grad = grad.clone()


def _stepped(spec: TrainingSpec, stage: int = 0, steps: int = 3) -> tuple[StageModule, torch.optim.Optimizer]:
    """A TINY stage and its optimizer after ``steps`` updates with seeded gradients."""
    module = build_stage(TINY, stage)
    optimizer = build_optimizer(spec, module)
    for step in range(steps):
        _set_grads(module, _grads(module, seed=step))
        apply_step(optimizer, spec, module.parameters(), step)
    return module, optimizer


@pytest.fixture
def num_threads() -> Iterator[Callable[[int], None]]:
    """Set torch's intra-op thread count for the test; restored afterwards."""
    before = torch.get_num_threads()
    try:
        yield torch.set_num_threads
    finally:
        torch.set_num_threads(before)


# ---- TrainingSpec: validation -----------------------------------------------------------------


def test_defaults() -> None:
    spec = TrainingSpec()
    assert spec.to_dict() == {
        "target_batch_size": 32, "optimizer": "adamw", "lr": 1e-3, "beta1": 0.9, "beta2": 0.95,
        "eps": 1e-8, "weight_decay": 0.01, "warmup_steps": 10, "schedule": "cosine",
        "total_steps": 10_000, "min_lr_ratio": 0.1, "clip_norm": 1.0, "delay_updates": False,
        "averaging_timeout_s": 30.0, "grad_codec": "none",
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_batch_size": 0}, "'target_batch_size' must be between 1"),
        ({"target_batch_size": True}, "'target_batch_size' must be an integer"),
        ({"target_batch_size": 32.0}, "'target_batch_size' must be an integer"),
        ({"total_steps": 0}, "'total_steps' must be between 1"),
        ({"warmup_steps": -1}, "'warmup_steps' must be between 0"),
        ({"warmup_steps": 11, "total_steps": 10}, "warmup_steps=11 must not exceed total_steps=10"),
        ({"optimizer": "sgd"}, "'optimizer' must be one of adamw, lamb"),
        ({"optimizer": None}, "'optimizer' must be one of"),
        ({"schedule": "Cosine"}, "'schedule' must be one of constant, linear, cosine"),
        ({"lr": 0.0}, r"'lr' must lie in \(0, 10\]"),
        ({"lr": -1e-3}, "'lr' must lie in"),
        ({"lr": math.nan}, "'lr' must lie in"),
        ({"lr": math.inf}, "'lr' must lie in"),
        ({"lr": "1e-3"}, "'lr' must be a number"),
        ({"lr": True}, "'lr' must be a number"),
        ({"beta1": 1.0}, r"'beta1' must lie in \[0, 1\)"),
        ({"beta2": -0.1}, "'beta2' must lie in"),
        ({"eps": 0.0}, "'eps' must lie in"),
        ({"weight_decay": -0.01}, "'weight_decay' must lie in"),
        ({"min_lr_ratio": 1.5}, "'min_lr_ratio' must lie in"),
        ({"clip_norm": -1.0}, "'clip_norm' must lie in"),
        ({"averaging_timeout_s": 0}, "'averaging_timeout_s' must lie in"),
        ({"delay_updates": 1}, "'delay_updates' must be true or false"),
        ({"grad_codec": "bf16"}, "'grad_codec' must be one of none, fp16, 8bit"),
    ],
)
def test_invalid_fields_raise_config_error(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainingSpec(**changes)
    with pytest.raises(ConfigError, match=message):
        TrainingSpec.from_dict(changes)


def test_ints_are_accepted_for_float_fields_and_stored_as_floats() -> None:
    spec = TrainingSpec(lr=1, weight_decay=0, clip_norm=0)
    assert type(spec.lr) is float and type(spec.weight_decay) is float and type(spec.clip_norm) is float
    assert spec == TrainingSpec(lr=1.0, weight_decay=0.0, clip_norm=0.0)
    assert spec.digest == TrainingSpec(lr=1.0, weight_decay=0.0, clip_norm=0.0).digest


# ---- TrainingSpec: dict form and digest -------------------------------------------------------


def test_to_dict_holds_only_scalars_and_round_trips() -> None:
    spec = TrainingSpec(optimizer="lamb", schedule="linear", lr=2e-3, delay_updates=True, warmup_steps=0)
    d = spec.to_dict()
    assert all(type(k) is str for k in d)
    assert all(type(v) in (bool, int, float, str) for v in d.values())
    assert TrainingSpec.from_dict(d) == spec
    assert TrainingSpec.from_dict(msgpack.unpackb(msgpack.packb(d))) == spec


def test_from_dict_ignores_unknown_keys_and_defaults_missing_ones() -> None:
    # A newer peer wrote the record: it knows a setting this build does not.
    d = {"lr": 3e-4, "schedule": "constant", "gradient_compression": "8bit", "zz": None}
    spec = TrainingSpec.from_dict(d)
    assert spec == TrainingSpec(lr=3e-4, schedule="constant")
    assert TrainingSpec.from_dict({}) == TrainingSpec()
    # Known keys are still validated next to unknown ones.
    with pytest.raises(ConfigError, match="'lr'"):
        TrainingSpec.from_dict({"lr": None, "new_field": 1})
    with pytest.raises(ConfigError, match="unknown training field.*'gradient_compression'"):
        TrainingSpec.from_dict(d, strict=True)
    with pytest.raises(ConfigError, match="must be a mapping"):
        TrainingSpec.from_dict([("lr", 1e-3)])  # type: ignore[arg-type]


def test_fits_a_signed_swarm_record_with_the_largest_preset() -> None:
    identity = Identity.generate()
    record = SwarmRecord(
        swarm="s" * 64, spec=PRESETS["base"].to_dict(),
        training=TrainingSpec(optimizer="lamb", schedule="linear").to_dict(),
        founder=identity.peer_id, timestamp=1_000.0, expiry=1_300.0,
    )
    raw = sign_record(identity, record)
    assert len(raw) <= MAX_RECORD_BYTES
    opened = open_record(raw, now=1_100.0)
    assert isinstance(opened, SwarmRecord)
    assert TrainingSpec.from_dict(opened.training) == TrainingSpec(optimizer="lamb", schedule="linear")


def test_digest_is_the_literal_and_sensitive_to_every_field() -> None:
    assert TrainingSpec().digest == DEFAULT_DIGEST
    assert TrainingSpec.from_dict(TrainingSpec().to_dict()).digest == DEFAULT_DIGEST
    changed = {
        "target_batch_size": 33, "optimizer": "lamb", "lr": 1.1e-3, "beta1": 0.8, "beta2": 0.999,
        "eps": 1e-6, "weight_decay": 0.0, "warmup_steps": 11, "schedule": "linear",
        "total_steps": 10_001, "min_lr_ratio": 0.0, "clip_norm": 0.0, "delay_updates": True,
        "averaging_timeout_s": 31.0, "grad_codec": "fp16",
    }
    assert set(changed) == {f.name for f in dataclasses.fields(TrainingSpec)}
    digests = {TrainingSpec(**{name: value}).digest for name, value in changed.items()}
    assert len(digests) == len(changed) and DEFAULT_DIGEST not in digests


# ---- the learning-rate schedule ---------------------------------------------------------------


def test_lr_at_warmup_then_each_schedule_at_its_key_points() -> None:
    base = {"lr": 1.0, "warmup_steps": 4, "total_steps": 104, "min_lr_ratio": 0.1}
    for schedule in ("constant", "linear", "cosine"):
        spec = TrainingSpec(schedule=schedule, **base)
        # Linear warmup: the first update already moves; update W-1 uses the full rate.
        assert [spec.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
        assert spec.lr_at(4) == 1.0
    constant = TrainingSpec(schedule="constant", **base)
    assert {constant.lr_at(s) for s in (4, 54, 104, 10**6)} == {1.0}
    linear = TrainingSpec(schedule="linear", **base)
    assert linear.lr_at(54) == pytest.approx(0.55)
    assert linear.lr_at(104) == pytest.approx(0.1) and linear.lr_at(10**6) == linear.lr_at(104)
    cosine = TrainingSpec(schedule="cosine", **base)
    assert cosine.lr_at(29) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cosine.lr_at(54) == pytest.approx(0.55)
    assert cosine.lr_at(104) == pytest.approx(0.1) and cosine.lr_at(10**6) == cosine.lr_at(104)


def test_lr_at_without_warmup_and_with_nothing_to_decay() -> None:
    no_warmup = TrainingSpec(lr=0.5, warmup_steps=0, total_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert no_warmup.lr_at(0) == 0.5 and no_warmup.lr_at(5) == 0.25 and no_warmup.lr_at(10) == 0.0
    # total_steps == warmup_steps: warm up, then straight to the floor.
    instant = TrainingSpec(lr=0.5, warmup_steps=2, total_steps=2, schedule="cosine", min_lr_ratio=0.2)
    assert [instant.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.1, 0.1]


@pytest.mark.parametrize("step", [-1, 1.0, True, None])
def test_lr_at_rejects_bad_steps(step: Any) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        TrainingSpec().lr_at(step)


@settings(max_examples=50, deadline=None)
@given(
    schedule=st.sampled_from(["constant", "linear", "cosine"]),
    warmup=st.integers(0, 50),
    extra=st.integers(0, 200),
    ratio=st.floats(0.0, 1.0),
)
def test_lr_at_warms_up_then_never_increases_and_stays_in_range(
    schedule: str, warmup: int, extra: int, ratio: float
) -> None:
    spec = TrainingSpec(lr=0.1, warmup_steps=warmup, total_steps=max(1, warmup + extra),
                        schedule=schedule, min_lr_ratio=ratio)
    rates = [spec.lr_at(s) for s in range(warmup + extra + 5)]
    assert all(0.0 < r <= 0.1 for r in rates[:warmup])
    assert rates[:warmup] == sorted(rates[:warmup])
    if warmup:
        assert rates[warmup - 1] == 0.1  # exactly the peak, not 0.1 * W / W
    after = rates[warmup:]
    assert after[0] == 0.1 or (warmup == spec.total_steps and schedule != "constant")
    assert all(b <= a for a, b in zip(after, after[1:]))
    assert all(0.1 * ratio <= r <= 0.1 for r in after)


# ---- build_optimizer and apply_step ------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_build_optimizer_decays_only_matrices_and_embeddings(kind: str) -> None:
    module = build_stage(TINY, 0)
    optimizer = build_optimizer(TrainingSpec(optimizer=kind, weight_decay=0.05), module)
    assert isinstance(optimizer, torch.optim.AdamW if kind == "adamw" else Lamb)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    params = list(module.parameters())
    assert [id(p) for p in decay["params"]] == [id(p) for p in params if p.dim() >= 2]
    assert [id(p) for p in no_decay["params"]] == [id(p) for p in params if p.dim() < 2]
    assert {id(module.wte.weight), id(module.blocks[0].attn.c_attn.weight)} <= {id(p) for p in decay["params"]}
    if kind == "adamw":
        # The per-tensor implementation on every device, never the fused one (see module docstring).
        assert decay["foreach"] is False and decay["fused"] is False


@pytest.mark.parametrize("kind", KINDS)
def test_weight_decay_moves_only_the_decayed_parameters(kind: str) -> None:
    spec = TrainingSpec(optimizer=kind, lr=0.1, weight_decay=0.5, warmup_steps=0, clip_norm=0.0)
    module = build_stage(TINY, 1)
    before = [p.detach().clone() for p in module.parameters()]
    optimizer = build_optimizer(spec, module)
    _set_grads(module, [torch.zeros_like(p) for p in module.parameters()])
    apply_step(optimizer, spec, module.parameters(), 0)
    for old, new in zip(before, module.parameters()):
        if old.dim() < 2:
            assert torch.equal(old, new)
        elif kind == "adamw":
            assert torch.equal(new, old * (1 - 0.1 * 0.5))  # AdamW's decoupled decay, exactly
        else:
            # LAMB: the update is all decay, and the trust ratio scales it to lr * ||p||.
            torch.testing.assert_close(new, old * (1 - 0.1))


def test_build_optimizer_takes_modules_params_or_named_params_alike() -> None:
    spec = TrainingSpec()
    module = build_stage(MINI, 0)
    by_module = build_optimizer(spec, module).state_dict()
    assert build_optimizer(spec, module.parameters()).state_dict() == by_module
    assert build_optimizer(spec, module.named_parameters()).state_dict() == by_module
    module.wpe.weight.requires_grad_(False)
    frozen = build_optimizer(spec, module)
    assert all(p is not module.wpe.weight for g in frozen.param_groups for p in g["params"])
    with pytest.raises(ValueError, match="given twice"):
        build_optimizer(spec, [module.wte.weight, module.wte.weight])
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(spec, [module.wpe.weight])
    with pytest.raises(TypeError, match="got an item of type str"):
        build_optimizer(spec, ["wte"])  # type: ignore[list-item]


@pytest.mark.parametrize("kind", KINDS)
def test_apply_step_uses_the_scheduled_learning_rate(kind: str) -> None:
    # Regression test for "the schedule was never stepped": the same gradient moves the
    # parameters four times less on update 0 than on update 3 of a 4-step warmup.
    spec = TrainingSpec(optimizer=kind, lr=0.01, warmup_steps=4, weight_decay=0.0, clip_norm=0.0)
    moves = {}
    for step in (0, 3, 500):
        layer = nn.Linear(8, 4)
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(-1, 1, 32).reshape(4, 8))
        before = layer.weight.detach().clone()
        optimizer = build_optimizer(spec, layer)
        layer.weight.grad = torch.full_like(layer.weight, 0.5)
        layer.bias.grad = torch.full_like(layer.bias, 0.5)
        apply_step(optimizer, spec, layer.parameters(), step)
        assert {g["lr"] for g in optimizer.param_groups} == {spec.lr_at(step)}
        moves[step] = float((layer.weight.detach() - before).norm())
        assert layer.weight.grad is None and layer.bias.grad is None
    assert moves[0] > 0
    assert moves[3] / moves[0] == pytest.approx(4.0, rel=1e-4)
    assert moves[500] / moves[3] == pytest.approx(spec.lr_at(500) / spec.lr, rel=1e-4)


def test_apply_step_clips_to_clip_norm_and_returns_the_norm_before_clipping() -> None:
    def first_moment_norm(clip_norm: float) -> tuple[float, float]:
        spec = TrainingSpec(clip_norm=clip_norm, beta1=0.5, warmup_steps=0)
        layer = nn.Linear(25, 4)  # 100 weights and 4 biases
        optimizer = build_optimizer(spec, layer)
        layer.weight.grad = torch.full_like(layer.weight, 0.6)
        layer.bias.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
        norm = apply_step(optimizer, spec, layer.parameters(), 0)
        # After one AdamW step exp_avg = (1 - beta1) * (clipped) grad.
        moments = [optimizer.state[p]["exp_avg"] for p in layer.parameters()]
        return norm, float(torch.linalg.vector_norm(torch.cat([m.flatten() for m in moments]))) / 0.5

    expected = math.sqrt(100 * 0.36 + 25)
    norm, clipped = first_moment_norm(1.0)
    assert norm == pytest.approx(expected, rel=1e-6)
    assert clipped == pytest.approx(1.0, rel=1e-5)
    norm, unclipped = first_moment_norm(0.0)  # 0 disables clipping; the norm is still reported
    assert norm == pytest.approx(expected, rel=1e-6)
    assert unclipped == pytest.approx(expected, rel=1e-5)
    _, loose = first_moment_norm(100.0)  # a bound above the norm changes nothing
    assert loose == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_apply_step_is_exactly_clip_grad_norm_then_step(kind: str) -> None:
    spec = TrainingSpec(optimizer=kind, clip_norm=0.5, warmup_steps=3)
    ours, theirs = build_stage(MINI, 1), build_stage(MINI, 1)
    opt_ours, opt_theirs = build_optimizer(spec, ours), build_optimizer(spec, theirs)
    for step in range(3):
        grads = _grads(ours, seed=step)
        _set_grads(ours, grads)
        _set_grads(theirs, grads)
        norm = apply_step(opt_ours, spec, ours.parameters(), step)
        reference = torch.nn.utils.clip_grad_norm_(theirs.parameters(), spec.clip_norm, foreach=False)
        for group in opt_theirs.param_groups:
            group["lr"] = spec.lr_at(step)
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)
        assert norm == float(reference)
        assert params_digest(ours) == params_digest(theirs)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_skips_the_update(bad: float) -> None:
    spec = TrainingSpec()
    module = build_stage(MINI, 0)
    digest = params_digest(module)
    optimizer = build_optimizer(spec, module)
    grads = _grads(module, seed=0)
    grads[3].view(-1)[0] = bad
    _set_grads(module, grads)
    norm = apply_step(optimizer, spec, module.parameters(), 0)
    assert not math.isfinite(norm)
    assert params_digest(module) == digest
    assert optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in module.parameters())


# ---- LAMB on hand-computed examples ------------------------------------------------------------


def _lamb_step(param: list[list[float]] | list[float], grad: list[list[float]] | list[float],
               weight_decay: float = 0.0, lr: float = 0.1) -> Tensor:
    p = nn.Parameter(torch.tensor(param, dtype=torch.float64))
    optimizer = Lamb([p], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    p.grad = torch.tensor(grad, dtype=torch.float64)
    optimizer.step()
    return p.detach()


def test_lamb_trust_ratio_on_hand_computed_examples() -> None:
    eps = 1e-8
    # Step 1: m_hat = g, v_hat = g^2, so u = g / (|g| + eps) = [1, 0] (up to eps); ||p|| = 5,
    # ||u|| = 1, trust = 5: p moves by lr * 5 along u.
    u0 = 1 / (1 + eps)
    torch.testing.assert_close(_lamb_step([[3.0, 4.0]], [[1.0, 0.0]]), torch.tensor([[3.0 - 0.1 * 5 * u0 / u0, 4.0]], dtype=torch.float64))
    # With weight decay 0.1: u = [u0, 0] + 0.1 * [3, 4]; trust = 5 / ||u||.
    u = torch.tensor([[u0 + 0.3, 0.4]], dtype=torch.float64)
    expected = torch.tensor([[3.0, 4.0]], dtype=torch.float64) - 0.1 * (5 / float(u.norm())) * u
    torch.testing.assert_close(_lamb_step([[3.0, 4.0]], [[1.0, 0.0]], weight_decay=0.1), expected)
    # A zero parameter (a fresh bias): trust is 1, a plain Adam-sized step of lr.
    torch.testing.assert_close(_lamb_step([0.0, 0.0], [2.0, 0.0]), torch.tensor([-0.1 * u0, 0.0], dtype=torch.float64))
    # A zero update (zero gradient, no decay): trust is 1 and nothing moves.
    assert torch.equal(_lamb_step([3.0, 4.0], [0.0, 0.0]), torch.tensor([3.0, 4.0], dtype=torch.float64))


def test_lamb_rejects_bad_hyperparameters() -> None:
    p = nn.Parameter(torch.zeros(2))
    for kwargs in ({"lr": -1.0}, {"betas": (1.0, 0.9)}, {"eps": 0.0}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError, match="LAMB"):
            Lamb([p], **kwargs)  # type: ignore[arg-type]


# ---- determinism ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_replicas_stay_bit_identical_step_after_step(kind: str, num_threads: Callable[[int], None]) -> None:
    spec = TrainingSpec(optimizer=kind, warmup_steps=2, clip_norm=0.5)
    a, b = build_stage(TINY, 0), build_stage(TINY, 0)
    opt_a = build_optimizer(spec, a)
    opt_b = build_optimizer(spec, b.named_parameters())  # built another way, same result
    for step in range(5):
        grads = _grads(a, seed=100 + step)
        _set_grads(a, grads)
        _set_grads(b, grads)
        num_threads(1)
        apply_step(opt_a, spec, a.parameters(), step)
        num_threads(4)
        apply_step(opt_b, spec, b.parameters(), step)
        assert params_digest(a) == params_digest(b)
    assert params_digest(a) != params_digest(build_stage(TINY, 0))


@pytest.mark.parametrize("kind", KINDS)
def test_steps_do_not_depend_on_the_thread_count(kind: str, num_threads: Callable[[int], None]) -> None:
    # Peers run with different --threads. Tensors this large are reduced in parallel chunks,
    # so this checks that the norms (clipping, LAMB's trust ratio) do not depend on the count.
    spec = TrainingSpec(optimizer=kind, clip_norm=1.0, warmup_steps=0)
    layers = [nn.Linear(600, 700), nn.Linear(600, 700)]
    layers[1].load_state_dict(layers[0].state_dict())
    optimizers = [build_optimizer(spec, layer) for layer in layers]
    for step in range(3):
        grads = _grads(layers[0], seed=step, scale=3.0)
        for layer, optimizer, threads in zip(layers, optimizers, (1, 4)):
            num_threads(threads)
            _set_grads(layer, grads)
            apply_step(optimizer, spec, layer.parameters(), step)
        assert params_digest(layers[0]) == params_digest(layers[1])


# ---- handing the optimizer state over ------------------------------------------------------------


def _over_the_wire(tensors: dict[str, Tensor], meta: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """What a joining peer receives: one data-plane frame, encoded and decoded."""
    frame = decode_frame(encode_frame("optimizer-state", meta, tensors), WireLimits(max_tensors=1024))
    return frame.tensors, frame.meta


@pytest.mark.parametrize("kind", KINDS)
def test_state_hand_over_continues_bit_identically(kind: str) -> None:
    spec = TrainingSpec(optimizer=kind, warmup_steps=2, total_steps=20)
    sender, sender_opt = _stepped(spec, steps=4)
    tensors, meta = optimizer_state_tensors(sender_opt)

    # The joining peer stepped once on its own before (its state must be replaced), then
    # receives the sender's parameters and optimizer state.
    joiner, joiner_opt = _stepped(spec, steps=1)
    with torch.no_grad():
        for mine, theirs in zip(joiner.parameters(), sender.parameters()):
            mine.copy_(theirs)
    load_optimizer_state_tensors(joiner_opt, *_over_the_wire(tensors, meta))
    for step in range(4, 8):
        grads = _grads(sender, seed=step)
        _set_grads(sender, grads)
        _set_grads(joiner, grads)
        apply_step(sender_opt, spec, sender.parameters(), step)
        apply_step(joiner_opt, spec, joiner.parameters(), step)
        assert params_digest(joiner) == params_digest(sender)
    # And the state itself matches, bit for bit.
    after_tensors, after_meta = optimizer_state_tensors(joiner_opt)
    sender_tensors, sender_meta = optimizer_state_tensors(sender_opt)
    assert after_meta == sender_meta
    assert after_tensors.keys() == sender_tensors.keys()
    assert all(torch.equal(after_tensors[k], sender_tensors[k]) for k in after_tensors)


@pytest.mark.parametrize("kind", KINDS)
def test_state_tensors_are_named_copies_with_plain_meta(kind: str) -> None:
    spec = TrainingSpec(optimizer=kind)
    module, optimizer = _stepped(spec, steps=2)
    tensors, meta = optimizer_state_tensors(optimizer)
    n_params = len(list(module.parameters()))
    keys = {"exp_avg", "exp_avg_sq", "step"} if kind == "adamw" else {"exp_avg", "exp_avg_sq"}
    assert set(tensors) == {f"state.{i}.{k}" for i in range(n_params) for k in keys}
    if kind == "adamw":
        assert tensors["state.0.step"].dim() == 0 and float(tensors["state.0.step"]) == 2.0
        assert meta["state"] == {}
    else:
        assert meta["state"] == {str(i): {"step": 2} for i in range(n_params)}
    assert meta["format"] == STATE_FORMAT
    assert meta["optimizer"] == ("AdamW" if kind == "adamw" else "Lamb")
    assert [g["params"] for g in meta["param_groups"]][0][0] == 0
    assert msgpack.unpackb(msgpack.packb(meta)) == meta  # lists, not tuples: survives msgpack
    # Copies: the optimizer keeps stepping while the snapshot is being sent.
    snapshot = tensors["state.0.exp_avg"].clone()
    _set_grads(module, _grads(module, seed=9))
    apply_step(optimizer, spec, module.parameters(), 2)
    assert torch.equal(tensors["state.0.exp_avg"], snapshot)
    assert all(t.is_contiguous() for t in tensors.values())


def _mutations(kind: str) -> list[tuple[str, Callable[[dict[str, Tensor], dict[str, Any]], None], str]]:
    def drop(name: str) -> Callable[[dict[str, Tensor], dict[str, Any]], None]:
        return lambda t, m: t.pop(name)

    def put(name: str, value: Any) -> Callable[[dict[str, Tensor], dict[str, Any]], None]:
        return lambda t, m: t.__setitem__(name, value)

    def meta(key: str, value: Any) -> Callable[[dict[str, Tensor], dict[str, Any]], None]:
        return lambda t, m: m.__setitem__(key, value)

    def group(key: str, value: Any) -> Callable[[dict[str, Tensor], dict[str, Any]], None]:
        return lambda t, m: m["param_groups"][0].__setitem__(key, value)

    cases = [
        ("missing tensor", drop("state.2.exp_avg_sq"), "parameter 2 lacks exp_avg_sq"),
        ("unknown key", put("state.2.momentum", torch.zeros(1)), "'state.2.momentum' is not part"),
        ("bad name", put("exp_avg.2", torch.zeros(1)), "not an optimizer state tensor name"),
        ("leading zero", put("state.02.exp_avg", torch.zeros(1)), "not an optimizer state tensor name"),
        ("index out of range", put("state.99.exp_avg", torch.zeros(1)), "parameter 99, but this optimizer has 14"),
        ("wrong shape", put("state.0.exp_avg", torch.zeros(3, 3)), r"is torch.float32 \[3, 3\], but its parameter"),
        ("wrong dtype", lambda t, m: t.__setitem__("state.0.exp_avg", t["state.0.exp_avg"].half()), "torch.float16"),
        ("non-finite", lambda t, m: t["state.1.exp_avg_sq"].view(-1)[0].fill_(math.nan), "non-finite"),
        ("not a tensor", put("state.0.exp_avg", [0.0]), "not a tensor"),
        ("format", meta("format", "other/9"), "format 'other/9'"),
        ("no meta state", meta("state", None), "no 'state' map"),
        ("groups", meta("param_groups", []), "0 parameter groups, this optimizer has 2"),
        ("other settings", group("eps", 1e-3), "eps=0.001 but this optimizer has 1e-08"),
        ("group keys", group("nesterov", True), "unknown: nesterov"),
        ("numbering", group("params", [1, 0, 2, 3, 4, 5]), "numbers its parameters differently"),
        ("learning rate", group("lr", "fast"), "invalid learning rate 'fast'"),
        ("meta index", lambda t, m: m["state"].__setitem__("x", {}), "names no parameter"),
    ]
    if kind == "adamw":
        cases += [
            ("step shape", put("state.0.step", torch.ones(2)), "must be a 0-d floating point tensor"),
            ("negative step", put("state.0.step", torch.tensor(-1.0)), "negative step count"),
            ("lamb state", meta("optimizer", "Lamb"), "'Lamb' state; it cannot be loaded into a AdamW"),
        ]
    else:
        cases += [
            ("step not int", lambda t, m: m["state"]["0"].__setitem__("step", 2.0), "non-negative integer, got 2.0"),
            ("step bool", lambda t, m: m["state"]["0"].__setitem__("step", True), "non-negative integer, got True"),
            ("missing step", lambda t, m: m["state"]["3"].pop("step"), "parameter 3 lacks step"),
            ("step as tensor", put("state.0.step", torch.tensor(1.0)), "'state.0.step' is not part"),
        ]
    return cases


@pytest.mark.parametrize("kind", KINDS)
def test_loading_refuses_bad_state_and_changes_nothing(kind: str) -> None:
    spec = TrainingSpec(optimizer=kind)
    _, sender_opt = _stepped(spec, steps=1)
    receiver = build_stage(TINY, 0)
    receiver_opt = build_optimizer(spec, receiver)
    for label, mutate, message in _mutations(kind):
        tensors, meta = optimizer_state_tensors(sender_opt)
        mutate(tensors, meta)
        with pytest.raises(ValueError, match=message):
            load_optimizer_state_tensors(receiver_opt, tensors, meta)
        assert receiver_opt.state_dict()["state"] == {}, label


def test_loading_refuses_another_stage_or_optimizer() -> None:
    adamw = TrainingSpec(optimizer="adamw")
    _, stage0_opt = _stepped(adamw, stage=0, steps=1)
    tensors, meta = optimizer_state_tensors(stage0_opt)
    stage1 = build_optimizer(adamw, build_stage(TINY, 1))
    with pytest.raises(ValueError, match="numbers its parameters differently"):
        load_optimizer_state_tensors(stage1, tensors, meta)
    lamb = build_optimizer(TrainingSpec(optimizer="lamb"), build_stage(TINY, 0))
    with pytest.raises(ValueError, match="'AdamW' state; it cannot be loaded into a Lamb"):
        load_optimizer_state_tensors(lamb, tensors, meta)
    with pytest.raises(TypeError, match="only the AdamW and Lamb"):
        load_optimizer_state_tensors(torch.optim.SGD(build_stage(TINY, 0).parameters()), tensors, meta)


def test_a_fresh_state_hands_over_as_empty() -> None:
    spec = TrainingSpec()
    fresh = build_optimizer(spec, build_stage(TINY, 0))
    tensors, meta = optimizer_state_tensors(fresh)
    assert tensors == {} and meta["state"] == {}
    _, stepped = _stepped(spec, steps=1)
    load_optimizer_state_tensors(stepped, tensors, meta)
    assert stepped.state_dict()["state"] == {}


# ---- learning ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "lr"), [("adamw", 1e-2), ("lamb", 1e-1)])
def test_a_tiny_model_learns_a_fixed_batch_with_one_optimizer_per_stage(kind: str, lr: float) -> None:
    spec = TrainingSpec(optimizer=kind, lr=lr, warmup_steps=3, total_steps=20)
    model = FullModel(MINI)
    optimizers = [build_optimizer(spec, stage) for stage in model.stages]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MINI.vocab_size, (4, MINI.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for step in range(20):
        loss = model(inputs, targets)
        losses.append(float(loss.detach()))
        loss.backward()
        for stage, optimizer in zip(model.stages, optimizers):
            assert math.isfinite(apply_step(optimizer, spec, stage.parameters(), step))
    assert losses[-1] < 0.6 * losses[0], losses
