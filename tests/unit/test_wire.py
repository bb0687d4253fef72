"""Frame round trips, and every malformed or hostile frame raising its typed error (never another)."""

from __future__ import annotations

import functools
import time
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.errors import (
    LimitExceeded,
    MalformedFrame,
    SwarmdError,
    UnknownCodec,
    UnsupportedDtype,
    UnsupportedVersion,
    WireError,
)
from swarmd.net.codecs import CODECS, EIGHT_BIT_REL_ERROR
from swarmd.net.wire import (
    ALLOWED_DTYPES,
    CONTENT_TYPE,
    DEFAULT_LIMITS,
    MAX_META_DEPTH,
    WIRE_VERSION,
    Frame,
    WireLimits,
    decode_frame,
    encode_frame,
    encode_tensor,
)

META = {"stage": 2, "model": "tiny", "loss": 0.25, "ok": True, "none": None, "ids": [1, -2, 3], "blob": b"\x00\xff",
        "nested": {"a": [{"b": "c"}], "big": 2**64 - 1, "neg": -(2**63)}}


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "inputs": torch.randn(2, 3, 5000, generator=gen),
        "half": torch.randn(7, generator=gen).half(),
        "brain": torch.randn(3, 3, generator=gen).bfloat16(),
        "scalar": torch.tensor(-1.5),
        "empty": torch.empty(0, 4),
        "ids": torch.arange(-5, 5, dtype=torch.int64),
        "small": torch.tensor([1, -2], dtype=torch.int32),
        "bytes": torch.tensor([0, 255], dtype=torch.uint8),
        "mask": torch.tensor([[True, False]]),
    }


def _frame(**changes: Any) -> dict[str, Any]:
    """A valid frame as a plain dict, to be broken by the caller."""
    frame = msgpack.unpackb(encode_frame("forward", {"stage": 1}, {"x": torch.ones(2, 3)}))
    frame.update(changes)
    return frame


def _tensor_entry(**changes: Any) -> dict[str, Any]:
    entry = _frame()["tensors"][0]
    entry.update(changes)
    return {key: value for key, value in entry.items() if value is not _DROP}


_DROP = object()


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _with_entries(*entries: dict[str, Any]) -> bytes:
    return _pack(_frame(tensors=list(entries)))


def _decodes_or_raises_typed(data: bytes, limits: WireLimits = DEFAULT_LIMITS) -> None:
    """Decoding hostile bytes may succeed or raise a WireError with a message; nothing else."""
    try:
        decode_frame(data, limits)
    except WireError as exc:
        assert str(exc) and not str(exc).startswith(("'", '"'))  # a sentence, not a bare KeyError-like repr


# --- round trips ---------------------------------------------------------------------------------


def test_constants() -> None:
    assert WIRE_VERSION == 1 and CONTENT_TYPE == "application/x-msgpack"
    assert set(ALLOWED_DTYPES) == {"float32", "float16", "bfloat16", "int64", "int32", "int16", "uint8", "bool"}


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_round_trip_every_codec(codec: str) -> None:
    sent = _tensors()
    frame = decode_frame(encode_frame("forward", META, sent, codec=codec))
    assert isinstance(frame, Frame)
    assert frame.kind == "forward" and frame.meta == META
    assert list(frame.tensors) == list(sent)  # order kept
    for name, original in sent.items():
        got = frame.tensors[name]
        assert got.dtype == original.dtype and got.shape == original.shape
        if codec == "none" or not original.is_floating_point():
            assert torch.equal(got, original)
        elif original.numel():
            tol = {"fp16": 2.0**-8, "bf16": 2.0**-7, "8bit": 2 * EIGHT_BIT_REL_ERROR, "4bit": 0.2,
                   "3bit": 0.5, "2bit": 1.0, "5level": 0.8}[codec]  # per element; their real bounds:
            # test_codec_few_bits, test_codec_5level
            assert torch.allclose(got.float(), original.float(), rtol=tol, atol=tol * float(original.abs().max()))


