"""The aiohttp data plane: forward and backward of one stage over msgpack frames.

Endpoints (all bodies ``application/x-msgpack`` frames, see ``swarmd.net.wire``; each
request and reply is a type of ``swarmd.net.messages``, which validates them):

- ``POST /v1/forward``  meta ``{stage, model?, codec?}``, tensors ``inputs`` (+ ``targets`` on
  the last stage) → ``outputs``, or ``loss`` when the last stage got targets.
- ``POST /v1/backward`` meta as above, tensors ``inputs`` + ``grad_outputs`` (the last stage:
  ``inputs`` + ``targets``) → ``grad_inputs`` (none on stage 0) and meta ``loss``/``samples``.
  Without ``inputs`` when the forward's reply said ``kept``: the peer uses the inputs it kept
  under ``meta.mb``, or refuses with 409 ``InputsNotCached`` (the sender resends them).
  Peer to peer (issue #31): a forward whose ``meta.next`` names the following stages' peers is sent
  on to the first of them (its outputs, the rest of ``next``, ``meta.origin``: the trainer's address),
  the last hop possibly being the last stage's fused backward; the reply is the chain's end
  (``meta.chain``, ``meta.fused``), or this stage's own outputs with ``meta.hop_error`` when the hop
  failed (the trainer goes on from there). A request naming another ``meta.peer`` than this one: 409.
  With ``meta.back`` (the backward chain), once the fused end answered this peer runs its own backward
  with the gradient the stage after it answered and answers that instead (``meta.backs``), or why it
  could not (``meta.back_error``). ``meta.min_step`` (forward or backward): run only once this peer
  reached that step, waited for within half the request's budget or deadline, else 409 ``PeerBehind``; a
  forward carries it on to its hops (a sync trainer's next step may reach a later stage of a chain
  while that stage still finishes the step before).
- ``GET /v1/info``      JSON: stage, model digest, step, codecs, limits.
- ``GET /v1/progress``  JSON (``ProgressReply``, one shape): step and samples held, for the
  stage's averaging rounds and for trainers. With
  ``?wait_step=N&wait_s=T`` a long-poll: answered once the stage reaches step ``N`` (or after
  ``T`` seconds, at most 10), so a trainer waiting for a step learns of it at once.
- ``POST /v1/average``  a stage-mate's gradient contribution (float32, sent with any codec; the
  swarm's ``grad_codec``); answered with the round's mean, encoded once with that codec for all
  contributors (``swarmd.pipeline.averaging.averager``).
- ``POST /v1/allreduce/<op>`` the chunked all-reduce round's reports, parts, ready reports,
  decisions and part means (``swarmd.pipeline.averaging.allreduce.averager``,
  ``swarmd.pipeline.averaging.allreduce.messages``),
  when the swarm's ``TrainingSpec.averaging`` is ``allreduce``.
- ``POST /v1/reserve`` a trainer's sample reservations for the stage's current step: leases
  from the stage's lease book (``swarmd.pipeline.reservations``), so several trainers together
  never start more than one step's batch.
- ``POST /v1/claim``   whether this stage counted a microbatch whose backward's answer a trainer
  lost; if not, the lost attempt is fenced off (``swarmd.pipeline.stage.step_protocol``, exactly once).
- ``POST /v1/gradients`` a leaving stage-mate's accumulated gradients, accepted for this very
  step only (``swarmd.net.handover``).
- ``POST /v1/report``   a trainer's signed misbehaviour report (``swarmd.pipeline.reports``),
  counted in this daemon's ledger; two independent ones exclude the accused. Answered
  whatever this peer serves (even while starting), with what the ledger made of it.
- ``POST /v1/recheck``  a stage-mate's conviction by recomputation: the accused's signed opening and
  one microbatch's inputs, checked and recomputed by the averager, which seconds it (and counts its
  report in the ledger) when it holds (``swarmd.pipeline.averaging.trust.recomputation``).
- ``GET /v1/state``     a consistent snapshot of the stage (parameters, optimizer state, step),
  streamed in checksummed chunks for a joining peer (``swarmd.net.state_transfer``).
- ``GET /v1/proof?nonce=N`` JSON: this peer's signature over the nonce, its peer id, announced
  address, stage, step and params digest (``swarmd.net.proof``, installed by the daemon).

Every reply's ``meta.step`` is the optimizer step the stage's parameters were at when the
request was computed; a backward sends back, as ``meta.step``, the step its forward reported.
``meta.mb`` (optional, forward and backward) is the trainer's 64-bit id of the microbatch: a
peer keeps a forward's activations under it for a while, so the backward of the same
microbatch on the same peer at the same step skips the recomputed forward
(``swarmd.pipeline.stage.executor``, activation cache).

``meta.codec`` picks the codec of the reply's float tensors (default ``none``); ``meta.model``,
when sent, must equal this peer's spec digest. Errors are JSON ``{"error", "message"}`` with the
status carried by the ``swarmd.errors`` class: bad input is always a 4xx, never a 500.

In a private swarm (``--swarm-key``) every request, GETs included, must carry an ``X-Swarm-Auth``
header signed with the swarm key (``swarmd.swarm_key``); any other gets 401 before it is served,
and is counted in ``/status`` (``auth.refused.data_plane``).

The stage being served is never held here: every request asks the daemon's getter for the
current ``StageRuntime`` (``swarmd.pipeline.stage.runtime``) once, and uses that one throughout, so a
migration swaps the stage with one assignment. Before there is one, requests get 503
``Starting``; while draining 503 ``Draining``, while paused for a move 503 ``Migrating``.

Decoding and encoding run on a small codec thread pool and compute on the stage's worker
thread, so the event loop only moves bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from swarmd.errors import (
    Busy,
    Draining,
    InputsNotCached,
    LimitExceeded,
    Migrating,
    PeerBehind,
    PeerError,
    RequestError,
    RequestTimeout,
    Starting,
    SwarmdError,
    Unauthorized,
    UnsupportedMediaType,
    WrongStage,
)
from swarmd.finite import json_response
from swarmd.net.addresses import RELAY_ATTACH_PATH, RELAY_HEADER
from swarmd.net.client import DataPlaneClient
from swarmd.net.codecs import CODECS
from swarmd.net.handover import GradientsRequest
from swarmd.net.messages import (
    HOP_MARGIN_MS,
    MAX_EXCLUDED,
    AverageRequest,
    BackwardReply,
    BackwardRequest,
    ClaimReply,
    ClaimRequest,
    ForwardReply,
    ForwardRequest,
    HopResult,
    InfoLimits,
    InfoReply,
    ModelInfo,
    PartRecheckRequest,
    ProgressReply,
    ProgressRequest,
    RecheckRequest,
    ReportReply,
    ReportRequest,
    ReserveReply,
    ReserveRequest,
    StageTarget,
)
from swarmd.net.state_transfer import StateSnapshot, stream_state
from swarmd.net.wire import CONTENT_TYPE, WIRE_VERSION, Frame, WireLimits, decode_frame, media_type
from swarmd.pipeline.averaging.trust.accusations import RecomputedEvidence, decode_evidence
from swarmd.pipeline.reports import MisbehaviourReport, ReportLedger
from swarmd.pipeline.stage.runtime import RuntimeGetter, StageRuntime
from swarmd.swarm_key import AUTH_HEADER, HttpAuth, SwarmKey, body_sha256

__all__ = ["CODEC_KEY", "MAX_REPORT_FRAME_BYTES", "DataPlane", "error_response"]

#: Where a handler leaves the codec its request named (``meta.codec``, validated), for the byte
#: counters' ``codec`` label (``swarmd.api.metrics``); requests without tensors count as ``none``.
#: A ``web.RequestKey`` where aiohttp has one (a plain string key warns there), a string before.
CODEC_KEY: Any = web.RequestKey("codec", str) if hasattr(web, "RequestKey") else "swarmd.codec"

#: The largest ``POST /v1/report`` body served (a report is about 400 bytes).
MAX_REPORT_FRAME_BYTES = 16 * 2**10

if TYPE_CHECKING:
    from swarmd.net.relay import RelayServer

log = logging.getLogger(__name__)

#: The longest a request's ``min_step`` is waited for, whatever budget it names.
STEP_WAIT_MAX_S = 30.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, error: str, message: str) -> web.Response:
    """The data plane's refusal: JSON ``{"error", "message"}``; the client rebuilds ``error``
    as its class (``swarmd.errors.remote_error``)."""
    return json_response({"error": error, "message": message}, status=status)


def _refuse(exc: SwarmdError) -> web.Response:
    return error_response(exc.http_status, type(exc).__name__, str(exc))


class DataPlane:
    """Serves the daemon's current stage; owns its aiohttp runner, its codec pool and its
    in-flight count."""

    def __init__(
        self,
        runtime: RuntimeGetter,
        *,
        limits: WireLimits,
        read_timeout_s: float = 60.0,
        swarm_key: SwarmKey | None = None,
        relay: RelayServer | None = None,
        peer_id: Callable[[], str | None] = lambda: None,
        reports: ReportLedger | None = None,
        hops: DataPlaneClient | None = None,
    ) -> None:
        """``runtime``: returns the stage this peer serves now (None while it has none).
        ``swarm_key``: a private swarm's key; every request must then carry a valid
        ``X-Swarm-Auth`` header (``swarmd.swarm_key``), or is refused with 401.
        ``relay``: passes requests addressed to peers relayed through this one (``X-Swarm-Relay``
        naming another ``peer_id()`` than this peer's) on to them (``swarmd.net.relay``).
        ``reports``: the daemon's ledger of misbehaviour reports (``POST /v1/report``; without
        one the endpoint answers 404); its exclusions go out with every progress reply.
        ``hops``: the client a forward's outputs go on to the next stage's peer with (issue #31: peer
        to peer, signed like the daemon's other requests); without one, a forward carrying a next hop is
        answered as any other (``hop_error`` says why) and the trainer goes on itself. Not closed here."""
        self.reports = reports
        self.hops = hops
        # forwards sent on to a next hop, and those that failed; backwards run in a backward chain, and failed ones
        self.hop_stats = {"sent": 0, "failed": 0, "backward": 0, "backward_failed": 0}
        self._runtime = runtime
        self.relay = relay
        self.relay_self = peer_id
        self.auth = swarm_key.http() if swarm_key is not None else None
        self.limits = limits
        self.read_timeout_s = read_timeout_s
        self.in_flight = 0
        self.served = {"forward": 0, "backward": 0, "rejected": 0}
        self.state_served = {"streams": 0, "bytes": 0}  # GET /v1/state: snapshots streamed to joiners
        self._draining = False
        self._paused = False  # migrating between stages: new requests get 503
        self._idle = asyncio.Event()
        self._idle.set()
        self._codec_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="swarmd-codec")
        self._runner: web.AppRunner | None = None
        self._site: web.BaseSite | None = None
        self.address: tuple[str, int] | None = None
        self.app = web.Application(client_max_size=limits.max_frame_bytes, middlewares=[self._middleware])
        self.app.router.add_post("/v1/forward", self._forward)
        self.app.router.add_post("/v1/backward", self._backward)
        self.app.router.add_get("/v1/info", self._info)
        self.app.router.add_get("/v1/progress", self._progress)
        self.app.router.add_post("/v1/average", self._average)
        self.app.router.add_post("/v1/reserve", self._reserve)  # sample reservations (pipeline/reservations.py)
        self.app.router.add_post("/v1/claim", self._claim)  # exactly once across peers (stage/step_protocol.py)
        self.app.router.add_post("/v1/gradients", self._gradients)  # a leaver's hand-over (net/handover.py)
        self.app.router.add_post("/v1/report", self._report)  # misbehaviour reports (pipeline/reports.py)
        self.app.router.add_post("/v1/recheck", self._recheck)  # convictions by recomputation (averaging/trust/)
        self.app.router.add_post("/v1/allreduce/{op}", self._allreduce)  # chunked all-reduce (pipeline/averaging/)
        # no HEAD: a streamed state would be written after the HEAD answer, corrupting the connection
        self.app.router.add_get("/v1/state", self._state, allow_head=False)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0, *,
                    sock: socket.socket | None = None) -> tuple[str, int]:
        """Listen on ``host:port`` (0 picks a free port), or on ``sock`` when one is given (bound
        beforehand: ``swarmd.net.ports``), and return the bound address."""
        # keepalive_timeout also bounds a request's headers: aiohttp closes a connection that has
        # not sent a whole request within it (of connecting, or of its last answer). Its default
        # (3630 s) let a slowloris client that never finishes its headers hold a connection an hour.
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=5.0,
                                     keepalive_timeout=self.read_timeout_s)
        await self._runner.setup()
        self._site = web.SockSite(self._runner, sock) if sock is not None else web.TCPSite(self._runner, host, port)
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
            refused = await self._authenticate(request, self.auth)
            if refused is not None:
                return refused
        target = request.headers.get(RELAY_HEADER)
        if target is not None and self.relay is not None and target != self.relay_self():
            # for a peer relayed through this one (swarmd.net.relay): passed on as it came, signature and all
            return await self.relay.forward(request, target, await request.read())
        if self._draining:
            self.served["rejected"] += 1
            return _refuse(Draining("this peer is shutting down; send the request to another peer"))
        if self._paused and request.path != "/v1/progress":
            self.served["rejected"] += 1
            return _refuse(Migrating("this peer is moving to another stage; send the request elsewhere"))
        if self.relay is not None and request.path == RELAY_ATTACH_PATH:
            return await handler(request)  # a relayed peer's long-lived WebSocket: not a request to drain
        self.in_flight += 1
        self._idle.clear()
        try:
            return await handler(request)
        except SwarmdError as exc:
            self.served["rejected"] += 1
            log.debug("refused %s: %s: %s", request.path, type(exc).__name__, exc)
            return _refuse(exc)
        except web.HTTPException as exc:
            self.served["rejected"] += 1
            return error_response(exc.status, type(exc).__name__, exc.reason)
        except ConnectionResetError as exc:  # (aiohttp's ClientConnectionResetError too) the caller went away
            # while a streamed answer was being written (a state download given up): no bug, and nobody to read
            # the answer (aiohttp drops it on the closed connection)
            log.info("%s %s: the caller went away mid-answer (%s)", request.method, request.path, exc)
            return error_response(400, "CallerGone", "the connection closed before the answer was written")
        except Exception:  # a bug, not bad input: keep serving, say so, log the traceback
            log.exception("unexpected error while serving %s %s", request.method, request.path)
            return error_response(500, "InternalError", "the peer failed unexpectedly; see its log")
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _authenticate(self, request: web.Request, auth: HttpAuth) -> web.Response | None:
        """None if the request is signed with the swarm key, else the response refusing it.

        The cheap checks (header, freshness, unseen nonce) come first; only then is the body read
        (under the frame limit and the read timeout; aiohttp keeps it for the handler) and hashed."""
        addr = request.remote
        checked = auth.precheck(request.headers.get(AUTH_HEADER), addr)
        if isinstance(checked, str):
            return _unauthorized(checked)
        body = b""
        if request.body_exists:
            try:
                body = await self._read_body(request)
            except SwarmdError as exc:
                return _refuse(exc)
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

    async def _read_frame(self, request: web.Request) -> Frame:
        return (await self._read_frame_and_body(request))[0]

    async def _read_frame_and_body(self, request: web.Request) -> tuple[Frame, bytes]:
        sent = media_type(request.headers.get("Content-Type"))
        if sent != CONTENT_TYPE:
            raise UnsupportedMediaType(f"send the body as {CONTENT_TYPE}, not {sent[:64] or 'nothing'}")
        body = await self._read_body(request)
        frame: Frame = await self._in_pool(decode_frame, body, self.limits)
        return frame, body

    def _current(self) -> StageRuntime:
        """The runtime this request is served with (one per request, whatever a migration does)."""
        runtime = self._runtime()
        if runtime is None:
            raise Starting("this peer has no stage built yet; send the request to another peer")
        return runtime

    @staticmethod
    def _target(runtime: StageRuntime) -> StageTarget:
        ex = runtime.executor
        return StageTarget(stage=ex.stage, model=ex.spec.digest, grad_numel=ex.grad_numel)

    async def _in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._codec_pool, fn, *args)

    async def _reply(self, encode: Callable[[str], bytes], codec: str) -> web.Response:
        body = await self._in_pool(encode, codec)
        return web.Response(body=body, content_type=CONTENT_TYPE)

    # ---- endpoints -------------------------------------------------------------------------

    async def _forward(self, request: web.Request) -> web.Response:
        received = time.monotonic()  # the sender's budget runs from here (peer to peer: _next_hop)
        runtime = self._current()
        req = ForwardRequest.from_frame(await self._read_frame(request), self._target(runtime))
        request[CODEC_KEY] = req.codec  # validated: one of CODECS (the metrics' codec label)
        me = self.relay_self()
        if req.peer is not None and me is not None and req.peer != me:  # a hop meant for whoever had this address
            raise WrongStage(f"this is peer {me[:12]}, not {req.peer[:12]}")
        # a kept forward is tied to where it came from: only a backward from there may omit its inputs; a hop's
        # forward to where the trainer's came from (``origin``), since the trainer sends the backward
        source = req.origin if req.origin is not None else (request.remote or "")
        targets = None if req.next else req.targets  # with next hops: the chain's last stage's, carried on
        budget_s = max(0, (req.budget_ms or 0) - HOP_MARGIN_MS) / 1000.0
        waited = await self._at_step(runtime, req.min_step, received + budget_s / 2)
        result = await runtime.executor.forward(req.inputs, targets, mb=req.mb, source=source)
        self.served["forward"] += 1
        loss = float(result.outputs) if targets is not None else None
        reply = ForwardReply(stage=req.stage, step=result.step, outputs=result.outputs, loss=loss,
                             precision=runtime.executor.precision, kept=result.kept)
        if req.next:
            reply = await self._next_hop(req, reply, source, received)
        if req.back:
            reply = await self._chain_backward(runtime, req, reply, result.outputs.shape, result.kept, source, received)
        if waited:  # not this peer's own time either (the sender's latency estimates leave it out)
            reply = dataclasses.replace(reply, wait_ms=reply.wait_ms + waited)
        return await self._reply(reply.encode, req.codec)

    @staticmethod
    async def _at_step(runtime: StageRuntime, min_step: int | None, until: float) -> int:
        """A request's ``min_step``: wait until this peer's stage reached it, or refuse at ``until``
        (``PeerBehind``: the sender goes on without this peer, nothing was computed or counted). Half of
        the request's budget (or deadline) at most, what follows keeps the other half, and never longer
        than ``STEP_WAIT_MAX_S`` (a request does not pin a handler for an hour's budget). The ms waited."""
        ex = runtime.executor
        if min_step is None or ex.step >= min_step:
            return 0
        began = time.monotonic()
        if not await ex.wait_progress(min(STEP_WAIT_MAX_S, max(0.0, until - began)), step=min_step):
            raise PeerBehind(f"stage {ex.stage} on this peer is at step {ex.step}, not yet at step {min_step}")
        return int((time.monotonic() - began) * 1e3)

    async def _next_hop(self, req: ForwardRequest, own: ForwardReply, origin: str, received: float) -> ForwardReply:
        """Send this forward's outputs on to the next stage's peer the trainer chose (issue #31) and
        answer with the chain's end; when that hop fails (unreachable, refused, late, a reply of
        another stage), with this stage's own outputs and why, so the trainer goes on from there.

        The hop gets what is left of this request's budget (less ``HOP_MARGIN_MS`` to answer), and a
        fused hop's deadline as much less: what it counts, it counts before this peer gives up on it."""
        started = time.monotonic()
        if self.hops is None:
            return dataclasses.replace(own, hop_error="this peer sends no forward to other peers")
        left_ms = (req.budget_ms or 0) - int((started - received) * 1e3) - HOP_MARGIN_MS  # required with next
        planned = req.next[0]
        cut = max(0, planned.timeout_ms - left_ms)
        if cut >= planned.timeout_ms or (planned.deadline_ms is not None and cut > planned.deadline_ms):
            return dataclasses.replace(own, hop_error=f"no time left for the next hop ({left_ms} ms)")
        hop = dataclasses.replace(planned, timeout_ms=planned.timeout_ms - cut,
                                  deadline_ms=None if planned.deadline_ms is None else planned.deadline_ms - cut)
        self.hop_stats["sent"] += 1
        try:
            if hop.deadline_ms is not None:  # the last stage's fused forward and backward: counted there, once
                fused = await self.hops.backward(hop.addr, hop.stage, own.outputs, targets=req.targets,
                                                 codec=req.codec, model=req.model, mb=req.mb,
                                                 deadline_ms=hop.deadline_ms, timeout_s=hop.timeout_ms / 1000.0,
                                                 peer=hop.peer_id, origin=origin, min_step=req.min_step)
                if fused.stage != hop.stage or fused.loss is None:
                    raise PeerError(200, "BadReply", f"{hop.addr} answered a fused call without its loss")
                last = HopResult(stage=hop.stage, step=fused.step, peer_id=hop.peer_id, precision=fused.precision)
                return dataclasses.replace(own, outputs=torch.empty(0), chain=(last,), fused=fused,
                                           wait_ms=int((time.monotonic() - started) * 1e3))
            after = await self.hops.forward(hop.addr, hop.stage, own.outputs, req.targets, codec=req.codec,
                                            model=req.model, mb=req.mb, next=req.next[1:], peer=hop.peer_id,
                                            origin=origin, budget_ms=hop.timeout_ms, timeout_s=hop.timeout_ms / 1000.0,
                                            back=req.back, min_step=req.min_step)
            if after.stage != hop.stage or after.loss is not None:
                raise PeerError(200, "BadReply", f"{hop.addr} answered a forward of stage {after.stage}, "
                                                 f"not of stage {hop.stage}")
        except PeerError as exc:
            self.hop_stats["failed"] += 1
            log.info("stage %d: the next hop %s (stage %d) failed (%s); answering the trainer", req.stage,
                     hop.addr, hop.stage, exc)
            return dataclasses.replace(own, hop_error=f"{hop.addr}: {exc}",
                                       wait_ms=int((time.monotonic() - started) * 1e3))
        first = HopResult(stage=hop.stage, step=after.step, peer_id=hop.peer_id, kept=after.kept,
                          precision=after.precision, wait_ms=after.wait_ms)
        return dataclasses.replace(own, outputs=after.outputs, chain=(first, *after.chain), hop_error=after.hop_error,
                                   fused=after.fused, backs=after.backs, back_error=after.back_error,
                                   wait_ms=int((time.monotonic() - started) * 1e3))

    async def _chain_backward(self, runtime: StageRuntime, req: ForwardRequest, reply: ForwardReply,
                              shape: torch.Size, kept: bool, origin: str, received: float) -> ForwardReply:
        """The backward chain (issue #31, ``meta.back``): the chain answered down to the last stage's fused
        call, and every stage after this one ran its backward: run this stage's, on the inputs this peer
        kept, with the input gradient the stage after it answered, and answer this stage's instead
        (``ForwardReply.backs``). Counted as the trainer's attempt 0 would be (for ``origin``, whose claim
        may fence it) and only within what is left of the sender's budget less ``HOP_MARGIN_MS``: what it
        counts, it counts before its sender gives up. Where it fails (refused, stale, late, a gradient of
        the wrong shape), the reply says why (``back_error``) and the trainer sends the rest itself."""
        if reply.fused is None or reply.back_error is not None:
            return reply  # the chain broke before its fused end, or the backward chain stopped after this stage
        after = reply.backs[0] if reply.backs else reply.fused
        grad = after.grad_inputs
        if after.stage != req.stage + 1 or grad is None or tuple(grad.shape) != tuple(shape):
            return dataclasses.replace(reply, back_error=f"stage {req.stage + 1} answered no input gradient for "
                                                         f"stage {req.stage}'s outputs")
        ex = runtime.executor
        deadline = received + ((req.budget_ms or 0) - HOP_MARGIN_MS) / 1000.0
        self.hop_stats["backward"] += 1
        try:
            try:
                result = await ex.backward(None if kept else req.inputs, grad, None, step=reply.step, mb=req.mb,
                                           deadline=deadline, attempt=0, source=origin)
            except InputsNotCached:  # evicted since the forward (refused before anything counted): this peer has them
                result = await ex.backward(req.inputs, grad, None, step=reply.step, mb=req.mb, deadline=deadline,
                                           attempt=0, source=origin)
        except SwarmdError as exc:
            self.hop_stats["backward_failed"] += 1
            log.info("stage %d: its backward in a chain failed (%s); the trainer sends it", req.stage, exc)
            return dataclasses.replace(reply, back_error=f"stage {req.stage}: {exc}")
        self.served["backward"] += 1
        mine = BackwardReply(stage=req.stage, step=result.step, samples=result.samples, accumulated=ex.grad_samples,
                             grad_inputs=result.grad_inputs, duplicate=result.duplicate, precision=ex.precision)
        rest = tuple(dataclasses.replace(b, grad_inputs=None) for b in reply.backs)  # only the first's is needed
        return dataclasses.replace(reply, fused=dataclasses.replace(reply.fused, grad_inputs=None), backs=(mine, *rest))

    async def _backward(self, request: web.Request) -> web.Response:
        received = time.monotonic()  # the sender's deadline runs from here (exactly once: step_protocol.py)
        runtime = self._current()
        req = BackwardRequest.from_frame(await self._read_frame(request), self._target(runtime))
        request[CODEC_KEY] = req.codec
        me = self.relay_self()
        if req.peer is not None and me is not None and req.peer != me:  # a fused hop meant for another peer
            raise WrongStage(f"this is peer {me[:12]}, not {req.peer[:12]}")
        ex = runtime.executor
        deadline = None if req.deadline_ms is None else received + req.deadline_ms / 1000.0
        await self._at_step(runtime, req.min_step, received + (req.deadline_ms or 0) / 2000.0)
        # a fused hop counts for the trainer's address (``origin``), whose claim may fence it (step_protocol.py)
        result = await ex.backward(req.inputs, req.grad_outputs, req.targets, step=req.step, mb=req.mb,
                                   deadline=deadline, verify=req.verify, attempt=req.attempt,
                                   source=req.origin if req.origin is not None else (request.remote or ""))
        self.served["backward"] += 1
        reply = BackwardReply(stage=req.stage, step=result.step, samples=result.samples, accumulated=ex.grad_samples,
                              grad_inputs=result.grad_inputs, loss=result.loss, duplicate=result.duplicate,
                              precision=ex.precision)
        return await self._reply(reply.encode, req.codec)

    async def _info(self, request: web.Request) -> web.Response:
        ex = self._current().executor
        reply = InfoReply(
            wire_version=WIRE_VERSION,
            stage=ex.stage,
            n_stages=ex.spec.n_stages,
            model=ModelInfo(name=ex.spec.name, digest=ex.spec.digest, spec=ex.spec.to_dict()),
            step=ex.step,
            codecs=tuple(sorted(CODECS)),
            limits=InfoLimits.of(self.limits, ex.max_batch_tokens),
        )
        return json_response(reply.to_json())

    async def _progress(self, request: web.Request) -> web.Response:
        req = ProgressRequest.from_query(request.query)
        runtime = self._current()
        if req.wait_step is not None:  # a long-poll: answer once the stage reaches that step (or at wait_s)
            await runtime.executor.wait_progress(req.wait_s, step=req.wait_step)
            runtime = self._current()  # a migration may have swapped the stage meanwhile
        averager = runtime.averager
        excluded = tuple(sorted(self.reports.excluded())) if self.reports is not None else ()
        if averager is not None:  # and the peers its round checks caught (a refused leader, a poisoned contributor)
            excluded = tuple(sorted(set(excluded) | averager.suspicions.excluded()))
        # accused once: trainers check their answers more (swarmd.pipeline.reports.ReportLedger.suspected)
        suspected = tuple(self.reports.suspected(MAX_EXCLUDED)) if self.reports is not None else ()
        if averager is not None and not self._paused:
            reply = dataclasses.replace(averager.progress(), excluded=excluded, suspected=suspected)
            return json_response(reply.to_json())
        ex = runtime.executor  # not taking part in rounds (starting, or moving to another stage)
        away = ProgressReply(stage=ex.stage, step=ex.step, samples=ex.grad_samples, averaging=ex.averaging,
                             away=True, dropped_samples=ex.dropped_samples,
                             target_batch_size=ex.training.target_batch_size, excluded=excluded,
                             suspected=suspected)
        return json_response(away.to_json())

    async def _report(self, request: web.Request) -> web.Response:
        """A signed misbehaviour report: validated (422 naming what is wrong), then counted."""
        if self.reports is None:
            raise web.HTTPNotFound(reason="this peer keeps no report ledger")
        if request.content_length is not None and request.content_length > MAX_REPORT_FRAME_BYTES:
            raise LimitExceeded(f"a report is at most {MAX_REPORT_FRAME_BYTES} bytes")
        req = ReportRequest.from_frame(await self._read_frame(request))
        report = MisbehaviourReport.decode(req.body, req.signature)
        evidence = None
        if report.kind == "averaging":  # a leader's conviction: the accused's own signed claims (422 if not)
            evidence = decode_evidence(report.evidence)  # far claims, or an opening that contradicts itself
            evidence.verify(report.stage, report.accused)
        result = self.reports.add(report, request.remote or "")
        runtime = self._runtime()
        if evidence is not None and runtime is not None and runtime.averager is not None and not self._paused:
            runtime.averager.consider_accusation(report, evidence)  # a stage-mate may second it
        reply = ReportReply(accepted=result.accepted, reason=result.reason, excluded=result.excluded)
        return await self._reply(reply.encode, "none")

    async def _recheck(self, request: web.Request) -> web.Response:
        """A stage-mate's conviction by recomputation: its signatures and digests checked (422 naming what
        is wrong), and handed to the averager, which recomputes the microbatch itself and counts the report
        in the ledger only when it holds (answered at once: ``reason`` says ``checking``, ``queued`` or
        ``ignored``, ``accepted`` is false until then)."""
        if self.reports is None:
            raise web.HTTPNotFound(reason="this peer keeps no report ledger")
        frame = await self._read_frame(request)
        if frame.kind == PartRecheckRequest.KIND:  # a part an all-reduce member sent (allreduce/sent_parts)
            return await self._recheck_part(request, PartRecheckRequest.from_frame(frame), self.reports)
        req = RecheckRequest.from_frame(frame)
        evidence = await self._in_pool(RecomputedEvidence.check, req.body, req.signature, req.opening, req.mb,
                                       req.inputs, req.targets)  # hashes the inputs: off the loop
        reports, source = self.reports, request.remote or ""
        runtime = self._runtime()
        consider = getattr(runtime.averager, "consider_recheck", None) if runtime is not None else None
        verdict = "not_checked"
        if consider is not None and not self._paused:
            # recomputed by the averager, which counts the report in the ledger only if it holds (and seconds it)
            verdict = consider(evidence, lambda: reports.add(evidence.report, source))
        reply = ReportReply(accepted=False, reason=verdict, excluded=evidence.report.accused in reports.excluded())
        return await self._reply(reply.encode, "none")

    async def _recheck_part(self, request: web.Request, req: PartRecheckRequest,
                            reports: ReportLedger) -> web.Response:
        """A stage-mate's conviction on a part an all-reduce member sent: handed to the averager, which checks its
        signatures and digests (422 naming what is wrong), sketches the part itself and counts the report in the
        ledger only when it holds (``swarmd.pipeline.averaging.allreduce.sent_parts``)."""
        source = request.remote or ""
        runtime = self._runtime()
        consider = getattr(runtime.averager, "consider_part_recheck", None) if runtime is not None else None
        if consider is None or self._paused:
            reply = ReportReply(accepted=False, reason="not_checked", excluded=False)
            return await self._reply(reply.encode, "none")
        verdict, accused = await consider(req, lambda report: reports.add(report, source))
        reply = ReportReply(accepted=False, reason=verdict, excluded=accused in reports.excluded())
        return await self._reply(reply.encode, "none")

    async def _average(self, request: web.Request) -> web.Response:
        runtime = self._current()
        frame = await self._read_frame(request)
        try:
            req = AverageRequest.from_frame(frame, self._target(runtime))
        except RequestError as exc:  # counted by the averager (non-finite or malformed contributions), then a 422
            checker = runtime.averager
            if checker is not None:
                signer = await self._in_pool(checker.signer_of, frame)  # hashes the gradients: off the loop
                checker.note_unreadable(frame, exc, signer)
            raise
        request[CODEC_KEY] = str(frame.meta.get("codec", "none"))  # checked by from_frame: one of CODECS
        averager = runtime.averager
        if averager is None:
            raise Busy("this peer is not taking part in averaging rounds yet")
        result = await averager.contribute(req.peer_id, req.step, req.samples, req.grads, request=req)
        if result.reply is not None:  # the mean, encoded once by the round for all its contributors
            return web.Response(body=result.reply, content_type=CONTENT_TYPE)
        return await self._reply(result.to_reply(req.stage).encode, "none")

    async def _allreduce(self, request: web.Request) -> web.Response:
        """One request of the chunked all-reduce round (``swarmd.pipeline.averaging.allreduce.averager``; the
        messages are ``swarmd.pipeline.averaging.allreduce.messages``): answered by the stage's averager when it
        runs that round."""
        runtime = self._current()
        handle = getattr(runtime.averager, "handle", None)
        if handle is None:
            raise Busy("this peer takes no part in all-reduce rounds now")
        # (the body too: a part's owner keeps its member's signed frame as it came, for audits)
        frame, raw = await self._read_frame_and_body(request)
        body = await handle(request.match_info["op"], frame, request.remote or "", raw)
        return web.Response(body=body, content_type=CONTENT_TYPE)

    async def _reserve(self, request: web.Request) -> web.Response:
        """Leases for the stage's current step from its lease book (``swarmd.pipeline.reservations``)."""
        runtime = self._current()
        req = ReserveRequest.from_frame(await self._read_frame(request), self._target(runtime))
        ex = runtime.executor
        if req.step > ex.step:
            raise PeerBehind(f"stage {ex.stage} on this peer is at step {ex.step}, behind step {req.step}")
        grant = ex.reservations.reserve(req.trainer, step=ex.step, size=req.size, count=req.count,
                                        lease_s=req.lease_s, done=req.done, renew=req.renew,
                                        held=req.held if req.step == ex.step else None)
        # "reserved" is what the step has spoken for, the shares kept for other trainers included: a trainer
        # told the step is full waits for the next one (an older trainer reads it the same way)
        reply = ReserveReply(stage=ex.stage, step=grant.step, leases=grant.leases,
                             reserved=max(0, grant.reserved + grant.promised), target=grant.target)
        return await self._reply(reply.encode, "none")

    async def _claim(self, request: web.Request) -> web.Response:
        """Whether this stage counted a microbatch; if not, the claimed attempts never will be
        (``swarmd.pipeline.stage.step_protocol``, exactly once). No compute, answered at once."""
        runtime = self._current()
        req = ClaimRequest.from_frame(await self._read_frame(request), self._target(runtime))
        # fences only the attempts sent from the claimant's own address (step_protocol.py)
        counted, step = runtime.executor.claim(req.mb, req.attempt, request.remote or "")
        return await self._reply(ClaimReply(stage=req.stage, step=step, counted=counted).encode, "none")

    async def _gradients(self, request: web.Request) -> web.Response:
        """A leaving stage-mate's accumulated gradients (``swarmd.net.handover``)."""
        ex = self._current().executor
        req = GradientsRequest.from_frame(await self._read_frame(request), stage=ex.stage, model=ex.spec.digest,
                                          grad_numel=ex.grad_numel)
        await ex.receive_gradients(req.grads, req.samples, req.step)
        return json_response({"accepted": req.samples, "step": req.step})

    async def _state(self, request: web.Request) -> web.StreamResponse:
        meta, tensors = await self._current().executor.snapshot_state()
        self.state_served["streams"] += 1

        def sent(n: int) -> None:
            self.state_served["bytes"] += n

        return await stream_state(request, StateSnapshot(meta=meta, tensors=tensors), on_sent=sent)


def _unauthorized(reason: str) -> web.Response:
    return _refuse(Unauthorized(f"this swarm is private: sign requests with its --swarm-key "
                                f"(the {AUTH_HEADER} header was {_REFUSALS.get(reason, reason)})"))


_REFUSALS = {
    "missing": "missing",
    "malformed": "malformed",
    "stale": "too old or too far in the future: check the clocks",
    "bad_mac": "not signed with this swarm's key",
    "replay": "a replay of an earlier request",
}
