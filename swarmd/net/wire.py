"""The wire format of the data plane: one frame is one msgpack message, as pure functions.

SWARM's pipeline (Ryabinin et al., 2023) moves activations forward and gradients backward between
peers that do not trust each other's software versions, let alone their bytes.
This module is the part of that design that says what travels: a versioned, self-describing
frame, encoded and decoded without I/O (the aiohttp glue lives in ``swarmd.net.server`` and
``swarmd.net.client``, the tensor byte formats in ``swarmd.net.codecs``).

A frame (``Content-Type: application/x-msgpack``) is a single msgpack map::

    {"v": 1,                         # wire version; anything else is UnsupportedVersion
     "kind": "forward",              # what the frame is, 1..max_kind_len characters
     "meta": {"stage": 2, ...},      # str keys; values None/bool/int/float/str/bin/list/map
     "tensors": [                    # at most max_tensors entries, unique names, in order
        {"n": "inputs",              # name
         "d": "float32",             # dtype, one of ALLOWED_DTYPES
         "s": [4, 512, 1024],        # shape, at most max_rank non-negative ints
         "c": "8bit",                # codec, one of swarmd.net.codecs.CODECS
         "p": <bin>,                 # payload bytes
         "a": <bin>,                 # 8bit/4bit only: float32 absmax per block, little-endian
         "b": 4096},                 # 8bit/4bit only: block size
     ]}

Compatibility: decoders ignore keys they do not know (a newer peer may add some), and reject
required keys that are missing or of the wrong type. ``v`` is checked before any other field, so
a frame of another version is reported as such as long as it is a msgpack map with string keys
(every map key in a frame must be a string). ``encode_frame`` sends floating tensors with the
requested codec and integer/bool tensors with ``none``.

``decode_frame`` treats its input as hostile and raises only the typed errors of
``swarmd.errors``, translated from msgpack with ``raise ... from``:

- ``LimitExceeded``: frame bytes, tensor count, rank, elements per tensor, meta bytes (as
  re-encoded), ``kind`` length, or msgpack's own string/binary/array/map length limits;
- ``UnsupportedVersion``: ``v`` other than :data:`WIRE_VERSION`;
- ``UnknownCodec`` / ``UnsupportedDtype``: a codec or dtype this peer does not have, and also a
  float-only codec (``fp16``, ``bf16``, ``8bit``, ``4bit``) declared for an integer or bool tensor;
- ``MalformedFrame``: everything else (not msgpack, truncated, trailing bytes, wrong types,
  missing fields, duplicate names or keys, negative dimensions, payload lengths that do not match
  the declared dtype and shape, meta nested deeper than :data:`MAX_META_DEPTH`).

Sizes are checked before anything is built from them: the frame length before unpacking; string,
binary, array and map lengths by msgpack's unpack limits; the number of values in all arrays and
maps together by a budget counted while unpacking (so a small frame cannot expand into gigabytes
of Python objects); and each tensor's declared shape before any tensor memory is allocated.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgpack
import torch

from swarmd.errors import LimitExceeded, MalformedFrame, SwarmdError, UnsupportedDtype, UnsupportedVersion
from swarmd.net.codecs import CODECS, EncodedTensor, get_codec
from swarmd.net.limits import DEFAULT_LIMITS, WireLimits

__all__ = [
    "ALLOWED_DTYPES",
    "CONTENT_TYPE",
    "media_type",
    "DEFAULT_LIMITS",
    "WIRE_VERSION",
    "Frame",
    "WireLimits",
    "decode_frame",
    "encode_frame",
]

WIRE_VERSION = 1
CONTENT_TYPE = "application/x-msgpack"


def media_type(header: str | None) -> str:
    """The media type a ``Content-Type`` header names (lowercase, parameters dropped; "" for none).

    Read here rather than by aiohttp's ``content_type``, whose parser raises on some malformed
    parameters (``'V8p;_2*'``: an IndexError from the standard library's email parser): a header
    is remote input, and a bad one is a 415, never a 500."""
    return (header or "").split(";", 1)[0].strip().lower()

ALLOWED_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int64": torch.int64,
        "int32": torch.int32,
        "int16": torch.int16,  # token ids of vocabularies up to 32768 (swarmd.net.token_ids)
        "uint8": torch.uint8,
        "bool": torch.bool,
    }
)
_DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType({dtype: name for name, dtype in ALLOWED_DTYPES.items()})

# Meta is configuration-sized data; deeper nesting than this is a mistake or an attack.
MAX_META_DEPTH = 16
# Array/map entries a tensor entry or the top-level map may hold, known keys plus room for
# keys a newer peer adds; used to size the per-frame value budget.
_ENTRY_VALUES = 32




@dataclass(frozen=True)
class Frame:
    """A decoded frame. ``tensors`` keeps the frame's order; names are unique."""

    kind: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]


