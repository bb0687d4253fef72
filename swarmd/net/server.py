"""The aiohttp data plane: forward and backward of one stage over msgpack frames.

Endpoints (all bodies ``application/x-msgpack`` frames, see ``swarmd.net.wire``):

- ``POST /v1/forward``  meta ``{stage, model?, codec?}``, tensors ``inputs`` (+ ``targets`` on
  the last stage) → ``outputs``, or ``loss`` when the last stage got targets.
- ``POST /v1/backward`` meta as above, tensors ``inputs`` + ``grad_outputs`` (the last stage:
  ``inputs`` + ``targets``) → ``grad_inputs`` (none on stage 0) and meta ``loss``/``samples``.
- ``GET /v1/info``      JSON: stage, model digest, step, codecs, limits.
- ``GET /v1/progress``  JSON: step and samples held, for the stage's averaging rounds.
- ``POST /v1/average``  a stage-mate's gradient contribution; answered with the round's mean
  (``swarmd.pipeline.averaging``).
- ``GET /v1/state``     a consistent snapshot of the stage (parameters, optimizer state, step),
  streamed in checksummed chunks for a joining peer (``swarmd.net.state_transfer``).

Every reply's ``meta.step`` is the optimizer step the stage's parameters were at when the
request was computed; a backward sends back, as ``meta.step``, the step its forward reported.

``meta.codec`` picks the codec of the reply's float tensors (default ``none``); ``meta.model``,
when sent, must equal this peer's spec digest. Errors are JSON ``{"error", "message"}`` with the
status carried by the ``swarmd.errors`` class: bad input is always a 4xx, never a 500.

Decoding and encoding run on a small codec thread pool and compute on the stage's worker
thread, so the event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from aiohttp import web

from swarmd.errors import (
    Busy,
    LimitExceeded,
    RequestError,
    RequestTimeout,
    SwarmdError,
    UnsupportedMediaType,
    WrongStage,
)
from swarmd.net.codecs import CODECS
from swarmd.net.state_transfer import StateSnapshot, stream_state
from swarmd.net.wire import CONTENT_TYPE, WIRE_VERSION, WireLimits, decode_frame, encode_frame
from swarmd.pipeline.averaging import StageAverager
from swarmd.pipeline.executor import StageExecutor

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, error: str, message: str) -> web.Response:
    return web.json_response({"error": error, "message": message}, status=status)


class DataPlane:
    """Serves one stage; owns its aiohttp runner, its codec pool and its in-flight count."""

    def __init__(
        self,
        executor: StageExecutor,
        *,
        limits: WireLimits,
        read_timeout_s: float = 60.0,
    ) -> None:
        self.executor = executor
        self.limits = limits
        self.read_timeout_s = read_timeout_s
        self.in_flight = 0
        self.served = {"forward": 0, "backward": 0, "rejected": 0}
        self._draining = False
        self._paused = False  # migrating between stages: new requests get 503
        self._idle = asyncio.Event()
        self._idle.set()
        self._codec_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="swarmd-codec")
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.address: tuple[str, int] | None = None
        self.app = web.Application(client_max_size=limits.max_frame_bytes, middlewares=[self._middleware])
        self.app.router.add_post("/v1/forward", self._forward)
        self.app.router.add_post("/v1/backward", self._backward)
        self.app.router.add_get("/v1/info", self._info)
        self.app.router.add_get("/v1/progress", self._progress)
        self.app.router.add_post("/v1/average", self._average)
        self.app.router.add_get("/v1/state", self._state)
        self.averager: StageAverager | None = None  # set by the daemon once it takes part in rounds

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (0 picks a free port) and return the bound address."""
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port)
        await self._site.start()
        sockets = self._site._server.sockets  # type: ignore[union-attr]
        bound = sockets[0].getsockname()
        self.address = (bound[0], bound[1])
        return self.address

    async def drain(self, timeout: float) -> bool:
        """Stop taking new requests and wait for in-flight ones; False if the timeout hit."""
        self._draining = True
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()  # close the listening socket: no new connections
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            log.warning("drain timed out after %.1fs with %d request(s) in flight", timeout, self.in_flight)
            return False

    async def pause(self, timeout: float) -> bool:
        """Answer new requests with 503 (retry elsewhere) and wait for in-flight ones: a peer
        changing stage must not swap its stage under a running request. False on timeout."""
        self._paused = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def resume(self) -> None:
        self._paused = False

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await asyncio.get_running_loop().run_in_executor(None, self._codec_pool.shutdown, True)

    # ---- request plumbing ------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._draining:
            self.served["rejected"] += 1
            return error_response(503, "Draining", "this peer is shutting down; send the request to another peer")
        if self._paused and request.path != "/v1/progress":
            self.served["rejected"] += 1
            return error_response(503, "Migrating", "this peer is moving to another stage; send the request elsewhere")
        self.in_flight += 1
        self._idle.clear()
        try:
            return await handler(request)
        except SwarmdError as exc:
            self.served["rejected"] += 1
            return error_response(exc.http_status, type(exc).__name__, str(exc))
        except web.HTTPException as exc:
            self.served["rejected"] += 1
            return error_response(exc.status, type(exc).__name__, exc.reason)
        except Exception:  # a bug, not bad input: keep serving, say so, log the traceback
            log.exception("unexpected error while serving %s %s", request.method, request.path)
            return error_response(500, "InternalError", "the peer failed unexpectedly; see its log")
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _read_frame(self, request: web.Request, kind: str):
        if request.content_type != CONTENT_TYPE:
            raise UnsupportedMediaType(f"send the body as {CONTENT_TYPE}, not {request.content_type or 'nothing'}")
        if request.content_length is not None and request.content_length > self.limits.max_frame_bytes:
            raise LimitExceeded(
                f"a {request.content_length}-byte body exceeds the {self.limits.max_frame_bytes}-byte frame limit"
            )
        try:
            body = await asyncio.wait_for(request.read(), self.read_timeout_s)
        except web.HTTPRequestEntityTooLarge as exc:
            raise LimitExceeded(f"the body exceeds the {self.limits.max_frame_bytes}-byte frame limit") from exc
        except asyncio.TimeoutError as exc:
            raise RequestTimeout(f"the request body did not arrive within {self.read_timeout_s:.0f}s") from exc
        frame = await self._in_pool(decode_frame, body, self.limits)
        if frame.kind != kind:
            raise RequestError(f"this endpoint takes a '{kind}' frame, got '{frame.kind}'")
        self._check_meta(frame.meta)
        return frame

    def _check_meta(self, meta: dict[str, Any]) -> None:
        ex = self.executor
        stage = meta.get("stage")
        if not isinstance(stage, int) or isinstance(stage, bool):
            raise RequestError("meta.stage (an integer) is required")
        if stage != ex.stage:
            raise WrongStage(f"this peer serves stage {ex.stage}, not stage {stage}")
        model = meta.get("model")
        if model is not None and model != ex.spec.digest:
            raise WrongStage(f"this peer serves model {ex.spec.digest[:12]}, not {str(model)[:12]}")
        codec = meta.get("codec", "none")
        if codec not in CODECS:
            raise RequestError(f"meta.codec must be one of {sorted(CODECS)}, got {codec!r}")

    async def _in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._codec_pool, fn, *args)

    async def _reply(self, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor], codec: str) -> web.Response:
        meta = {"stage": self.executor.stage, **meta}
        body = await self._in_pool(encode_frame, kind, meta, tensors, codec)
        return web.Response(body=body, content_type=CONTENT_TYPE)

    # ---- endpoints -------------------------------------------------------------------------

    async def _forward(self, request: web.Request) -> web.Response:
        frame = await self._read_frame(request, "forward")
        inputs = _required(frame.tensors, "inputs")
        targets = frame.tensors.get("targets")
        result = await self.executor.forward(inputs, targets)
        self.served["forward"] += 1
        codec = frame.meta.get("codec", "none")
        out = result.outputs
        if targets is not None:
            return await self._reply("forward_result", {"step": result.step, "loss": float(out)}, {"loss": out}, codec)
        return await self._reply("forward_result", {"step": result.step}, {"outputs": out}, codec)

    async def _backward(self, request: web.Request) -> web.Response:
        frame = await self._read_frame(request, "backward")
        inputs = _required(frame.tensors, "inputs")
        step = frame.meta.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise RequestError(f"meta.step must be a non-negative integer (the step the forward reported), got {step!r}")
        result = await self.executor.backward(
            inputs, frame.tensors.get("grad_outputs"), frame.tensors.get("targets"), step=step
        )
        self.served["backward"] += 1
        meta: dict[str, Any] = {"step": result.step, "samples": result.samples, "accumulated": self.executor.grad_samples}
        if result.loss is not None:
            meta["loss"] = result.loss
        tensors = {} if result.grad_inputs is None else {"grad_inputs": result.grad_inputs}
        return await self._reply("backward_result", meta, tensors, frame.meta.get("codec", "none"))

    async def _info(self, request: web.Request) -> web.Response:
        ex = self.executor
        limits = self.limits
        return web.json_response(
            {
                "wire_version": WIRE_VERSION,
                "stage": ex.stage,
                "n_stages": ex.spec.n_stages,
                "model": {"name": ex.spec.name, "digest": ex.spec.digest, "spec": ex.spec.to_dict()},
                "step": ex.step,
                "codecs": sorted(CODECS),
                "limits": {
                    "max_frame_bytes": limits.max_frame_bytes,
                    "max_tensors": limits.max_tensors,
                    "max_rank": limits.max_rank,
                    "max_elements": limits.max_elements,
                    "max_batch_tokens": ex.max_batch_tokens,
                },
            }
        )


    async def _progress(self, request: web.Request) -> web.Response:
        if self.averager is not None and not self._paused:
            return web.json_response(self.averager.progress())
        ex = self.executor  # not taking part in rounds (starting, or moving to another stage)
        return web.json_response({"stage": ex.stage, "step": ex.step, "samples": ex.grad_samples,
                                  "averaging": ex.averaging, "leader": None, "away": True})

    async def _average(self, request: web.Request) -> web.Response:
        frame = await self._read_frame(request, "average")
        if self.averager is None:
            raise Busy("this peer is not taking part in averaging rounds yet")
        meta = frame.meta
        peer_id, step, samples = meta.get("peer_id"), meta.get("step"), meta.get("samples")
        if not isinstance(peer_id, str) or not 0 < len(peer_id) <= 64:
            raise RequestError("meta.peer_id (the contributor's peer id) is required")
        for name, value in (("step", step), ("samples", samples)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RequestError(f"meta.{name} must be a non-negative integer, got {value!r}")
        grads = frame.tensors.get("grads")
        if grads is not None:
            if grads.dtype != torch.float32 or grads.dim() != 1 or grads.numel() != self.executor.grad_numel:
                raise RequestError(f"'grads' must be float32 of shape [{self.executor.grad_numel}]")
            if not bool(torch.isfinite(grads).all()):
                raise RequestError("'grads' contain NaN or Inf; refused")
        elif samples:
            raise RequestError("a contribution with samples must carry its 'grads'")
        result = await self.averager.contribute(peer_id, step, samples, grads)
        tensors = {"grads": result.mean_grads} if result.mean_grads is not None else {}
        reply = {"status": result.status, "step": result.step, "samples": result.samples,
                 "contributors": result.contributors}
        return await self._reply("average_result", reply, tensors, "none")

    async def _state(self, request: web.Request) -> web.StreamResponse:
        meta, tensors = await self.executor.snapshot_state()
        return await stream_state(request, StateSnapshot(meta=meta, tensors=tensors))


def _required(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise RequestError(f"the frame has no '{name}' tensor (it has {sorted(tensors) or 'none'})") from None
