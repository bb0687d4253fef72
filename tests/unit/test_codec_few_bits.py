"""The 2- and 3-bit Hadamard codecs for error-fed gradient averaging: their packing, their
documented error bound and what error feedback makes of them (a bounded residual); their refusals
of bad input are in test_codec_refusals.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmd.net import hadamard
from swarmd.net.codecs import (
    CODECS,
    FEW_BIT_DEFAULT_BLOCKSIZE,
    FEW_BIT_SLACK,
    Codec,
    EncodedTensor,
    ThreeBitCodec,
    TwoBitCodec,
)
from swarmd.net.wire import encode_frame
from swarmd.pipeline.averaging.error_feedback import ErrorFeedback, needs_feedback

CODEC = CODECS["2bit"]
KINDS = {"2bit": TwoBitCodec, "3bit": ThreeBitCodec}


def _round_trip(codec: Codec, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    enc = codec.encode(t)
    enc = EncodedTensor(bytes(enc.payload), enc.absmax, enc.blocksize)  # real bytes, as from the wire
    out = codec.decode(enc, dtype or t.dtype, tuple(t.shape))
    assert out.dtype == (dtype or t.dtype) and tuple(out.shape) == tuple(t.shape)
    return out


def _blocks(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    """The codec's blocks of a flat tensor: full ones, then the zero-padded tail."""
    full = flat.numel() // size
    out = list(flat[: full * size].view(full, size)) if full else []
    tail = hadamard.tail_size(flat.numel(), size)
    if tail:
        rest = flat[full * size :]
        out.append(torch.cat([rest, rest.new_zeros(tail - rest.numel())]))
    return out


def _check_bound(t: torch.Tensor, name: str = "2bit", size: int = FEW_BIT_DEFAULT_BLOCKSIZE) -> float:
    """Assert the documented per-block bound; return the largest error / bound ratio seen."""
    codec = KINDS[name](size)
    rel = 1.0 / (2**codec.bits - 1) + FEW_BIT_SLACK
    flat = t.reshape(-1).double()
    out = _round_trip(codec, t).reshape(-1).double()
    worst = 0.0
    for x, x_hat in zip(_blocks(flat, size), _blocks(out, size), strict=True):
        n = x.numel()
        absmax_y = float(hadamard.rotate(x.float().unsqueeze(0)).abs().max())
        valid = min(n, flat.numel())  # padding positions are not decoded
        err = float((x - x_hat)[:valid].norm())
        bound = rel * n**0.5 * absmax_y
        assert err <= bound * (1 + 1e-6) + 1e-30, (err, bound)
        if bound > 0:
            worst = max(worst, err / bound)
    return worst


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 8, 127, 1000])
def test_bit_planes_round_trip(bits: int, count: int) -> None:
    g = torch.Generator().manual_seed(count)
    codes = torch.randint(0, 2**bits, (count,), generator=g, dtype=torch.uint8)
    packed = hadamard.pack_bits(codes.float(), bits)
    assert packed.dtype == torch.uint8 and packed.numel() == bits * ((count + 7) // 8)
    assert torch.equal(hadamard.unpack_bits(packed, count, bits), codes)


@pytest.mark.parametrize("name", ["2bit", "3bit"])
@pytest.mark.parametrize("size", [1, 5, 127, 128, 129, 1000, 4099])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e20])
@pytest.mark.parametrize("kind", ["gaussian", "outliers", "uniform"])
@pytest.mark.parametrize("blocksize", [16, 128, 1024])
def test_within_bound(name: str, size: int, seed: int, scale: float, kind: str, blocksize: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(size, generator=g)
    if kind == "outliers":
        t[:: 97] *= 30.0
    elif kind == "uniform":
        t = torch.rand(size, generator=g) * 2 - 1
    _check_bound(t * scale, name, blocksize)


@pytest.mark.parametrize("name", ["2bit", "3bit"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-1e6, 1e6, width=32)))
def test_within_bound_for_any_finite_values(name: str, values: np.ndarray) -> None:
    _check_bound(torch.from_numpy(values.copy()), name)


@pytest.mark.parametrize("name", ["2bit", "3bit"])
def test_the_bound_is_nearly_reached(name: str) -> None:
    g = torch.Generator().manual_seed(7)
    assert _check_bound(torch.randn(1 << 14, generator=g), name) > 0.3