# --- encoding ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WireTensor:
    """A tensor encoded for the wire once (:func:`encode_tensor`), framed as it is by :func:`encode_frame`. A sender
    that must know what its receiver will decode (averaging with a lossy codec: error feedback and digests) decodes
    a frame of it and then sends the same bytes, instead of encoding the tensor twice."""

    entry: Mapping[str, Any]


def encode_tensor(tensor: torch.Tensor, codec: str = "none") -> WireTensor:
    """``tensor`` encoded with ``codec`` (for a floating tensor) as :func:`encode_frame` would, once."""
    return WireTensor(_encode_tensor("tensor", tensor, get_codec(codec).name))


def encode_frame(
    kind: str,
    meta: Mapping[str, Any] | None,
    tensors: Mapping[str, torch.Tensor | WireTensor] | None = None,
    codec: str = "none",
) -> bytes:
    """One frame as bytes. ``codec`` applies to floating tensors; the others always go as ``none``.

    Tensors are detached and moved to the CPU first. Local mistakes (a non-string kind, meta the
    wire cannot carry) raise ``TypeError``/``ValueError``; an unknown codec or a dtype outside
    :data:`ALLOWED_DTYPES` raise :class:`~swarmd.errors.UnknownCodec` /
    :class:`~swarmd.errors.UnsupportedDtype`, as they would on the receiving side.
    """
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"a frame kind must be a non-empty string, got {kind!r}")
    float_codec = get_codec(codec)
    meta_dict = dict(meta) if meta is not None else {}
    problem = _meta_problem(meta_dict, "meta", 0)
    if problem is not None:
        raise TypeError(f"meta cannot be sent: {problem}")
    entries = [_named(name, t.entry) if isinstance(t, WireTensor) else _encode_tensor(name, t, float_codec.name)
               for name, t in (tensors or {}).items()]
    return _pack_frame({"v": WIRE_VERSION, "kind": kind, "meta": meta_dict, "tensors": entries})


