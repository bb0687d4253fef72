"""Streaming a stage's state (parameters, optimizer state, step) from a live peer to a joiner.

In SWARM (Ryabinin et al., 2023, section 3.2) a peer that joins a pipeline stage, or moves to
another one, does not start from scratch: it downloads the stage's current parameters and
optimizer statistics from a peer already serving it, then takes part in the next averaging
round. This module is that download: the byte format (:func:`iter_state_chunks` and the
sans-I/O :class:`StateStreamDecoder`) and the thin aiohttp glue around it (:func:`stream_state`
on the serving peer, :func:`download_state` on the joining one). A stage's state is 100 KB to
about 1 GB (85M parameters plus two Adam moments), so both sides stream it: neither side ever
holds the body, only the tensors themselves and about one chunk in flight.

The stream
----------
``Content-Type: application/x-swarmd-state`` (:data:`STATE_CONTENT_TYPE`), sent with chunked
transfer encoding. The body is a sequence of self-delimiting msgpack maps (string keys; keys a
decoder does not know are ignored, so a newer peer may add some)::

    header   {"v": 1,                      # stream version; anything else is refused
              "kind": "state_header",
              "meta": {...},               # the caller's msgpack-able dict: step, digests, ...
              "tensors": [{"n": name, "d": dtype, "s": [dims]}, ...],   # in content order
              "bytes": total,              # sum of every tensor's byte size
              "chunk": chunk_bytes}        # size of every chunk but the last
    chunk k  {"kind": "state_chunk",
              "i": k,                      # 0, 1, 2, ... in order
              "o": k * chunk_bytes,        # offset of this payload in the content
              "h": <32 bytes>,             # running SHA-256, see below
              "p": <bin>}                  # content[o : o + min(chunk_bytes, total - o)]
    trailer  {"kind": "state_end",
              "chunks": n,                 # how many chunk messages were sent
              "bytes": total,
              "h": <32 bytes>}             # the running SHA-256 over everything

The *content* is every tensor's raw bytes (little-endian, C order, its own dtype: the ``none``
codec of ``swarmd.net.wire``, so the round trip is exact), concatenated in header order. Cutting
that one byte string into equal chunks packs many small tensors (biases, 0-d step counters) into
one chunk and splits a large tensor across many, with no per-tensor framing; empty tensors take
no bytes. The running hash after chunk ``k`` is ``SHA-256(header message bytes || p_0 || ... ||
p_k)``: one hashing pass per side, a corrupt chunk is caught at that chunk (not only at the end),
and the header's own bytes (meta, shapes) are covered too; chunk indices and offsets are checked
for equality rather than hashed. The trailer proves that the stream was not cut short: a body
that ends without it, or has bytes after it, is refused.

The receiving side treats the stream as hostile (:class:`StateStreamDecoder`). Before any tensor
is allocated it checks the header against :class:`StateLimits` (header bytes, tensor count, name
length, rank, dtypes from ``swarmd.net.wire.ALLOWED_DTYPES``, chunk size bounds) and the declared
total against ``max_total_bytes``, and runs the caller's ``expected(meta)`` check. msgpack's own
length limits and a budget on array and map entries keep a small header from expanding into
gigabytes of Python objects. Every failure raises :class:`~swarmd.errors.StateTransferError`
naming the peer's URL; a partial state is never returned. The checksums guard against accidental
corruption and truncation; they do not authenticate a peer (a hostile donor can hash its own
bytes), which is why callers also check ``meta`` (spec digest, parameters digest) themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack
import torch
from aiohttp import web

from swarmd.errors import StateTransferError, SwarmdError
from swarmd.net.wire import ALLOWED_DTYPES, KIND_NAMES, media_type, type_name, wire_dtype_name

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_STATE_LIMITS",
    "STATE_CONTENT_TYPE",
    "STATE_STREAM_VERSION",
    "StateLimits",
    "StateSnapshot",
    "StateStreamDecoder",
    "download_state",
    "iter_state_chunks",
    "stream_state",
]

log = logging.getLogger(__name__)

STATE_CONTENT_TYPE = "application/x-swarmd-state"
STATE_STREAM_VERSION = 1
DEFAULT_CHUNK_BYTES = 4 * 2**20

_HEADER, _CHUNK, _TRAILER = "state_header", "state_chunk", "state_end"
_DIGEST_BYTES = hashlib.sha256().digest_size
# A chunk or trailer message without its payload: five short keys, two 64-bit ints, a digest.
_MESSAGE_OVERHEAD = 128
# The decoder slices what it is fed into pieces of at most this size, so msgpack's buffer never
# holds more than one message plus one piece, whatever size the caller feeds.
_FEED_BYTES = 256 * 2**10
# What download_state asks aiohttp to buffer per read: large enough that hopping to a worker
# thread per piece costs nothing, small enough to stay well under one chunk.
_READ_BYTES = 2**20
# How much of an error body download_state reads to quote the peer's message.
_ERROR_BODY_BYTES = 4096


@dataclass(frozen=True)
class StateLimits:
    """What a state stream's header may declare; checked before anything is allocated.

    The defaults fit an 85M-parameter stage with Adam (a few hundred tensors) many times over.
    ``min_chunk_bytes`` bounds the framing overhead a peer can make us parse (about 85 bytes per
    chunk message), ``max_chunk_bytes`` the memory one message may take.
    """

    max_header_bytes: int = 16 * 2**20
    max_tensors: int = 65536
    max_name_len: int = 512
    max_rank: int = 8
    max_meta_values: int = 2**18  # array and map entries in meta, all levels together
    min_chunk_bytes: int = 1024
    max_chunk_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StateLimits.{name} must be a positive integer, got {value!r}")
        if self.min_chunk_bytes > self.max_chunk_bytes:
            raise ValueError("StateLimits.min_chunk_bytes must not exceed max_chunk_bytes")


DEFAULT_STATE_LIMITS = StateLimits()


@dataclass(frozen=True)
class StateSnapshot:
    """A stage's state at one step: CPU tensors (detached and cloned by the caller) and meta.

    Tensor names are ``param.<name>`` for parameters and ``opt.<...>`` for optimizer tensors by
    convention; this module only requires them to be unique non-empty strings. ``meta`` must be
    msgpack-able (str keys; None, bool, int, float, str, bytes, lists and maps): tuples arrive as
    lists. Tensors are streamed in the dict's order and come back in the same order.
    """

    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


# --- encoding (pure, no I/O) ---------------------------------------------------------------------


def iter_state_chunks(
    snapshot: StateSnapshot,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    limits: StateLimits = DEFAULT_STATE_LIMITS,
) -> Iterator[bytes]:
    """The stream as messages (header, chunks, trailer), produced lazily one at a time.

    The snapshot is checked now, when this is called, so that a bad one fails before a response
    is started: a tensor with a dtype outside the wire's allow-list raises
    :class:`~swarmd.errors.UnsupportedDtype`, other local mistakes ``TypeError``/``ValueError``
    (including a header or chunk size the default receiver would refuse). The returned iterator
    copies tensor bytes only into the chunk being built, so memory stays at one chunk however
    large the state is; a tensor that is not a contiguous CPU tensor is copied to one only when
    the stream reaches it.
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise TypeError(f"chunk_bytes must be an integer, got {chunk_bytes!r}")
    if not limits.min_chunk_bytes <= chunk_bytes <= limits.max_chunk_bytes:
        raise ValueError(
            f"chunk_bytes must lie in [{limits.min_chunk_bytes}, {limits.max_chunk_bytes}], got {chunk_bytes}"
        )
    if not isinstance(snapshot.meta, dict):
        raise TypeError(f"StateSnapshot.meta must be a dict, got {type(snapshot.meta).__name__}")
    if len(snapshot.tensors) > limits.max_tensors:
        raise ValueError(f"the snapshot has {len(snapshot.tensors)} tensors, over the limit of {limits.max_tensors}")
    entries: list[dict[str, Any]] = []
    total = 0
    for name, tensor in snapshot.tensors.items():
        if not isinstance(name, str) or not 0 < len(name) <= limits.max_name_len:
            raise ValueError(
                f"tensor names must be strings of 1 to {limits.max_name_len} characters, got {name!r:.80}"
            )
        dtype_name = wire_dtype_name(name, tensor)
        if tensor.dim() > limits.max_rank:
            raise ValueError(f"tensor {name!r} has rank {tensor.dim()}, over the limit of {limits.max_rank}")
        entries.append({"n": name, "d": dtype_name, "s": list(tensor.shape)})
        total += tensor.numel() * tensor.element_size()
    header_dict = {
        "v": STATE_STREAM_VERSION,
        "kind": _HEADER,
        "meta": snapshot.meta,
        "tensors": entries,
        "bytes": total,
        "chunk": chunk_bytes,
    }
    try:
        header = msgpack.packb(header_dict, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"the snapshot's meta cannot be sent as msgpack: {exc}") from exc
    if len(header) > limits.max_header_bytes:
        raise ValueError(
            f"the state header is {len(header)} bytes, over the receiver's {limits.max_header_bytes}-byte limit; "
            "keep bulk data in tensors, not meta"
        )
    return _generate(header, list(snapshot.tensors.values()), total, chunk_bytes)


