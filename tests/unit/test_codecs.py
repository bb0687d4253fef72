"""Codec round trips within their documented error bounds, and every refusal of bad input."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmd.errors import MalformedFrame, UnknownCodec, UnsupportedDtype
from swarmd.net.codecs import (
    CODECS,
    EIGHT_BIT_DEFAULT_BLOCKSIZE,
    EIGHT_BIT_REL_ERROR,
    Codec,
    EightBitCodec,
    EncodedTensor,
    _bin_codes,
    _code_map,
    eight_bit_error_bound,
    get_codec,
)

ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.uint8,
              torch.bool]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)


def _bytes_of(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _round_trip(codec: Codec, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    enc = codec.encode(t)
    # Decode from real bytes, as the wire layer does, never from a view of the input.
    enc = EncodedTensor(bytes(enc.payload), enc.absmax, enc.blocksize)
    out = codec.decode(enc, dtype or t.dtype, tuple(t.shape))
    assert out.dtype == (dtype or t.dtype) and tuple(out.shape) == tuple(t.shape)
    return out


@st.composite
def any_tensor(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(SHAPES)
    if dtype == torch.bool:
        return torch.from_numpy(draw(hnp.arrays(np.bool_, shape)))
    if dtype.is_floating_point:  # any float32 bit pattern, NaN and inf included, then cast
        return torch.from_numpy(draw(hnp.arrays(np.float32, shape, elements=st.floats(width=32)))).to(dtype)
    np_dtype = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8}[dtype]
    return torch.from_numpy(draw(hnp.arrays(np_dtype, shape)))


# --- registry ------------------------------------------------------------------------------------


def test_registry_names() -> None:
    assert set(CODECS) == {"none", "fp16", "bf16", "8bit", "4bit", "3bit", "2bit", "5level"}
    for name, codec in CODECS.items():
        assert codec.name == name and get_codec(name) is codec


@pytest.mark.parametrize("name", ["zstd", "", "NONE", "8-bit", None, ["none"]])
def test_unknown_codec(name: object) -> None:
    with pytest.raises(UnknownCodec, match="unknown codec"):
        get_codec(name)  # type: ignore[arg-type]


def test_import_is_lazy_about_bitsandbytes() -> None:
    code = "import sys, swarmd.net.codecs; sys.exit('bitsandbytes' in sys.modules)"
    assert subprocess.run([sys.executable, "-W", "error", "-c", code], timeout=60).returncode == 0


def test_bitsandbytes_is_imported_without_compiling_its_kernels() -> None:
    """bitsandbytes' import-time ``torch.compile`` calls would load Inductor (seconds per daemon
    start-up): the warm-up must not, must leave ``torch.compile`` as it found it, and the 8-bit
    codec must still round-trip."""
    code = """if True:
        import sys, torch
        compile_ = torch.compile
        from swarmd.net import codecs
        codecs.warm_up()
        assert 'bitsandbytes' in sys.modules, 'no import'
        assert 'torch._inductor.compile_fx' not in sys.modules, 'inductor loaded'
        assert torch.compile is compile_, 'torch.compile not restored'
        x = torch.randn(4096)
        c = codecs.get_codec('8bit')
        assert (c.decode(c.encode(x), torch.float32, (4096,)) - x).abs().max() <= 0.02 * x.abs().max()
    """
    done = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_compile_stand_in_passes_other_code_through() -> None:
    from swarmd.net.codecs import _not_for_bitsandbytes

    seen: list[object] = []

    def compile_(model: object, **kwargs: object) -> str:
        seen.append((model, kwargs))
        return "compiled"

    def theirs() -> None: ...

    def bnb_kernel() -> None: ...

    bnb_kernel.__module__ = "bitsandbytes.backends.default.ops"
    stand_in = _not_for_bitsandbytes(compile_)
    assert stand_in(bnb_kernel, dynamic=False) is bnb_kernel and stand_in()(bnb_kernel) is bnb_kernel
    assert stand_in(theirs, dynamic=False) == "compiled" and stand_in(mode="max")(theirs) == "compiled"
    assert seen == [(theirs, {"dynamic": False}), (theirs, {"mode": "max"})]


# --- none ----------------------------------------------------------------------------------------


@settings(max_examples=150)
@given(any_tensor())
def test_none_is_exact_for_every_dtype(t: torch.Tensor) -> None:
    out = _round_trip(CODECS["none"], t)
    assert _bytes_of(out) == _bytes_of(t)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_none_empty_and_rank0(dtype: torch.dtype) -> None:
    for t in (torch.zeros((0, 3), dtype=dtype), torch.zeros((), dtype=dtype), torch.ones((2, 0, 1), dtype=dtype)):
        assert _bytes_of(_round_trip(CODECS["none"], t)) == _bytes_of(t)


def test_none_refuses_bool_bytes_other_than_0_and_1() -> None:
    with pytest.raises(MalformedFrame, match="bool"):
        CODECS["none"].decode(EncodedTensor(b"\x00\x01\x02"), torch.bool, (3,))


# --- fp16 / bf16 ---------------------------------------------------------------------------------


@settings(max_examples=100)
@given(
    hnp.arrays(np.float32, SHAPES, elements=st.floats(-65504, 65504, width=32)),
    st.sampled_from(FLOAT_DTYPES),
)
def test_fp16_within_half_ulp(values: np.ndarray, dtype: torch.dtype) -> None:
    t = torch.from_numpy(values)
    out = _round_trip(CODECS["fp16"], t).double()
    # Round to nearest: half an ulp relative (2**-11), or half the subnormal spacing (2**-25).
    assert bool(((out - t.double()).abs() <= t.double().abs() * 2.0**-11 + 2.0**-25).all())
    # Decoding into another float dtype goes through that dtype's rounding as well.
    other = CODECS["fp16"].decode(EncodedTensor(bytes(CODECS["fp16"].encode(t).payload)), dtype, tuple(t.shape))
    assert other.dtype == dtype
    assert torch.equal(other, t.to(torch.float16).to(dtype))


@settings(max_examples=100)
@given(hnp.arrays(np.float32, SHAPES, elements=st.floats(-(2.0**126), 2.0**126, width=32)))
def test_bf16_within_half_ulp(values: np.ndarray) -> None:
    t = torch.from_numpy(values)
    out = _round_trip(CODECS["bf16"], t).double()
    assert bool(((out - t.double()).abs() <= t.double().abs() * 2.0**-8 + 2.0**-134).all())


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_half_codecs_empty_and_rank0(name: str, dtype: torch.dtype) -> None:
    codec = CODECS[name]
    assert _round_trip(codec, torch.zeros((0, 4), dtype=dtype)).shape == (0, 4)
    assert float(_round_trip(codec, torch.tensor(1.5, dtype=dtype))) == 1.5


def test_fp16_overflows_to_inf() -> None:
    assert _round_trip(CODECS["fp16"], torch.tensor([1e6, -1e6])).isinf().all()


# --- 8bit ----------------------------------------------------------------------------------------


def _block_absmax(t: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Per element, the absmax of its quantization block."""
    flat = t.reshape(-1).float()
    pad = -flat.numel() % blocksize
    blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, blocksize).abs().amax(dim=1)
    return blocks.repeat_interleave(blocksize)[: flat.numel()]