def wire_dtype_name(name: str, tensor: Any) -> str:
    """The wire's name for ``tensor``'s dtype; TypeError/UnsupportedDtype for what cannot travel."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
    dtype_name = _DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        raise UnsupportedDtype(
            f"tensor {name!r} has dtype {tensor.dtype}, which the wire does not carry; "
            f"convert it to one of {', '.join(ALLOWED_DTYPES)}"
        )
    return dtype_name


def _named(name: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """An encoded tensor's entry (:class:`WireTensor`) under ``name``, with its own codec (``encode_frame``'s
    ``codec`` is for the other tensors)."""
    _check_name(name)
    return {**entry, "n": name}


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"tensor names must be non-empty strings, got {name!r}")


def _encode_tensor(name: str, tensor: torch.Tensor, float_codec: str) -> dict[str, Any]:
    _check_name(name)
    dtype_name = wire_dtype_name(name, tensor)
    cpu = tensor.detach().to("cpu")
    codec = CODECS[float_codec if cpu.is_floating_point() else "none"]
    enc = codec.encode(cpu)
    entry: dict[str, Any] = {"n": name, "d": dtype_name, "s": list(cpu.shape), "c": codec.name, "p": enc.payload}
    if enc.absmax is not None:
        entry["a"] = enc.absmax
    if enc.blocksize is not None:
        entry["b"] = enc.blocksize
    return entry


def _pack_frame(frame: dict[str, Any]) -> bytes:
    """``msgpack.packb(frame)``, byte for byte, but copying each tensor payload only once.

    ``packb`` copies a large binary into its growing buffer and again into the result; here each
    tensor's bytes go straight from the tensor into the one joined result.
    """
    packer = msgpack.Packer(use_bin_type=True)
    parts: list[bytes | memoryview] = [packer.pack_map_header(len(frame))]
    for key, value in frame.items():
        parts.append(packer.pack(key))
        if key != "tensors":
            parts.append(packer.pack(value))
            continue
        parts.append(packer.pack_array_header(len(value)))
        for entry in value:
            parts.append(packer.pack_map_header(len(entry)))
            for field, item in entry.items():
                parts.append(packer.pack(field))
                if isinstance(item, (bytes, memoryview)):
                    parts += [_bin_header(memoryview(item).nbytes), item]
                else:
                    parts.append(packer.pack(item))
    return b"".join(parts)


def _bin_header(size: int) -> bytes:
    """The msgpack header of a binary of ``size`` bytes (bin 8, bin 16 or bin 32)."""
    if size < 2**8:
        return struct.pack(">BB", 0xC4, size)
    if size < 2**16:
        return struct.pack(">BH", 0xC5, size)
    if size < 2**32:
        return struct.pack(">BI", 0xC6, size)
    raise ValueError(f"a {size}-byte tensor payload is over msgpack's 4 GiB binary limit; split the tensor")


# --- decoding ------------------------------------------------------------------------------------


def decode_frame(data: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> Frame:
    """Decode one frame from untrusted bytes; raises only :class:`~swarmd.errors.WireError`s."""
    view = memoryview(data).cast("B")
    if view.nbytes > limits.max_frame_bytes:
        raise LimitExceeded(
            f"the frame is {view.nbytes} bytes, over this peer's {limits.max_frame_bytes}-byte limit; "
            "send fewer or smaller tensors (or a compressing codec) per request"
        )
    top = _unpack(view, limits)
    if not isinstance(top, dict):
        raise MalformedFrame(
            f"a frame must be a msgpack map with keys v, kind, meta and tensors, got {type_name(top)}"
        )
    version = _require(top, "v", int, "the frame")
    if version != WIRE_VERSION:
        raise UnsupportedVersion(
            f"the frame uses wire version {version}, but this peer reads only version {WIRE_VERSION}; "
            "run the same swarmd release on both sides"
        )
    kind = _require(top, "kind", str, "the frame")
    if not kind:
        raise MalformedFrame("the frame's 'kind' is empty; name what the frame is, e.g. 'forward'")
    if len(kind) > limits.max_kind_len:
        raise LimitExceeded(f"the frame's 'kind' is {len(kind)} characters, over the limit of {limits.max_kind_len}")
    meta = _decode_meta(_require(top, "meta", dict, "the frame"), limits)
    entries = _require(top, "tensors", list, "the frame")
    if len(entries) > limits.max_tensors:
        raise LimitExceeded(
            f"the frame carries {len(entries)} tensors, over this peer's limit of {limits.max_tensors}; "
            "split the request"
        )
    tensors: dict[str, torch.Tensor] = {}
    for index, entry in enumerate(entries):
        name, tensor = _decode_tensor(entry, index, limits)
        if name in tensors:
            raise MalformedFrame(f"the frame carries two tensors named {name!r}; tensor names must be unique")
        tensors[name] = tensor
    return Frame(kind=kind, meta=meta, tensors=tensors)


class _ValueBudget:
    """Counts the values of every array and map while msgpack builds them (its hooks)."""

    def __init__(self, limit: int) -> None:
        self.left = limit
        self.limit = limit

    def _spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise LimitExceeded(
                f"the frame holds more than {self.limit} array and map entries in all; "
                "send less metadata per request"
            )

    def array(self, items: list[Any]) -> list[Any]:
        self._spend(len(items))
        return items

    def pairs(self, pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
        self._spend(len(pairs))
        result: dict[str, Any] = {}
        for key, value in pairs:
            if not isinstance(key, str):
                raise MalformedFrame(
                    f"every map key in a frame must be a string, got {type_name(key)} ({key!r:.40})"
                )
            if key in result:
                raise MalformedFrame(f"a map in the frame repeats the key {key!r:.40}; keys must be unique")
            result[key] = value
        return result


def _unpack(view: memoryview, limits: WireLimits) -> Any:
    """msgpack's unpacker under limits derived from ``limits``, its errors translated."""
    container_len = max(limits.max_meta_bytes, limits.max_tensors, limits.max_rank, _ENTRY_VALUES)
    budget = _ValueBudget(limits.max_meta_bytes + (limits.max_tensors + 1) * (_ENTRY_VALUES + limits.max_rank))
    try:
        return msgpack.unpackb(
            view,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limits.max_meta_bytes,
            max_bin_len=limits.max_frame_bytes,
            max_array_len=container_len,
            max_map_len=container_len,
            max_ext_len=limits.max_meta_bytes,
            ext_hook=_refuse_ext,
            list_hook=budget.array,
            object_pairs_hook=budget.pairs,
        )
    except SwarmdError:
        raise
    except msgpack.ExtraData as exc:
        raise MalformedFrame("the frame has bytes after its msgpack message; send exactly one message") from exc
    except msgpack.FormatError as exc:
        raise MalformedFrame("the frame is not msgpack: it holds an invalid type byte (such as 0xc1)") from exc
    except (msgpack.StackError, RecursionError) as exc:
        raise MalformedFrame("the frame nests arrays or maps too deeply to decode") from exc
    except UnicodeDecodeError as exc:
        raise MalformedFrame(
            f"a string in the frame is not valid UTF-8 ({exc.reason} at offset {exc.start} of the string)"
        ) from exc
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # msgpack says which rule broke only in its message; these wordings hold since msgpack 1.0,
        # and a reworded message still ends up as MalformedFrame below.
        detail = str(exc) or type(exc).__name__
        if "exceeds max_" in detail:
            raise LimitExceeded(
                f"a string, binary, array or map in the frame is longer than this peer accepts ({detail})"
            ) from exc
        if "map key" in detail:
            raise MalformedFrame(f"every map key in a frame must be a string ({detail})") from exc
        raise MalformedFrame(f"the frame is not one complete msgpack message ({detail})") from exc


