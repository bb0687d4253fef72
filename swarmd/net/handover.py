"""``POST /v1/gradients``: a peer that leaves gracefully hands its accumulated gradients to a stage-mate.

Without it, a peer that drains on SIGTERM takes the gradient sum of every sample it computed
since the stage's last step with it, and the stage needs that many samples again. With it, the
leaver takes its sum out of the step protocol (as an averaging round would), and sends it to a
serving stage-mate, which accumulates it only if it is at the very same step and not averaging
(``StepProtocol.receive``): a gradient of one version of the parameters is never added to the
update of another. Refused (``Busy``, ``StaleStep``, ``Draining`` ...), the leaver tries the next
stage-mate, and what nobody took is counted as dropped.

Whom it offers them to (:func:`handover_order`, issue #18): in an open swarm a stage's listing
may hold dozens of fake peers, and a leaver on its way out must not spend its drain offering
gradients to each. It tries the stage-mates that proved themselves (``swarmd.net.proof``) first,
in id order, then at most :data:`MAX_UNPROVEN_ATTEMPTS` others with a short timeout, and never
one its stage excludes.

The request is a wire frame (``swarmd.net.wire``), kind ``gradients``: meta ``{stage, model,
step, samples, peer_id}``, one float32 tensor ``grads`` (the flat sum over ``samples``, the
parameters in name order, as ``/v1/average`` carries it; always codec ``none``, the hand-over is
exact). The reply is JSON ``{"accepted": samples, "step": step}``.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch

from swarmd.errors import NonFinite, PeerError, RequestError, WrongStage, remote_error
from swarmd.net.wire import CONTENT_TYPE, Frame, encode_frame

__all__ = ["GradientsRequest", "HandoverResult", "hand_over", "handover_order", "send_gradients"]

log = logging.getLogger(__name__)

KIND = "gradients"
MAX_PEER_ID_CHARS = 64
#: A hand-over to a stage-mate that proved itself may take this long ...
PROVEN_TIMEOUT_S = 10.0
#: ... one to a stage-mate that did not (maybe a fake record pointing at a tarpit) this long,
UNPROVEN_TIMEOUT_S = 2.0
#: and at most this many unproven stage-mates are tried at all.
MAX_UNPROVEN_ATTEMPTS = 2


def handover_order(mates: Mapping[str, str], *, proven: Collection[str] | None, excluded: Collection[str] = (),
                   self_id: str = "") -> list[tuple[str, str, float]]:
    """``(peer_id, addr, timeout_s)`` to offer a hand-over to, in order: the ``proven`` stage-mates
    (by id), then at most :data:`MAX_UNPROVEN_ATTEMPTS` unproven ones with a short timeout; never
    ``excluded`` ones or ``self_id``. ``proven`` None: nothing is known about proofs (a private
    swarm's members, or no averager yet) and every listed stage-mate is tried as before."""
    listed = [(pid, addr) for pid, addr in sorted(mates.items()) if pid != self_id and pid not in excluded]
    if proven is None:
        return [(pid, addr, PROVEN_TIMEOUT_S) for pid, addr in listed]
    first = [(pid, addr, PROVEN_TIMEOUT_S) for pid, addr in listed if pid in proven]
    rest = [(pid, addr, UNPROVEN_TIMEOUT_S) for pid, addr in listed if pid not in proven]
    return first + rest[:MAX_UNPROVEN_ATTEMPTS]


def _count(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"meta.{key} must be a non-negative integer, got {value!r:.60}")
    return value


@dataclass(frozen=True)
class GradientsRequest:
    """A leaver's gradient sum over ``samples`` samples, computed at ``step``."""

    stage: int
    model: str
    step: int
    samples: int
    peer_id: str
    grads: torch.Tensor

    def encode(self) -> bytes:
        meta = {"stage": self.stage, "model": self.model, "step": self.step, "samples": self.samples,
                "peer_id": self.peer_id}
        return encode_frame(KIND, meta, {"grads": self.grads}, "none")

    @classmethod
    def from_frame(cls, frame: Frame, *, stage: int, model: str, grad_numel: int) -> GradientsRequest:
        """Validate a remote frame against the stage this peer serves (typed 4xx errors, never assert)."""
        if frame.kind != KIND:
            raise RequestError(f"this endpoint takes a '{KIND}' frame, got '{frame.kind}'")
        meta = frame.meta
        got_stage, got_model = meta.get("stage"), meta.get("model")
        if got_stage != stage or isinstance(got_stage, bool):
            raise WrongStage(f"this peer serves stage {stage}, not stage {got_stage!r:.20}")
        if got_model != model:
            raise WrongStage(f"this peer serves model {model[:12]}, not {str(got_model)[:12]}")
        peer_id = meta.get("peer_id")
        if not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_CHARS:
            raise RequestError("meta.peer_id (the leaver's peer id) is required")
        step, samples = _count(meta, "step"), _count(meta, "samples")
        if samples < 1:
            raise RequestError("handed-over gradients must cover at least one sample (meta.samples)")
        grads = frame.tensors.get("grads")
        if grads is None or grads.dtype != torch.float32 or grads.dim() != 1 or grads.numel() != grad_numel:
            raise RequestError(f"'grads' must be float32 of shape [{grad_numel}]")
        if not bool(torch.isfinite(grads).all()):
            raise NonFinite("'grads' contain NaN or Inf; refused")
        return cls(stage=stage, model=model, step=step, samples=samples, peer_id=peer_id, grads=grads)


@dataclass(frozen=True)
class HandoverResult:
    """What a leaver's hand-over achieved: to whom, how many samples, and what was refused."""

    accepted_by: str | None  # the stage-mate's peer id; None: nobody took them
    samples: int
    refusals: tuple[str, ...] = ()


async def send_gradients(session: aiohttp.ClientSession, addr: str, request: GradientsRequest,
                         *, timeout_s: float = 10.0) -> int:
    """POST the hand-over to ``addr``; the samples accepted, or a ``PeerError`` (rebuilt by name)."""
    try:
        async with session.post(f"http://{addr}/v1/gradients", data=io.BytesIO(request.encode()),
                                headers={"Content-Type": CONTENT_TYPE},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                try:
                    body = await resp.json(content_type=None)
                    raise remote_error(resp.status, str(body.get("error", "Error"))[:64],
                                       str(body.get("message", ""))[:500])
                except (ValueError, AttributeError, aiohttp.ClientError):
                    raise PeerError(resp.status, "Error", (await resp.text(errors="replace"))[:200]) from None
            reply = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise PeerError(0, type(exc).__name__, f"{addr} did not answer: {exc}") from exc
    accepted = reply.get("accepted") if isinstance(reply, dict) else None
    if not isinstance(accepted, int) or isinstance(accepted, bool) or accepted != request.samples:
        raise PeerError(200, "MalformedReply", f"{addr} answered the hand-over with {reply!r:.80}")
    return accepted


async def hand_over(session: aiohttp.ClientSession, mates: Iterable[tuple[str, str, float]],
                    request: GradientsRequest) -> HandoverResult:
    """Offer ``request`` to each ``(peer_id, data_addr, timeout_s)`` in turn until one accepts it
    (:func:`handover_order` says whom)."""
    refusals: list[str] = []
    for peer_id, addr, timeout_s in mates:
        try:
            await send_gradients(session, addr, request, timeout_s=timeout_s)
        except PeerError as exc:
            refusals.append(f"{peer_id[:12]}: {exc.error}")
            log.debug("hand-over of %d samples to %s refused: %s", request.samples, peer_id[:12], exc)
            continue
        return HandoverResult(accepted_by=peer_id, samples=request.samples, refusals=tuple(refusals))
    return HandoverResult(accepted_by=None, samples=request.samples, refusals=tuple(refusals))
