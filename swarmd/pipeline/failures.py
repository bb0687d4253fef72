"""What a trainer does when a peer refuses a call: a pure ``PeerError -> Action`` rule.

SWARM's trainers (paper, section 3.2) survive peers that are slow, leaving, or gone by routing
around them (``swarmd.pipeline.routing`` bans and retries elsewhere). Which of those a refusal
calls for depends on *why* the peer refused, and the peer says why by the error's class
(``swarmd.errors``; the client rebuilds it from its name). This module is that decision, kept
apart from the async trainer so it can be tested exhaustively; the trainer only carries it out.

=========================  ===================================================================
action                     when
=========================  ===================================================================
``REDO``                   ``StaleStep``: the stage stepped since this microbatch's forward; its
                           gradient would mix two steps, so the whole microbatch is redone
``RETRY_SOON``             ``Busy`` (the stage is averaging) and any other 503: the peer is fine
                           and will serve shortly; pause briefly and retry, no ban
``RETRY_ELSEWHERE``        ``Draining``, ``Migrating``, ``Starting`` (the peer is leaving or not
                           serving yet), ``PeerBehind`` (it missed a step and resyncs),
                           ``WrongStage`` (our view of the swarm is out of date),
                           ``InputsNotCached`` (a backward sent without its inputs, which this
                           peer no longer holds: the trainer resends it with them at once, so
                           this is only reached if even that is refused so): another peer
                           of the stage can serve it now; no ban, the peer did nothing wrong
                           (once every usable peer refused a call as ``PeerBehind``, the
                           trainer redoes the microbatch: ``swarmd.train.stage_calls.StageBehind``)
``BAN``                    unreachable (status 0), a request timeout (408), a server error
                           (5xx other than 503), or a reply we cannot read (200): the peer is
                           broken or gone; ban it with backoff and retry elsewhere
``FATAL``                  any other refusal (400, 401, 409, 413, 415, 422, ...): the request
                           itself is wrong, and resending it anywhere would fail the same way
=========================  ===================================================================

Whether a ``BAN`` was this client's own timeout (:func:`timed_out`: the peer held the call and never
answered, a tarpit's signature) is told by the type of the error's cause, never by its name.
"""

from __future__ import annotations

import enum

from swarmd.errors import (
    Busy,
    Draining,
    InputsNotCached,
    Migrating,
    PeerBehind,
    PeerError,
    StaleStep,
    Starting,
    Unavailable,
    WrongStage,
)

__all__ = ["Action", "classify", "refused_connection", "timed_out"]


class Action(enum.Enum):
    """What the trainer does with a call a peer refused (see the module docstring)."""

    REDO = "redo"
    RETRY_SOON = "retry_soon"
    RETRY_ELSEWHERE = "retry_elsewhere"
    BAN = "ban"
    FATAL = "fatal"


_ELSEWHERE: tuple[type[Exception], ...] = (Draining, Migrating, Starting, PeerBehind, WrongStage, InputsNotCached)


def classify(error: PeerError) -> Action:
    """The action for ``error``; by its class first, then (for names a peer of another version
    may send) by its HTTP status. Total: every PeerError gets an action."""
    if isinstance(error, StaleStep):
        return Action.REDO
    if isinstance(error, _ELSEWHERE):
        return Action.RETRY_ELSEWHERE
    if isinstance(error, (Busy, Unavailable)) or error.status == 503:
        return Action.RETRY_SOON
    if error.status in (0, 200, 408) or error.status >= 500:
        return Action.BAN
    return Action.FATAL


def timed_out(error: PeerError) -> bool:
    """Whether ``error`` is this client giving up waiting for an answer (status 0: the peer said
    nothing), told by its cause: aiohttp's and asyncio's timeouts are all ``TimeoutError``
    subclasses, and a trainer that cuts a call short raises its PeerError from one too. A peer's
    own refusal (a 408 whose body did not arrive at the peer in time, say) is not this client's
    timeout."""
    return error.status == 0 and isinstance(error.__cause__, TimeoutError)


def refused_connection(error: PeerError) -> bool:
    """Whether ``error`` is the peer's address refusing the connection (status 0, caused by a
    ``ConnectionRefusedError``, which aiohttp wraps as its ``os_error``): no process listens
    there, so the peer is gone (a loaded or partitioned peer times out instead)."""
    cause = error.__cause__
    return error.status == 0 and isinstance(getattr(cause, "os_error", cause), ConnectionRefusedError)
