"""The ``5level`` gradient codec (five levels with a zero, bfloat16 scales, base-5 packing): its
packing, its documented bound (a block's error below its norm, whatever the block), what error
feedback makes of it over many rounds (never more than the bound allows), and the refusals
of its own (those all rotated codecs share: test_codec_refusals.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmd.errors import MalformedFrame, UnknownCodec
from swarmd.net import codecs, hadamard
from swarmd.net.codecs import (
    BF16_SCALE_SLACK,
    CODECS,
    FIVE_LEVEL_BLOCKSIZES,
    FIVE_LEVEL_DEFAULT_BLOCKSIZE,
    FIVE_LEVELS,
    EncodedTensor,
    FiveLevelCodec,
    five_level_bound,
)
from swarmd.net.wire import decode_frame, encode_frame
from swarmd.pipeline.averaging.error_feedback import ErrorFeedback, needs_feedback

CODEC = CODECS["5level"]


def _round_trip(codec: codecs.Codec, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
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


def _check_bound(t: torch.Tensor, size: int = FIVE_LEVEL_DEFAULT_BLOCKSIZE) -> float:
    """Assert the documented bound on every block (error below ``five_level_bound(n)`` of the
    block's norm); return the largest error / norm ratio seen."""
    flat = t.reshape(-1).double()
    out = _round_trip(FiveLevelCodec(size), t).reshape(-1).double()
    worst = 0.0
    for x, x_hat in zip(_blocks(flat, size), _blocks(out, size), strict=True):
        valid = min(x.numel(), flat.numel())  # padding positions are not decoded
        err = float((x - x_hat)[:valid].norm())
        norm = float(x.norm())
        assert err <= five_level_bound(x.numel()) * norm * (1 + 1e-6) + 1e-30, (err, norm, x.numel())
        if norm > 0:
            worst = max(worst, err / norm)
    return worst


def _spiky_block(n: int, below: float = 1e-3) -> torch.Tensor:
    """The worst block: one spike in the rotated domain, every other rotated value just below the
    midpoint 3/16 between the levels 0 and 3/8 (so it rounds to 0 and errs by all of itself)."""
    y = torch.full((1, n), (3 / 16) * (1 - below), dtype=torch.float64)
    y[0, 0] = 1.0
    return hadamard.unrotate(y.float()).reshape(-1)


# --- packing ---------------------------------------------------------------------------------------


def test_radix_groups() -> None:
    assert hadamard.radix_group(5) == (24, 7)  # 5**24 < 2**56: 2.333 bits a code
    assert hadamard.radix_group(3) == (5, 1) and hadamard.radix_group(2) == (8, 1)
    assert hadamard.radix_group(7) == (17, 6)
    for base in (2, 3, 5, 7, 100, 256):
        codes, nbytes = hadamard.radix_group(base)
        assert base**codes <= 256**nbytes < 2**63 and nbytes <= 7
    with pytest.raises(ValueError):
        hadamard.radix_group(1)


@pytest.mark.parametrize("count", [0, 1, 5, 23, 24, 25, 48, 1000])
def test_radix_round_trip(count: int) -> None:
    g = torch.Generator().manual_seed(count)
    codes = torch.randint(0, 5, (count,), generator=g)
    packed = hadamard.pack_radix(codes, 5)
    assert packed.dtype == torch.uint8 and packed.numel() == hadamard.radix_bytes(count, 5) == 7 * -(-count // 24)
    assert torch.equal(hadamard.unpack_radix(packed, count, 5), codes)
    if count:  # the extremes of a group: all 4s is 5**24 - 1, the largest number a group holds
        top = torch.full((count,), 4)
        assert torch.equal(hadamard.unpack_radix(hadamard.pack_radix(top, 5), count, 5), top)


def test_a_group_beyond_five_to_the_24_is_refused() -> None:
    packed = torch.frombuffer(bytearray((5**24).to_bytes(7, "little")), dtype=torch.uint8)
    with pytest.raises(ValueError, match="base-5 digits"):
        hadamard.unpack_radix(packed, 24, 5)
    enc = CODEC.encode(torch.randn(24))
    bad = EncodedTensor(b"\xff" * 7 * -(-32 // 24), enc.absmax, enc.blocksize)  # 24 values: one tail block of 32
    with pytest.raises(MalformedFrame, match="not base-5 codes"):
        CODEC.decode(bad, torch.float32, (24,))


def test_bfloat16_scale_rounds_up() -> None:
    g = torch.Generator().manual_seed(2)
    values = torch.cat([torch.rand(10_000, generator=g) * 10.0 ** torch.randint(-30, 30, (10_000,), generator=g),
                        torch.tensor([0.0, 1.0, 3.4e38, float("inf"), float("nan"), 1e-40])])
    up = codecs._round_up_to_bfloat16(values)
    finite = torch.isfinite(up)
    assert torch.equal(up[finite], up[finite].to(torch.bfloat16).float())  # a bfloat16, exactly
    assert bool((up[finite] >= values[finite]).all())  # never below: no value is clipped
    normal = finite & (values >= 2.0**-126)  # subnormals have fewer bits: 1e-40 rounds up to 1.8e-40
    assert bool((up[normal] <= values[normal] * (1 + BF16_SCALE_SLACK)).all())
    assert up[-6] == 0.0 and up[-5] == 1.0 and math.isinf(float(up[-4])) and math.isinf(float(up[-3]))
    assert math.isnan(float(up[-2])) and up[-1] >= 1e-40


# --- the bound -------------------------------------------------------------------------------------


def test_the_bound_is_below_one_for_every_block_size() -> None:
    """Why error feedback cannot amplify: every block's error is below its norm."""
    bounds = {n: five_level_bound(n) for n in sorted(FIVE_LEVEL_BLOCKSIZES)}
    assert all(b < 1 for b in bounds.values()), bounds
    assert [round(b, 2) for b in bounds.values()] == [0.60, 0.74, 0.84, 0.92]  # as documented
    assert FIVE_LEVEL_DEFAULT_BLOCKSIZE == 64 and FIVE_LEVELS == (-1.0, -0.375, 0.0, 0.375, 1.0)


@pytest.mark.parametrize("size", [1, 5, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e20])
@pytest.mark.parametrize("kind", ["gaussian", "outliers", "uniform", "spiky"])
@pytest.mark.parametrize("blocksize", sorted(FIVE_LEVEL_BLOCKSIZES))
def test_within_bound(size: int, seed: int, scale: float, kind: str, blocksize: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(size, generator=g)
    if kind == "outliers":
        t[::97] *= 30.0
    elif kind == "uniform":
        t = torch.rand(size, generator=g) * 2 - 1
    elif kind == "spiky":
        count = -(-size // blocksize)
        t = torch.cat([_spiky_block(blocksize) * float(torch.rand(1, generator=g)) for _ in range(count)])[:size]
    _check_bound(t * scale, blocksize)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-1e6, 1e6, width=32)),
       blocksize=st.sampled_from(sorted(FIVE_LEVEL_BLOCKSIZES)))
def test_within_bound_for_any_finite_values(values: np.ndarray, blocksize: int) -> None:
    _check_bound(torch.from_numpy(values.copy()), blocksize)


@pytest.mark.parametrize("blocksize", sorted(FIVE_LEVEL_BLOCKSIZES))
def test_the_bound_is_reached_by_the_worst_block(blocksize: int) -> None:
    """The bound is tight: a spike with every other rotated value just under the first midpoint."""
    worst = _check_bound(_spiky_block(blocksize), blocksize)
    assert worst > 0.97 * five_level_bound(blocksize), (worst, five_level_bound(blocksize))


@pytest.mark.parametrize("name", ["3bit", "2bit"])
def test_without_a_zero_level_the_worst_block_errs_more_than_its_norm(name: str) -> None:
    """Why ``5level`` exists: on the same kind of block, ``3bit`` and ``2bit`` (no level at 0)
    send back more error than the block holds, so error feedback can grow."""
    y = torch.zeros(1, 128)
    y[0, 0] = 1.0  # a spike and zeros, rotated: every zero errs by the absmax / 7 (or / 3)
    x = hadamard.unrotate(y).reshape(-1)
    ratio = float((x - _round_trip(CODECS[name], x)).norm() / x.norm())
    assert ratio > 1.5, ratio
    five = float((x - _round_trip(FiveLevelCodec(128), x)).norm() / x.norm())
    assert five < BF16_SCALE_SLACK  # 5level: exact up to the scale's rounding


def test_gaussian_error() -> None:
    """Relative RMS error on Gaussian values by block size; heavy tails (as gradients have) less."""
    expected = {16: 0.29, 32: 0.31, 64: 0.34, 128: 0.36}
    t = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    for size, rel in expected.items():
        got = float((t - _round_trip(FiveLevelCodec(size), t)).norm() / t.norm())
        assert abs(got - rel) < 0.02, (size, got)
    tails = t.clone()
    tails[::101] *= 20.0
    assert float((tails - _round_trip(CODEC, tails)).norm() / tails.norm()) < 0.33


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_decodes_into_other_float_dtypes(dtype: torch.dtype) -> None:
    t = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = _round_trip(CODEC, t)
    assert out.dtype == dtype and float((t.double() - out.double()).norm() / t.double().norm()) < 0.45


def test_blocks_of_zeros_and_of_non_finite_values() -> None:
    t = torch.randn(3 * 64)
    t[:64] = 0.0
    t[70] = float("inf")
    t[150] = float("nan")
    out = _round_trip(CODEC, t)
    assert torch.equal(out[:64], torch.zeros(64))
    assert bool(out[64:].isnan().all())


# --- error feedback --------------------------------------------------------------------------------


def test_error_feedback_carries_what_five_levels_drop() -> None:
    """A steady gradient for many rounds: with feedback, what the leader received sums to the true
    sum up to one residual; without, it drifts."""
    assert needs_feedback("5level")
    g = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    fed, plain = ErrorFeedback(True), ErrorFeedback(False)
    got_fed, got_plain = torch.zeros_like(g), torch.zeros_like(g)
    rounds = 50
    for _ in range(rounds):
        for ef, total in ((fed, got_fed), (plain, got_plain)):
            sent = ef.compensate(g.clone())
            decoded = _round_trip(CODEC, sent)
            ef.keep(sent, decoded)
            total += decoded
    true = g * rounds
    assert fed.residual is not None
    assert torch.allclose(got_fed + fed.residual, true, atol=1e-3)
    assert float((got_fed - true).norm()) < float(g.norm()) < 0.02 * float(true.norm())
    assert float((got_plain - true).norm()) > 0.1 * float(true.norm())


def _feed(gradients: list[torch.Tensor]) -> list[float]:
    """Each round's residual norm, relative to the largest gradient's, under error feedback."""
    ef = ErrorFeedback(True)
    top = max(float(g.norm()) for g in gradients)
    sizes = []
    for g in gradients:
        sent = ef.compensate(g.clone())
        ef.keep(sent, _round_trip(CODEC, sent))
        assert ef.residual is not None
        sizes.append(float(ef.residual.norm()) / top)
    return sizes


def test_the_residual_stays_bounded_on_the_worst_blocks() -> None:
    """200 rounds of worst-case blocks (a rotated spike over values at the midpoint, at random
    signs and scales): the residual never exceeds bound / (1 - bound) of the largest gradient,
    as the bound promises, and in fact stays under one round's worst error."""
    g = torch.Generator().manual_seed(9)
    n = FIVE_LEVEL_DEFAULT_BLOCKSIZE
    rounds = []
    for _ in range(200):
        blocks = [_spiky_block(n) * float(torch.randn(1, generator=g)) for _ in range(32)]
        t = torch.cat(blocks)
        rounds.append(t * torch.where(torch.rand(t.shape, generator=g) < 0.5, -1.0, 1.0) if len(rounds) % 2 else t)
    sizes = _feed(rounds)
    bound = five_level_bound(n)
    assert max(sizes) <= bound / (1 - bound), max(sizes)
    assert max(sizes) < bound, sizes


def test_the_same_worst_block_every_round_does_not_pile_up() -> None:
    n = FIVE_LEVEL_DEFAULT_BLOCKSIZE
    sizes = _feed([_spiky_block(n)] * 100)
    assert max(sizes) < five_level_bound(n) and max(sizes[50:]) <= max(sizes[:50]) * 1.01, sizes


def test_the_residual_stays_at_one_rounds_error_on_gradient_like_values() -> None:
    """Fresh heavy-tailed gradients every round, and a fixed one: the residual stays near one
    round's error (0.3 of a gradient), never growing round after round."""
    g = torch.Generator().manual_seed(4)
    fresh = []
    for _ in range(100):
        t = torch.randn(1 << 14, generator=g)
        t[:: 101] *= 20.0
        fresh.append(t)
    sizes = _feed(fresh)
    assert max(sizes) < 0.45 and max(sizes[50:]) < 1.1 * max(sizes[:50]), sizes
    fixed = _feed([fresh[0]] * 100)
    assert max(fixed) < 0.35 and max(fixed[50:]) < 1.1 * fixed[0], fixed


# --- bytes and refusals (those all rotated codecs share: test_codec_refusals.py) ----------------


def test_frame_size_is_2_58_bits_per_value() -> None:
    t = torch.randn(8, 64, 16)  # 8192 values: 128 blocks of 64
    enc = CODEC.encode(t)
    assert len(bytes(enc.payload)) == 7 * -(-8192 // 24) and enc.absmax is not None and len(enc.absmax) == 128 * 2
    body = encode_frame("average", {}, {"grads": t}, "5level")
    assert len(body) < 8192 * 4 / 11.9  # 12.0x fewer bytes than float32, framing included (12.4x without)


def _valid(shape: tuple[int, ...] = (3, 50)) -> EncodedTensor:
    enc = CODEC.encode(torch.randn(shape))
    return EncodedTensor(bytes(enc.payload), enc.absmax, enc.blocksize)


@settings(max_examples=100, deadline=None)
@given(payload=st.binary(min_size=21, max_size=21))
def test_any_payload_of_the_right_length_decodes_or_is_refused(payload: bytes) -> None:
    """60 values: one block of 64 (after padding), 3 groups of 7 bytes; random bytes are mostly
    numbers beyond 5**24 (refused), the rest decode to finite values."""
    enc = _valid((60,))
    try:
        out = CODEC.decode(EncodedTensor(payload, enc.absmax, enc.blocksize), torch.float32, (60,))
    except MalformedFrame as exc:
        assert "base-5" in str(exc)
        return
    assert bool(torch.isfinite(out).all())


def test_an_older_peer_refuses_the_codec_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer built before ``5level`` existed does not know the name: it refuses the frame with a
    clear UnknownCodec (a 4xx), never decodes its bytes as another codec's."""
    frame = encode_frame("average", {"stage": 1}, {"x": torch.randn(3, 50)}, "5level")
    monkeypatch.delitem(codecs._REGISTRY, "5level")  # what an older build's registry holds
    with pytest.raises(UnknownCodec, match="unknown codec '5level'") as caught:
        decode_frame(frame)
    assert caught.value.http_status < 500