def _eight_bit_rel_errors(t: torch.Tensor, blocksize: int = EIGHT_BIT_DEFAULT_BLOCKSIZE) -> torch.Tensor:
    codec = CODECS["8bit"] if blocksize == EIGHT_BIT_DEFAULT_BLOCKSIZE else EightBitCodec(blocksize)
    out = _round_trip(codec, t)
    absmax = _block_absmax(t, blocksize)
    err = (out.reshape(-1).double() - t.reshape(-1).double()).abs()
    return torch.where(absmax > 0, err / absmax.double(), err)


def test_eight_bit_bound_matches_the_code_map() -> None:
    derived = eight_bit_error_bound()
    assert derived <= EIGHT_BIT_REL_ERROR < derived + 1e-7
    # The half-gap term alone: the largest gap of the signed dynamic map is 0.9 / 64.
    assert abs(derived - (0.9 / 64 / 2 + 2.0**-16 + 2.0**-20)) < 1e-7


def test_eight_bit_bound_holds_at_every_code_midpoint() -> None:
    """Dense sweep of every interval between adjacent codes, tightest around the midpoints."""
    code = torch.sort(_code_map().double()).values.numpy()
    sweeps = []
    for lo, hi in zip(code[:-1], code[1:], strict=True):
        mid, gap = (lo + hi) / 2, hi - lo
        sweeps += [np.linspace(lo, hi, 1001), np.linspace(mid - 0.01 * gap, mid + 0.01 * gap, 1001)]
    values = torch.from_numpy(np.concatenate(sweeps).astype(np.float32))
    # One exact 1.0 at the head of every block pins each block's absmax to 1.
    per_block = EIGHT_BIT_DEFAULT_BLOCKSIZE - 1
    values = torch.cat([values, values.new_zeros(-values.numel() % per_block)]).reshape(-1, per_block)
    values = torch.cat([values.new_ones(values.shape[0], 1), values], dim=1).reshape(-1)
    errors = _eight_bit_rel_errors(values)
    assert float(errors.max()) <= EIGHT_BIT_REL_ERROR
    assert float(errors.max()) > 0.007  # the sweep does reach the worst case the bound describes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.one_of(
        st.sampled_from([0, 1, 2, 4095, 4096, 4097, 8192, 3 * 4096 + 5]),
        st.integers(0, 20_000),
    ),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
    kind=st.sampled_from(["normal", "uniform", "spiky", "constant", "sparse"]),
)
def test_eight_bit_within_bound(size: int, seed: int, scale: float, kind: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        t = torch.randn(size, generator=gen)
    elif kind == "uniform":
        t = torch.rand(size, generator=gen) * 2 - 1
    elif kind == "spiky":  # heavy tails: a few huge values dominate their blocks
        t = torch.randn(size, generator=gen) ** 5
    elif kind == "constant":
        t = torch.full((size,), -0.37)
    else:
        t = torch.randn(size, generator=gen) * (torch.rand(size, generator=gen) < 0.01)
    t = (t * scale).float()
    errors = _eight_bit_rel_errors(t)
    assert errors.numel() == size
    if size:
        assert float(errors.max()) <= EIGHT_BIT_REL_ERROR


@pytest.mark.parametrize("blocksize", [64, 256, 4096])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7, 13), (2, 3, 4097)])
def test_eight_bit_shapes_and_blocksizes(shape: tuple[int, ...], blocksize: int) -> None:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    errors = _eight_bit_rel_errors(t, blocksize)
    assert bool((errors <= EIGHT_BIT_REL_ERROR).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_eight_bit_decodes_into_half_dtypes(dtype: torch.dtype) -> None:
    t = torch.randn(5000, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = _round_trip(CODECS["8bit"], t)
    # The bound, plus the output dtype's own rounding of the dequantized value.
    limit = EIGHT_BIT_REL_ERROR * _block_absmax(t, 4096) + out.float().abs() * 2.0**-8
    assert bool(((out.float() - t.float()).abs() <= limit).all())


def test_eight_bit_keeps_the_standard_code_map() -> None:
    import bitsandbytes.functional as bnb

    _round_trip(CODECS["8bit"], torch.randn(10_000) * 3)
    assert torch.equal(_code_map(), bnb.create_dynamic_map(signed=True).float())


def test_eight_bit_frame_is_a_quarter_of_float32() -> None:
    enc = CODECS["8bit"].encode(torch.randn(3, 4096 + 1))
    assert len(enc.payload) == 3 * 4097 and enc.blocksize == 4096
    assert enc.absmax is not None and len(enc.absmax) == 4 * 4  # ceil(12291 / 4096) blocks


def test_eight_bit_table_holds_the_code_nearest_each_bin_centre() -> None:
    """swarmd's encoder looks codes up per bin of 2**-16 over [-1, 1]: every entry is checked by
    brute force against all 256 codes (ties between two equally near codes may go either way)."""
    code = _code_map().double()
    table = _bin_codes().long()
    assert table.numel() == 2**17
    for start in range(0, table.numel(), 8192):
        k = torch.arange(start, start + 8192, dtype=torch.float64)
        centres = (k + 0.5) * 2.0**-16 - 1.0
        distance = (centres[:, None] - code[None, :]).abs()
        chosen = distance.gather(1, table[start : start + 8192, None]).squeeze(1)
        assert torch.equal(chosen, distance.min(dim=1).values)


def test_eight_bit_codes_are_those_of_bitsandbytes_away_from_midpoints() -> None:
    """The same quantizer as bitsandbytes' quantize_blockwise: the two pick different codes only
    for values within the table's bin width of a midpoint between those two codes."""
    import bitsandbytes.functional as bnb

    t = torch.cat([torch.randn(3 * 4096, generator=torch.Generator().manual_seed(5)), torch.linspace(-1, 1, 4096)])
    ours = torch.frombuffer(bytearray(CODECS["8bit"].encode(t).payload), dtype=torch.uint8).long()
    theirs, state = bnb.quantize_blockwise(t, code=_code_map().clone(), blocksize=4096)
    theirs = theirs.reshape(-1).long()
    differ = ours != theirs
    assert float(differ.float().mean()) < 0.01
    code = _code_map().double()
    scaled = (t.double() / _block_absmax(t, 4096).double())[differ]
    midpoints = (code[ours[differ]] + code[theirs[differ]]) / 2
    assert bool(((scaled - midpoints).abs() <= 2.0**-16 + 2.0**-20).all())


def test_eight_bit_blocks_of_zeros_and_of_non_finite_values() -> None:
    t = torch.randn(4 * 4096 + 10, generator=torch.Generator().manual_seed(6))
    t[:4096] = 0.0
    t[4096 + 7] = float("inf")
    t[2 * 4096 + 100] = float("nan")
    t[3 * 4096 + 1] = float("-inf")
    out = _round_trip(CODECS["8bit"], t)
    assert bool((out[:4096] == 0).all())
    assert bool(out[4096 : 4 * 4096].isnan().all())  # a non-finite value spoils its whole block
    tail = t[4 * 4096 :]
    assert float((out[4 * 4096 :] - tail).abs().max()) <= EIGHT_BIT_REL_ERROR * float(tail.abs().max())


# --- shared behaviour and refusals ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decoded_tensor_is_writable_and_owns_its_memory(name: str) -> None:
    t = torch.randn(4, 5)
    payload = bytes(CODECS[name].encode(t).payload)
    enc = CODECS[name].encode(t)
    out = CODECS[name].decode(EncodedTensor(payload, enc.absmax, enc.blocksize), torch.float32, (4, 5))
    out.add_(1.0)  # would warn (an error under -W error) or fail if it viewed read-only memory
    assert out.is_contiguous() and out.device.type == "cpu"


@pytest.mark.parametrize("name", sorted(CODECS))
def test_encode_accepts_strided_and_grad_tensors(name: str) -> None:
    """A strided view of a tensor that requires grad encodes exactly as its contiguous copy does (the
    input is seeded: the few-bit codecs' worst element lies anywhere up to their bound, and an unseeded
    draw once went past a tolerance tighter than that bound)."""
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(6)).requires_grad_()
    t = base.t()[::2]
    out = _round_trip(CODECS[name], t)
    assert torch.equal(out, _round_trip(CODECS[name], t.detach().contiguous()))
    rel = {"4bit": 0.2, "3bit": 0.4, "2bit": 1.0, "5level": 0.8}.get(name, 0.05)  # 4bit: verify.tolerance's per-element figure
    assert torch.allclose(out, t.detach(), atol=rel * float(t.detach().abs().max()))


@pytest.mark.parametrize("name", ["fp16", "bf16", "8bit", "4bit", "3bit", "2bit", "5level"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_float_codecs_refuse_integers(name: str, dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="codec 'none'"):
        CODECS[name].encode(torch.zeros(3, dtype=dtype))
    with pytest.raises(UnsupportedDtype, match="codec 'none'"):
        CODECS[name].decode(EncodedTensor(b"\x00" * 24, b"\x00" * 4, 4096), dtype, (3,))


def _valid(name: str, shape: tuple[int, ...] = (3, 5)) -> EncodedTensor:
    enc = CODECS[name].encode(torch.randn(shape))
    return EncodedTensor(bytes(enc.payload), enc.absmax, enc.blocksize)


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("delta", [-1, 1, -15])
def test_payload_length_mismatch(name: str, delta: int) -> None:
    enc = _valid(name)
    payload = enc.payload[:delta] if delta < 0 else bytes(enc.payload) + b"\x00" * delta
    with pytest.raises(MalformedFrame, match="payload bytes"):
        CODECS[name].decode(EncodedTensor(payload, enc.absmax, enc.blocksize), torch.float32, (3, 5))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_payload_for_another_shape(name: str) -> None:
    enc = _valid(name)
    with pytest.raises(MalformedFrame, match=r"shape \[5, 5\]"):
        CODECS[name].decode(enc, torch.float32, (5, 5))
    with pytest.raises(MalformedFrame, match="negative"):
        CODECS[name].decode(enc, torch.float32, (-3, -5))


@pytest.mark.parametrize(
    ("absmax", "blocksize", "match"),
    [
        (None, 4096, "absmax"),
        (b"\x00" * 4, None, "blocksize"),
        (b"", 4096, "absmax bytes"),
        (b"\x00" * 8, 4096, "absmax bytes"),
        (b"\x00" * 4, 0, "blocksize must be one of"),
        (b"\x00" * 4, 100, "blocksize must be one of"),
        (b"\x00" * 4, -4096, "blocksize must be one of"),
    ],
)
def test_eight_bit_side_data_is_checked(absmax: bytes | None, blocksize: int | None, match: str) -> None:
    payload = _valid("8bit").payload
    with pytest.raises(MalformedFrame, match=match):
        CODECS["8bit"].decode(EncodedTensor(payload, absmax, blocksize), torch.float32, (3, 5))


def test_eight_bit_codec_refuses_unsupported_blocksize() -> None:
    with pytest.raises(ValueError, match="blocksize"):
        EightBitCodec(100)
