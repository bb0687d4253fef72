"""A real in-process daemon on 127.0.0.1 port 0: the data plane against the local module."""

from __future__ import annotations

import asyncio
import io
import random
import threading

import aiohttp
import httpx
import pytest
import torch

from swarmd.errors import Draining, PeerBehind, PeerError, RequestError, Starting, StepMismatch, WrongStage
from swarmd.net.client import INLINE_CODEC_BYTES, DataPlaneClient
from swarmd.net.codecs import EIGHT_BIT_REL_ERROR
from swarmd.net.messages import ProgressReply
from swarmd.net.server import DataPlane
from swarmd.net.wire import CONTENT_TYPE, WireLimits, encode_frame
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.model import build_stage
from swarmd.pipeline.stage.runtime import StageRuntime
from tests.conftest import TINY, running_daemon

B, T = 3, 16


def tokens(seed: int = 0, batch: int = B, seq: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (batch, seq), generator=g)


def hidden(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, TINY.d_model, generator=g)


async def post(addr: str, path: str, body: bytes, content_type: str = CONTENT_TYPE) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{addr}{path}", data=io.BytesIO(body), headers={"Content-Type": content_type}) as r:
            return r.status, await r.json(content_type=None)


async def test_forward_equals_local_module_exactly() -> None:
    local = build_stage(TINY, 0)
    x = tokens()
    async with running_daemon(0) as d, DataPlaneClient() as c:
        reply = await c.forward(d.data_addr, 0, x, model=TINY.digest)
    with torch.no_grad():
        expected = local(x)
    assert reply.stage == 0 and reply.step == 0
    assert torch.equal(reply.outputs, expected)


async def test_last_stage_forward_returns_loss_equal_to_local() -> None:
    local = build_stage(TINY, 1)
    h, y = hidden(), tokens(2)
    async with running_daemon(1) as d, DataPlaneClient() as c:
        reply = await c.forward(d.data_addr, 1, h, targets=y)
        logits = await c.forward(d.data_addr, 1, h)
    with torch.no_grad():
        assert torch.equal(reply.outputs, local(h, y))
        assert torch.equal(logits.outputs, local(h))
    assert reply.loss == pytest.approx(float(local(h, y).detach()))


async def test_backward_equals_local_and_accumulates_with_sample_count() -> None:
    local0, local1 = build_stage(TINY, 0), build_stage(TINY, 1)
    x, y = tokens(), tokens(5)
    async with running_daemon(0) as d0, running_daemon(1) as d1, DataPlaneClient() as c:
        h = (await c.forward(d0.data_addr, 0, x)).outputs
        b1 = await c.backward(d1.data_addr, 1, h, targets=y)
        b0 = await c.backward(d0.data_addr, 0, x, grad_outputs=b1.grad_inputs)
        remote1 = {n: p.grad.clone() for n, p in d1.executor.module.named_parameters()}
        remote0 = {n: p.grad.clone() for n, p in d0.executor.module.named_parameters()}
        # a second microbatch accumulates on top of the first
        b1_again = await c.backward(d1.data_addr, 1, h, targets=y)
        twice1 = {n: p.grad.clone() for n, p in d1.executor.module.named_parameters()}
        assert d1.executor.grad_samples == 2 * B and d0.executor.grad_samples == B
    assert b0.grad_inputs is None  # token ids have no gradient
    assert b1.samples == B and b1_again.accumulated == 2 * B

    h_local = local0(x)
    h_leaf = h_local.detach().requires_grad_(True)
    loss = local1(h_leaf, y)
    (loss * B).backward()
    assert b1.loss == pytest.approx(loss.item())
    assert torch.equal(b1.grad_inputs, h_leaf.grad)
    torch.autograd.backward(h_local, h_leaf.grad)
    for name, p in local1.named_parameters():
        assert torch.equal(remote1[name], p.grad), name
        torch.testing.assert_close(twice1[name], 2 * p.grad, rtol=1e-6, atol=1e-9)
    for name, p in local0.named_parameters():
        assert torch.equal(remote0[name], p.grad), name