def _generate(header: bytes, tensors: list[torch.Tensor], total: int, chunk_bytes: int) -> Iterator[bytes]:
    hasher = hashlib.sha256(header)
    yield header
    index = 0
    parts: list[memoryview] = []
    filled = 0
    for tensor in tensors:
        data = _byte_view(tensor)
        pos = 0
        while pos < len(data):
            take = min(chunk_bytes - filled, len(data) - pos)
            part = data[pos : pos + take]
            hasher.update(part)
            parts.append(part)
            filled += take
            pos += take
            if filled == chunk_bytes:
                yield _chunk_message(index, index * chunk_bytes, hasher.digest(), parts, filled)
                index += 1
                parts, filled = [], 0
    if filled:
        yield _chunk_message(index, index * chunk_bytes, hasher.digest(), parts, filled)
        index += 1
    yield msgpack.packb({"kind": _TRAILER, "chunks": index, "bytes": total, "h": hasher.digest()}, use_bin_type=True)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes without a copy (one copy if it is not a contiguous CPU tensor)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def _chunk_message(index: int, offset: int, digest: bytes, parts: list[memoryview], size: int) -> bytes:
    """``msgpack.packb({"kind", "i", "o", "h", "p"})``, byte for byte, copying the payload once."""
    packer = msgpack.Packer(use_bin_type=True)
    head = b"".join(
        [
            packer.pack_map_header(5),
            packer.pack("kind"),
            packer.pack(_CHUNK),
            packer.pack("i"),
            packer.pack(index),
            packer.pack("o"),
            packer.pack(offset),
            packer.pack("h"),
            packer.pack(digest),
            packer.pack("p"),
            _bin_header(size),
        ]
    )
    return b"".join([head, *parts])


