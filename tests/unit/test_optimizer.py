"""Stage-wide steps (build_optimizer, apply_step, LAMB) and the optimizer-state hand-over.

The property everything here protects: peers of one stage that start from the same
parameters and apply the same averaged gradients stay bit-identical, step after step, and
across a hand-over of the optimizer state to a joining peer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
from torch import Tensor, nn

from swarmd.net.wire import WireLimits, decode_frame, encode_frame
from swarmd.pipeline.model import FullModel, StageModule, build_stage, params_digest
from swarmd.pipeline.stage.optimizer import Lamb, apply_step, build_optimizer
from swarmd.pipeline.stage.optimizer_state import STATE_FORMAT, load_optimizer_state_tensors, optimizer_state_tensors
from swarmd.pipeline.spec import PRESETS, ModelSpec, TrainingSpec

TINY = PRESETS["tiny"]
# Smaller than tiny, for the tests that train: a few milliseconds per step.
MINI = ModelSpec(
    name="mini", d_model=32, n_heads=2, d_ff=64, layers_per_stage=1, n_stages=2,
    vocab_size=32, seq_len=16,
)
KINDS = ("adamw", "lamb")


def _grads(module: nn.Module, seed: int, scale: float = 1.0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) * scale for p in module.parameters()]


def _set_grads(module: nn.Module, grads: list[Tensor]) -> None:
    for param, grad in zip(module.parameters(), grads, strict=True):
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
    attn: Any = module.blocks[0].attn  # a module: mypy sees Tensor | Module
    assert {id(module.wte.weight), id(attn.c_attn.weight)} <= {id(p) for p in decay["params"]}
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
    for old, new in zip(before, module.parameters(), strict=True):
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
        build_optimizer(spec, [module.wte.weight, module.wte.weight])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(spec, [module.wpe.weight])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got an item of type str"):
        build_optimizer(spec, ["wte"])  # type: ignore[arg-type]


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
    torch.testing.assert_close(
        _lamb_step([[3.0, 4.0]], [[1.0, 0.0]]), torch.tensor([[3.0 - 0.1 * 5 * u0 / u0, 4.0]], dtype=torch.float64)
    )
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
            Lamb([p], **kwargs)


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
        for layer, optimizer, threads in zip(layers, optimizers, (1, 4), strict=True):
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
        for mine, theirs in zip(joiner.parameters(), sender.parameters(), strict=True):
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
        def mutate(t: dict[str, Tensor], m: dict[str, Any]) -> None:
            t.pop(name)

        return mutate

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
        for stage, optimizer in zip(model.stages, optimizers, strict=True):
            assert math.isfinite(apply_step(optimizer, spec, stage.parameters(), step))
    assert losses[-1] < 0.6 * losses[0], losses
