"""The randomized Hadamard rotation and the packing behind the ``4bit``, ``3bit``, ``2bit`` and ``5level`` codecs, as
pure torch.

Quantizing a block to 4 bits loses most where a few large values (activation outliers) set the
block's scale and squeeze every other value into one or two of the 16 levels. TAH-Quant
(arXiv 2506.01352) rotates each block first: ``y = H D x / sqrt(n)``, with ``H`` the
``n x n`` Walsh-Hadamard matrix and ``D`` a fixed diagonal of random signs. The rotation is
orthonormal (``||y|| = ||x||``) and spreads an outlier over the whole block, so the block's
values look Gaussian and its absmax is close to its norm's ``sqrt(2 ln n / n)``; the decoder
undoes it with ``x = D H y / sqrt(n)`` (``H`` is symmetric and ``H H = n I``).

The signs are not sent: both sides derive them from SHA-256 of a fixed label
(:func:`signs`), so they are the same in every build, Python and torch version. A fixed
rotation is as good as a fresh one here: nothing adversarial chooses the values.

Everything here is local, trusted computation on tensors already checked by the codec.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch

__all__ = [
    "fwht",
    "pack_bits",
    "pack_levels",
    "pack_nibbles",
    "pack_radix",
    "radix_bytes",
    "radix_group",
    "rotate",
    "signs",
    "tail_size",
    "unpack_bits",
    "unpack_nibbles",
    "unpack_radix",
    "unrotate",
]

_SIGNS_LABEL = b"swarmd.4bit.signs/1\n"


@functools.lru_cache(maxsize=16)
def signs(n: int) -> torch.Tensor:
    """``n`` float32 signs (+1/-1) from SHA-256 of a fixed label: the diagonal ``D``.

    The signs of a block of ``n`` are the first ``n`` of those of any larger block, so a short
    tail block uses a prefix of the same diagonal.
    """
    out = bytearray()
    counter = 0
    while len(out) * 8 < n:
        out += hashlib.sha256(_SIGNS_LABEL + counter.to_bytes(8, "little")).digest()
        counter += 1
    bits = torch.frombuffer(out, dtype=torch.uint8)
    bits = bits.unsqueeze(1).bitwise_right_shift(torch.arange(8, dtype=torch.uint8)).bitwise_and_(1)
    values = bits.reshape(-1)[:n].to(torch.float32).mul_(2.0).sub_(1.0)
    values.requires_grad_(False)
    return values


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row of ``x`` ``[rows, n]``, ``n`` a power
    of two: ``log2(n)`` butterfly passes, each one vectorised over the whole tensor."""
    rows, n = x.shape
    if n & (n - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two length, got {n}")
    h = 1
    while h < n:
        pairs = x.view(rows, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2).view(rows, n)
        h *= 2
    return x.mul_(1.0 / math.sqrt(n)) if n > 1 else x.clone()


#: Up to this block width the rotation is one matrix product with the ``n x n`` matrix ``D H /
#: sqrt(n)`` (a BLAS call, ~3x faster than the butterflies' log2(n) passes of small tensor ops);
#: wider blocks use :func:`fwht`, whose log2(n) passes cost less than the product's n per value.
MATRIX_MAX = 256


@functools.lru_cache(maxsize=16)
def _rotation_matrix(n: int) -> torch.Tensor:
    """``D H / sqrt(n)``: row ``i`` of ``H / sqrt(n)`` times sign ``i``, so ``x @ M = H D x / sqrt(n)``."""
    return fwht(torch.eye(n)).mul_(signs(n).unsqueeze(1))


def rotate(blocks: torch.Tensor) -> torch.Tensor:
    """``H D x / sqrt(n)`` of each row of float32 ``blocks`` ``[rows, n]``."""
    n = blocks.shape[1]
    if n <= MATRIX_MAX:
        return blocks @ _rotation_matrix(n)
    return fwht(blocks * signs(n))


def unrotate(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate`: ``D H y / sqrt(n)`` of each row."""
    n = blocks.shape[1]
    if n <= MATRIX_MAX:
        return blocks @ _rotation_matrix(n).t()
    return fwht(blocks).mul_(signs(n))


def tail_size(numel: int, blocksize: int) -> int:
    """Width of the last, short block of a tensor of ``numel`` values: the smallest power of two
    holding the ``numel % blocksize`` values left over (zero-padded), or 0 when there are none.
    Both sides compute it from the declared shape, so it is never sent."""
    rest = numel % blocksize
    return 0 if rest == 0 else 1 << (rest - 1).bit_length()


def pack_levels(levels: torch.Tensor) -> torch.Tensor:
    """:func:`pack_nibbles` of codes still held as whole floats in [0, 15] (flat): one small
    matrix product, faster than integer shifts over strided views."""
    if levels.numel() % 2:
        levels = torch.cat([levels, levels.new_zeros(1)])
    return (levels.view(-1, 2) @ _NIBBLE_WEIGHTS).to(torch.uint8)


_NIBBLE_WEIGHTS = torch.tensor([1.0, 16.0])


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes < 16, flat, to bytes holding two each (the first in the low nibble); an odd
    count gets a zero high nibble at the end."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | pairs[:, 1].bitwise_left_shift(4)


def unpack_nibbles(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` codes of :func:`pack_nibbles`' bytes, as uint8."""
    low = packed.bitwise_and(15)
    high = packed.bitwise_right_shift(4)
    return torch.stack((low, high), dim=1).view(-1)[:count]



_BIT_WEIGHTS = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0])