def _refuse_ext(code: int, data: bytes) -> Any:
    raise MalformedFrame(f"the frame holds a msgpack extension value (type {code}); the wire format has none")


def _decode_meta(meta: dict[str, Any], limits: WireLimits) -> dict[str, Any]:
    problem = _meta_problem(meta, "meta", 0)
    if problem is not None:
        raise MalformedFrame(f"the frame's meta is invalid: {problem}")
    size = len(msgpack.packb(meta, use_bin_type=True))
    if size > limits.max_meta_bytes:
        raise LimitExceeded(
            f"the frame's meta is {size} bytes, over this peer's {limits.max_meta_bytes}-byte limit; "
            "send bulk data as tensors"
        )
    return meta


_META_SCALARS = (type(None), bool, int, float, str, bytes)


def _meta_problem(value: Any, path: str, depth: int) -> str | None:
    """Why ``value`` cannot be meta (str keys; scalars, lists, maps), or None if it can."""
    if isinstance(value, _META_SCALARS):
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            return f"{path} is an integer outside msgpack's 64-bit range"
        return None
    if depth >= MAX_META_DEPTH:
        return f"{path} nests lists and maps deeper than {MAX_META_DEPTH} levels"
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            problem = _meta_problem(item, f"{path}[{i}]", depth + 1)
            if problem is not None:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path} has {type_name(key)} key ({key!r:.40}); meta keys must be strings"
            problem = _meta_problem(item, f"{path}[{key!r:.40}]", depth + 1)
            if problem is not None:
                return problem
        return None
    return f"{path} is {type_name(value)}; meta values are None, bool, int, float, str, bytes, lists and maps"