async def test_8bit_reply_within_the_documented_bound() -> None:
    local = build_stage(TINY, 0)
    x = tokens(seed=3, batch=8, seq=64)
    async with running_daemon(0) as d, DataPlaneClient() as c:
        reply = await c.forward(d.data_addr, 0, x, codec="8bit")
    with torch.no_grad():
        expected = local(x)
    err = (reply.outputs - expected).abs().max()
    assert err > 0  # it really was quantized
    assert err <= EIGHT_BIT_REL_ERROR * expected.abs().max()


def valid_frame(stage: int = 0, **meta: object) -> bytes:
    return encode_frame("forward", {"stage": stage, **meta}, {"inputs": tokens()})


BAD_REQUESTS = {
    # fixed garbage: random bytes now and then open with a valid header declaring a field longer than the
    # limits, which is a 413 (CI saw one); those are refused in tests/unit/test_wire.py and by the fuzzers
    "garbage bytes": (random.Random(0).randbytes(257), CONTENT_TYPE, 400),
    "empty body": (b"", CONTENT_TYPE, 400),
    "truncated frame": (valid_frame()[:-7], CONTENT_TYPE, 400),
    "wrong content type": (valid_frame(), "application/json", 415),
    "content type the stdlib parser chokes on": (valid_frame(), "V8p;_2*", 415),  # found by hypothesis: was a 500
    "wrong stage": (valid_frame(stage=1), CONTENT_TYPE, 409),
    "wrong model": (valid_frame(model="0" * 64), CONTENT_TYPE, 409),
    "missing stage": (encode_frame("forward", {}, {"inputs": tokens()}), CONTENT_TYPE, 422),
    "wrong kind": (encode_frame("backward", {"stage": 0}, {"inputs": tokens()}), CONTENT_TYPE, 422),
    "unknown reply codec": (valid_frame(codec="zip"), CONTENT_TYPE, 422),
    "missing inputs": (encode_frame("forward", {"stage": 0}, {"x": tokens()}), CONTENT_TYPE, 422),
    "float tokens (wrong dtype)": (encode_frame("forward", {"stage": 0}, {"inputs": hidden()}), CONTENT_TYPE, 422),
    "wrong shape": (encode_frame("forward", {"stage": 0}, {"inputs": tokens()[0]}), CONTENT_TYPE, 422),
    "too long a sequence": (
        encode_frame("forward", {"stage": 0}, {"inputs": tokens(seq=TINY.seq_len + 1)}), CONTENT_TYPE, 422),
    "token out of range": (
        encode_frame("forward", {"stage": 0}, {"inputs": tokens() + TINY.vocab_size}), CONTENT_TYPE, 422),
    "targets on stage 0": (
        encode_frame("forward", {"stage": 0}, {"inputs": tokens(), "targets": tokens()}), CONTENT_TYPE, 422),
    "oversized frame": (encode_frame("forward", {"stage": 0}, {"inputs": torch.zeros(300_000)}), CONTENT_TYPE, 413),
}


async def test_bad_requests_get_the_right_4xx_and_the_daemon_keeps_serving() -> None:
    local = build_stage(TINY, 0)
    async with running_daemon(0, limits=WireLimits(max_frame_bytes=1 << 20)) as d, DataPlaneClient() as c:
        for name, (body, ctype, status) in BAD_REQUESTS.items():
            got, payload = await post(d.data_addr, "/v1/forward", body, ctype)
            assert got == status, f"{name}: {got} {payload}"
            assert payload["message"] and payload["error"], name
        got, payload = await post(d.data_addr, "/v1/nope", b"")
        assert got == 404 and payload["error"]
        # the peer is unharmed: a correct request still returns the exact local result
        x = tokens(9)
        reply = await c.forward(d.data_addr, 0, x)
        with torch.no_grad():
            assert torch.equal(reply.outputs, local(x))
        assert d.data_plane.served["rejected"] == len(BAD_REQUESTS) + 1
        assert all(p.grad is None for p in d.executor.module.parameters())


