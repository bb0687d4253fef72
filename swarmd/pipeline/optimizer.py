"""Stage-wide optimizer steps that keep every peer of a stage bit-identical.

SWARM (Ryabinin et al., 2023, section 3) trains each pipeline stage on a swarm of peers that
hold the *same* parameters. Section 3.2 makes the optimizer step synchronous per stage: once
the peers of a stage have processed ``target_batch_size`` samples between them, they
all-reduce their accumulated gradients and every peer applies the same optimizer step to the
averaged gradient. Nothing ever reconciles the parameters afterwards, so that step must be a
pure function of (parameters, optimizer state, averaged gradient, step number). This module is
that function and its inputs:

- :class:`TrainingSpec`: the training settings every peer reads from the swarm's DHT record
  (a map of str keys to scalars), validated and digestible like
  :class:`~swarmd.pipeline.spec.ModelSpec`;
- :meth:`TrainingSpec.lr_at`: the learning-rate schedule as a pure function of the global
  step, so no scheduler object can drift out of step with the swarm (or never be stepped);
- :func:`build_optimizer` and :func:`apply_step`: the one way a peer builds its optimizer and
  takes a step (clip, set the learning rate, step, clear the gradients);
- :func:`optimizer_state_tensors` / :func:`load_optimizer_state_tensors`: the optimizer state
  as named tensors plus msgpack-able meta, so a peer joining a stage (section 3.3, a peer
  moving to a busier stage) can take over the exact state of a peer already serving it.

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

Delayed parameter updates (``delay_updates``, the paper's section 3.2 option of applying the
step computed from batch ``t`` while batch ``t + 1`` is already being processed with the old
parameters) are only a setting here: the stage's training loop decides when to call
:func:`apply_step`, and the step itself is the same either way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Union

import torch
from torch import Tensor, nn

from swarmd.errors import ConfigError

__all__ = [
    "DIGEST_VERSION",
    "GRAD_CODECS",
    "OPTIMIZERS",
    "SCHEDULES",
    "STATE_FORMAT",
    "Lamb",
    "TrainingSpec",
    "apply_step",
    "build_optimizer",
    "load_optimizer_state_tensors",
    "optimizer_state_tensors",
]

#: Bumped whenever the digest's canonical form changes; hashed in front of the payload.
DIGEST_VERSION = "swarmd.TrainingSpec/2"  # /2: grad_codec
#: The ``format`` entry of :func:`optimizer_state_tensors`' meta; bumped if the layout changes.
STATE_FORMAT = "swarmd.optimizer_state/1"

OPTIMIZERS: tuple[str, ...] = ("adamw", "lamb")
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
#: How a stage's averaging traffic carries gradients (codecs of ``swarmd.net.codecs``).
GRAD_CODECS: tuple[str, ...] = ("none", "fp16", "8bit")

Scalar = Union[bool, int, float, str]
NamedParams = Iterable[tuple[str, nn.Parameter]]
Params = Union[nn.Module, Iterable[nn.Parameter], NamedParams]

# Inclusive (minimum, maximum) of each integer field. As in ModelSpec, the maxima only turn
# typos (a few extra zeros) into a clear error.
_INT_BOUNDS: Mapping[str, tuple[int, int]] = MappingProxyType(
    {
        "target_batch_size": (1, 2**24),
        "warmup_steps": (0, 10**9),
        "total_steps": (1, 10**9),
    }
)

# (minimum, maximum, minimum excluded, maximum excluded) of each float field.
_FLOAT_BOUNDS: Mapping[str, tuple[float, float, bool, bool]] = MappingProxyType(
    {
        "lr": (0.0, 10.0, True, False),
        "beta1": (0.0, 1.0, False, True),
        "beta2": (0.0, 1.0, False, True),
        "eps": (0.0, 1.0, True, False),
        "weight_decay": (0.0, 1.0, False, False),
        "min_lr_ratio": (0.0, 1.0, False, False),
        "clip_norm": (0.0, 1e6, False, False),
        "averaging_timeout_s": (0.0, 3600.0, True, False),
    }
)

_CHOICES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"optimizer": OPTIMIZERS, "schedule": SCHEDULES, "grad_codec": GRAD_CODECS}
)


@dataclass(frozen=True)
class TrainingSpec:
    """How a swarm trains: batch size, optimizer, schedule, clipping, averaging.

    Every field is validated on construction, so a ``TrainingSpec`` that exists is usable.
    Float fields also accept ints (``lr=1`` becomes ``1.0``), so a value that went through
    JSON or a hand-written config has the same digest as the float it means.
    """

    target_batch_size: int = 32  # samples per optimizer step, over the whole swarm
    optimizer: str = "adamw"  # one of OPTIMIZERS
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01  # applied to parameters with two or more dimensions only
    warmup_steps: int = 10
    schedule: str = "cosine"  # one of SCHEDULES; see lr_at
    total_steps: int = 10_000
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0  # max L2 norm of a stage's gradient; 0 disables clipping
    delay_updates: bool = False  # the paper's delayed parameter updates (a flag here)
    averaging_timeout_s: float = 30.0  # a stage's all-reduce gives up on missing peers after this
    # codec of the gradients a stage's peers send to the round's leader and of the mean it sends
    # back (one of GRAD_CODECS). Lossy codecs keep the peers bit-identical: the leader encodes
    # the mean once and every peer, the leader included, applies the decoded mean.
    grad_codec: str = "none"

    def __post_init__(self) -> None:
        for name, (low, high) in _INT_BOUNDS.items():
            value = getattr(self, name)
            # bool is a subclass of int; `true` for a step count is a typo, not the number 1.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(
                    f"training field {name!r} must be an integer, got {type(value).__name__} "
                    f"{value!r}"
                )
            if not low <= value <= high:
                raise ConfigError(
                    f"training field {name!r} must be between {low} and {high}, got {value}"
                )
        for name, (low, high, low_open, high_open) in _FLOAT_BOUNDS.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(
                    f"training field {name!r} must be a number, got {type(value).__name__} "
                    f"{value!r}"
                )
            value = float(value)
            above = value > low if low_open else value >= low
            below = value < high if high_open else value <= high
            if not (math.isfinite(value) and above and below):
                interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
                raise ConfigError(f"training field {name!r} must lie in {interval}, got {value!r}")
            object.__setattr__(self, name, value)
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if not isinstance(value, str) or value not in choices:
                raise ConfigError(
                    f"training field {name!r} must be one of {', '.join(choices)}, got {value!r}"
                )
        if not isinstance(self.delay_updates, bool):
            raise ConfigError(
                "training field 'delay_updates' must be true or false, "
                f"got {type(self.delay_updates).__name__} {self.delay_updates!r}"
            )
        if self.warmup_steps > self.total_steps:
            raise ConfigError(
                f"training warmup_steps={self.warmup_steps} must not exceed "
                f"total_steps={self.total_steps}"
            )

    @property
    def digest(self) -> str:
        """Stable SHA-256 hex of every field: equal digests mean identical training settings.

        The payload is canonical JSON (sorted keys, no whitespace, ASCII) of the scalars from
        :meth:`to_dict`, prefixed with :data:`DIGEST_VERSION`. Floats are written as Python's
        shortest round-tripping repr, which does not depend on the platform.
        """
        payload = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(f"{DIGEST_VERSION}\n{payload}".encode("ascii")).hexdigest()

    def to_dict(self) -> dict[str, Scalar]:
        """Every field as an int, float, bool or str: what the swarm record's ``training`` holds."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, strict: bool = False) -> TrainingSpec:
        """Build a spec from a swarm record's ``training`` map (or a config file's).

        Missing keys take their defaults. Unknown keys are *ignored* by default, unlike
        :meth:`ModelSpec.from_dict <swarmd.pipeline.spec.ModelSpec.from_dict>`: the map comes
        from the DHT, where a newer peer may have added settings this build does not know,
        and an old peer must still be able to join. Known keys are validated as usual. An old
        peer that ignored a setting computes a different :attr:`digest` than the newer peers
        (theirs covers the new field), so comparing digests still tells the two apart. Pass
        ``strict=True`` for input a person typed, where an unknown key is a typo.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"training settings must be a mapping of names to values, got {type(d).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        if strict:
            unknown = sorted(repr(k) for k in d if k not in known)
            if unknown:
                raise ConfigError(
                    f"unknown training field(s) {', '.join(unknown)}; "
                    f"valid fields are: {', '.join(known)}"
                )
        return cls(**{name: d[name] for name in known if name in d})

    def lr_at(self, step: int) -> float:
        """Learning rate of the update that takes the parameters from ``step`` to ``step + 1``.

        With ``W = warmup_steps``, ``T = total_steps``, ``m = min_lr_ratio``:

        - warmup, ``step < W``: ``lr * ((step + 1) / W)``, so the first update already moves
          (``lr / W``) and update ``W - 1`` uses the full ``lr``;
        - afterwards, with progress ``p = min(1, (step - W) / (T - W))`` (``p = 1`` when
          ``T == W``): ``constant`` gives ``lr``; ``linear`` gives ``lr * (1 - (1 - m) * p)``;
          ``cosine`` gives ``lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)``. Both decaying
          schedules start at ``lr`` on step ``W``, reach ``m * lr`` on step ``T`` and stay
          there.

        A pure function of ``step`` rather than a scheduler object: the step number is the
        swarm's (every peer of a stage agrees on it), so a peer that joins at step 5000 needs
        no scheduler state to use the right rate.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"a training step must be a non-negative integer, got {step!r}")
        warmup, total = self.warmup_steps, self.total_steps
        if step < warmup:
            # The ratio first, so the last warmup step gives exactly lr (lr * W / W may not).
            return self.lr * ((step + 1) / warmup)
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - warmup) / (total - warmup)) if total > warmup else 1.0
        if self.schedule == "linear":
            factor = 1.0 - (1.0 - self.min_lr_ratio) * progress
        else:
            factor = self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (
                1.0 + math.cos(math.pi * progress)
            )
        # Clamped so that rounding can never leave [min_lr_ratio * lr, lr].
        return self.lr * min(1.0, max(self.min_lr_ratio, factor))


