"""Tensor codecs: how one tensor's values become the bytes of a wire frame.

SWARM (Ryabinin et al., 2023) sends activations and gradients between pipeline stages over slow
links and, in its large-model experiments, compresses them to 8 bits with dynamic blockwise
quantization so that communication stays hidden behind compute. This module realises that part
of the design as a registry of small codec classes behind one interface (the shape of
hivemind's compression registry), and nothing else: no I/O, no msgpack, no knowledge of frames.
``swarmd.net.wire`` chooses a codec per tensor and stores the dtype, shape and codec name next to
the bytes.

Codecs (``CODECS``, looked up with :func:`get_codec`):

``none``
    The tensor's own bytes, little-endian, in its own dtype: an exact round trip for every dtype
    the wire allows (floats, integers and bool).
``fp16`` / ``bf16``
    Floats cast to float16 / bfloat16 for transport and cast back to the declared dtype.
    Per element the relative error is at most the transport dtype's half unit in the last place
    (2**-11 for float16, 2**-8 for bfloat16); float16 additionally overflows to ``inf`` above
    65504 and loses precision below 6.1e-5 (subnormals), bfloat16 keeps float32's range.
``8bit``
    Dynamic blockwise quantization as in ``bitsandbytes`` (Dettmers et al., "8-bit Optimizers
    via Block-wise Quantization"): each block of ``blocksize`` (default 4096) consecutive elements
    is divided by its absolute maximum and every value is replaced by the index of (within
    2**-16) the nearest of the 256 values of the signed dynamic code map
    (``bitsandbytes.functional.create_dynamic_map(signed=True)``, which both sides compute and
    which is never sent). The frame carries one byte per element plus one float32 absmax per
    block. Decoding is bitsandbytes' ``dequantize_blockwise``; encoding is swarmd's own (below).
``4bit``
    Blockwise 4-bit quantization after a randomized Hadamard rotation (TAH-Quant, arXiv
    2506.01352; the rotation is :mod:`swarmd.net.hadamard`): the flat tensor is cut into blocks
    of ``blocksize`` (a power of two, default 64) plus one short tail block (the smallest power
    of two holding what is left, zero-padded); each block is rotated (``y = H D x / sqrt(n)``,
    orthonormal), divided by its absmax and rounded to the nearest of 16 evenly spaced levels
    ``-1, -13/15, ..., 13/15, 1``. The frame carries half a byte per (padded) element plus one
    float32 absmax per block: about 7.1x fewer bytes than float32 at block size 64.

``3bit`` / ``2bit``
    For averaged gradients, which carry error feedback (:mod:`swarmd.pipeline.averaging.error_feedback`):
    the ``4bit`` codec with fewer levels. Rotated blocks (``blocksize`` a power of two, default
    128, and the same short tail block), each divided by its absmax and rounded to the nearest of
    ``L = 2**bits`` evenly spaced levels from -1 to 1 (8 or 4). The frame carries the codes as
    ``bits`` bit planes (:func:`hadamard.pack_bits`) plus one float32 absmax per block: 3.25 /
    2.25 bits per value at block size 128, about 9.8x / 14x fewer bytes than float32. Error
    feedback is safe only where the codec shrinks what it is given: ``4bit`` does in the worst
    case (a block's error is at most ``sqrt(64) / 15 = 0.53`` of its norm), ``3bit`` at block 128
    does not (``sqrt(128) / 7 = 1.62``: a block whose rotated values are one spike and zeros) but
    did in every run measured, and ``2bit`` (``sqrt(128) / 3 = 3.77``) did not: in `small` runs
    with 2 peers per stage a contributor's residual grew round after round until the leader
    refused it as an outlier (300x the median), which neither 2 bits without error feedback nor
    4 bits with it did. ``2bit`` is experimental: do not average with it. (A first version scaled
    each block by its RMS and clipped the tails, 0.19 / 0.35 relative error; error feedback piled
    the clipped tails up even on a fixed gradient.)
``5level``
    For averaged gradients with error feedback, in fewer bytes than ``3bit`` and without its worst
    case: rotated blocks (``blocksize`` 16-128, default 64, and the short tail block), each divided
    by its absmax rounded up to a bfloat16 and rounded to the nearest of the five levels
    ``-1, -3/8, 0, 3/8, 1`` (:data:`FIVE_LEVELS`). The frame carries the codes as base-5 numbers,
    24 codes in 7 bytes (:func:`hadamard.pack_radix`), plus one bfloat16 scale per block: 2.58 bits
    per value at block size 64, 12.4x fewer bytes than float32. Because a level is 0, rounding never
    moves a value further than its own size, and a block's error is at most
    :func:`five_level_bound` of its norm: 0.84 at block 64 (0.60 / 0.74 / 0.92 at 16 / 32 / 128),
    always below 1, so error feedback cannot amplify (see "The 5-level bound"). On Gaussian values
    the relative RMS error is 0.34 at block 64 (``3bit`` 0.23 at 3.25 bits, ``2bit`` 0.55).

The 8-bit error bound
---------------------
For every element ``x`` of a block whose absolute maximum is ``absmax``::

    |x - decode(encode(x))| <= EIGHT_BIT_REL_ERROR * absmax

The bound is derived from the code map by :func:`eight_bit_error_bound`: a nearest-value
quantizer is off by at most half the largest gap between adjacent code values (0.0140625 / 2,
between the two codes closest to -1 and to +1), or by the distance from -1 / +1 to the
outermost code, whichever is larger (the same 0.00703 here: the map stops at -0.99297). Two
slack terms are added: the encoder picks the code nearest to the centre of the bin of width
``w = 2**-16`` that holds ``x / absmax``, not to ``x / absmax`` itself, which costs at most ``w``
more (``|v - code(c)| <= |v - c| + |c - code(v)| <= 2|v - c| + |v - code(v)|``, with
``|v - c| <= w / 2``); and float32 rounding of ``x / absmax``, of the bin and of
``code * absmax`` adds a few units of 2**-24. So
``EIGHT_BIT_REL_ERROR = 0.0070313 + 2**-16 + 2**-20 ~= 0.0070475``, the same bound the
bitsandbytes 0.50 CPU kernel met (it, too, errs up to about 2**-16 from a midpoint); the
largest error measured over a dense sweep of every code interval stays below it (see
``tests/unit/test_codecs.py``). Blocks that contain ``inf`` or ``nan`` decode as ``nan`` throughout,
blocks of zeros as zeros: the stage rejects non-finite values anyway.

The 8-bit encoder
-----------------
bitsandbytes' CPU ``quantize_blockwise`` searches the code map for every element, one thread,
about 8 ns an element: 4 ms for one 4x256x512 activation, on the critical path of every
forward and backward RPC. swarmd instead looks the code up in a table of :data:`_LUT_BINS`
(2**17) bins over [-1, 1], built once from the map (``_bin_codes``): per element a divide, a
multiply-add, a truncation and a gather, all vectorised by torch: 0.6-1.3 ms for that
activation on one core (``scripts/bench_rpc.py`` in ``docs/BENCHMARKS.md``). The bytes it
produces are ordinary 8-bit frames; any peer decodes them.

The 4-bit error bound
---------------------
Rounding to levels ``2/15`` apart errs by at most ``1/15`` of the rotated block's absmax per
rotated value, so, the rotation being orthonormal, for every block of ``n`` values::

    ||x - decode(encode(x))||_2 <= FOUR_BIT_REL_ERROR * sqrt(n) * max|H D x / sqrt(n)|

with ``FOUR_BIT_REL_ERROR = 1/15 + 2**-12`` (the slack covers float32 rounding in the
``log2(n)`` butterfly passes each way). As ``max|y| <= ||y||_2 = ||x||_2``, the relative error
of a block's norm is at most ``sqrt(n) / 15`` (0.53 at block size 64) in the worst case. Measured
on Gaussian values, the relative RMS error is 0.09 / 0.10 / 0.11 / 0.12 at block sizes 32 / 64 /
128 / 256, and 0.06 at 64 with one value in 97 scaled by 30 (outliers, as in activations: the
rotation spreads them); the largest per-element error stayed below 0.02 of the tensor's absmax
(``tests/unit/test_codec_4bit.py``). The rounding is deterministic (nearest level), so an
error that accumulates (averaged gradients) needs error feedback
(:mod:`swarmd.pipeline.averaging.error_feedback`). Blocks holding ``inf`` or ``nan`` decode as ``nan``
throughout, blocks of zeros as zeros; the rotation sums a block in float32, so a block with values
beyond about ``3e38 / blocksize`` overflows and decodes as ``nan`` too (the stage refuses
non-finite values; no activation or gradient comes near).

The 2- and 3-bit error bound
----------------------------
As for ``4bit``, with ``L - 1`` steps instead of 15: rounding to levels ``2 / (L - 1)`` apart errs
by at most ``1 / (L - 1)`` of the rotated block's absmax per rotated value, so for every block of
``n`` values::

    ||x - decode(encode(x))||_2 <= (1 / (L - 1) + FEW_BIT_SLACK) * sqrt(n) * max|H D x / sqrt(n)|

(1/7 for 3 bits, 1/3 for 2). On Gaussian values the relative RMS error is 0.23 / 0.55 at block size
128 (``tests/unit/test_codec_few_bits.py``). These are coarse codecs, meant for gradients averaged
with error feedback, whose residual carries what one round dropped into the next; not for
activations.

The 5-level bound
-----------------
Rotate a block (``y = H D x / sqrt(n)``, orthonormal) and let ``A = max|y|`` and ``A'`` its scale,
``A`` rounded up to a bfloat16 (``A <= A' < A (1 + 2**-7)`` for every normal float ``A``, i.e. above
``2**-126 ~= 1.2e-38``; a block of values that small may err more). Each ``v = y / A'`` lies in [-1, 1]
and rounds to the nearest level; the largest rounds to 1 and errs by ``A' - A < 2**-7 A``. Every
other value errs by ``e(v) A'``, ``e(v)`` the distance from ``v`` to its nearest level, which is
at most ``|v|`` (0 is a level), and largest relative to ``v`` at the midpoints between levels. Over
the ``n - 1`` other values::

    sum e(v_i)**2  <=  d2 * (1 + sum v_i**2),    d2 = max_m (n - 1) h_m**2 / (1 + (n - 1) m**2)

with ``m`` the midpoints 3/16 and 11/16 and ``h_m`` the half gaps there (3/16 and 5/16): ``e(v)**2 /
(1 / (n - 1) + v**2)`` grows up to a midpoint and falls after it, so a sum of such terms is largest
with every value at the worst midpoint. So ``||x - decode(encode(x))|| <= (sqrt(d2) (1 + 2**-7)
+ 2**-7 + 2**-12) ||x||`` (the last term: float32 rounding of the rotations), which
:func:`five_level_bound` computes: 0.60 / 0.74 / 0.84 / 0.92 at block sizes 16 / 32 / 64 / 128;
the worst block is a single spike in the rotated domain with every other value at ``3/16 A``.
Error feedback then keeps a residual of at most ``bound / (1 - bound)`` of the largest gradient
block it was fed (5.4x at block 64), in the worst case; on gradient-like values it stays at one
round's error, 0.3 of the gradient (``tests/unit/test_codec_5level.py``). ``3bit`` has no zero
level: the values near 0 of a spiky block all err by ``A / 7``, up to 1.62 of the block's norm
at block 128, and ``2bit``'s 3.77; error feedback can grow from that. A bfloat16 scale keeps
float32's range (a float16 one would round the absmax of a block of tiny gradients to a
subnormal or to 0, many times off). Hostile bytes: a 7-byte group holding a number of 5**24 or
more is refused (:class:`~swarmd.errors.MalformedFrame`); any scale decodes, as for the others.

Conventions shared by all codecs:

- ``encode`` is local code: a tensor a codec cannot carry is a programming error (``TypeError``).
- ``decode`` reads remote input: wrong payload or absmax lengths raise
  :class:`~swarmd.errors.MalformedFrame`, a dtype the codec cannot produce raises
  :class:`~swarmd.errors.UnsupportedDtype`; nothing is asserted.
- ``decode`` returns a fresh, writable CPU tensor and copies the payload at most once on the
  way (plus the dtype conversion itself where the transport dtype differs).
- ``encode`` may return a payload that shares memory with its input (``none`` does, to avoid
  a copy); the wire layer packs it straight away.
- Bytes are little-endian; like torch and numpy in practice, swarmd assumes a little-endian host.

``bitsandbytes`` is imported on the first 8-bit call, not at import time: importing it takes
seconds and logs a warning about optional kernels, and most peers never use it.
"""

