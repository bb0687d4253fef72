"""A thin async client for the data plane: one typed call per endpoint, typed errors.

Trainers and peers call stages through this; it knows the wire contract
(``swarmd.net.messages``) and nothing about routing (that lives in
``swarmd.pipeline.routing``). Every failure surfaces as ``swarmd.errors.PeerError`` carrying
the HTTP status (0 when the peer was unreachable, 200 when its reply could not be read); a
refusal named after one of swarmd's error classes is also an instance of that class
(``swarmd.errors.remote_error``), so callers write ``except StaleStep`` rather than compare
the error's name.

Encoding and decoding frames costs real CPU (8-bit quantization especially), so frames
above :data:`INLINE_CODEC_BYTES` are coded on a small thread pool the client owns, and the
event loop only moves bytes (the server does the same). The client owns its aiohttp session,
or uses one it is given (the daemon's, signed with the swarm key) and leaves that one open.

Every reply body is timed from its first byte to its last into :attr:`DataPlaneClient.links`
(``swarmd.net.links``): the averaging rounds' bodies measure the links between stage-mates for free.
The bodies' bytes are counted on the client (:attr:`DataPlaneClient.bytes_sent`, ``bytes_received``)
and, inside :func:`metered`, on the caller's :class:`WireBytes` too: what one call cost the link,
whatever retries and hops it took (a trainer's spot checks weigh their traffic with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import torch

from swarmd.errors import PeerError, SwarmdError, remote_error
from swarmd.net.addresses import dial_target
from swarmd.net.links import LinkMeter
from swarmd.net.messages import (
    AverageReply,
    AverageRequest,
    BackwardReply,
    BackwardRequest,
    ClaimReply,
    ClaimRequest,
    ForwardReply,
    ForwardRequest,
    Hop,
    InfoReply,
    PartRecheckRequest,
    ProgressReply,
    ProgressRequest,
    RecheckRequest,
    ReportReply,
    ReportRequest,
    ReserveReply,
    ReserveRequest,
)
from swarmd.net.wire import CONTENT_TYPE, DEFAULT_LIMITS, Frame, WireLimits, decode_frame
from swarmd.swarm_key import SwarmKey, signing_middleware

__all__ = ["INLINE_CODEC_BYTES", "KEEPALIVE_S", "DataPlaneClient", "WireBytes", "client_session", "metered"]

#: Frames (or, before encoding, tensor bytes) up to this size are coded on the event loop: a
#: hop to the pool costs more than encoding a few KiB, and progress polls stay cheap.
INLINE_CODEC_BYTES = 64 * 2**10
CONNECT_TIMEOUT_S = 10.0  # a TCP connect that takes longer: the address is not reachable
#: Idle connections to a peer stay open this long: below the data plane's own 60 s (``NetConfig
#: .read_timeout_s``), so the client never reuses one the server is closing.
KEEPALIVE_S = 50.0

T = TypeVar("T")


@dataclass
class WireBytes:
    """The request and reply bodies (frames, HTTP headers not counted) of the data-plane posts made
    inside one :func:`metered` block."""

    sent: int = 0
    received: int = 0

    @property
    def total(self) -> int:
        return self.sent + self.received


_METER: contextvars.ContextVar[WireBytes | None] = contextvars.ContextVar("swarmd_wire_meter", default=None)


@contextlib.contextmanager
def metered() -> Iterator[WireBytes]:
    """Count the bodies of every data-plane post made in this block (and in tasks it starts) into
    the :class:`WireBytes` it yields, on whichever client sends them."""
    wire = WireBytes()
    token = _METER.set(wire)
    try:
        yield wire
    finally:
        _METER.reset(token)


class DataPlaneClient:
    """Calls peers' data planes; use as ``async with DataPlaneClient() as client``.

    ``session``: an aiohttp session to send with (e.g. the daemon's, which signs requests in a
    private swarm); the client then does not close it. Without one, the client opens its own
    on entering, signed with ``swarm_key`` when given. ``timeout_s`` bounds each call unless
    the call names its own.
    """

    def __init__(
        self,
        timeout_s: float = 60.0,
        *,
        swarm_key: SwarmKey | None = None,
        session: aiohttp.ClientSession | None = None,
        limits: WireLimits = DEFAULT_LIMITS,
        codec_threads: int = 2,
    ) -> None:
        self.timeout_s = timeout_s
        self.limits = limits  # what this client accepts in replies
        self._swarm_key = swarm_key
        self.links = LinkMeter()  # every reply body's time, by the address it came from
        self._session = session
        self._owns_session = session is None
        #: bodies sent and received (frames and JSON, HTTP headers not counted): what this client
        #: costs its machine's link (``scripts/bench_p2p.py``'s trainer bytes per microbatch)
        self.bytes_sent = 0
        self.bytes_received = 0
        # threads start on the first submit: a client that only polls progress never has any
        self._codec_pool = ThreadPoolExecutor(max_workers=codec_threads, thread_name_prefix="swarmd-client-codec")

    async def __aenter__(self) -> DataPlaneClient:
        if self._session is None:
            self._session = client_session(self._swarm_key)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use DataPlaneClient as an async context manager, or give it a session")
        return self._session

    async def close(self) -> None:
        """Close the session if this client opened it, and stop the codec threads."""
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
        await asyncio.get_running_loop().run_in_executor(None, self._codec_pool.shutdown, True)

    # ---- endpoints -------------------------------------------------------------------------

    async def forward(
        self,
        addr: str,
        stage: int,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        codec: str = "none",
        model: str | None = None,
        mb: int | None = None,
        timeout_s: float | None = None,
        next: tuple[Hop, ...] = (),
        peer: str | None = None,
        origin: str | None = None,
        budget_ms: int | None = None,
        back: bool = False,
        min_step: int | None = None,
    ) -> ForwardReply:
        """``mb``: the microbatch's id; the peer keeps the forward's activations for its backward.
        ``timeout_s``: this call's own bound (a trainer's per-peer timeout), else the client's.
        ``next``, ``peer``, ``origin``: peer to peer (issue #31, :class:`~swarmd.net.messages.ForwardRequest`):
        the peers of the following stages the outputs go on to, the peer id this request is for,
        the trainer's address a hop's forward is kept for, and how long the sender waits (with ``next``);
        ``back``: the backward chain runs back through them once the last stage's fused call answered;
        ``min_step``: run only once the peer (and each hop's) reached that step, waited for within the budget."""
        request = ForwardRequest(stage=stage, inputs=inputs, targets=targets, model=model, codec=codec, mb=mb,
                                 next=next, peer=peer, origin=origin, budget_ms=budget_ms, back=back,
                                 min_step=min_step)
        frame = await self._post(addr, "forward", request.encode, _nbytes(inputs, targets), timeout_s=timeout_s)
        return self._read(addr, ForwardReply.from_frame, frame)

    async def backward(
        self,
        addr: str,
        stage: int,
        inputs: torch.Tensor | None,
        grad_outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        codec: str = "none",
        model: str | None = None,
        step: int | None = None,
        mb: int | None = None,
        deadline_ms: int | None = None,
        timeout_s: float | None = None,
        verify: bool = False,
        attempt: int = 0,
        peer: str | None = None,
        origin: str | None = None,
        min_step: int | None = None,
    ) -> BackwardReply:
        """``step``: the step this stage's forward reported for the microbatch (None: no check);
        ``mb``: the id its forward was sent with (a hit in that peer's activation cache; counted
        once per step); ``deadline_ms``: the peer adds the gradient only within this long of
        receiving it (send less than this call's timeout: the rest is the way there and back);
        ``timeout_s``: this call's own bound, else the client's; ``verify``: a spot check's second
        opinion, computed and answered but never accumulated (``swarmd.train.verify``); ``attempt``:
        this call's number among the attempts at ``mb`` on this stage (exactly once: a claim fences).
        ``inputs`` None: the peer's own of ``mb``, which its forward's reply said it ``kept`` (a peer
        that lost them refuses with ``InputsNotCached``: send them then). ``peer``, ``origin``: a fused
        last hop's (issue #31), as :meth:`forward`'s, and ``min_step`` (waited for within ``deadline_ms``)."""
        request = BackwardRequest(stage=stage, inputs=inputs, grad_outputs=grad_outputs, targets=targets, model=model,
                                  codec=codec, step=step, mb=mb, deadline_ms=deadline_ms, verify=verify,
                                  attempt=attempt, peer=peer, origin=origin, min_step=min_step)
        frame = await self._post(addr, "backward", request.encode, _nbytes(inputs, grad_outputs, targets),
                                 timeout_s=timeout_s)
        return self._read(addr, BackwardReply.from_frame, frame)

    async def average(
        self, addr: str, request: AverageRequest, *, grad_numel: int | None = None, timeout_s: float | None = None
    ) -> AverageReply:
        """Send a contribution to the round's leader and wait for the round's answer.

        ``grad_numel``: the size an ``ok`` answer's mean must have (a wrong one is a
        ``PeerError`` with status 200, as any unreadable reply).
        """
        frame = await self._post(addr, "average", request.encode, _nbytes(request.grads), timeout_s=timeout_s)
        return self._read(addr, lambda f: AverageReply.from_frame(f, grad_numel), frame)

    async def reserve(self, addr: str, request: ReserveRequest, *, timeout_s: float | None = None) -> ReserveReply:
        """Ask a stage peer's lease book for sample reservations (``swarmd.pipeline.reservations``)."""
        frame = await self._post(addr, "reserve", request.encode, 0, timeout_s=timeout_s)
        return self._read(addr, ReserveReply.from_frame, frame)

    async def claim(self, addr: str, request: ClaimRequest, *, timeout_s: float | None = None) -> ClaimReply:
        """Ask a peer whether it counted a microbatch whose backward there failed without an answer
        (and fence the attempt off if not: ``swarmd.pipeline.stage.step_protocol``, exactly once)."""
        frame = await self._post(addr, "claim", request.encode, 0, timeout_s=timeout_s)
        return self._read(addr, ClaimReply.from_frame, frame)

    async def report(self, addr: str, request: ReportRequest, *, timeout_s: float | None = None) -> ReportReply:
        """Hand a peer a signed misbehaviour report (``swarmd.pipeline.reports``)."""
        frame = await self._post(addr, "report", request.encode, 0, timeout_s=timeout_s)
        return self._read(addr, ReportReply.from_frame, frame)

    async def recheck(self, addr: str, request: RecheckRequest | PartRecheckRequest, *,
                      timeout_s: float | None = None) -> ReportReply:
        """Show a stage-mate a conviction by recomputation, or on a part an all-reduce member sent, to check
        (``POST /v1/recheck``)."""
        frame = await self._post(addr, "recheck", request.encode, request.nbytes, timeout_s=timeout_s)
        return self._read(addr, ReportReply.from_frame, frame)

    async def info(self, addr: str, *, timeout_s: float | None = None) -> InfoReply:
        body = await self._get_json(addr, "info", {}, timeout_s)
        return self._read(addr, InfoReply.from_json, body)

    async def progress(
        self, addr: str, *, wait_step: int | None = None, wait_s: float | None = None, timeout_s: float | None = None
    ) -> ProgressReply:
        """Where the peer's stage stands. With ``wait_step``, a long-poll: the peer answers once
        its stage reaches that step, or after ``wait_s`` seconds (default 1)."""
        request = ProgressRequest(wait_step=wait_step, wait_s=1.0 if wait_s is None else wait_s)
        body = await self._get_json(addr, "progress", request.to_query(), timeout_s)
        return self._read(addr, ProgressReply.from_json, body)

    async def allreduce(self, addr: str, op: str, encode: Callable[[], bytes], nbytes: int = 0, *,
                        timeout_s: float | None = None) -> Frame:
        """One call of the chunked all-reduce round (``POST /v1/allreduce/<op>``,
        ``swarmd.pipeline.averaging.allreduce.messages``); the decoded answer frame, for the caller to validate."""
        return await self._post(addr, f"allreduce/{op}", encode, nbytes, timeout_s=timeout_s)

    # ---- plumbing --------------------------------------------------------------------------

    def _timeout(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        total = self.timeout_s if timeout_s is None else timeout_s
        # an address nobody answers at (a firewall that drops, a wrong --announce) fails in seconds, not at `total`
        return aiohttp.ClientTimeout(total=total, sock_connect=min(total, CONNECT_TIMEOUT_S))

    async def _post(
        self, addr: str, kind: str, encode: Callable[[], bytes], nbytes: int, *, timeout_s: float | None = None
    ) -> Frame:
        body = await self._coded(encode, nbytes)
        self.bytes_sent += len(body)
        meter = _METER.get()
        if meter is not None:
            meter.sent += len(body)
        base, relay = dial_target(addr)
        try:
            async with self.session.post(
                # bytes, not a file-like body: io.BytesIO costs aiohttp two more copies of the frame
                # (getbuffer unshares it, then 64 KiB reads) and a loop iteration per chunk
                f"{base}/v1/{kind}", data=body, headers={"Content-Type": CONTENT_TYPE, **relay},
                timeout=self._timeout(timeout_s),
            ) as resp:
                if resp.status != 200:
                    raise await _refusal(resp)
                started = time.monotonic()  # the headers are in: the body's first bytes with them
                payload = await resp.read()
                self.bytes_received += len(payload)
                if meter is not None:
                    meter.received += len(payload)
                self.links.record(addr, len(payload), time.monotonic() - started)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerError(0, type(exc).__name__, f"{addr} did not answer: {exc}") from exc
        try:
            return await self._coded(lambda: decode_frame(payload, self.limits), len(payload))
        except SwarmdError as exc:
            raise _bad_reply(addr, exc) from exc

    async def _get_json(self, addr: str, path: str, query: dict[str, str], timeout_s: float | None) -> Any:
        base, relay = dial_target(addr)
        try:
            async with self.session.get(f"{base}/v1/{path}", params=query or None, headers=relay,
                                        timeout=self._timeout(timeout_s)) as resp:
                if resp.status != 200:
                    raise await _refusal(resp)
                self.bytes_received += len(await resp.read())  # kept by aiohttp: json() reads it again for free
                try:
                    return await resp.json(content_type=None)
                except ValueError as exc:
                    raise _bad_reply(addr, exc) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise PeerError(0, type(exc).__name__, f"{addr} did not answer: {exc}") from exc

    def _read(self, addr: str, decode: Callable[[Any], T], value: Any) -> T:
        """A reply decoded into its type; a peer's unreadable reply becomes a PeerError (200)."""
        try:
            return decode(value)
        except SwarmdError as exc:
            raise _bad_reply(addr, exc) from exc

    async def _coded(self, fn: Callable[[], T], nbytes: int) -> T:
        """``fn()`` (an encode or decode) inline when small, else on the codec pool."""
        if nbytes <= INLINE_CODEC_BYTES:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._codec_pool, fn)


def client_session(swarm_key: SwarmKey | None, **kwargs: Any) -> aiohttp.ClientSession:
    """An aiohttp session whose requests are signed with ``swarm_key`` (when given), so that the
    data plane of a private swarm serves them.

    Its connections stay open :data:`KEEPALIVE_S` between requests (aiohttp's default is 15 s): a
    stage-mate averaged with once a step of 20 s, or a stage peer a trainer calls now and then, is
    reached without a new handshake (one round trip more over the internet, and a fresh connection
    starts TCP's congestion window from scratch). Every connection has TCP_NODELAY set (aiohttp's
    protocol does it for client and server alike): a small request is not held back for a full segment."""
    kwargs.setdefault("connector", aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S))
    if swarm_key is not None:
        kwargs["middlewares"] = (*kwargs.get("middlewares", ()), signing_middleware(swarm_key.http()))
    return aiohttp.ClientSession(**kwargs)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _bad_reply(addr: str, exc: Exception) -> PeerError:
    """A reply this client cannot read: the peer's fault (status 200: it did answer)."""
    return PeerError(200, "BadReply", f"{addr} sent a reply this client cannot read: {exc}")


async def _refusal(resp: aiohttp.ClientResponse) -> PeerError:
    """The peer's ``{"error", "message"}`` refusal, rebuilt as its error class when it is ours."""
    try:
        body = await resp.json(content_type=None)
        return remote_error(resp.status, str(body.get("error", "Error"))[:64], str(body.get("message", ""))[:2000])
    except (ValueError, AttributeError, aiohttp.ClientError):
        return PeerError(resp.status, "Error", (await resp.text(errors="replace"))[:200])