# --- building and stepping -------------------------------------------------------------------


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
    parameters (and so the state of :func:`optimizer_state_tensors`) alike. Parameters that
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


# --- handing the state over --------------------------------------------------------------------

_STATE_NAME_RE = re.compile(r"state\.(0|[1-9][0-9]*)\.(.+)", re.DOTALL)

# What each supported optimizer keeps per parameter: "param" is a tensor shaped and typed
# like the parameter, "count" a 0-d floating tensor (torch's AdamW step), "int" a Python int.
_ADAMW_LAYOUT: Mapping[str, str] = MappingProxyType(
    {"step": "count", "exp_avg": "param", "exp_avg_sq": "param"}
)
_LAMB_LAYOUT: Mapping[str, str] = MappingProxyType(
    {"step": "int", "exp_avg": "param", "exp_avg_sq": "param"}
)


def _plain(value: Any, where: str) -> Any:
    """``value`` as msgpack-able data (tuples become lists), or a ValueError saying why not."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -(2**63) <= value < 2**64:
            raise ValueError(f"{where} is an integer outside msgpack's 64-bit range")
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where} has a non-string key {key!r}")
            out[key] = _plain(item, f"{where}[{key!r}]")
        return out
    raise ValueError(
        f"{where} is a {type(value).__name__}; only None, bool, int, float, str, lists and "
        "maps can travel as meta"
    )


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The optimizer's state as named tensors plus msgpack-able meta, for a joining peer.

    Tensors are named ``state.<param index>.<key>`` (``state.3.exp_avg``; AdamW's ``step``
    is a 0-d tensor, ``state.3.step``), numbered like ``optimizer.state_dict()``: over the
    groups in order. They are contiguous copies, so the optimizer may keep stepping while
    they are sent. The meta is ``{"format": STATE_FORMAT, "optimizer": class name,
    "param_groups": [group settings with "params" as index lists], "state": {"<index>":
    {key: non-tensor value}}}`` (LAMB's int ``step`` lives there), with string keys only and
    tuples turned into lists, as the wire's meta requires.
    """
    state_dict = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        for key, value in entries.items():
            if not isinstance(key, str):
                raise ValueError(f"optimizer state of parameter {index} has a non-string key {key!r}")
            if isinstance(value, Tensor):
                tensors[f"state.{index}.{key}"] = value.detach().clone(
                    memory_format=torch.contiguous_format
                )
            else:
                where = f"optimizer state {key!r} of parameter {index}"
                scalars.setdefault(str(index), {})[key] = _plain(value, where)
    groups = [
        _plain(group, f"optimizer parameter group {i}")
        for i, group in enumerate(state_dict["param_groups"])
    ]
    meta = {
        "format": STATE_FORMAT,
        "optimizer": type(optimizer).__name__,
        "param_groups": groups,
        "state": scalars,
    }
    return tensors, meta


