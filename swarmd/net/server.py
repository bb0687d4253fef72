"""The aiohttp data plane: forward and backward of one stage over msgpack frames.

Endpoints (all bodies ``application/x-msgpack`` frames, see ``swarmd.net.wire``):

- ``POST /v1/forward``  meta ``{stage, model?, codec?}``, tensors ``inputs`` (+ ``targets`` on
  the last stage) → ``outputs``, or ``loss`` when the last stage got targets.
- ``POST /v1/backward`` meta as above, tensors ``inputs`` + ``grad_outputs`` (the last stage:
  ``inputs`` + ``targets``) → ``grad_inputs`` (none on stage 0) and meta ``loss``/``samples``.
- ``GET /v1/info``      JSON: stage, model digest, step, codecs, limits.
- ``GET /v1/progress``  JSON: step and samples held, for the stage's averaging rounds. With
  ``?wait_step=N&wait_s=T`` a long-poll: answered once the stage reaches step ``N`` (or after
  ``T`` seconds, at most 10), so a trainer waiting for a step learns of it at once.
- ``POST /v1/average``  a stage-mate's gradient contribution (float32, sent with any codec; the
  swarm's ``grad_codec``); answered with the round's mean, encoded once with that codec for all
  contributors (``swarmd.pipeline.averaging``).
- ``GET /v1/state``     a consistent snapshot of the stage (parameters, optimizer state, step),
  streamed in checksummed chunks for a joining peer (``swarmd.net.state_transfer``).

Every reply's ``meta.step`` is the optimizer step the stage's parameters were at when the
request was computed; a backward sends back, as ``meta.step``, the step its forward reported.
``meta.mb`` (optional, forward and backward) is the trainer's 64-bit id of the microbatch: a
peer keeps a forward's activations under it for a while, so the backward of the same
microbatch on the same peer at the same step skips the recomputed forward
(``swarmd.pipeline.executor``, activation cache).

``meta.codec`` picks the codec of the reply's float tensors (default ``none``); ``meta.model``,
when sent, must equal this peer's spec digest. Errors are JSON ``{"error", "message"}`` with the
status carried by the ``swarmd.errors`` class: bad input is always a 4xx, never a 500.

In a private swarm (``--swarm-key``) every request, GETs included, must carry an ``X-Swarm-Auth``
header signed with the swarm key (``swarmd.swarm_key``); any other gets 401 before it is served,
and is counted in ``/status`` (``auth.refused.data_plane``).

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
from swarmd.swarm_key import AUTH_HEADER, SwarmKey, body_sha256

log = logging.getLogger(__name__)

MAX_PROGRESS_WAIT_S = 10.0  # the longest a /v1/progress long-poll (?wait_step=) is held open

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
        swarm_key: SwarmKey | None = None,
    ) -> None:
        """``swarm_key``: a private swarm's key; every request must then carry a valid
        ``X-Swarm-Auth`` header (``swarmd.swarm_key``), or is refused with 401."""
        self.executor = executor
        self.auth = swarm_key.http() if swarm_key is not None else None
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
        # no HEAD: a streamed state would be written after the HEAD answer, corrupting the connection
        self.app.router.add_get("/v1/state", self._state, allow_head=False)
        self.averager: StageAverager | None = None  # set by the daemon once it takes part in rounds

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (0 picks a free port) and return the bound address."""
        # keepalive_timeout also bounds a request's headers: aiohttp closes a connection that has
        # not sent a whole request within it (of connecting, or of its last answer). Its default
        # (3630 s) let a slowloris client that never finishes its headers hold a connection an hour.
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=5.0,
                                     keepalive_timeout=self.read_timeout_s)
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
        if self.auth is not None:  # a private swarm: nothing is served to a stranger, not even /v1/info
            refused = await self._authenticate(request)
            if refused is not None:
                return refused
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

    async def _authenticate(self, request: web.Request) -> web.Response | None:
        """None if the request is signed with the swarm key, else the response refusing it.

        The cheap checks (header, freshness, unseen nonce) come first; only then is the body read
        (under the frame limit and the read timeout; aiohttp keeps it for the handler) and hashed."""
        auth = self.auth
        assert auth is not None
        addr = request.remote
        checked = auth.precheck(request.headers.get(AUTH_HEADER), addr)
        if isinstance(checked, str):
            return _unauthorized(checked)
        body = b""
        if request.body_exists:
            try:
                body = await self._read_body(request)
            except SwarmdError as exc:
                return error_response(exc.http_status, type(exc).__name__, str(exc))
        why = auth.verify(checked, request.method, request.rel_url.raw_path_qs, await body_sha256(body), addr)
        return None if why is None else _unauthorized(why)

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body, within the frame limit and the read timeout (aiohttp keeps it, so a
        second read, e.g. the handler's after authentication, costs nothing)."""
        if request.content_length is not None and request.content_length > self.limits.max_frame_bytes:
            raise LimitExceeded(
                f"a {request.content_length}-byte body exceeds the {self.limits.max_frame_bytes}-byte frame limit"
            )
        try:
            return await asyncio.wait_for(request.read(), self.read_timeout_s)
        except web.HTTPRequestEntityTooLarge as exc:
            raise LimitExceeded(f"the body exceeds the {self.limits.max_frame_bytes}-byte frame limit") from exc
        except asyncio.TimeoutError as exc:
            raise RequestTimeout(f"the request body did not arrive within {self.read_timeout_s:.0f}s") from exc

    async def _read_frame(self, request: web.Request, kind: str):
        if request.content_type != CONTENT_TYPE:
            raise UnsupportedMediaType(f"send the body as {CONTENT_TYPE}, not {request.content_type or 'nothing'}")
        body = await self._read_body(request)
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
        if not isinstance(codec, str) or codec not in CODECS:  # a list or map is unhashable: no 500
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
        result = await self.executor.forward(inputs, targets, mb=_microbatch_id(frame.meta))
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
            inputs, frame.tensors.get("grad_outputs"), frame.tensors.get("targets"), step=step,
            mb=_microbatch_id(frame.meta),
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
        wait_step = request.query.get("wait_step")
        if wait_step is not None:  # a long-poll: answer once the stage reaches that step (or at wait_s)
            try:
                step, wait_s = int(wait_step), float(request.query.get("wait_s", "1"))
            except ValueError:
                raise RequestError("wait_step must be an integer and wait_s a number") from None
            if not 0.0 <= wait_s <= MAX_PROGRESS_WAIT_S:
                raise RequestError(f"wait_s must lie in [0, {MAX_PROGRESS_WAIT_S}]")
            await self.executor.wait_progress(wait_s, step=step)
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
            if not samples:  # the mean divides by samples: gradients of no sample would be weightless
                raise RequestError("a contribution with 'grads' must count its samples (meta.samples > 0)")
        elif samples:
            raise RequestError("a contribution with samples must carry its 'grads'")
        result = await self.averager.contribute(peer_id, step, samples, grads)
        if result.reply is not None:  # the mean, encoded once by the round for all its contributors
            return web.Response(body=result.reply, content_type=CONTENT_TYPE)
        tensors = {"grads": result.mean_grads} if result.mean_grads is not None else {}
        reply = {"status": result.status, "step": result.step, "samples": result.samples,
                 "contributors": result.contributors}
        return await self._reply("average_result", reply, tensors, "none")

    async def _state(self, request: web.Request) -> web.StreamResponse:
        meta, tensors = await self.executor.snapshot_state()
        return await stream_state(request, StateSnapshot(meta=meta, tensors=tensors))


def _unauthorized(reason: str) -> web.Response:
    return error_response(401, "Unauthorized", f"this swarm is private: sign requests with its --swarm-key "
                          f"(the {AUTH_HEADER} header was {_REFUSALS.get(reason, reason)})")


_REFUSALS = {
    "missing": "missing",
    "malformed": "malformed",
    "stale": "too old or too far in the future: check the clocks",
    "bad_mac": "not signed with this swarm's key",
    "replay": "a replay of an earlier request",
}


def _microbatch_id(meta: dict[str, Any]) -> int | None:
    """``meta.mb``: the trainer's id of the microbatch (keys the peer's activation cache)."""
    mb = meta.get("mb")
    if mb is not None and (not isinstance(mb, int) or isinstance(mb, bool) or not 0 <= mb < 2**64):
        raise RequestError(f"meta.mb must be an integer in [0, 2**64) (a microbatch id), got {mb!r}")
    return mb


def _required(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise RequestError(f"the frame has no '{name}' tensor (it has {sorted(tensors) or 'none'})") from None