def _decode_tensor(entry: Any, index: int, limits: WireLimits) -> tuple[str, torch.Tensor]:
    where = f"tensors[{index}]"
    if not isinstance(entry, dict):
        raise MalformedFrame(f"{where} must be a map with keys n, d, s, c and p, got {type_name(entry)}")
    name = _require(entry, "n", str, where)
    if not name:
        raise MalformedFrame(f"{where} has an empty name; every tensor needs a non-empty 'n'")
    where = f"tensor {name!r:.40}"

    dtype_name = _require(entry, "d", str, where)
    dtype = ALLOWED_DTYPES.get(dtype_name)
    if dtype is None:
        raise UnsupportedDtype(
            f"{where} has dtype {dtype_name!r:.40}; this peer accepts {', '.join(ALLOWED_DTYPES)}"
        )
    shape = _decode_shape(_require(entry, "s", list, where), where, limits)
    codec = get_codec(_require(entry, "c", str, where))
    payload = _require(entry, "p", bytes, where)
    absmax = _optional(entry, "a", bytes, where)
    blocksize = _optional(entry, "b", int, where)
    if codec.floating_only and not dtype.is_floating_point:
        raise UnsupportedDtype(
            f"{where} is {dtype_name} but uses codec {codec.name!r}, which carries floating-point "
            "tensors only; send integer and bool tensors with codec 'none'"
        )
    return name, codec.decode(EncodedTensor(payload, absmax, blocksize), dtype, shape)


def _decode_shape(dims: list[Any], where: str, limits: WireLimits) -> tuple[int, ...]:
    """The declared shape, checked against the limits before anything is allocated."""
    if len(dims) > limits.max_rank:
        raise LimitExceeded(f"{where} has rank {len(dims)}, over this peer's limit of {limits.max_rank}")
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise MalformedFrame(f"{where} has {type_name(dim)} in its shape; dimensions are integers")
        if dim < 0:
            raise MalformedFrame(f"{where} has a negative dimension ({dim}) in its shape")
        if dim > limits.max_elements:  # also bounds the product below when another dim is 0
            raise LimitExceeded(
                f"{where} declares a dimension of {dim}, over this peer's {limits.max_elements}-element limit"
            )
    numel = math.prod(dims)
    if numel > limits.max_elements:
        raise LimitExceeded(
            f"{where} declares {numel} elements (shape {dims}), over this peer's limit of "
            f"{limits.max_elements} per tensor; split it across requests"
        )
    return tuple(dims)


def _require(mapping: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in mapping:
        raise MalformedFrame(f"{where} has no {key!r} field")
    return _optional(mapping, key, kind, where)


def _optional(mapping: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in mapping:
        return None
    value = mapping[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedFrame(f"{where} field {key!r} must be {KIND_NAMES[kind]}, got {type_name(value)}")
    return value


KIND_NAMES: Mapping[type, str] = MappingProxyType(
    {int: "an integer", str: "a string", bytes: "binary", list: "an array", dict: "a map"}
)


TYPE_NAMES: Mapping[type, str] = MappingProxyType(
    {
        type(None): "nil",
        bool: "a boolean",
        int: "an integer",
        float: "a float",
        str: "a string",
        bytes: "binary",
        list: "an array",
        tuple: "an array",
        dict: "a map",
    }
)


def type_name(value: Any) -> str:
    """A msgpack-flavoured name for a value's type, article included, for error messages."""
    return TYPE_NAMES.get(type(value), f"an object of type {type(value).__name__}")