def _state_layout(optimizer: torch.optim.Optimizer) -> Mapping[str, str]:
    if isinstance(optimizer, Lamb):
        return _LAMB_LAYOUT
    if isinstance(optimizer, torch.optim.AdamW):
        if any(group.get("amsgrad") for group in optimizer.param_groups):
            return {**_ADAMW_LAYOUT, "max_exp_avg_sq": "param"}
        return _ADAMW_LAYOUT
    raise TypeError(
        f"cannot load state into a {type(optimizer).__name__}: only the AdamW and Lamb "
        "optimizers of build_optimizer are supported"
    )


def _check_groups(optimizer: torch.optim.Optimizer, saved_groups: Any) -> list[dict[str, Any]]:
    """The live groups with the saved learning rates, once the saved settings match them."""
    live_groups = optimizer.state_dict()["param_groups"]
    if not isinstance(saved_groups, list) or len(saved_groups) != len(live_groups):
        count = len(saved_groups) if isinstance(saved_groups, list) else "no list of"
        raise ValueError(
            f"the optimizer state has {count} parameter groups, this optimizer has "
            f"{len(live_groups)}"
        )
    out: list[dict[str, Any]] = []
    for i, (live, saved) in enumerate(zip(live_groups, saved_groups)):
        if not isinstance(saved, Mapping):
            raise ValueError(f"parameter group {i} of the optimizer state is not a map")
        missing, extra = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
        if missing or extra:
            raise ValueError(
                f"parameter group {i} of the optimizer state does not have this optimizer's "
                f"settings (missing: {', '.join(missing) or 'none'}; unknown: "
                f"{', '.join(map(str, extra)) or 'none'}); was it written by another torch "
                "version?"
            )
        if saved["params"] != live["params"]:
            raise ValueError(
                f"parameter group {i} of the optimizer state numbers its parameters "
                f"differently from this optimizer's {len(live['params'])}; it belongs to "
                "another model or stage"
            )
        for key, value in live.items():
            if key in ("lr", "params"):
                continue
            if _plain(saved[key], key) != _plain(value, key):
                raise ValueError(
                    f"parameter group {i} of the optimizer state has {key}={saved[key]!r} but "
                    f"this optimizer has {value!r}; the two peers train with different settings"
                )
        lr = saved["lr"]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(
                f"parameter group {i} of the optimizer state has an invalid learning rate {lr!r}"
            )
        out.append({**live, "lr": float(lr)})
    return out


