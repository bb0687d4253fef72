"""Stage-wide optimizer steps that keep every peer of a stage bit-identical.

SWARM (Ryabinin et al., 2023, section 3) trains each pipeline stage on a swarm of peers that
hold the *same* parameters. Section 3.2 makes the optimizer step synchronous per stage: once
the peers of a stage have processed ``target_batch_size`` samples between them, they
all-reduce their accumulated gradients and every peer applies the same optimizer step to the
averaged gradient. Nothing ever reconciles the parameters afterwards, so that step must be a
pure function of (parameters, optimizer state, averaged gradient, step number). This module is
that function:

- :func:`build_optimizer` and :func:`apply_step`: the one way a peer builds its optimizer and
  takes a step (clip, set the learning rate of
  :meth:`TrainingSpec.lr_at <swarmd.pipeline.spec.TrainingSpec.lr_at>`, step, clear the
  gradients), from the settings of :class:`~swarmd.pipeline.spec.TrainingSpec`;
- :class:`Lamb`, the second optimizer a swarm may choose besides torch's AdamW.

A joining peer takes over the optimizer's state through :mod:`swarmd.pipeline.stage.optimizer_state`.

Determinism. AdamW is built with ``foreach=False, fused=False``: torch's per-tensor
implementation, whatever the device, instead of a default that depends on where the
parameters live. On CPU the ``foreach`` path happens to give the same bits as the per-tensor
one (elementwise kernels, same operation order), but the ``fused`` CPU kernel does not: it
differs in the last bits after a few steps, so peers must not mix them, and picking one
explicitly removes the question. Gradient clipping likewise uses the per-tensor norm. Its
L2 norms (the only reductions in a step, also used by LAMB's trust ratio) give the same bits
whatever ``torch.get_num_threads()`` is, which the tests check, so peers may run with
different thread counts. Bit-identity is promised between peers running the same torch build
on the same kind of device; across CPU vector extensions or between CPU and GPU, reductions
and transcendental functions may round differently.

Delayed parameter updates (``delay_updates``: applying the step computed from batch ``t`` while
batch ``t + 1`` is already being processed with the old parameters, :mod:`swarmd.pipeline.stage.delayed_updates`)
are no concern of this module: the stage's step protocol decides when :func:`apply_step` is
called, and the step itself is the same either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from swarmd.pipeline.spec import TrainingSpec

__all__ = ["Lamb", "apply_step", "build_optimizer"]

NamedParams = Iterable[tuple[str, nn.Parameter]]
Params = nn.Module | Iterable[nn.Parameter] | NamedParams


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning", Algorithm 2).

    Per parameter tensor: Adam moments with bias correction, ``u = m_hat / (sqrt(v_hat) + eps)
    + weight_decay * p``, then ``p -= lr * trust * u`` with the trust ratio
    ``trust = ||p|| / ||u||``, or 1 when either norm is 0 (a zero-initialised bias takes a
    plain Adam-sized step instead of none). The identity scaling ``phi`` of the paper is used.
    SWARM trains with large swarm-wide batches, where the layer-wise trust ratio keeps each
    layer's relative step size in check.

    Deterministic: elementwise operations and two L2 norms per tensor, no ``foreach`` or
    fused kernels, no host synchronisation. ``state["step"]`` is a Python int, exact for any
    number of steps.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"LAMB learning rate must be non-negative, got {lr!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"LAMB betas must lie in [0, 1), got {betas!r}")
        if not eps > 0.0:
            raise ValueError(f"LAMB eps must be positive, got {eps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"LAMB weight decay must be non-negative, got {weight_decay!r}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                step: int = state["step"]
                exp_avg: Tensor = state["exp_avg"]
                exp_avg_sq: Tensor = state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(eps)
                update = (exp_avg / (1.0 - beta1**step)).div_(denom)
                if weight_decay != 0.0:
                    update.add_(param, alpha=weight_decay)
                param_norm = torch.linalg.vector_norm(param)
                update_norm = torch.linalg.vector_norm(update)
                # A tensor, not a Python float: no device-to-host sync per parameter.
                trust = torch.where(
                    (param_norm > 0) & (update_norm > 0),
                    param_norm / update_norm,
                    torch.ones_like(param_norm),
                )
                param.sub_(update.mul_(trust * lr))
        return loss


def _unique_params(params: Params) -> list[nn.Parameter]:
    """The trainable parameters of a module, of named parameters or of plain parameters."""
    items = list(params.parameters() if isinstance(params, nn.Module) else params)
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for item in items:
        param = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        if not isinstance(param, Tensor):
            raise TypeError(
                "build_optimizer takes a module, parameters or (name, parameter) pairs, "
                f"got an item of type {type(item).__name__}"
            )
        if id(param) in seen:
            raise ValueError("the same parameter was given twice; each may appear once")
        seen.add(id(param))
        if param.requires_grad:
            out.append(param)  # type: ignore[arg-type]
    if not out:
        raise ValueError("build_optimizer was given no trainable parameters")
    return out


def build_optimizer(spec: TrainingSpec, params: Params) -> torch.optim.Optimizer:
    """The optimizer ``spec`` asks for, over ``params`` (a module, parameters or named ones).

    Two parameter groups, in this order: parameters with two or more dimensions (matrices
    and embeddings) decay with ``spec.weight_decay``; the others (biases, LayerNorm) do not,
    the GPT-2/nanoGPT convention. Groups keep the order of ``params``, and an empty group is
    left out; since every peer of a stage builds the same module, every peer numbers the
    parameters (and so the state of
    :func:`~swarmd.pipeline.stage.optimizer_state.optimizer_state_tensors`) alike. Parameters that
    do not require gradients are left out. The initial learning rate is ``spec.lr_at(0)``,
    though :func:`apply_step` sets it before every step anyway.
    """
    trainable = _unique_params(params)
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups: list[dict[str, Any]] = [
        {"params": group, "weight_decay": weight_decay}
        for group, weight_decay in ((decay, spec.weight_decay), (no_decay, 0.0))
        if group
    ]
    betas = (spec.beta1, spec.beta2)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(
            groups, lr=spec.lr_at(0), betas=betas, eps=spec.eps, foreach=False, fused=False
        )
    return Lamb(groups, lr=spec.lr_at(0), betas=betas, eps=spec.eps)


def _grad_norm(grads: list[Tensor]) -> Tensor:
    """The L2 norm of all gradients together, as ``torch.nn.utils.clip_grad_norm_`` computes it
    with ``foreach=False``: the norm of the per-tensor norms."""
    if not grads:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g.detach(), 2.0) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)


def apply_step(
    optimizer: torch.optim.Optimizer,
    spec: TrainingSpec,
    params: Iterable[nn.Parameter],
    step: int,
) -> float:
    """Take the swarm's update number ``step``, given that each ``param.grad`` holds the
    averaged gradient (the mean over the step's samples). Returns the gradient's norm
    before clipping.

    In order: the L2 norm of the gradients of ``params``; if ``spec.clip_norm > 0``, scale
    them by ``min(1, clip_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s formula); set every
    group's learning rate to ``spec.lr_at(step)``; ``optimizer.step()``; clear every
    gradient (``zero_grad(set_to_none=True)``). The clipping is written out rather than
    delegated to ``clip_grad_norm_`` so that the norm is computed once, on the per-tensor
    path whatever torch's ``foreach`` default is, and the same value is both checked and
    used (the tests check it gives ``clip_grad_norm_(..., foreach=False)``'s bits).

    A non-finite norm (an overflowed gradient, or a NaN that an all-reduce spread to every
    peer) skips the update: the parameters and the optimizer state are left untouched, the
    gradients are cleared and the non-finite norm is returned. Every peer of the stage holds
    the same averaged gradient and so skips the same step; whether the caller still counts
    ``step`` as taken is up to it, as long as all peers do the same.
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    norm = _grad_norm(grads)
    norm_value = float(norm)
    if not math.isfinite(norm_value):
        optimizer.zero_grad(set_to_none=True)
        return norm_value
    if spec.clip_norm > 0:
        coef = torch.clamp(spec.clip_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.detach().mul_(coef.to(grad.device))
    lr = spec.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm_value
