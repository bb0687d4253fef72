"""What every rotated-block codec (``4bit``, ``2bit``, ``3bit``, ``5level``) refuses, one contract for
all of them: side data that does not fit the payload, a payload for another shape, integer tensors,
block sizes it does not know, frames over the wire limits, random hostile bytes; and its encoding
is deterministic (the leader encodes a mean once and contributors re-derive the same bytes).

Each codec's own properties (bounds, packing, frame sizes) are in its ``test_codec_<name>.py``.
"""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import LimitExceeded, MalformedFrame, UnsupportedDtype
from swarmd.net.codecs import CODECS, EncodedTensor
from swarmd.net.limits import WireLimits
from swarmd.net.wire import decode_frame, encode_frame

ROTATED = ("4bit", "2bit", "3bit", "5level")
SHAPE = (3, 50)  # 150 values: several blocks and a short tail at every default block size


def _valid(name: str, shape: tuple[int, ...] = SHAPE) -> EncodedTensor:
    enc = CODECS[name].encode(torch.randn(shape))
    return EncodedTensor(bytes(enc.payload), enc.absmax, enc.blocksize)


def _scale_bytes(enc: EncodedTensor) -> int:
    """Bytes of one block's scale: the side data holds one per block (the tail is a block)."""
    assert enc.absmax is not None and enc.blocksize is not None
    return len(enc.absmax) // math.ceil(math.prod(SHAPE) / enc.blocksize)


def _unknown_blocksizes(name: str, blocksize: int) -> list[int]:
    known = type(CODECS[name]).blocksizes
    sizes = [0, 8, 48, 100, 2 * max(known), 4096, -blocksize, 2**70]
    return [s for s in sizes if s not in known]


def _side_data_cases() -> list[tuple[str, bytes | None, int | None, str]]:
    cases = []
    for name in ROTATED:
        enc = _valid(name)
        assert enc.absmax is not None and enc.blocksize is not None
        n, one, b = len(enc.absmax), _scale_bytes(enc), enc.blocksize
        cases += [
            (name, None, b, "absmax"),
            (name, b"\x00" * n, None, "blocksize"),
            (name, b"", b, "absmax bytes"),
            (name, b"\x00" * (n - one), b, "absmax bytes"),  # a block's scale missing
            (name, b"\x00" * (n + one), b, "absmax bytes"),  # one too many
            (name, b"\x00" * (2 * n), b, "absmax bytes"),  # scales of twice the width (float32 vs 16)
        ]
        cases += [(name, b"\x00" * n, size, "blocksize must be one of") for size in _unknown_blocksizes(name, b)]
    return cases


@pytest.mark.parametrize("name", ROTATED)
def test_encoding_is_deterministic(name: str) -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    first, again = CODECS[name].encode(t), CODECS[name].encode(t.clone())
    assert bytes(first.payload) == bytes(again.payload) and first.absmax == again.absmax


@pytest.mark.parametrize(("name", "absmax", "blocksize", "match"), _side_data_cases())
def test_side_data_is_checked(name: str, absmax: bytes | None, blocksize: int | None, match: str) -> None:
    payload = _valid(name).payload
    with pytest.raises(MalformedFrame, match=match):
        CODECS[name].decode(EncodedTensor(payload, absmax, blocksize), torch.float32, SHAPE)


@pytest.mark.parametrize("name", ROTATED)
@pytest.mark.parametrize("shape", [(3, 60), (2, 50), (200,), (0,), (-3, -50)])
def test_payload_for_another_shape(name: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(MalformedFrame):
        CODECS[name].decode(_valid(name), torch.float32, shape)


@pytest.mark.parametrize("name", ROTATED)
def test_integers_are_refused(name: str) -> None:
    with pytest.raises(TypeError, match="codec 'none'"):
        CODECS[name].encode(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(UnsupportedDtype, match="codec 'none'"):
        CODECS[name].decode(_valid(name), torch.int32, SHAPE)


@pytest.mark.parametrize("name", ROTATED)
def test_the_codec_refuses_an_unknown_blocksize(name: str) -> None:
    kind = type(CODECS[name])
    for size in _unknown_blocksizes(name, kind.default_blocksize):
        if size > 0 and size < 2**63:
            with pytest.raises(ValueError, match="blocksize"):
                kind(size)


@pytest.mark.parametrize("name", ROTATED)
def test_wire_limits_apply_before_decoding(name: str) -> None:
    """A frame declaring more elements than the peer allows is refused before anything is built."""
    frame = encode_frame("average", {}, {"x": torch.randn(10, 100)}, name)
    with pytest.raises(LimitExceeded, match="elements"):
        decode_frame(frame, WireLimits(max_elements=999))
    assert decode_frame(frame, WireLimits(max_elements=1000)).tensors["x"].shape == (10, 100)


@pytest.mark.parametrize("name", ROTATED)
@settings(max_examples=60, deadline=None)
@given(payload=st.binary(max_size=80), absmax=st.binary(max_size=16), blocksize=st.integers(-10, 2000),
       shape=st.lists(st.integers(0, 40), max_size=3))
def test_hostile_side_data_raises_only_malformed_frame(name: str, payload: bytes, absmax: bytes, blocksize: int,
                                                       shape: list[int]) -> None:
    try:
        out = CODECS[name].decode(EncodedTensor(payload, absmax, blocksize), torch.float32, tuple(shape))
    except MalformedFrame:
        return
    assert tuple(out.shape) == tuple(shape)


@pytest.mark.parametrize("name", ROTATED)
@pytest.mark.parametrize("field", ["a", "b", "p"])
def test_a_tampered_frame_is_a_clear_error(name: str, field: str) -> None:
    """The same refusals through the wire layer, as a peer meets them (a 4xx, never a crash)."""
    frame = msgpack.unpackb(encode_frame("forward", {"stage": 1}, {"x": torch.randn(*SHAPE)}, name), raw=False)
    one = _scale_bytes(EncodedTensor(b"", frame["tensors"][0]["a"], frame["tensors"][0]["b"]))
    value, match = {"a": (b"\x00" * one, "absmax bytes"),  # one block's scale for a tensor of several
                    "b": (4096, "blocksize must be one of"),
                    "p": (b"\x00", "payload bytes")}[field]
    frame["tensors"][0][field] = value
    with pytest.raises(MalformedFrame, match=match) as caught:
        decode_frame(msgpack.packb(frame, use_bin_type=True))
    assert 400 <= caught.value.http_status < 500