@pytest.mark.parametrize("codec", ["fp16", "bf16", "8bit"])
def test_integer_tensors_always_travel_raw(codec: str) -> None:
    raw = msgpack.unpackb(encode_frame("k", None, _tensors(), codec=codec))
    for entry in raw["tensors"]:
        float_dtype = ALLOWED_DTYPES[entry["d"]].is_floating_point
        assert entry["c"] == (codec if float_dtype else "none")
        assert ("a" in entry) == ("b" in entry) == (float_dtype and codec == "8bit")


def test_encoding_matches_msgpack_byte_for_byte() -> None:
    data = encode_frame("forward", META, _tensors(), codec="8bit")
    assert _pack(msgpack.unpackb(data)) == data


def test_empty_frame_and_buffer_types() -> None:
    data = encode_frame("ping", None)
    for buf in (data, bytearray(data), memoryview(data)):
        assert decode_frame(buf) == Frame(kind="ping", meta={}, tensors={})


def test_encode_detaches_and_moves_to_cpu() -> None:
    x = torch.randn(3, 4, requires_grad=True) * 2
    got = decode_frame(encode_frame("k", {}, {"x": x.t()})).tensors["x"]
    assert torch.equal(got, x.detach().t()) and not got.requires_grad


def test_unknown_keys_are_ignored() -> None:
    frame = _frame(future={"anything": [1, 2, {"deep": b"x"}]}, zz=None)
    frame["tensors"][0]["extra"] = [3, 4]
    decoded = decode_frame(_pack(frame))
    assert decoded.kind == "forward" and torch.equal(decoded.tensors["x"], torch.ones(2, 3))


_meta_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(st.text(min_size=1, max_size=32), st.dictionaries(st.text(max_size=8), _meta_values, max_size=5))
def test_meta_round_trip(kind: str, meta: dict[str, Any]) -> None:
    frame = decode_frame(encode_frame(kind, meta))
    assert frame.kind == kind and frame.meta == meta


# --- encode refusals (local programming errors) --------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "meta", "tensors", "codec", "error"),
    [
        ("", {}, None, "none", TypeError),
        (b"forward", {}, None, "none", TypeError),
        ("k", {1: "x"}, None, "none", TypeError),
        ("k", {"s": {1, 2}}, None, "none", TypeError),
        ("k", {"big": 2**64}, None, "none", TypeError),
        ("k", {"t": torch.ones(1)}, None, "none", TypeError),
        ("k", {}, {"": torch.ones(1)}, "none", TypeError),
        ("k", {}, {"x": [1.0]}, "none", TypeError),
        ("k", {}, {"x": torch.ones(2, dtype=torch.float64)}, "none", UnsupportedDtype),
        ("k", {}, {"x": torch.ones(2, dtype=torch.int8)}, "none", UnsupportedDtype),
        ("k", {}, {"x": torch.ones(2)}, "zstd", UnknownCodec),
    ],
)
def test_encode_refusals(kind: Any, meta: Any, tensors: Any, codec: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        encode_frame(kind, meta, tensors, codec=codec)


def test_encode_refuses_too_deep_meta() -> None:
    deep: Any = 1
    for _ in range(MAX_META_DEPTH + 1):
        deep = [deep]
    with pytest.raises(TypeError, match="deeper"):
        encode_frame("k", {"d": deep})


# --- decode: not a frame at all ------------------------------------------------------------------


@settings(max_examples=300)
@given(st.binary(max_size=512))
def test_random_bytes_raise_wire_errors(data: bytes) -> None:
    with pytest.raises(WireError):
        decode_frame(data)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_every_truncation_is_malformed(codec: str) -> None:
    data = encode_frame("forward", {"stage": 1, "ids": [1, 2]}, {"x": torch.randn(3, 4), "i": torch.arange(3)}, codec)
    for cut in range(len(data)):
        with pytest.raises(MalformedFrame):
            decode_frame(data[:cut])


def test_truncated_large_frame_at_random_points() -> None:
    data = encode_frame("forward", META, _tensors(), codec="none")
    for cut in torch.randint(0, len(data), (200,), generator=torch.Generator().manual_seed(3)).tolist():
        with pytest.raises(MalformedFrame):
            decode_frame(data[:cut])


def test_trailing_garbage() -> None:
    with pytest.raises(MalformedFrame, match="bytes after"):
        decode_frame(encode_frame("k", {}) + b"\x00")


@pytest.mark.parametrize("top", [[], [1, 2], 1, "frame", None, b"frame", 1.5])
def test_top_level_must_be_a_map(top: Any) -> None:
    with pytest.raises(MalformedFrame, match="must be a msgpack map"):
        decode_frame(_pack(top))


@functools.cache
def _small_frame() -> bytes:
    tensors = {"f": torch.randn(2, 3), "h": torch.randn(3).half(), "i": torch.arange(3), "m": torch.tensor([True])}
    return encode_frame("fwd", {"a": [1, "b"], "c": {"d": 1.5}}, tensors, codec="8bit")


def test_every_single_bit_flip_is_decoded_or_typed() -> None:
    data = bytearray(_small_frame())
    for position in range(len(data)):
        for bit in range(8):
            data[position] ^= 1 << bit
            _decodes_or_raises_typed(bytes(data))
            data[position] ^= 1 << bit


@functools.cache
def _large_frame() -> bytes:
    return encode_frame("k", META, _tensors(), "fp16")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_corruption_is_decoded_or_typed(data: st.DataObject) -> None:
    frame = bytearray(data.draw(st.sampled_from([_small_frame(), _large_frame()])))
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] = data.draw(st.integers(0, 255))
    _decodes_or_raises_typed(bytes(frame))


