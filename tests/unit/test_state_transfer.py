"""State transfer: a real aiohttp server on 127.0.0.1 port 0 and a real ClientSession, no mocks.

The decoder is also driven directly (it is sans-I/O) for the byte-level properties: any split
of the stream decodes the same, any flipped byte or cut is refused, and forged but well-hashed
streams that break the header's rules are refused before anything is allocated.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import tracemalloc
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import torch
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.errors import StateTransferError, UnsupportedDtype, WrongStage
from swarmd.net.state_transfer import (
    STATE_CONTENT_TYPE,
    StateLimits,
    StateSnapshot,
    StateStreamDecoder,
    download_state,
    iter_state_chunks,
    stream_state,
)
from swarmd.pipeline.model import build_stage, params_digest
from swarmd.pipeline.spec import PRESETS

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SMALL_CHUNK = 4096


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[str]:
    """A one-route server on 127.0.0.1 port 0; yields the URL of ``GET /v1/state``."""
    app = web.Application()
    app.router.add_get("/v1/state", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}/v1/state"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving(snapshot: StateSnapshot, chunk_bytes: int = SMALL_CHUNK) -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_state(request, snapshot, chunk_bytes)

    async with serve(handler) as url:
        yield url


async def fetch(url: str, **kwargs: Any) -> StateSnapshot:
    async with aiohttp.ClientSession() as session:
        return await download_state(session, url, **kwargs)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and raw bytes: NaNs, -0.0 and infinities included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(raw(a), raw(b))


def assorted_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 65504.0])
    return {
        "param.big": torch.randn(300, 200, generator=g),  # 240 KB: ~59 chunks of 4 KiB
        "param.half": torch.randn(17, 3, generator=g).half(),
        "param.bf16": torch.cat([torch.randn(33, generator=g), special]).bfloat16(),
        "param.special": special.clone(),
        "param.transposed": torch.randn(5, 9, generator=g).t(),  # not contiguous on the way in
        "opt.state.0.step": torch.tensor(12.0),  # 0-d
        "opt.count": torch.tensor(2**62 + 3, dtype=torch.int64),  # 0-d int
        "opt.int64": torch.tensor([-(2**63), 2**63 - 1, 0], dtype=torch.int64),
        "opt.int32": torch.randint(-(2**31), 2**31 - 1, (1000,), generator=g, dtype=torch.int32),
        "opt.uint8": torch.randint(0, 256, (3, 4, 5), generator=g, dtype=torch.uint8),
        "opt.mask": torch.rand(77, generator=g) > 0.5,
        "opt.empty": torch.empty(0),
        "opt.empty3d": torch.empty(3, 0, 2, dtype=torch.int32),
        "opt.last": torch.tensor([1.5]),
    }


META: dict[str, Any] = {
    "step": 41,
    "spec_digest": "ab" * 32,
    "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "params": [0, 1, 2], "foreach": None, "amsgrad": False}],
    "blob": b"\x00\xff",
}


# --- round trips over HTTP ------------------------------------------------------------------------


async def test_round_trip_is_bit_identical_for_every_dtype_and_shape() -> None:
    tensors = assorted_tensors()
    async with serving(StateSnapshot(meta=META, tensors=tensors)) as url:
        got = await fetch(url)
    assert got.meta == META
    assert list(got.tensors) == list(tensors)  # same order
    for name, tensor in tensors.items():
        assert same_bits(got.tensors[name], tensor), name
        assert got.tensors[name].is_contiguous()
    got.tensors["param.big"].add_(1)  # writable, and not sharing memory with anything


async def test_empty_state_round_trips() -> None:
    async with serving(StateSnapshot(meta={"step": 0}, tensors={})) as url:
        got = await fetch(url)
    assert got.meta == {"step": 0} and got.tensors == {}


async def test_real_stage_with_adam_state_resumes_identically() -> None:
    spec = PRESETS["tiny"]
    stage = build_stage(spec, 0)
    optimizer = torch.optim.Adam(stage.parameters(), lr=1e-2)
    tokens = torch.randint(0, spec.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    stage(tokens).square().mean().backward()
    optimizer.step()  # parameters move away from their deterministic init; Adam moments exist
    state = optimizer.state_dict()
    tensors = {f"param.{name}": p.detach().clone() for name, p in stage.named_parameters()}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            tensors[f"opt.{index}.{key}"] = value.detach().clone()
    meta = {
        "step": 1,
        "spec_digest": spec.digest,
        "params_digest": params_digest(stage),
        "param_groups": state["param_groups"],
    }

    async with serving(StateSnapshot(meta=meta, tensors=tensors)) as url:
        got = await fetch(url)

    joiner = build_stage(spec, 0)
    assert params_digest(joiner) != meta["params_digest"]
    with torch.no_grad():
        for name, p in joiner.named_parameters():
            p.copy_(got.tensors[f"param.{name}"])
    assert params_digest(joiner) == got.meta["params_digest"] == params_digest(stage)
    joiner_opt = torch.optim.Adam(joiner.parameters(), lr=1e-2)
    joiner_opt.load_state_dict(
        {
            "state": {i: {k: got.tensors[f"opt.{i}.{k}"] for k in state["state"][i]} for i in state["state"]},
            "param_groups": got.meta["param_groups"],
        }
    )
    for model, opt in ((stage, optimizer), (joiner, joiner_opt)):  # one more step on both
        opt.zero_grad()
        model(tokens).square().mean().backward()
        opt.step()
    assert params_digest(joiner) == params_digest(stage)


# --- failures over HTTP ---------------------------------------------------------------------------


def _messages(chunk_bytes: int = SMALL_CHUNK) -> list[bytes]:
    return list(iter_state_chunks(StateSnapshot(meta=META, tensors=assorted_tensors()), chunk_bytes))


async def _send(
    request: web.Request, parts: list[bytes], content_type: str = STATE_CONTENT_TYPE
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": content_type})
    await resp.prepare(request)
    for part in parts:
        await resp.write(part)
    return resp


def _flip_last_byte(message: bytes) -> bytes:
    return message[:-1] + bytes([message[-1] ^ 0x01])


def _retrailer(message: bytes) -> bytes:
    trailer = msgpack.unpackb(message, raw=False)
    trailer["h"] = hashlib.sha256(b"not the stream").digest()
    return msgpack.packb(trailer, use_bin_type=True)


async def _corrupt(request: web.Request) -> web.StreamResponse:
    msgs = _messages()
    msgs[3] = _flip_last_byte(msgs[3])  # the last byte of a chunk message is payload
    return await _send(request, msgs)


async def _truncated(request: web.Request) -> web.StreamResponse:
    return await _send(request, _messages()[:5])  # a clean end of body, without the trailer


async def _dropped(request: web.Request) -> web.StreamResponse:
    resp = await _send(request, _messages()[:5])
    assert request.transport is not None
    request.transport.close()  # the peer dies mid-stream
    return resp


async def _wrong_trailer(request: web.Request) -> web.StreamResponse:
    msgs = _messages()
    msgs[-1] = _retrailer(msgs[-1])
    return await _send(request, msgs)


async def _oversized(request: web.Request) -> web.StreamResponse:
    header = {"v": 1, "kind": "state_header", "meta": {}, "chunk": 2**20,
              "tensors": [{"n": "param.huge", "d": "float32", "s": [2**20, 2**20]}], "bytes": 4 * 2**40}
    return await _send(request, [msgpack.packb(header)])


async def _garbage(request: web.Request) -> web.StreamResponse:
    return await _send(request, [bytes(range(256)) * 64])


async def _wrong_type(request: web.Request) -> web.StreamResponse:
    return await _send(request, b"".join(_messages()).split(b"\n"), content_type="text/html")


async def _json_500(request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": "InternalError", "message": "the disk is on fire"}, status=500)


async def _bad_snapshot(request: web.Request) -> web.StreamResponse:
    # float64 is outside the wire's allow-list: refused before the response starts (plain 500)
    return await stream_state(request, StateSnapshot(meta={}, tensors={"x": torch.zeros(3, dtype=torch.float64)}))


@pytest.mark.parametrize(
    ("handler", "path", "status", "match"),
    [
        (_corrupt, "/v1/state", 0, "chunk 2 .* fails its SHA-256 check"),
        (_truncated, "/v1/state", 0, "truncated"),
        (_dropped, "/v1/state", 0, "ClientPayloadError|truncated"),
        (_wrong_trailer, "/v1/state", 0, "trailer's SHA-256"),
        (_oversized, "/v1/state", 0, "over the 1073741824-byte limit"),
        (_garbage, "/v1/state", 0, "not msgpack|not valid msgpack|expected a msgpack map"),
        (_wrong_type, "/v1/state", 0, "text/html"),
        (_json_500, "/v1/state", 500, "HTTP 500: InternalError: the disk is on fire"),
        (_bad_snapshot, "/v1/state", 500, "HTTP 500"),
        (_json_500, "/v1/nothing-here", 404, "HTTP 404"),
    ],
    ids=["corrupt", "truncated", "dropped", "wrong-trailer", "oversized", "garbage", "content-type",
         "500-json", "500-bad-snapshot", "404"],
)
async def test_broken_downloads_raise_a_typed_error_quickly(
    handler: Handler, path: str, status: int, match: str
) -> None:
    async with serve(handler) as url:
        start = time.monotonic()
        with pytest.raises(StateTransferError, match=match) as info:
            await fetch(url.replace("/v1/state", path), timeout_s=5.0, max_total_bytes=2**30)
    assert time.monotonic() - start < 2.0
    assert info.value.status == status
    assert not info.value.unreachable  # the peer was there: a refusal or a bad stream, not a connection problem
    assert info.value.url.endswith(path) and url.split("/v1")[0] in str(info.value)


async def test_a_snapshot_that_fails_mid_stream_closes_the_connection() -> None:
    # A meta tensor passes the up-front checks but cannot be copied out once the stream reaches it.
    tensors = {"param.ok": torch.zeros(64 * 2**10), "param.broken": torch.empty(8, device="meta")}
    async with serving(StateSnapshot(meta={}, tensors=tensors)) as url:
        with pytest.raises(StateTransferError, match="ClientPayloadError|truncated") as info:
            await fetch(url, timeout_s=5.0)
    assert info.value.status == 0
    assert not info.value.unreachable


async def test_a_peer_that_never_answers_times_out() -> None:
    release = asyncio.Event()

    async def silent(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response()

    async with serve(silent) as url:
        try:
            start = time.monotonic()
            with pytest.raises(StateTransferError, match=r"did not finish within 0.3s \(no header received\)") as info:
                await fetch(url, timeout_s=0.3)
            assert time.monotonic() - start < 1.5
            assert info.value.unreachable  # nothing heard before the deadline: told apart from a stalled stream
        finally:
            release.set()


async def test_an_unreachable_peer_raises_a_typed_error() -> None:
    async with serve(_json_500) as url:
        pass  # the port is closed again
    with pytest.raises(StateTransferError, match="ClientConnectorError") as info:
        await fetch(url, timeout_s=5.0)
    assert info.value.status == 0
    assert info.value.unreachable


async def test_expected_rejecting_the_header_aborts_the_download() -> None:
    seen: list[dict[str, Any]] = []

    def expected(meta: dict[str, Any]) -> None:
        seen.append(meta)
        if meta["spec_digest"] != "cd" * 32:
            raise WrongStage(f"this peer serves model {'cd' * 6}, not {meta['spec_digest'][:12]}")

    big = StateSnapshot(meta=META, tensors={"param.w": torch.zeros(4 * 2**20)})  # 16 MiB
    async with serving(big, chunk_bytes=2**20) as url:
        rejected = "caller rejected the state's header: this peer serves model"
        with pytest.raises(StateTransferError, match=rejected) as info:
            await fetch(url, expected=expected)
        accepted = await fetch(url, expected=lambda meta: None)  # the same server still serves
    assert isinstance(info.value.__cause__, WrongStage)
    assert seen == [META]
    assert torch.equal(accepted.tensors["param.w"], big.tensors["param.w"])


# --- memory ---------------------------------------------------------------------------------------


def test_chunks_are_produced_lazily_one_at_a_time() -> None:
    tensors = {f"param.{i}": torch.full((2**20,), float(i)) for i in range(16)}  # 16 x 4 MiB = 64 MiB
    chunk = 2**20
    messages = iter_state_chunks(StateSnapshot(meta={"step": 1}, tensors=tensors), chunk)
    assert isinstance(messages, types.GeneratorType)
    tracemalloc.start()
    try:
        header = next(messages)
        first = next(messages)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(header) < 4096 and chunk < len(first) < chunk + 128
    assert peak < 3 * chunk  # one chunk built, not the 64 MiB body
    assert sum(1 for _ in messages) == 64 - 1 + 1  # the other chunks, then the trailer


async def test_a_64_mib_transfer_never_holds_the_body_in_memory() -> None:
    tensors = {"param.a": torch.randn(12 * 2**20), "param.b": torch.arange(4 * 2**20, dtype=torch.int32)}  # 64 MiB
    chunk = 2**20
    async with serving(StateSnapshot(meta={"step": 9}, tensors=tensors), chunk_bytes=chunk) as url:
        tracemalloc.start()
        try:
            got = await fetch(url)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # Server and client together: a few chunks in flight (msgpack buffers, socket buffers), while
    # the tensors themselves (torch's allocator) are not traced. The body is 64 MiB.
    assert peak < 16 * chunk, f"peak traced Python memory {peak / 2**20:.1f} MiB"
    assert all(torch.equal(got.tensors[name], tensors[name]) for name in tensors)


# --- the decoder, byte by byte (sans-I/O) ---------------------------------------------------------

TINY_LIMITS = StateLimits(min_chunk_bytes=1)
STREAM = b"".join(
    iter_state_chunks(
        StateSnapshot(
            meta={"step": 3, "x": [1, {"y": b"z"}], "f": 1.5},
            tensors={
                "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                "b": torch.tensor(5),
                "c": torch.empty(0, 3),
                "d": torch.tensor([True, False, True]),
                "e": torch.arange(10).bfloat16(),
            },
        ),
        chunk_bytes=16,
        limits=TINY_LIMITS,
    )
)


def decode(data: bytes, pieces: list[int] | None = None, **kwargs: Any) -> StateSnapshot:
    decoder = StateStreamDecoder(limits=kwargs.pop("limits", TINY_LIMITS), **kwargs)
    cuts = sorted({0, len(data), *(p % (len(data) + 1) for p in pieces or [])})
    for start, end in zip(cuts, cuts[1:]):
        decoder.feed(data[start:end])
    return decoder.finish()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=0), max_size=40))
def test_any_split_of_the_stream_decodes_the_same(pieces: list[int]) -> None:
    got = decode(STREAM, pieces)
    assert got.meta == {"step": 3, "x": [1, {"y": b"z"}], "f": 1.5}
    assert torch.equal(got.tensors["a"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert same_bits(got.tensors["e"], torch.arange(10).bfloat16())
    assert got.tensors["c"].shape == (0, 3) and got.tensors["b"].shape == ()


def test_every_single_byte_flip_and_every_cut_is_refused() -> None:
    for index in range(len(STREAM)):
        for bit in (0x01, 0x80):
            flipped = bytearray(STREAM)
            flipped[index] ^= bit
            with pytest.raises(StateTransferError):
                decode(bytes(flipped))
        with pytest.raises(StateTransferError, match="truncated|not valid msgpack"):
            decode(STREAM[:index])
    with pytest.raises(StateTransferError, match="bytes follow the trailer"):
        decode(STREAM + b"\x00")


def forge(header: dict[str, Any], payloads: list[bytes], *, trailer: dict[str, Any] | None = None) -> bytes:
    """A stream with correct running hashes around whatever ``header`` and ``payloads`` say."""
    head = msgpack.packb({"v": 1, "kind": "state_header", "meta": {}, **header}, use_bin_type=True)
    hasher = hashlib.sha256(head)
    out, offset = [head], 0
    for index, payload in enumerate(payloads):
        hasher.update(payload)
        out.append(msgpack.packb({"kind": "state_chunk", "i": index, "o": offset, "h": hasher.digest(), "p": payload}))
        offset += len(payload)
    end = {"kind": "state_end", "chunks": len(payloads), "bytes": offset, "h": hasher.digest(), **(trailer or {})}
    out.append(msgpack.packb(end, use_bin_type=True))
    return b"".join(out)


def entry(name: str = "t", dtype: str = "uint8", shape: list[Any] | None = None) -> dict[str, Any]:
    return {"n": name, "d": dtype, "s": [4] if shape is None else shape}


@pytest.mark.parametrize(
    ("stream", "match"),
    [
        (forge({"tensors": [entry()], "bytes": 4, "chunk": 4}, [b"\x01\x02\x03\x04"]), None),  # the control
        (forge({"v": 2, "tensors": [], "bytes": 0, "chunk": 4}, []), "version 2"),
        (forge({"kind": "state_chunk", "tensors": [], "bytes": 0, "chunk": 4}, []), "must start with"),
        (forge({"tensors": [entry(str(i)) for i in range(5)], "bytes": 20, "chunk": 4}, []), "5 tensors, over"),
        (forge({"tensors": [entry(dtype="float64")], "bytes": 32, "chunk": 4}, []), "dtype 'float64'"),
        (forge({"tensors": [entry(shape=[-1])], "bytes": 0, "chunk": 4}, []), "non-negative"),
        (forge({"tensors": [entry(shape=[1] * 9)], "bytes": 1, "chunk": 4}, []), "rank 9"),
        (forge({"tensors": [entry(shape=[True])], "bytes": 1, "chunk": 4}, []), "non-negative integers"),
        (forge({"tensors": [entry(shape=[0, 2**62])], "bytes": 0, "chunk": 4}, []), "dimension of 4611686018427387904"),
        (forge({"tensors": [entry(), entry()], "bytes": 8, "chunk": 4}, []), "two tensors named 't'"),
        (forge({"tensors": [entry("x" * 600)], "bytes": 4, "chunk": 4}, []), "600 characters"),
        (forge({"tensors": [entry()], "bytes": 5, "chunk": 4}, []), "add up to 4"),
        (forge({"tensors": [entry()], "bytes": 4, "chunk": 0}, []), "0-byte chunks"),
        (forge({"tensors": [entry()], "bytes": 4}, []), "no 'chunk' field"),
        (forge({"tensors": [entry()], "bytes": 4, "chunk": 4}, [b"\x01\x02"]), "carries 2 bytes; it must carry 4"),
        (forge({"tensors": [entry()], "bytes": 4, "chunk": 4}, [b"1234", b"5678"]), "after all 4 announced bytes"),
        (forge({"tensors": [entry()], "bytes": 4, "chunk": 4}, []), "after 0 of 4 announced bytes"),
        (forge({"tensors": [entry()], "bytes": 4, "chunk": 4}, [b"1234"], trailer={"chunks": 2}), "counts 2 chunks"),
        (forge({"tensors": [entry(dtype="bool")], "bytes": 4, "chunk": 4}, [b"\x00\x01\x02\x01"]), "bool tensor"),
        (forge({"tensors": [], "bytes": 0, "chunk": 4, "meta": [1]}, []), "'meta' must be a map"),
        (msgpack.packb({"v": 1, 7: 1}), "map key in the stream must be a string"),
        (msgpack.packb({"v": 1, "meta": msgpack.ExtType(1, b"x")}), "extension|max_ext_len"),
        (msgpack.packb({"v": 1, "meta": {"k": b"\xff" * 2**20}}), "header is longer|longer than allowed"),
        (msgpack.packb({"v": 1, "meta": [[0] * 40] * 40}), "more than .* array and map entries"),
        (msgpack.packb([1, 2, 3]), "expected a msgpack map, got an array"),
    ],
)
def test_forged_streams_that_break_the_rules_are_refused(stream: bytes, match: str | None) -> None:
    limits = StateLimits(max_tensors=4, max_header_bytes=2**16, max_meta_values=1000, min_chunk_bytes=1)
    if match is None:
        assert decode(stream, limits=limits).tensors["t"].tolist() == [1, 2, 3, 4]
        return
    with pytest.raises(StateTransferError, match=match):
        decode(stream, limits=limits)


def test_a_declared_total_over_the_limit_is_refused_before_allocating() -> None:
    stream = forge({"tensors": [entry("w", "float32", [2**20, 2**20])], "bytes": 4 * 2**40, "chunk": 2**20}, [])
    with pytest.raises(StateTransferError, match="over the 1048576-byte limit"):
        decode(stream, max_total_bytes=2**20)


def test_local_mistakes_are_refused_when_the_stream_is_made() -> None:
    with pytest.raises(UnsupportedDtype, match="float64"):
        iter_state_chunks(StateSnapshot(meta={}, tensors={"x": torch.zeros(2, dtype=torch.float64)}))
    with pytest.raises(TypeError, match="msgpack"):
        iter_state_chunks(StateSnapshot(meta={"x": object()}, tensors={}))
    with pytest.raises(ValueError, match="chunk_bytes"):
        iter_state_chunks(StateSnapshot(meta={}, tensors={}), chunk_bytes=10)