from __future__ import annotations

import abc
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any, ClassVar

import torch

from swarmd.errors import MalformedFrame, UnknownCodec, UnsupportedDtype
from swarmd.net import hadamard

__all__ = [
    "CODECS",
    "EIGHT_BIT_BLOCKSIZES",
    "EIGHT_BIT_DEFAULT_BLOCKSIZE",
    "EIGHT_BIT_REL_ERROR",
    "FOUR_BIT_BLOCKSIZES",
    "FOUR_BIT_DEFAULT_BLOCKSIZE",
    "FOUR_BIT_REL_ERROR",
    "FEW_BIT_BLOCKSIZES",
    "FEW_BIT_DEFAULT_BLOCKSIZE",
    "FEW_BIT_SLACK",
    "FIVE_LEVELS",
    "FIVE_LEVEL_BLOCKSIZES",
    "FIVE_LEVEL_DEFAULT_BLOCKSIZE",
    "BF16_SCALE_SLACK",
    "FiveLevelCodec",
    "five_level_bound",
    "Codec",
    "EncodedTensor",
    "FourBitCodec",
    "ThreeBitCodec",
    "TwoBitCodec",
    "eight_bit_error_bound",
    "get_codec",
]

EIGHT_BIT_DEFAULT_BLOCKSIZE = 4096
# The block sizes bitsandbytes documents for quantize_blockwise; a frame naming another is refused
# rather than handed to native code.
EIGHT_BIT_BLOCKSIZES: frozenset[int] = frozenset({64, 128, 256, 512, 1024, 2048, 4096})