@pytest.mark.parametrize("name", ["2bit", "3bit"])
def test_gaussian_error_is_far_below_the_worst_case(name: str) -> None:
    """Relative RMS error on Gaussian values by block size (the absmax grows with the block)."""
    expected = {"2bit": {16: 0.40, 128: 0.55, 1024: 0.68}, "3bit": {16: 0.17, 128: 0.23, 1024: 0.29}}[name]
    t = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    for size, rel in expected.items():
        got = float((t - _round_trip(KINDS[name](size), t)).norm() / t.norm())
        assert abs(got - rel) < 0.02, (size, got)
    high = expected[FEW_BIT_DEFAULT_BLOCKSIZE] + 0.02
    outliers = t.clone()
    outliers[::97] *= 30.0
    assert float((outliers - _round_trip(CODECS[name], outliers)).norm() / outliers.norm()) < high


@pytest.mark.parametrize("name", ["2bit", "3bit"])
def test_error_feedback_carries_what_few_bits_drop(name: str) -> None:
    """A steady gradient sent through 2 or 3 bits for many rounds: with feedback, the sum of what
    the leader received differs from the true sum by one residual only; without, it drifts."""
    assert needs_feedback(name)
    g = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    fed, plain = ErrorFeedback(True), ErrorFeedback(False)
    got_fed, got_plain = torch.zeros_like(g), torch.zeros_like(g)
    rounds = 50
    for _ in range(rounds):
        for ef, total in ((fed, got_fed), (plain, got_plain)):
            sent = ef.compensate(g.clone())
            decoded = _round_trip(CODECS[name], sent)
            ef.keep(sent, decoded)
            total += decoded
    true = g * rounds
    assert fed.residual is not None
    assert torch.allclose(got_fed + fed.residual, true, atol=1e-3)
    # one residual's worth, not 50 rounds' worth
    assert float((got_fed - true).norm()) < float(g.norm()) < 0.02 * float(true.norm())
    assert float((got_plain - true).norm()) > 0.1 * float(true.norm())


@pytest.mark.parametrize("name", ["2bit", "3bit"])
def test_the_residual_stays_at_one_rounds_error(name: str) -> None:
    """On gradient-like values (Gaussian with heavy tails) the residual of a fixed gradient does
    not pile up round after round (a first, RMS-scaled version's grew from 0.19 to 0.41 of the
    gradient in 8 rounds). Not a guarantee at 2 or 3 bits: see swarmd.net.codecs' worst cases."""
    g = torch.randn(1 << 14, generator=torch.Generator().manual_seed(4))
    g[::101] *= 20.0  # heavy tails, as gradients have
    ef = ErrorFeedback(True)
    sizes = []
    for _ in range(20):
        sent = ef.compensate(g.clone())
        ef.keep(sent, _round_trip(CODECS[name], sent))
        assert ef.residual is not None
        sizes.append(float(ef.residual.norm() / g.norm()))
    assert max(sizes[10:]) < 1.2 * sizes[0] and max(sizes) < (0.7 if name == "2bit" else 0.3), sizes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_two_bit_decodes_into_half_dtypes(dtype: torch.dtype) -> None:
    # seeded: over 600 draws of 300 values (3 blocks) the relative error ranged 0.43-0.69 (median 0.53), so an
    # unseeded 0.6 bound failed in CI about one run in ten
    t = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = _round_trip(CODEC, t)
    assert out.dtype == dtype and float((t.float() - out.float()).norm() / t.float().norm()) < 0.75


def test_blocks_of_zeros_and_of_non_finite_values() -> None:
    t = torch.randn(3 * 128)
    t[:128] = 0.0
    t[130] = float("inf")
    t[300] = float("nan")
    out = _round_trip(CODEC, t)
    assert torch.equal(out[:128], torch.zeros(128))
    assert bool(out[128:].isnan().all())


@pytest.mark.parametrize(("name", "bits", "factor"), [("2bit", 2, 13.7), ("3bit", 3, 9.6)])
def test_frame_size_is_bits_per_value_plus_the_scales(name: str, bits: int, factor: float) -> None:
    t = torch.randn(8, 64, 16)  # 8192 values: 64 blocks of 128
    enc = CODECS[name].encode(t)
    assert len(bytes(enc.payload)) == 8192 * bits // 8 and enc.absmax is not None and len(enc.absmax) == 64 * 4
    body = encode_frame("average", {}, {"grads": t}, name)
    assert len(body) < 8192 * 4 / factor  # 13.7x / 9.6x fewer bytes than float32, framing included
