"""all_finite: the same answer as ``torch.isfinite(t).all()``, for every bit pattern and dtype; strict JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmd.finite import all_finite, strict_json, strict_json_dumps

# Any float32 bit pattern: NaN, +-inf, subnormals, and values near float32's maximum whose sum
# overflows (the case where the fast test alone would be wrong and the exact one must run).
FLOATS = st.one_of(st.floats(width=32), st.sampled_from([3.0e38, -3.0e38, float("inf"), float("nan")]))


@settings(max_examples=300, deadline=None)
@given(values=hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=8),
                         elements=FLOATS),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_agrees_with_isfinite(values: np.ndarray, dtype: torch.dtype) -> None:
    t = torch.from_numpy(values).to(dtype)
    assert all_finite(t) == bool(torch.isfinite(t).all())


def test_finite_values_whose_sum_overflows_are_finite() -> None:
    big = torch.full((1000,), 3.0e38)
    assert not torch.isfinite(big.sum()) and all_finite(big)
    big[500] = float("nan")
    assert not all_finite(big)


def test_tensors_that_require_grad_are_checked_without_a_graph() -> None:
    t = torch.ones(4, requires_grad=True)  # float() of such a sum warns, an error under -W error
    assert all_finite(t) and all_finite(t * 2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_and_bool_tensors_are_always_finite(dtype: torch.dtype) -> None:
    assert all_finite(torch.ones(3, dtype=dtype)) and all_finite(torch.empty(0, dtype=dtype))


def test_strict_json_writes_non_finite_numbers_as_null() -> None:
    value = {"loss": float("nan"), "curve": [1.5, float("inf"), (float("-inf"), 2)], "n": 3, "ok": True,
             "name": "NaN", "nested": {"x": float("nan")}}
    text = strict_json_dumps(value)
    assert json.loads(text) == {"loss": None, "curve": [1.5, None, [None, 2]], "n": 3, "ok": True, "name": "NaN",
                                "nested": {"x": None}}
    assert "NaN" not in text.replace('"NaN"', "") and "Infinity" not in text
    assert strict_json(value)["curve"][0] == 1.5 and value["loss"] != value["loss"]  # the input is left as it was


def test_strict_json_dumps_refuses_what_it_cannot_see_into() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError):
        strict_json_dumps({"x": Opaque()})  # not JSON at all: json's own error, no silent str()
    with pytest.raises(ValueError):
        strict_json_dumps({"x": Opaque()}, default=lambda o: float("nan"))  # a NaN slipped past: refused