# --- decode: limits ------------------------------------------------------------------------------


def test_oversized_frame_is_refused_before_unpacking() -> None:
    limits = WireLimits(max_frame_bytes=100)
    with pytest.raises(LimitExceeded, match="101 bytes"):
        decode_frame(b"\xc1" * 101, limits)  # garbage: proves the size check comes first
    decode_frame(encode_frame("k", {}), limits)


@pytest.mark.parametrize(
    "shape",
    [[2**40, 2**40], [2**27 + 1], [2**14, 2**14], [0, 2**63], [0, 2**64 - 1], [2**64 - 1] * 6],
)
def test_huge_declared_shapes_allocate_nothing(shape: list[int]) -> None:
    start = time.perf_counter()
    with pytest.raises(LimitExceeded, match="limit"):
        decode_frame(_with_entries(_tensor_entry(s=shape)))
    assert time.perf_counter() - start < 1.0


def test_too_many_tensors() -> None:
    tensors = {f"t{i}": torch.zeros(1) for i in range(DEFAULT_LIMITS.max_tensors + 1)}
    with pytest.raises(LimitExceeded, match="17 tensors"):
        decode_frame(encode_frame("k", {}, tensors))
    assert len(decode_frame(encode_frame("k", {}, tensors), WireLimits(max_tensors=17)).tensors) == 17


def test_rank_too_high() -> None:
    data = encode_frame("k", {}, {"x": torch.zeros((1,) * 7)})
    with pytest.raises(LimitExceeded, match="rank 7"):
        decode_frame(data)
    assert decode_frame(data, WireLimits(max_rank=7)).tensors["x"].shape == (1,) * 7


def test_element_count_limit() -> None:
    data = encode_frame("k", {}, {"x": torch.zeros(10, 10)})
    with pytest.raises(LimitExceeded, match="100 elements"):
        decode_frame(data, WireLimits(max_elements=99))
    decode_frame(data, WireLimits(max_elements=100))


def test_meta_too_large() -> None:
    data = encode_frame("k", {"blob": b"x" * 70_000})
    with pytest.raises(LimitExceeded, match="meta is"):
        decode_frame(data)
    with pytest.raises(LimitExceeded, match="longer than this peer accepts"):
        decode_frame(encode_frame("k", {"text": "x" * 70_000}))  # caught by msgpack's max_str_len
    decode_frame(data, WireLimits(max_meta_bytes=80_000))


def test_many_small_containers_hit_the_value_budget() -> None:
    # Under every per-container limit, but too many values in all (a small frame that would
    # otherwise expand into many Python objects).
    data = _pack(_frame(future=[[0] * 1000] * 100))
    with pytest.raises(LimitExceeded, match="entries in all"):
        decode_frame(data)


