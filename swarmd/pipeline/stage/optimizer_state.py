"""The optimizer's state as named tensors, so a joining peer continues bit-identically.

In SWARM (Ryabinin et al., 2023, section 3.2) a peer that joins a stage, or moves to a busier
one (section 3.3), takes over the state of a peer already serving it: the parameters *and* the
optimizer statistics (Adam moments, step counts), since a fresh optimizer would step
differently from its stage-mates and the stage would drift apart. This module turns an
optimizer of :func:`swarmd.pipeline.stage.optimizer.build_optimizer` into named tensors plus
msgpack-able meta (:func:`optimizer_state_tensors`) and back (:func:`load_optimizer_state_tensors`);
:mod:`swarmd.net.state_transfer` streams them together with the parameters.

What arrives came from the network: the loader checks every name, index, shape, dtype and
value against the live optimizer before it changes anything, and a problem is a
:class:`ValueError` with a sentence, never a half-loaded state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from swarmd.pipeline.stage.optimizer import Lamb

__all__ = ["STATE_FORMAT", "load_optimizer_state_tensors", "optimizer_state_tensors"]

#: The ``format`` entry of :func:`optimizer_state_tensors`' meta; bumped if the layout changes.
STATE_FORMAT = "swarmd.optimizer_state/1"

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
    for i, (live, saved) in enumerate(zip(live_groups, saved_groups, strict=True)):
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

    The optimizer must be built by :func:`~swarmd.pipeline.stage.optimizer.build_optimizer` from the
    same :class:`~swarmd.pipeline.spec.TrainingSpec` over the same module, and its parameters must already hold the
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