# Bins of the encoder's look-up table over [-1, 1], each 2**-16 wide; see the module docstring.
_LUT_BINS = 2**17
# Slack terms of the 8-bit bound: the table's bin width, and float32 rounding.
_LUT_SLACK = 2.0 / _LUT_BINS
_FLOAT_SLACK = 2.0**-20
# eight_bit_error_bound() rounded up in its 7th decimal; tests check the two agree.
EIGHT_BIT_REL_ERROR = 0.0070475

FOUR_BIT_DEFAULT_BLOCKSIZE = 64
# Powers of two only (the Hadamard transform's lengths); a frame naming another is refused.
FOUR_BIT_BLOCKSIZES: frozenset[int] = frozenset({16, 32, 64, 128, 256, 512, 1024})
# Levels 2/15 apart: half a step, plus float32 slack of the rotations (see the module docstring).
FOUR_BIT_REL_ERROR = 1.0 / 15.0 + 2.0**-12

FEW_BIT_DEFAULT_BLOCKSIZE = 128
FEW_BIT_BLOCKSIZES: frozenset[int] = FOUR_BIT_BLOCKSIZES
# float32 rounding of the rotations, relative to 1 / (L - 1) (see "The 2- and 3-bit error bound")
FEW_BIT_SLACK = 2.0**-12