def pack_bits(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits``-bit codes held as whole floats in [0, 2**bits) (flat) as ``bits`` bit planes, the
    lowest first, each plane eight codes a byte (the first code in the lowest bit) and zero-padded
    to whole bytes: ``bits * ceil(count / 8)`` bytes."""
    rest = levels.numel() % 8
    if rest:
        levels = torch.cat([levels, levels.new_zeros(8 - rest)])
    codes = levels.to(torch.uint8)
    planes = [codes.bitwise_right_shift(b).bitwise_and_(1).float().view(-1, 8) @ _BIT_WEIGHTS for b in range(bits)]
    return torch.cat(planes).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The first ``count`` codes of :func:`pack_bits`' bytes (``bits`` planes), as uint8."""
    shifts = torch.arange(8, dtype=torch.uint8)
    planes = packed.view(bits, -1).unsqueeze(2).bitwise_right_shift(shifts).bitwise_and_(1).view(bits, -1)
    codes = planes[0].clone()
    for b in range(1, bits):
        codes.add_(planes[b].bitwise_left_shift(b))
    return codes[:count]


@functools.lru_cache(maxsize=8)
def radix_group(base: int) -> tuple[int, int]:
    """``(codes, nbytes)``: how many base-``base`` digits :func:`pack_radix` puts in how many bytes,
    the densest choice of at most 7 bytes (a group's number fits an int64): for base 5, 24 codes
    in 7 bytes (5**24 < 2**56), 2.33 bits a code against log2(5) = 2.32."""
    if not 2 <= base <= 256:
        raise ValueError(f"a radix must be between 2 and 256, got {base}")
    best = (1, 1)
    for nbytes in range(1, 8):
        codes = 1
        while base ** (codes + 1) <= 256**nbytes:
            codes += 1
        if codes * best[1] > best[0] * nbytes:
            best = (codes, nbytes)
    return best


def radix_bytes(count: int, base: int) -> int:
    """How many bytes :func:`pack_radix` makes of ``count`` codes."""
    codes, nbytes = radix_group(base)
    return nbytes * -(-count // codes)


@functools.lru_cache(maxsize=8)
def _radix_powers(base: int) -> torch.Tensor:
    return torch.tensor([base**i for i in range(radix_group(base)[0])], dtype=torch.int64)


def pack_radix(codes: torch.Tensor, base: int) -> torch.Tensor:
    """Whole-number codes in [0, base) (flat, any dtype) as base-``base`` numbers of
    :func:`radix_group` digits each (the first code the lowest digit), each number little-endian in
    ``nbytes`` bytes; the last group is zero-padded: :func:`radix_bytes` bytes."""
    group, nbytes = radix_group(base)
    rest = codes.numel() % group
    ints = codes.to(torch.int64)
    if rest:
        ints = torch.cat([ints, ints.new_zeros(group - rest)])
    numbers = (ints.view(-1, group) * _radix_powers(base)).sum(dim=1)
    return numbers.view(torch.uint8).view(-1, 8)[:, :nbytes].reshape(-1)


def unpack_radix(packed: torch.Tensor, count: int, base: int) -> torch.Tensor:
    """The first ``count`` codes of :func:`pack_radix`'s bytes, as int64. A group whose number is
    ``base ** group`` or more was not made by :func:`pack_radix`: ``ValueError``."""
    group, nbytes = radix_group(base)
    rows = packed.numel() // nbytes
    wide = torch.zeros(rows, 8, dtype=torch.uint8)
    wide[:, :nbytes] = packed[: rows * nbytes].view(rows, nbytes)
    numbers = wide.view(torch.int64).view(-1)
    if rows and int(numbers.max()) >= base**group:
        raise ValueError(f"a group of {nbytes} bytes holds a number of more than {group} base-{base} digits")
    digits = numbers.unsqueeze(1).div(_radix_powers(base), rounding_mode="floor").remainder_(base)
    return digits.reshape(-1)[:count]