def _bin_header(size: int) -> bytes:
    if size < 2**8:
        return struct.pack(">BB", 0xC4, size)
    if size < 2**16:
        return struct.pack(">BH", 0xC5, size)
    return struct.pack(">BI", 0xC6, size)  # chunk sizes are far below 4 GiB (StateLimits)


# --- decoding (pure, no I/O) ---------------------------------------------------------------------


@dataclass
class _Slot:
    """One announced tensor and where its bytes go."""

    name: str
    tensor: torch.Tensor
    view: memoryview  # the tensor's bytes, writable


class StateStreamDecoder:
    """Rebuilds a :class:`StateSnapshot` from stream bytes fed in pieces of any size.

    Sans-I/O, so it is testable byte by byte and usable with any transport. :meth:`feed` raises
    :class:`~swarmd.errors.StateTransferError` as soon as something is wrong (a header over the
    limits, a chunk out of order or with a bad checksum, bytes after the trailer);
    :meth:`finish` returns the snapshot only if the trailer arrived and everything matched.
    ``expected(meta)`` is called once, as soon as the header is decoded and before any tensor
    is allocated; raising a :class:`~swarmd.errors.SwarmdError` or ``ValueError`` there rejects
    the stream (it surfaces as ``StateTransferError`` with the original as ``__cause__``).
    Memory: msgpack's buffer (one message plus one fed piece), the current chunk's payload, and
    the preallocated tensors.
    """

    def __init__(
        self,
        *,
        max_total_bytes: int = 8 * 2**30,
        limits: StateLimits = DEFAULT_STATE_LIMITS,
        expected: Callable[[dict[str, Any]], None] | None = None,
        url: str = "",
    ) -> None:
        self.max_total_bytes = max_total_bytes
        self.limits = limits
        self.url = url
        self._expected = expected
        self._raw = bytearray()  # stream bytes kept until the header is decoded, to hash them
        self._budget = _ValueBudget(limits.max_meta_values + limits.max_tensors * (8 + limits.max_rank) + 64)
        self._unpacker_fed = 0
        self._unpacker = self._new_unpacker(
            max_buffer=limits.max_header_bytes + _FEED_BYTES,
            max_str=limits.max_header_bytes,
            max_bin=limits.max_header_bytes,
            max_container=max(limits.max_meta_values, limits.max_tensors),
            hooks=True,
        )
        self.meta: dict[str, Any] | None = None  # set once the header is decoded and accepted
        self._slots: list[_Slot] = []
        self._hasher = hashlib.sha256()
        self._total = 0
        self._chunk_bytes = 0
        self._received = 0
        self._chunks = 0
        self._slot_index = 0
        self._slot_pos = 0
        self._done = False
        self._failed: StateTransferError | None = None
        self.stream_bytes = 0  # every byte fed, for progress and throughput reports

    # ---- public ------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        """The content size the header announced (0 before the header)."""
        return self._total

    @property
    def received_bytes(self) -> int:
        """Content bytes received and verified so far."""
        return self._received

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Consume the next piece of the stream; raises at the first problem found."""
        if self._failed is not None:
            raise self._failed
        view = memoryview(data).cast("B")
        self.stream_bytes += view.nbytes
        try:
            for start in range(0, view.nbytes, _FEED_BYTES):
                piece = view[start : start + _FEED_BYTES]
                if self._done:
                    raise self._error(f"{piece.nbytes}+ bytes follow the trailer; the stream must end there")
                if self.meta is None:
                    self._raw += piece
                self._feed_unpacker(piece)
                self._drain()
        except StateTransferError as exc:
            self._failed = exc
            raise

    def finish(self) -> StateSnapshot:
        """The snapshot, once the whole stream has been fed; raises if it ended early."""
        if self._failed is not None:
            raise self._failed
        if not self._done or self.meta is None:
            if self.meta is None:
                where = "before its header was complete"
            else:
                where = (
                    f"after {self._received} of {self._total} content bytes ({self._chunks} chunks) "
                    "without its trailer"
                )
            self._failed = self._error(f"the stream was truncated: it ended {where}")
            raise self._failed
        return StateSnapshot(meta=self.meta, tensors={slot.name: slot.tensor for slot in self._slots})

    # ---- messages ----------------------------------------------------------------------------

    def _drain(self) -> None:
        while not self._done:
            try:
                message = next(self._unpacker)
            except StopIteration:
                return
            except _Refused as exc:  # raised by our own msgpack hooks
                raise self._error(str(exc)) from None
            except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
                raise self._error(_msgpack_problem(exc)) from exc
            if not isinstance(message, dict):
                raise self._error(f"expected a msgpack map, got {type_name(message)}")
            if self.meta is None:
                self._header(message)
            else:
                self._message(message)

    def _header(self, message: dict[str, Any]) -> None:
        end = self._unpacker.tell()
        header_bytes, rest = bytes(self._raw[:end]), bytes(self._raw[end:])
        self._raw = bytearray()
        version = self._field(message, "v", int, "the header")
        if version != STATE_STREAM_VERSION:
            raise self._error(
                f"the stream has version {version}, but this peer reads only version {STATE_STREAM_VERSION}; "
                "run the same swarmd release on both sides"
            )
        kind = self._field(message, "kind", str, "the header")
        if kind != _HEADER:
            raise self._error(f"the stream must start with a {_HEADER!r} message, got {kind!r:.40}")
        meta = self._field(message, "meta", dict, "the header")
        entries = self._field(message, "tensors", list, "the header")
        declared = self._field(message, "bytes", int, "the header")
        chunk = self._field(message, "chunk", int, "the header")
        limits = self.limits
        if len(entries) > limits.max_tensors:
            raise self._error(f"the header announces {len(entries)} tensors, over the limit of {limits.max_tensors}")
        if not limits.min_chunk_bytes <= chunk <= limits.max_chunk_bytes:
            raise self._error(
                f"the header declares {chunk}-byte chunks, outside [{limits.min_chunk_bytes}, {limits.max_chunk_bytes}]"
            )
        if declared > self.max_total_bytes:
            raise self._error(
                f"the header declares {declared} bytes of tensors, over the {self.max_total_bytes}-byte limit"
            )
        specs, total = self._tensor_specs(entries)
        if total != declared:
            raise self._error(f"the header declares {declared} bytes, but its tensors' shapes add up to {total}")
        if self._expected is not None:
            try:
                self._expected(meta)
            except (SwarmdError, ValueError) as exc:
                raise self._error(f"the caller rejected the state's header: {exc}") from exc
        self._allocate(specs)
        self.meta = meta
        self._total, self._chunk_bytes = total, chunk
        self._hasher.update(header_bytes)
        self._skip_empty()
        # Chunks get their own unpacker, sized for one chunk message instead of a whole header.
        self._unpacker = self._new_unpacker(
            max_buffer=chunk + _MESSAGE_OVERHEAD + _FEED_BYTES,
            max_str=64,
            max_bin=max(chunk, _DIGEST_BYTES),
            max_container=16,
            hooks=False,
        )
        if rest:
            self._feed_unpacker(rest)  # at most one fed piece: fits the new buffer

    def _tensor_specs(self, entries: list[Any]) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], int]:
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        names: set[str] = set()
        total = 0
        for index, entry in enumerate(entries):
            where = f"tensors[{index}]"
            if not isinstance(entry, dict):
                raise self._error(f"{where} must be a map with keys n, d and s, got {type_name(entry)}")
            name = self._field(entry, "n", str, where)
            if not 0 < len(name) <= self.limits.max_name_len:
                raise self._error(
                    f"{where} has a name of {len(name)} characters; 1 to {self.limits.max_name_len} allowed"
                )
            if name in names:
                raise self._error(f"the header announces two tensors named {name!r:.80}")
            names.add(name)
            where = f"tensor {name!r:.80}"
            dtype_name = self._field(entry, "d", str, where)
            dtype = ALLOWED_DTYPES.get(dtype_name)
            if dtype is None:
                raise self._error(
                    f"{where} has dtype {dtype_name!r:.40}; the wire carries {', '.join(ALLOWED_DTYPES)}"
                )
            dims = self._field(entry, "s", list, where)
            if len(dims) > self.limits.max_rank:
                raise self._error(f"{where} has rank {len(dims)}, over the limit of {self.limits.max_rank}")
            for dim in dims:
                if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
                    raise self._error(f"{where} has shape {dims!r:.80}; dimensions are non-negative integers")
                if dim > self.max_total_bytes:  # bounds the product below, also when another dim is 0
                    raise self._error(
                        f"{where} declares a dimension of {dim}, over the {self.max_total_bytes}-byte limit"
                    )
            total += math.prod(dims) * dtype.itemsize
            if total > self.max_total_bytes:
                raise self._error(
                    f"the header's tensors add up to more than the {self.max_total_bytes}-byte limit "
                    f"(at {where}, shape {dims})"
                )
            specs.append((name, dtype, tuple(dims)))
        return specs, total

    def _allocate(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        try:
            for name, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=dtype)
                view = tensor.reshape(-1).view(torch.uint8).numpy().data
                self._slots.append(_Slot(name, tensor, view))
        except RuntimeError as exc:  # torch's out-of-memory on the CPU allocator
            self._slots = []
            raise self._error(f"could not allocate the announced tensors: {exc}") from exc

    def _message(self, message: dict[str, Any]) -> None:
        kind = self._field(message, "kind", str, "a message")
        if kind == _CHUNK:
            self._chunk(message)
        elif kind == _TRAILER:
            self._trailer(message)
        else:
            raise self._error(f"expected a {_CHUNK!r} or {_TRAILER!r} message, got {kind!r:.40}")

    def _chunk(self, message: dict[str, Any]) -> None:
        where = f"chunk {self._chunks}"
        index = self._field(message, "i", int, where)
        offset = self._field(message, "o", int, where)
        digest = self._field(message, "h", bytes, where)
        payload = self._field(message, "p", bytes, where)
        if index != self._chunks or offset != self._received:
            raise self._error(
                f"expected chunk {self._chunks} at offset {self._received}, got chunk {index} at offset {offset}: "
                "a chunk was lost, repeated or reordered"
            )
        want = min(self._chunk_bytes, self._total - self._received)
        if want <= 0:
            raise self._error(f"{where} arrived after all {self._total} announced bytes")
        if len(payload) != want:
            raise self._error(f"{where} carries {len(payload)} bytes; it must carry {want}")
        self._hasher.update(payload)
        if self._hasher.digest() != digest:
            raise self._error(f"{where} (content bytes {offset}..{offset + want}) fails its SHA-256 check: corrupted")
        self._scatter(memoryview(payload))
        self._received += want
        self._chunks += 1

    def _scatter(self, payload: memoryview) -> None:
        """Copy a payload into the tensors it spans, in header order."""
        pos = 0
        while pos < payload.nbytes:
            slot = self._slots[self._slot_index]
            take = min(slot.view.nbytes - self._slot_pos, payload.nbytes - pos)
            slot.view[self._slot_pos : self._slot_pos + take] = payload[pos : pos + take]
            self._slot_pos += take
            pos += take
            if self._slot_pos == slot.view.nbytes:
                if slot.tensor.dtype == torch.bool and bool(slot.tensor.view(torch.uint8).gt(1).any()):
                    raise self._error(f"bool tensor {slot.name!r:.80} holds bytes other than 0 and 1")
                self._slot_index += 1
                self._slot_pos = 0
                self._skip_empty()

    def _skip_empty(self) -> None:
        while self._slot_index < len(self._slots) and self._slots[self._slot_index].view.nbytes == 0:
            self._slot_index += 1

    def _trailer(self, message: dict[str, Any]) -> None:
        chunks = self._field(message, "chunks", int, "the trailer")
        total = self._field(message, "bytes", int, "the trailer")
        digest = self._field(message, "h", bytes, "the trailer")
        if self._received != self._total:
            raise self._error(
                f"the trailer came after {self._received} of {self._total} announced bytes: tensors are incomplete"
            )
        if chunks != self._chunks or total != self._total:
            raise self._error(
                f"the trailer counts {chunks} chunks and {total} bytes, but {self._chunks} chunks "
                f"and {self._received} bytes arrived"
            )
        if digest != self._hasher.digest():
            raise self._error("the trailer's SHA-256 does not match the stream: corrupted")
        self._done = True
        # Bytes already fed behind the trailer are refused here, bytes fed later by feed().
        if self._unpacker.tell() != self._unpacker_fed:
            raise self._error("bytes follow the trailer; the stream must end there")

    # ---- helpers -----------------------------------------------------------------------------

    def _feed_unpacker(self, data: bytes | memoryview) -> None:
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            raise self._error(self._buffer_full_message()) from None
        self._unpacker_fed += memoryview(data).nbytes

    def _new_unpacker(
        self, *, max_buffer: int, max_str: int, max_bin: int, max_container: int, hooks: bool
    ) -> msgpack.Unpacker:
        """A fresh unpacker (its ``tell()`` counts from 0) under the given msgpack limits."""
        self._unpacker_fed = 0
        kwargs: dict[str, Any] = {"object_pairs_hook": _string_keyed}
        if hooks:
            kwargs = {"list_hook": self._budget.array, "object_pairs_hook": self._budget.pairs}
        return msgpack.Unpacker(
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_buffer_size=max_buffer,
            max_str_len=max_str,
            max_bin_len=max_bin,
            max_array_len=max_container,
            max_map_len=max_container,
            max_ext_len=0,
            ext_hook=_refuse_ext,
            **kwargs,
        )

    def _buffer_full_message(self) -> str:
        if self.meta is None:
            return f"the header is longer than the {self.limits.max_header_bytes}-byte limit"
        return f"a message is longer than a {self._chunk_bytes}-byte chunk plus its framing"

    def _field(self, mapping: dict[str, Any], key: str, kind: type, where: str) -> Any:
        if key not in mapping:
            raise self._error(f"{where} has no {key!r} field")
        value = mapping[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self._error(f"{where} field {key!r} must be {KIND_NAMES[kind]}, got {type_name(value)}")
        return value

    def _error(self, message: str) -> StateTransferError:
        return StateTransferError(message, url=self.url)


class _Refused(Exception):
    """Raised from inside msgpack's hooks; the decoder turns it into a StateTransferError."""