def test_kind_limits() -> None:
    with pytest.raises(LimitExceeded, match="33 characters"):
        decode_frame(encode_frame("k" * 33, {}))
    with pytest.raises(MalformedFrame, match="empty"):
        decode_frame(_pack(_frame(kind="")))


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tensors"):
        WireLimits(max_tensors=0)


# --- decode: wrong versions, fields and values ---------------------------------------------------


@pytest.mark.parametrize("version", [2, 0, -1, 2**64 - 1])
def test_unsupported_version(version: int) -> None:
    with pytest.raises(UnsupportedVersion) as info:
        decode_frame(_pack(_frame(v=version, tensors="a v2 layout this build cannot read")))
    assert f"version {version}" in str(info.value) and f"only version {WIRE_VERSION}" in str(info.value)


@pytest.mark.parametrize("key", ["v", "kind", "meta", "tensors"])
def test_missing_top_level_field(key: str) -> None:
    frame = _frame()
    del frame[key]
    with pytest.raises(MalformedFrame, match=f"no '{key}' field"):
        decode_frame(_pack(frame))


@pytest.mark.parametrize(
    ("key", "value"),
    [("v", "1"), ("v", True), ("v", 1.0), ("kind", 3), ("kind", None), ("meta", []), ("meta", None),
     ("tensors", {}), ("tensors", b"")],
)
def test_wrongly_typed_top_level_field(key: str, value: Any) -> None:
    with pytest.raises(MalformedFrame, match=f"field '{key}' must be"):
        decode_frame(_pack(_frame(**{key: value})))


@pytest.mark.parametrize("key", ["n", "d", "s", "c", "p"])
def test_missing_tensor_field(key: str) -> None:
    with pytest.raises(MalformedFrame, match=f"no '{key}' field"):
        decode_frame(_with_entries(_tensor_entry(**{key: _DROP})))


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"n": 1}, MalformedFrame, "field 'n' must be a string"),
        ({"n": ""}, MalformedFrame, "empty name"),
        ({"d": 7}, MalformedFrame, "field 'd' must be a string"),
        ({"d": "float64"}, UnsupportedDtype, "float64"),
        ({"d": "complex64"}, UnsupportedDtype, "accepts float32"),
        ({"s": 6}, MalformedFrame, "field 's' must be an array"),
        ({"s": [2, 3.0]}, MalformedFrame, "a float in its shape"),
        ({"s": [2, True]}, MalformedFrame, "a boolean in its shape"),
        ({"s": [-2, -3]}, MalformedFrame, "negative dimension"),
        ({"s": [3, 3]}, MalformedFrame, "needs 36 payload bytes"),
        ({"c": "zstd"}, UnknownCodec, "zstd"),
        ({"c": 0}, MalformedFrame, "field 'c' must be a string"),
        ({"p": "text"}, MalformedFrame, "field 'p' must be binary"),
        ({"p": b"\x00" * 23}, MalformedFrame, "needs 24 payload bytes"),
        ({"p": b"\x00" * 25}, MalformedFrame, "needs 24 payload bytes"),
        ({"a": [1.0]}, MalformedFrame, "field 'a' must be binary"),
        ({"b": "4096"}, MalformedFrame, "field 'b' must be an integer"),
        ({"b": False}, MalformedFrame, "field 'b' must be an integer"),
        ({"d": "int64", "c": "fp16"}, UnsupportedDtype, "codec 'none'"),
        ({"d": "bool", "c": "8bit", "a": b"", "b": 4096}, UnsupportedDtype, "codec 'none'"),
        ({"c": "8bit"}, MalformedFrame, "blocksize"),
        ({"c": "8bit", "p": b"\x00" * 6, "a": b"\x00" * 4, "b": 4095}, MalformedFrame, "blocksize must be one of"),
        ({"c": "8bit", "p": b"\x00" * 6, "a": b"\x00" * 3, "b": 4096}, MalformedFrame, "absmax bytes"),
        ({"d": "bool", "p": b"\x00\x01\x02\x00\x00\x00"}, MalformedFrame, "0 and 1"),
    ],
)
def test_bad_tensor_fields(changes: dict[str, Any], error: type[WireError], match: str) -> None:
    with pytest.raises(error, match=match):
        decode_frame(_with_entries(_tensor_entry(**changes)))