def _check_state_tensor(name: str, kind: str, value: Tensor, param: Tensor) -> None:
    if kind == "param":
        if value.shape != param.shape or value.dtype != param.dtype:
            raise ValueError(
                f"optimizer state tensor {name!r} is {value.dtype} {list(value.shape)}, but its "
                f"parameter is {param.dtype} {list(param.shape)}; a converted copy would not "
                "step bit-identically"
            )
    elif value.dim() != 0 or not value.is_floating_point():
        raise ValueError(
            f"optimizer state tensor {name!r} must be a 0-d floating point tensor, got "
            f"{value.dtype} {list(value.shape)}"
        )
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"optimizer state tensor {name!r} holds non-finite values")
    if kind == "count" and float(value) < 0:
        raise ValueError(f"optimizer state tensor {name!r} is a negative step count")


def load_optimizer_state_tensors(
    optimizer: torch.optim.Optimizer,
    tensors: Mapping[str, Tensor],
    meta: Mapping[str, Any],
) -> None:
    """Replace ``optimizer``'s state with one from :func:`optimizer_state_tensors`.

    The optimizer must be built by :func:`build_optimizer` from the same
    :class:`TrainingSpec` over the same module, and its parameters must already hold the
    sender's values; its next :func:`apply_step` then gives the sender's bits. Everything
    is checked before anything changes, and a problem raises :class:`ValueError` with a
    sentence: another format or optimizer class, groups numbered or configured differently
    (only ``lr`` may differ), a name that is not ``state.<index>.<key>``, an index out of
    range, missing or unknown state keys, a tensor whose shape or dtype is not its
    parameter's, a non-finite value. The tensors are copied, so the caller's buffers (a
    decoded frame) are not kept.
    """
    layout = _state_layout(optimizer)
    if not isinstance(meta, Mapping) or meta.get("format") != STATE_FORMAT:
        found = meta.get("format") if isinstance(meta, Mapping) else type(meta).__name__
        raise ValueError(f"optimizer state meta has format {found!r}, expected {STATE_FORMAT!r}")
    if meta.get("optimizer") != type(optimizer).__name__:
        raise ValueError(
            f"the optimizer state is a {meta.get('optimizer')!r} state; it cannot be loaded "
            f"into a {type(optimizer).__name__}"
        )
    groups = _check_groups(optimizer, meta.get("param_groups"))
    if not isinstance(tensors, Mapping):
        raise ValueError(f"optimizer state tensors must be a map of names, got {type(tensors).__name__}")
    params = [p for group in optimizer.param_groups for p in group["params"]]

    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        match = _STATE_NAME_RE.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise ValueError(f"{name!r} is not an optimizer state tensor name (state.<index>.<key>)")
        index, key = int(match[1]), match[2]
        if index >= len(params):
            raise ValueError(
                f"optimizer state tensor {name!r} is for parameter {index}, but this optimizer "
                f"has {len(params)} parameters"
            )
        if not isinstance(value, Tensor):
            raise ValueError(f"optimizer state {name!r} is a {type(value).__name__}, not a tensor")
        if layout.get(key) not in ("param", "count"):
            raise ValueError(f"optimizer state tensor {name!r} is not part of this optimizer's state")
        _check_state_tensor(name, layout[key], value, params[index])
        state.setdefault(index, {})[key] = value.detach().clone(memory_format=torch.contiguous_format)

    scalars = meta.get("state")
    if not isinstance(scalars, Mapping):
        raise ValueError("optimizer state meta has no 'state' map")
    for index_text, entries in scalars.items():
        if not (isinstance(index_text, str) and index_text.isdigit() and int(index_text) < len(params)):
            raise ValueError(f"optimizer state meta names no parameter of this optimizer: {index_text!r}")
        if not isinstance(entries, Mapping):
            raise ValueError(f"optimizer state meta for parameter {index_text} is not a map")
        for key, value in entries.items():
            if layout.get(key) != "int":
                raise ValueError(
                    f"optimizer state meta {key!r} of parameter {index_text} is not part of "
                    "this optimizer's state"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"optimizer state meta {key!r} of parameter {index_text} must be a "
                    f"non-negative integer, got {value!r}"
                )
            state.setdefault(int(index_text), {})[key] = value

    for index, entries in sorted(state.items()):
        missing = sorted(set(layout) - set(entries))
        if missing:
            raise ValueError(
                f"the optimizer state of parameter {index} lacks {', '.join(missing)}; a "
                "parameter has either all of its state or none"
            )
    optimizer.load_state_dict({"state": state, "param_groups": groups})