#: The levels of ``5level``: a zero, and an inner level placed for the rotated blocks' near-Gaussian
#: values (0.34 relative error at block 64 against 0.38 with evenly spaced levels at 1/2).
FIVE_LEVELS: tuple[float, ...] = (-1.0, -0.375, 0.0, 0.375, 1.0)
FIVE_LEVEL_DEFAULT_BLOCKSIZE = 64
# up to 128: the worst case grows with the block (see "The 5-level bound"), and wider blocks save
# little (the scale is 16 bits a block)
FIVE_LEVEL_BLOCKSIZES: frozenset[int] = frozenset({16, 32, 64, 128})
#: Relative error of the bfloat16 scale, rounded up: under one unit in its last place.
BF16_SCALE_SLACK = 2.0**-7
_FIVE_LEVEL_VALUES = torch.tensor(FIVE_LEVELS)
_FIVE_LEVEL_MIDPOINTS = (_FIVE_LEVEL_VALUES[1:] + _FIVE_LEVEL_VALUES[:-1]) / 2


@dataclass(frozen=True)
class EncodedTensor:
    """What a codec produces: the main bytes plus the side data the decoder needs."""

    payload: bytes | memoryview
    absmax: bytes | None = None  # per block, little-endian: float32 (8bit, 4bit, 3bit, 2bit), bfloat16 (5level)
    blocksize: int | None = None  # 8bit, 4bit, 3bit, 2bit and 5level only