def test_tensor_entry_must_be_a_map() -> None:
    with pytest.raises(MalformedFrame, match=r"tensors\[0\] must be a map"):
        decode_frame(_pack(_frame(tensors=[[1, 2]])))


def test_duplicate_tensor_names() -> None:
    with pytest.raises(MalformedFrame, match="two tensors named 'x'"):
        decode_frame(_with_entries(_tensor_entry(), _tensor_entry()))


def _raw_map(*pairs: tuple[bytes, bytes]) -> bytes:
    """A msgpack map written by hand, so keys may repeat or be of any type."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(key + value for key, value in pairs)


def _top(meta: bytes) -> bytes:
    return _raw_map((_pack("v"), _pack(1)), (_pack("kind"), _pack("k")), (_pack("meta"), meta),
                    (_pack("tensors"), _pack([])))


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (_raw_map((_pack(1), _pack("x"))), "must be a string"),
        (_raw_map((_pack(b"key"), _pack("x"))), "must be a string"),
        (_raw_map((_pack(1.5), _pack("x"))), "must be a string"),
        (_raw_map((_pack("a"), _pack(1)), (_pack("a"), _pack(2))), "repeats the key 'a'"),
        (_raw_map((_pack("t"), b"\xd6\x05abcd")), "extension"),
        (_raw_map((_pack("t"), b"\xd6\xff\x00\x00\x00\x01")), "Timestamp"),
    ],
)
def test_bad_meta(meta: bytes, match: str) -> None:
    with pytest.raises(MalformedFrame, match=match):
        decode_frame(_top(meta))


def test_meta_nesting() -> None:
    deep: Any = 1
    for _ in range(MAX_META_DEPTH):
        deep = [deep]
    decode_frame(_pack(_frame(meta={"d": deep[0]})))
    with pytest.raises(MalformedFrame, match="deeper"):
        decode_frame(_pack(_frame(meta={"d": deep})))
    with pytest.raises(MalformedFrame, match="too deeply"):
        decode_frame(_top(b"\x81\xa1d" + b"\x91" * 100_000 + b"\x00"))


def test_invalid_utf8_and_reserved_byte() -> None:
    with pytest.raises(MalformedFrame, match="UTF-8"):
        decode_frame(_top(_raw_map((b"\xa2\xff\xfe", _pack(1)))))
    with pytest.raises(MalformedFrame, match="type byte"):
        decode_frame(_top(b"\xc1"))


def test_errors_are_swarmd_errors_with_http_status() -> None:
    for data, status in [(b"\xc1", 400), (_pack(_frame(v=2)), 400), (encode_frame("k" * 40, {}), 413),
                         (_with_entries(_tensor_entry(c="zstd")), 422)]:
        with pytest.raises(SwarmdError) as info:
            decode_frame(data)
        assert info.value.http_status == status


def test_a_content_type_is_read_without_trusting_its_parameters() -> None:
    from swarmd.net.wire import media_type

    assert media_type("application/x-msgpack") == CONTENT_TYPE
    assert media_type("Application/X-Msgpack; charset=binary") == CONTENT_TYPE
    assert media_type("V8p;_2*") == "v8p"  # aiohttp's parser raises IndexError on this one
    assert media_type(None) == "" and media_type("") == ""


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_tensor_encoded_once_frames_to_the_same_bytes(codec: str) -> None:
    """``encode_tensor`` then ``encode_frame`` gives the bytes ``encode_frame`` gives from the tensor (under any name,
    beside tensors the frame's own codec encodes): what averaging decodes to learn what its receiver will read and
    then sends, instead of encoding twice."""
    g = torch.Generator().manual_seed(3)
    grads, ids = torch.randn(5000, generator=g), torch.arange(7, dtype=torch.int64)
    direct = encode_frame("ar_part", {"part": 1}, {"grads": grads, "mbs": ids}, codec)
    once = encode_frame("ar_part", {"part": 1}, {"grads": encode_tensor(grads, codec), "mbs": ids}, codec)
    assert once == direct
    with pytest.raises(TypeError, match="non-empty"):
        encode_frame("x", {}, {"": encode_tensor(grads, codec)})