class _ValueBudget:
    """Counts array and map entries while msgpack builds the header, and refuses non-str keys.

    msgpack's per-container limits alone would let a 16 MiB header hold millions of tiny
    containers, each a Python object; the budget bounds them all together.
    """

    def __init__(self, limit: int) -> None:
        self.left = limit
        self.limit = limit

    def _spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise _Refused(f"the header holds more than {self.limit} array and map entries in all")

    def array(self, items: list[Any]) -> list[Any]:
        self._spend(len(items))
        return items

    def pairs(self, pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
        self._spend(len(pairs))
        return _string_keyed(pairs)


def _string_keyed(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise _Refused(f"every map key in the stream must be a string, got {type_name(key)}")
        if key in result:
            raise _Refused(f"a map in the stream repeats the key {key!r:.40}")
        result[key] = value
    return result


def _refuse_ext(code: int, data: bytes) -> Any:
    raise _Refused(f"the stream holds a msgpack extension value (type {code}); the format has none")


def _msgpack_problem(exc: Exception) -> str:
    if isinstance(exc, msgpack.FormatError):
        return "the stream is not msgpack: it holds an invalid type byte (such as 0xc1)"
    if isinstance(exc, (msgpack.StackError, RecursionError)):
        return "the stream nests arrays or maps too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return f"a string in the stream is not valid UTF-8 ({exc.reason})"
    detail = str(exc) or type(exc).__name__
    if "exceeds max_" in detail:
        return f"a string, binary, array or map in the stream is longer than allowed ({detail})"
    if "map key" in detail:  # strict_map_key's wording since msgpack 1.0
        return f"every map key in the stream must be a string ({detail})"
    return f"the stream is not valid msgpack ({detail})"


# --- aiohttp glue --------------------------------------------------------------------------------


async def stream_state(
    request: web.Request,
    snapshot: StateSnapshot,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    executor: Executor | None = None,
    on_sent: Callable[[int], None] | None = None,
) -> web.StreamResponse:
    """Serve ``snapshot`` as the response to ``request``, one message at a time.

    ``on_sent(n)`` is told of every ``n`` bytes written (the daemon's state-transfer counters).

    Producing a chunk hashes and copies up to ``chunk_bytes`` (milliseconds for 4 MiB), so each
    one is made on ``executor`` (default: the loop's) while the loop keeps serving other
    requests; ``await resp.write`` then waits for the socket to drain, so a slow reader holds
    back production instead of piling chunks up in memory. A bad snapshot raises before the
    response starts (the data plane's middleware answers 4xx/5xx). Once bytes are sent an error
    can no longer be reported by status, so a failure mid-stream is logged and the connection
    closed: the client sees a truncated stream. A client that goes away just ends the stream.
    """
    messages = iter_state_chunks(snapshot, chunk_bytes)
    loop = asyncio.get_running_loop()
    resp = web.StreamResponse(headers={"Content-Type": STATE_CONTENT_TYPE, "Cache-Control": "no-store"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    sent = 0
    try:
        while (message := await loop.run_in_executor(executor, next, messages, None)) is not None:
            await resp.write(message)
            sent += len(message)
            if on_sent is not None:
                on_sent(len(message))
    except ConnectionError as exc:
        log.info("state stream to %s ended after %d bytes: the client went away (%s)", request.remote, sent, exc)
        return resp
    except Exception:
        log.exception("state stream to %s failed after %d bytes; closing the connection", request.remote, sent)
        if request.transport is not None:
            request.transport.close()
        return resp
    await resp.write_eof()
    return resp


async def download_state(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout_s: float = 300.0,
    max_total_bytes: int = 8 * 2**30,
    expected: Callable[[dict[str, Any]], None] | None = None,
    limits: StateLimits = DEFAULT_STATE_LIMITS,
    executor: Executor | None = None,
    headers: Mapping[str, str] | None = None,
    on_received: Callable[[int], None] | None = None,
) -> StateSnapshot:
    """GET ``url`` and rebuild the state it streams, verified; see the module docstring.

    ``headers``: extra request headers (a relayed donor's ``X-Swarm-Relay``, ``swarmd.net.relay``).
    ``on_received(n)``: told of every ``n`` body bytes read, whether the download succeeds or not
    (what a state download cost the network: the daemon's ``swarmd_state_transfer_bytes_total``).

    ``timeout_s`` bounds the whole download (connect, headers, body), replacing the session's
    own timeouts, which are usually sized for small requests. ``expected(meta)`` may reject the
    header (wrong stage, spec digest) by raising a ``SwarmdError`` or ``ValueError``; the
    download stops before any tensor is allocated. Verifying and copying a chunk runs on
    ``executor`` (default: the loop's), except while the header is being read, so that
    ``expected`` runs on the event loop's thread. Every failure raises
    :class:`~swarmd.errors.StateTransferError` naming ``url``.
    """
    decoder = StateStreamDecoder(max_total_bytes=max_total_bytes, limits=limits, expected=expected, url=url)
    try:
        return await asyncio.wait_for(_download(session, url, decoder, executor, headers or {}, on_received),
                                      timeout_s)
    except StateTransferError:
        raise
    except asyncio.TimeoutError as exc:
        got = f"{decoder.received_bytes} of {decoder.total_bytes} bytes" if decoder.meta is not None else "no header"
        raise StateTransferError(f"it did not finish within {timeout_s:g}s ({got} received)", url=url,
                                 unreachable=decoder.meta is None) from exc
    except aiohttp.ClientError as exc:
        raise StateTransferError(f"{type(exc).__name__}: {exc}", url=url,
                                 unreachable=isinstance(exc, aiohttp.ClientConnectorError)) from exc
    except OSError as exc:  # a socket error aiohttp did not wrap
        raise StateTransferError(f"{type(exc).__name__}: {exc}", url=url, unreachable=True) from exc


async def _download(
    session: aiohttp.ClientSession, url: str, decoder: StateStreamDecoder, executor: Executor | None,
    headers: Mapping[str, str], on_received: Callable[[int], None] | None = None,
) -> StateSnapshot:
    loop = asyncio.get_running_loop()
    async with session.get(
        url,
        timeout=aiohttp.ClientTimeout(total=None),  # the caller's deadline rules, see download_state
        read_bufsize=_READ_BYTES,
        headers={"Accept": STATE_CONTENT_TYPE, **headers},
        auto_decompress=False,
    ) as resp:
        if resp.status != 200:
            raise StateTransferError(await _refusal(resp), url=url, status=resp.status)
        answered = media_type(resp.headers.get("Content-Type"))
        if answered != STATE_CONTENT_TYPE:
            raise StateTransferError(f"the peer answered with {answered[:64]!r}, not {STATE_CONTENT_TYPE!r}", url=url)
        async for piece in resp.content.iter_chunked(_READ_BYTES):
            if on_received is not None:
                on_received(len(piece))
            if decoder.meta is None:
                decoder.feed(piece)  # on the loop: the header is small and `expected` runs here
            else:
                await loop.run_in_executor(executor, decoder.feed, piece)
    return decoder.finish()


async def _refusal(resp: aiohttp.ClientResponse) -> str:
    """The peer's error, from the data plane's JSON ``{"error", "message"}`` when it sent one."""
    body = b""
    while len(body) < _ERROR_BODY_BYTES and (piece := await resp.content.read(_ERROR_BODY_BYTES - len(body))):
        body += piece
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and "error" in data:
        message = str(data.get("message", ""))[:300]
        return f"the peer refused with HTTP {resp.status}: {data.get('error')}: {message}"
    return f"the peer refused with HTTP {resp.status}: {text[:300] or resp.reason or ''}"