class Codec(abc.ABC):
    """One way of turning a tensor into bytes and back."""

    name: ClassVar[str]
    floating_only: ClassVar[bool] = True

    @abc.abstractmethod
    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        """Encode ``tensor`` (moved to a contiguous CPU copy first if it is not one already)."""

    @abc.abstractmethod
    def decode(self, enc: EncodedTensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Rebuild a writable CPU tensor of ``dtype`` and ``shape``; ``enc`` is remote input."""

    def __repr__(self) -> str:
        return f"<codec {self.name!r}>"

    def _cpu_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """The contiguous CPU tensor to encode; refuses dtypes this codec cannot carry."""
        if self.floating_only and not tensor.is_floating_point():
            raise TypeError(
                f"codec {self.name!r} encodes floating-point tensors only, got {tensor.dtype}; "
                "send integer and bool tensors with codec 'none'"
            )
        return tensor.detach().to("cpu").contiguous()

    def _check_decodable(self, dtype: torch.dtype) -> None:
        if self.floating_only and not dtype.is_floating_point:
            raise UnsupportedDtype(
                f"codec {self.name!r} carries floating-point tensors only, but the frame declares "
                f"{_dtype_name(dtype)}; send integer and bool tensors with codec 'none'"
            )


class _RawCodec(Codec):
    """Shared body of the codecs that send every element in a fixed-width transport dtype."""

    @abc.abstractmethod
    def _transport_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the bytes travel in, for a tensor declared as ``dtype``."""

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        cpu = self._cpu_input(tensor)
        wire = cpu.to(self._transport_dtype(cpu.dtype))
        return EncodedTensor(payload=_bytes_view(wire))

    def decode(self, enc: EncodedTensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        self._check_decodable(dtype)
        wire_dtype = self._transport_dtype(dtype)
        numel = _numel(shape)
        _check_length("payload", enc.payload, numel * wire_dtype.itemsize, self.name, shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        # bytearray() is the one copy: it yields memory torch may write to without a warning.
        values = torch.frombuffer(bytearray(enc.payload), dtype=wire_dtype)
        if wire_dtype == torch.bool and bool(values.view(torch.uint8).gt(1).any()):
            raise MalformedFrame("a bool tensor's payload may only contain the bytes 0 and 1")
        return values.to(dtype).reshape(shape)


class NoneCodec(_RawCodec):
    """Exact: the tensor's own bytes."""

    name = "none"
    floating_only = False

    def _transport_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype


class Fp16Codec(_RawCodec):
    """Half the bytes of float32; relative error <= 2**-11, range +-65504."""

    name = "fp16"

    def _transport_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float16


class Bf16Codec(_RawCodec):
    """Half the bytes of float32; relative error <= 2**-8, float32's range."""

    name = "bf16"

    def _transport_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16


class EightBitCodec(Codec):
    """A quarter of the bytes of float32; error <= EIGHT_BIT_REL_ERROR * absmax of the block."""

    name = "8bit"

    def __init__(self, blocksize: int = EIGHT_BIT_DEFAULT_BLOCKSIZE) -> None:
        if blocksize not in EIGHT_BIT_BLOCKSIZES:
            raise ValueError(f"blocksize must be one of {sorted(EIGHT_BIT_BLOCKSIZES)}, got {blocksize}")
        self.blocksize = blocksize

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        cpu = self._cpu_input(tensor).float()
        if cpu.numel() == 0:
            return EncodedTensor(payload=b"", absmax=b"", blocksize=self.blocksize)
        codes, absmax = _quantize_blockwise(cpu.reshape(-1), self.blocksize)
        return EncodedTensor(payload=_bytes_view(codes), absmax=_bytes_view(absmax).tobytes(), blocksize=self.blocksize)

    def decode(self, enc: EncodedTensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        self._check_decodable(dtype)
        blocksize = enc.blocksize
        if blocksize is None or enc.absmax is None:
            raise MalformedFrame("an 8bit tensor needs its blocksize ('b') and per-block absmax ('a')")
        if blocksize not in EIGHT_BIT_BLOCKSIZES:
            raise MalformedFrame(
                f"8bit blocksize must be one of {sorted(EIGHT_BIT_BLOCKSIZES)}, the frame says {blocksize}"
            )
        numel = _numel(shape)
        blocks = -(-numel // blocksize)
        _check_length("payload", enc.payload, numel, self.name, shape)
        _check_length("absmax", enc.absmax, blocks * 4, self.name, shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        codes = torch.frombuffer(bytearray(enc.payload), dtype=torch.uint8)
        absmax = torch.frombuffer(bytearray(enc.absmax), dtype=torch.float32)
        values = _bnb_functional().dequantize_blockwise(codes, absmax=absmax, code=_code_map(), blocksize=blocksize)
        return values.to(dtype).reshape(shape)


class _RotatedBlockCodec(Codec):
    """Hadamard-rotated blocks, each divided by its absmax and rounded to the nearest of a few levels
    in [-1, 1] (``2**bits`` evenly spaced ones, or :meth:`_codes`' own), plus the absmax per block.
    Rows of zeros keep absmax 0; rows holding ``inf``/``nan`` get absmax ``nan`` (they decode as
    ``nan`` throughout). The codecs differ only in their block sizes, their levels, their scale's
    dtype and how the codes are packed (:meth:`_pack`, :meth:`_unpack`)."""

    bits: ClassVar[int]  # 2**bits evenly spaced levels (:meth:`_codes`); unset where a codec has its own levels
    blocksizes: ClassVar[frozenset[int]]
    default_blocksize: ClassVar[int]
    #: How each block's absmax travels: float32 (exact), or bfloat16 rounded *up* (never below the
    #: absmax, so no value is clipped; less than 2**-7 above it unless subnormal) for half the bytes.
    scale_dtype: ClassVar[torch.dtype] = torch.float32

    def __init__(self, blocksize: int | None = None) -> None:
        blocksize = self.default_blocksize if blocksize is None else blocksize
        if blocksize not in self.blocksizes:
            raise ValueError(f"blocksize must be one of {sorted(self.blocksizes)}, got {blocksize}")
        self.blocksize = blocksize

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        flat = self._cpu_input(tensor).float().reshape(-1)
        size = self.blocksize
        full = flat.numel() // size
        tail = hadamard.tail_size(flat.numel(), size)
        levels: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        if full:
            lv, sc = self._quantize(flat[: full * size].view(full, size))
            levels.append(lv)
            scales.append(sc)
        if tail:
            rest = flat[full * size :]
            lv, sc = self._quantize(torch.cat([rest, rest.new_zeros(tail - rest.numel())]).view(1, tail))
            levels.append(lv)
            scales.append(sc)
        if not levels:
            return EncodedTensor(payload=b"", absmax=b"", blocksize=size)
        packed = self._pack(levels[0] if len(levels) == 1 else torch.cat(levels))
        scale_bytes = _bytes_view(torch.cat(scales).to(self.scale_dtype)).tobytes()
        return EncodedTensor(payload=_bytes_view(packed), absmax=scale_bytes, blocksize=size)

    def decode(self, enc: EncodedTensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        self._check_decodable(dtype)
        size = enc.blocksize
        if size is None or enc.absmax is None:
            raise MalformedFrame(f"a {self.name} tensor needs its blocksize ('b') and per-block absmax ('a')")
        if size not in self.blocksizes:
            raise MalformedFrame(
                f"{self.name} blocksize must be one of {sorted(self.blocksizes)}, the frame says {size}"
            )
        numel = _numel(shape)
        full, tail = numel // size, hadamard.tail_size(numel, size)
        count = full * size + tail
        _check_length("payload", enc.payload, self._payload_bytes(count), self.name, shape)
        _check_length("absmax", enc.absmax, (full + (1 if tail else 0)) * self.scale_dtype.itemsize, self.name,
                      shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        packed = torch.frombuffer(bytearray(enc.payload), dtype=torch.uint8)
        scales = torch.frombuffer(bytearray(enc.absmax), dtype=self.scale_dtype).float()
        levels = self._values(self._unpack(packed, count))
        parts: list[torch.Tensor] = []
        if full:
            rows = levels[: full * size].view(full, size).mul_(scales[:full].unsqueeze(1))
            parts.append(hadamard.unrotate(rows).reshape(-1))
        if tail:
            row = levels[full * size :].view(1, tail).mul_(scales[full:])
            parts.append(hadamard.unrotate(row).reshape(-1)[: numel - full * size])
        values = parts[0] if len(parts) == 1 else torch.cat(parts)
        return values.to(dtype).reshape(shape)

    def _quantize(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (flat, unpacked: :meth:`_codes`) and the absmax per row of float32 ``blocks``
        ``[rows, n]`` after the rotation, as the scale travels (:attr:`scale_dtype`, held in float32)."""
        rotated = hadamard.rotate(blocks)
        absmax = rotated.abs().amax(dim=1)
        if self.scale_dtype == torch.bfloat16:
            absmax = _round_up_to_bfloat16(absmax)
        usable = torch.isfinite(absmax) & (absmax > 0)
        if not bool(usable.all()):
            rotated = torch.where(usable.unsqueeze(1), rotated, torch.zeros_like(rotated))
            absmax = torch.where(torch.isfinite(absmax), absmax, torch.full_like(absmax, math.nan))
        divisor = torch.where(usable, absmax, torch.ones_like(absmax))
        return self._codes(rotated.div_(divisor.unsqueeze(1))).reshape(-1), absmax

    def _codes(self, scaled: torch.Tensor) -> torch.Tensor:
        """The code of the level nearest to each of ``scaled`` (in [-1, 1]): here ``2**bits`` evenly
        spaced levels, codes as whole floats in [0, 2**bits)."""
        top = 2**self.bits - 1
        return scaled.add_(1.0).mul_(top / 2).round_().clamp_(0, top)

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        """The levels (in [-1, 1], float32) of decoded ``codes``; the inverse of :meth:`_codes`."""
        return codes.float().div_((2**self.bits - 1) / 2).sub_(1.0)

    @abc.abstractmethod
    def _pack(self, levels: torch.Tensor) -> torch.Tensor:
        """uint8 bytes of the flat codes ``levels`` (whole numbers, as :meth:`_codes` makes them)."""

    @abc.abstractmethod
    def _unpack(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        """The first ``count`` codes of :meth:`_pack`'s bytes (remote input: bytes no
        :meth:`_pack` makes raise :class:`MalformedFrame`)."""

    @abc.abstractmethod
    def _payload_bytes(self, count: int) -> int:
        """How many bytes :meth:`_pack` makes of ``count`` codes."""


class FourBitCodec(_RotatedBlockCodec):
    """An eighth of the bytes of float32 plus an absmax per block; Hadamard-rotated blocks, two
    codes a byte."""

    name = "4bit"
    bits = 4
    blocksizes = FOUR_BIT_BLOCKSIZES
    default_blocksize = FOUR_BIT_DEFAULT_BLOCKSIZE

    def _pack(self, levels: torch.Tensor) -> torch.Tensor:
        return hadamard.pack_levels(levels)

    def _unpack(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        return hadamard.unpack_nibbles(packed, count)

    def _payload_bytes(self, count: int) -> int:
        return (count + 1) // 2


class _FewBitCodec(_RotatedBlockCodec):
    """``4bit``'s rule with fewer levels, packed as bit planes; for error-fed gradient averaging
    (see "The 2- and 3-bit error bound")."""

    blocksizes = FEW_BIT_BLOCKSIZES
    default_blocksize = FEW_BIT_DEFAULT_BLOCKSIZE

    def _pack(self, levels: torch.Tensor) -> torch.Tensor:
        return hadamard.pack_bits(levels, self.bits)

    def _unpack(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        return hadamard.unpack_bits(packed, count, self.bits)

    def _payload_bytes(self, count: int) -> int:
        return self.bits * ((count + 7) // 8)


class TwoBitCodec(_FewBitCodec):
    """A sixteenth of the bytes of float32 plus an absmax per block: four levels. For error-fed
    gradient averaging."""

    name = "2bit"
    bits = 2


class ThreeBitCodec(_FewBitCodec):
    """Three bits a value plus an absmax per block: eight levels. For error-fed gradient averaging."""

    name = "3bit"
    bits = 3


class FiveLevelCodec(_RotatedBlockCodec):
    """Five levels with a zero, ``-1, -3/8, 0, 3/8, 1``, 24 codes in 7 bytes, and a bfloat16 absmax
    per block of 64: 2.58 bits a value. Error-fed gradient averaging that never amplifies what it
    is given (see "The 5-level bound")."""

    name = "5level"
    blocksizes = FIVE_LEVEL_BLOCKSIZES
    default_blocksize = FIVE_LEVEL_DEFAULT_BLOCKSIZE
    scale_dtype = torch.bfloat16

    def _codes(self, scaled: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(scaled, _FIVE_LEVEL_MIDPOINTS)

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        return _FIVE_LEVEL_VALUES[codes]

    def _pack(self, levels: torch.Tensor) -> torch.Tensor:
        return hadamard.pack_radix(levels, len(FIVE_LEVELS))

    def _unpack(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        try:
            return hadamard.unpack_radix(packed, count, len(FIVE_LEVELS))
        except ValueError as exc:
            raise MalformedFrame(f"a 5level payload is not base-5 codes: {exc}") from None

    def _payload_bytes(self, count: int) -> int:
        return hadamard.radix_bytes(count, len(FIVE_LEVELS))


def _quantize_blockwise(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes and float32 absmax per block of a flat float32 tensor (see "The 8-bit encoder").

    Each value is divided by its block's absmax (so it lies in [-1, 1] exactly: IEEE division
    is monotone), its bin of :data:`_LUT_BINS` equal bins over [-1, 1] is computed, and the bin's
    code is looked up. A block of zeros keeps absmax 0 (it decodes as zeros); a block holding
    ``inf`` or ``nan`` gets absmax ``nan`` (it decodes as ``nan`` throughout).
    """
    n = flat.numel()
    blocks = -(-n // blocksize)
    if n % blocksize:
        flat = torch.cat([flat, flat.new_zeros(blocks * blocksize - n)])
    values = flat.view(blocks, blocksize)
    absmax = values.abs().amax(dim=1)
    usable = torch.isfinite(absmax) & (absmax > 0)
    all_usable = bool(usable.all())
    divisor = absmax if all_usable else torch.where(usable, absmax, torch.ones_like(absmax))
    half = _LUT_BINS / 2
    bins = values.div(divisor.unsqueeze(1)).mul_(half).add_(half)
    if not all_usable:  # inf / nan in a block: any valid bin will do, the block decodes as nan
        bins.nan_to_num_(nan=half, posinf=half, neginf=half)
        absmax = torch.where(torch.isfinite(absmax), absmax, torch.full_like(absmax, math.nan))
    # int32 bin numbers and index_select: three times faster than int64 and take
    codes = torch.index_select(_bin_codes(), 0, bins.clamp_(0, _LUT_BINS - 1).to(torch.int32).reshape(-1))
    return codes[:n], absmax


def five_level_bound(blocksize: int) -> float:
    """The most ``5level`` can err on a block of ``blocksize`` values, relative to the block's norm:
    ``||x - decode(encode(x))||_2 <= five_level_bound(n) * ||x||_2`` for every finite block (see
    "The 5-level bound"); below 1 for every allowed block size."""
    n = blocksize
    positive = [v for v in FIVE_LEVELS if v >= 0]
    worst = 0.0
    for low, high in zip(positive[:-1], positive[1:], strict=True):
        middle, half_gap = (low + high) / 2, (high - low) / 2
        worst = max(worst, (n - 1) * half_gap**2 / (1 + (n - 1) * middle**2))
    return math.sqrt(worst) * (1 + BF16_SCALE_SLACK) + BF16_SCALE_SLACK + FEW_BIT_SLACK


def eight_bit_error_bound() -> float:
    """The 8-bit per-element error bound, relative to the block's absmax, from the code map.

    Half the largest gap between adjacent codes (or the distance from +-1 to the outermost code,
    if larger), plus the encoder's bin width and float32 slack: see the module docstring.
    """
    code = torch.sort(_code_map().double()).values
    half_gap = float((code[1:] - code[:-1]).max()) / 2
    edge = max(1.0 - float(code[-1]), float(code[0]) + 1.0)
    return max(half_gap, edge) + _LUT_SLACK + _FLOAT_SLACK


_REGISTRY: dict[str, Codec] = {
    codec.name: codec
    for codec in (NoneCodec(), Fp16Codec(), Bf16Codec(), EightBitCodec(), FourBitCodec(), ThreeBitCodec(),
                  TwoBitCodec(), FiveLevelCodec())
}
CODECS: Mapping[str, Codec] = MappingProxyType(_REGISTRY)


def get_codec(name: str) -> Codec:
    """The registered codec called ``name``; unknown names are an error, never a fallback."""
    try:
        return CODECS[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name from a hostile frame
        raise UnknownCodec(f"unknown codec {name!r}; this peer supports {', '.join(sorted(CODECS))}") from None


# --- helpers -------------------------------------------------------------------------------------

_lazy_lock = threading.Lock()
_bnb: ModuleType | None = None
_code: torch.Tensor | None = None
_lut: torch.Tensor | None = None


class _NoFourBitKernelNotice(logging.Filter):
    """Drops bitsandbytes' import-time notice about an optional 4-bit CPU GEMM kernel.

    swarmd never uses 4-bit matmuls, so the notice ("Failed to load CPU gemm_4bit_forward ...
    pip install kernels") would only alarm users; every other bitsandbytes log line passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in str(record.msg)


def _bnb_functional() -> ModuleType:
    """``bitsandbytes.functional``, imported on first use (see the module docstring)."""
    global _bnb
    if _bnb is None:
        with _lazy_lock:
            if _bnb is None:
                logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoFourBitKernelNotice())
                compile_ = torch.compile
                torch.compile = _not_for_bitsandbytes(compile_)
                try:
                    import bitsandbytes.functional as functional
                finally:
                    torch.compile = compile_
                _bnb = functional
    return _bnb


def _not_for_bitsandbytes(compile_: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` for the duration of bitsandbytes' import: bitsandbytes' own functions
    are returned as they are (not compiled), anything else is passed through.

    At import, bitsandbytes wraps its default-backend kernels (4-bit dequantization, its
    optimizers' updates, a fallback blockwise dequantization) in ``torch.compile``, which imports
    TorchDynamo and Inductor: 2.3 of the 2.4 s the import takes here, paid by every daemon at
    start-up. swarmd calls none of those kernels (it decodes with the CPU backend's own
    ``dequantize_blockwise``), and an uncompiled function computes what its compiled form would.
    The import then takes 0.03 s.
    """

    def ours(model: Any) -> bool:
        return str(getattr(model, "__module__", "")).startswith("bitsandbytes")

    def compile_unless_bitsandbytes(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # decorator form: @torch.compile(...)
            return lambda fn: fn if ours(fn) else compile_(fn, **kwargs)
        return model if ours(model) else compile_(model, **kwargs)

    return compile_unless_bitsandbytes


def warm_up() -> None:
    """Import bitsandbytes, build the code map and the encoder's table now (seconds), not on the
    first 8-bit request.

    The daemon calls this off the event loop during start-up, so a peer that reports ready
    answers its first 8-bit request as fast as any other.
    """
    _bin_codes()


def _bin_codes() -> torch.Tensor:
    """The encoder's look-up table: for each of :data:`_LUT_BINS` equal bins over [-1, 1], the
    index of the code nearest to the bin's centre (exact: midpoints compared in float64)."""
    global _lut
    if _lut is None:
        code = _code_map().double()
        centres = (torch.arange(_LUT_BINS, dtype=torch.float64) + 0.5) * (2.0 / _LUT_BINS) - 1.0
        order = torch.argsort(code)
        midpoints = (code[order][1:] + code[order][:-1]) / 2
        lut = order[torch.searchsorted(midpoints, centres)].to(torch.uint8)
        with _lazy_lock:
            if _lut is None:
                _lut = lut
    return _lut


def _code_map() -> torch.Tensor:
    """The signed dynamic 8-bit code map; computed once, never sent, never modified."""
    global _code
    if _code is None:
        code = _bnb_functional().create_dynamic_map(signed=True).to(torch.float32)
        with _lazy_lock:
            if _code is None:
                _code = code
    return _code


def _round_up_to_bfloat16(values: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 ``values`` rounded up to the next bfloat16 (held in float32): the low 16
    bits of each cleared after adding 0xFFFF to it. ``inf`` stays ``inf``, ``nan`` stays ``nan``;
    the largest finite values round up to ``inf``."""
    bits = values.contiguous().view(torch.int32).add(0xFFFF).bitwise_and_(-65536)
    return torch.where(torch.isnan(values), values, bits.view(torch.float32))


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, rank 0 included)."""
    if tensor.numel() == 0:  # empty tensors may carry strides that no byte view accepts
        return memoryview(b"")
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _numel(shape: tuple[int, ...]) -> int:
    if any(dim < 0 for dim in shape):
        raise MalformedFrame(f"a tensor shape cannot have negative dimensions, got {list(shape)}")
    return math.prod(shape)


def _check_length(field: str, data: bytes | memoryview, expected: int, codec: str, shape: tuple[int, ...]) -> None:
    got = memoryview(data).nbytes
    if got != expected:
        raise MalformedFrame(
            f"codec {codec!r} needs {expected} {field} bytes for shape {list(shape)}, the frame has {got}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