async def test_backward_bad_inputs_are_refused_and_leave_gradients_untouched() -> None:
    nan = hidden()
    nan[0, 0, 0] = float("nan")
    cases = {
        "NaN inputs": {"inputs": nan, "targets": tokens()},
        "no targets on the last stage": {"inputs": hidden()},
        "grad_outputs on the last stage": {"inputs": hidden(), "targets": tokens(), "grad_outputs": hidden()},
        "targets of the wrong shape": {"inputs": hidden(), "targets": tokens(seq=T - 1)},
        "wrong hidden size": {"inputs": torch.zeros(B, T, TINY.d_model + 1), "targets": tokens()},
    }
    async with running_daemon(1) as d:
        for name, tensors in cases.items():
            got, payload = await post(d.data_addr, "/v1/backward", encode_frame("backward", {"stage": 1}, tensors))
            assert got == 422, f"{name}: {got} {payload}"
        assert d.executor.grad_samples == 0
        assert all(p.grad is None for p in d.executor.module.parameters())


async def test_client_raises_typed_peer_errors() -> None:
    async with running_daemon(0) as d, DataPlaneClient(timeout_s=5) as c:
        with pytest.raises(PeerError) as wrong:
            await c.forward(d.data_addr, 1, tokens())
        assert wrong.value.status == 409 and wrong.value.error == "WrongStage"
        addr = d.data_addr
    async with DataPlaneClient(timeout_s=5) as c:
        with pytest.raises(PeerError) as gone:
            await c.forward(addr, 0, tokens())
        assert gone.value.status == 0


async def test_info_status_and_health() -> None:
    async with running_daemon(1) as d, DataPlaneClient() as c:
        info = await c.info(d.data_addr)
        assert info.stage == 1 and info.model.digest == TINY.digest
        assert set(info.codecs) >= {"none", "fp16", "bf16", "8bit"}
        assert info.limits.max_frame_bytes > 0
        await c.backward(d.data_addr, 1, hidden(), targets=tokens())
        async with httpx.AsyncClient(base_url=f"http://{d.status()['api_addr']}") as api:
            status = (await api.get("/status")).json()
            health = await api.get("/healthz")
            docs = await api.get("/docs")
            schema = (await api.get("/openapi.json")).json()
    for key in ("peer_id", "stage", "state", "swarm", "model", "step", "queue", "throughput",
                "data_addr", "version", "uptime_s"):
        assert key in status, key
    assert status["state"] == "serving" and status["stage"] == 1 and status["swarm"] == "test"
    assert status["model"] == {"name": "tiny", "digest": TINY.digest}
    assert status["data_addr"] == d.data_addr and status["throughput"] > 0 and status["grad_samples"] == B
    assert health.status_code == 200 and health.json() == {"ok": True, "state": "serving"}
    assert docs.status_code == 200 and "/status" in schema["paths"]


async def test_draining_refuses_new_requests_with_503() -> None:
    async with running_daemon(0) as d:
        addr = d.data_addr
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://{addr}/v1/forward", data=valid_frame(),
                              headers={"Content-Type": CONTENT_TYPE}) as r:
                assert r.status == 200  # opens a keep-alive connection
            drained = asyncio.create_task(d.data_plane.drain(5))
            await asyncio.sleep(0.05)
            async with s.post(f"http://{addr}/v1/forward", data=valid_frame(),
                              headers={"Content-Type": CONTENT_TYPE}) as r:
                assert r.status == 503 and (await r.json())["error"] == "Draining"
            assert await drained



async def test_an_average_contribution_with_gradients_but_no_samples_is_refused() -> None:
    """The leader divides the sum by the samples: gradients that count no sample would weigh
    nothing in the divisor yet everything in the sum (and could make the mean overflow)."""
    async with running_daemon(0) as d:
        assert d.runtime is not None and d.runtime.averager is not None and d.executor is not None
        grads = torch.ones(d.executor.grad_numel)
        meta = {"stage": 0, "peer_id": "someone", "step": d.executor.step, "samples": 0}
        status, body = await post(d.data_addr, "/v1/average", encode_frame("average", meta, {"grads": grads}))
        assert status == 422 and "samples" in body["message"], body
        assert d.executor.grad_samples == 0 and d.averager is not None and d.averager.rounds_ok == 0


