"""Token ids travel in the narrowest integer dtype that holds them, and arrive as int64 (issue 30)."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import RequestError, UnsupportedDtype
from swarmd.net.messages import BackwardRequest, ForwardRequest, StageTarget
from swarmd.net.token_ids import narrow, widen
from swarmd.net.wire import decode_frame, encode_frame
from swarmd.pipeline.model import build_stage
from swarmd.pipeline.spec import PRESETS

TARGET = StageTarget(stage=0, model="d" * 64)


@pytest.mark.parametrize(
    ("low", "high", "dtype"),
    [(0, 255, torch.uint8), (0, 256, torch.int16), (-1, 3, torch.int16), (0, 32767, torch.int16),
     (0, 32768, torch.int32), (0, 50256, torch.int32), (-(2**31), 2**31 - 1, torch.int32),
     (0, 2**31, torch.int64), (-(2**63), 2**63 - 1, torch.int64)],
)
def test_narrow_picks_the_narrowest_dtype_holding_every_value(low: int, high: int, dtype: torch.dtype) -> None:
    ids = torch.tensor([[low, high], [high, low]], dtype=torch.int64)
    sent = narrow(ids)
    assert sent.dtype == dtype
    back = widen(sent)
    assert back is not None and back.dtype == torch.int64 and torch.equal(back, ids)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40))
def test_narrow_then_widen_is_exact(values: list[int]) -> None:
    ids = torch.tensor(values, dtype=torch.int64)
    back = widen(narrow(ids))
    assert back is not None and back.dtype == torch.int64 and torch.equal(back, ids)


def test_narrow_leaves_other_tensors_alone() -> None:
    floats, flags, empty = torch.randn(3), torch.tensor([True, False]), torch.empty(0, 4, dtype=torch.int64)
    assert narrow(floats) is floats and narrow(flags) is flags and narrow(empty) is empty
    assert widen(floats) is floats and widen(flags) is flags and widen(None) is None


def test_a_byte_level_forward_sends_one_byte_per_id_and_the_stage_reads_int64() -> None:
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    body = ForwardRequest(stage=0, inputs=ids, targets=ids, codec="4bit", mb=1).encode()
    raw = msgpack.unpackb(body)
    assert {t["n"]: t["d"] for t in raw["tensors"]} == {"inputs": "uint8", "targets": "uint8"}
    assert all(len(t["p"]) == ids.numel() for t in raw["tensors"])
    wide = ForwardRequest(stage=0, inputs=ids, targets=ids, codec="4bit", mb=1)
    assert len(body) < len(encode_frame("forward", {"stage": 0}, {"inputs": wide.inputs, "targets": ids})) / 4
    got = ForwardRequest.from_frame(decode_frame(body), TARGET)
    assert got.inputs.dtype == torch.int64 and torch.equal(got.inputs, ids)
    assert got.targets is not None and got.targets.dtype == torch.int64 and torch.equal(got.targets, ids)


def test_a_backward_resending_ids_sends_them_narrow() -> None:
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    body = BackwardRequest(stage=0, inputs=ids, grad_outputs=torch.randn(2, 16, 4), targets=ids, mb=3).encode()
    assert {t["n"]: t["d"] for t in msgpack.unpackb(body)["tensors"]}["inputs"] == "int16"
    got = BackwardRequest.from_frame(decode_frame(body), TARGET)
    assert got.inputs is not None and got.inputs.dtype == torch.int64 and torch.equal(got.inputs, ids)
    assert got.targets is not None and got.targets.dtype == torch.int64


def test_ids_in_a_dtype_the_wire_does_not_carry_are_refused() -> None:
    body = encode_frame("forward", {"stage": 0}, {"inputs": torch.zeros(2, 4, dtype=torch.int16)})
    raw = msgpack.unpackb(body)
    raw["tensors"][0]["d"] = "int8"
    with pytest.raises(UnsupportedDtype) as caught:
        decode_frame(msgpack.packb(raw))
    assert caught.value.http_status == 422


def test_the_first_stage_still_refuses_ids_that_are_not_integers_or_out_of_range() -> None:
    stage = build_stage(PRESETS["tiny"], 0)
    for bad in (torch.zeros(2, 4, dtype=torch.bool), torch.zeros(2, 4)):
        got = ForwardRequest.from_frame(decode_frame(ForwardRequest(stage=0, inputs=bad).encode()), TARGET)
        with pytest.raises(RequestError):
            stage.check_inputs(got.inputs)
    too_big = torch.full((2, 4), PRESETS["tiny"].vocab_size, dtype=torch.int64)
    got = ForwardRequest.from_frame(decode_frame(ForwardRequest(stage=0, inputs=too_big).encode()), TARGET)
    assert got.inputs.dtype == torch.int64
    with pytest.raises(RequestError):
        stage.check_inputs(got.inputs)