async def test_refusals_arrive_as_their_error_classes() -> None:
    """The client rebuilds a refusal from its name: callers catch by type, never compare strings."""
    async with running_daemon(0) as d, DataPlaneClient(timeout_s=5) as c:
        with pytest.raises(PeerBehind) as behind:  # a backward naming a step the peer has not reached
            await c.backward(d.data_addr, 0, tokens(), grad_outputs=hidden(), step=5)
        assert isinstance(behind.value, StepMismatch) and isinstance(behind.value, PeerError)
        assert behind.value.status == 409 and behind.value.error == "PeerBehind"
        with pytest.raises(WrongStage):
            await c.forward(d.data_addr, 1, tokens())
        with pytest.raises(RequestError):
            await c.forward(d.data_addr, 0, tokens() + TINY.vocab_size)
        assert d.data_plane is not None
        await d.data_plane.drain(5)
        with pytest.raises(Draining) as draining:
            await c.forward(d.data_addr, 0, tokens())
        assert draining.value.status == 503


async def test_a_data_plane_with_no_stage_yet_answers_503_starting() -> None:
    plane = DataPlane(lambda: None, limits=WireLimits())
    host, port = await plane.start("127.0.0.1", 0)
    try:
        async with DataPlaneClient(timeout_s=5) as c:
            addr = f"{host}:{port}"
            for call in (c.info(addr), c.progress(addr), c.forward(addr, 0, tokens())):
                with pytest.raises(Starting) as starting:
                    await call
                assert starting.value.status == 503
    finally:
        await plane.close()


async def test_progress_has_one_shape_with_and_without_an_averager() -> None:
    ex = StageExecutor(TINY, 0, "cpu", threads=1)
    runtime = StageRuntime(ex)
    plane = DataPlane(lambda: runtime, limits=WireLimits())
    host, port = await plane.start("127.0.0.1", 0)
    try:
        async with running_daemon(0) as d, aiohttp.ClientSession() as s, DataPlaneClient(timeout_s=5) as c:
            assert d.runtime is not None and d.runtime.averager is not None
            async with s.get(f"http://{d.data_addr}/v1/progress") as r:
                averaging = await r.json()
            async with s.get(f"http://{host}:{port}/v1/progress") as r:
                away = await r.json()
            assert set(averaging) == set(away)
            assert away["away"] is True and averaging["away"] is False and averaging["peer_id"] == d.peer_id
            typed = await c.progress(d.data_addr, wait_step=0, wait_s=0.1)
            assert typed == ProgressReply.from_json(averaging) and typed.stage == 0 and typed.step == 0
            assert (await c.progress(f"{host}:{port}")).away
    finally:
        await plane.close()
        await ex.close()


def _codec_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("swarmd-client-codec")}


async def test_the_client_codes_large_frames_off_its_event_loop_and_closes_its_pool() -> None:
    small = hidden()
    assert small.numel() * small.element_size() <= INLINE_CODEC_BYTES
    large = torch.randn(8, TINY.seq_len, TINY.d_model)
    assert large.numel() * large.element_size() > INLINE_CODEC_BYTES
    async with running_daemon(1) as d:
        before = _codec_threads()  # the daemon's own clients' (none run a round here)
        client = DataPlaneClient(timeout_s=10)
        async with client:
            await client.forward(d.data_addr, 1, small, codec="8bit")
            assert _codec_threads() == before  # a small frame is coded inline: no thread hop
            reply = await client.forward(d.data_addr, 1, large, codec="8bit")
            assert reply.outputs.shape == (8, TINY.seq_len, TINY.vocab_size)
            ours = _codec_threads() - before
            assert ours  # the 8-bit encode and the reply's decode ran on the client's pool
        assert not any(t.is_alive() for t in ours)  # closing the client joined them
