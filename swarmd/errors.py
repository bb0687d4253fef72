"""Every error swarmd raises on purpose, in one tree.

::

    SwarmdError
     ├── ConfigError          bad user configuration (CLI flag, model file); the CLI exits 2
     ├── PortUnavailable      a port the daemon must listen on is taken or forbidden; the CLI
     │                        exits 1 with the flag and address (``swarmd.net.ports``)
     ├── WireError            a frame that cannot be decoded                         (HTTP 400)
     │    ├── MalformedFrame     not msgpack, truncated, wrong field types/lengths   (HTTP 400)
     │    ├── UnsupportedVersion a wire version this build cannot read              (HTTP 400)
     │    ├── UnknownCodec       a codec name not in the registry                   (HTTP 422)
     │    ├── UnsupportedDtype   a dtype outside the allow-list                     (HTTP 422)
     │    └── LimitExceeded      frame size, tensor count, rank or element count    (HTTP 413)
     ├── RequestError         a well-formed frame whose content does not fit the stage:
     │                        missing tensors, wrong shape, non-finite values       (HTTP 422)
     ├── WrongStage           the request is for a stage or model this peer does not serve
     │                                                                              (HTTP 409)
     ├── UnsupportedMediaType a data-plane body that is not application/x-msgpack   (HTTP 415)
     ├── RequestTimeout       a request body that did not arrive in time            (HTTP 408)
     ├── InputsNotCached      a backward without its inputs, whose forward this peer no
     │                        longer holds (restarted, evicted, another peer): resend
     │                        it with the inputs                                    (HTTP 409)
     ├── StepMismatch         the request was computed at another optimizer step   (HTTP 409)
     │    ├── StaleStep          older than the peer's: the gradient would mix steps; redo it
     │    └── PeerBehind         newer than the peer's: this peer missed a step and resyncs
     ├── Unauthorized         a private swarm's request without a valid signature  (HTTP 401)
     ├── Unavailable          the peer cannot serve this request now               (HTTP 503)
     │    ├── Busy               the stage is averaging or syncing; retry shortly, same peer or not
     │    ├── Starting           the peer has no stage built yet; send the request elsewhere
     │    ├── Draining           the peer is shutting down; send the request elsewhere
     │    └── Migrating          the peer is moving to another stage; send the request elsewhere
     ├── MigrationRefused     a move between stages that cannot happen now (HTTP 409; 422 for a
     │                        stage that does not exist)
     ├── PeerError            (client side) a peer answered with an error or not at all;
     │                        carries the HTTP status (0 when unreachable). A refusal named
     │                        after one of the classes above is rebuilt as that class too
     │                        (``remote_error``): ``except StaleStep`` works on the client
     ├── StateTransferError   (client side) a stage's state could not be downloaded from a
     │                        peer: refused, unreachable, timed out, or a corrupt, truncated
     │                        or oversized stream; carries the URL and HTTP status  (HTTP 502)
     └── DHTError             the DHT membership layer (``swarmd.dht``): a node used while
          │                   not running, a UDP port that cannot be bound
          ├── BootstrapError     none of the bootstrap addresses answered before the deadline
          └── RecordError        a signed DHT record that cannot be trusted or read; ``reason``
               │                 names the counter it is tallied under in ``DHTNode.stats()``
               ├── MalformedRecord          garbage, truncated, wrong field types or values
               ├── UnsupportedRecordVersion an envelope version or record type from a newer build
               ├── BadSignature             the signature does not verify over the body
               ├── PeerIdMismatch           peer_id / founder is not the signing key's id
               ├── RecordTooLarge           above the size limit, not even decoded   (HTTP 413)
               └── RecordExpired            its absolute expiry time has passed

Lower-level errors (msgpack, aiohttp, torch) are translated into this tree at the boundary
with ``raise ... from exc`` so callers never have to know which library failed. Each class
carries the HTTP status the data plane answers with, so the mapping lives in one place.

Across the wire an error travels as JSON ``{"error": <class name>, "message"}``. The client
turns it back into a :class:`PeerError` that is *also* an instance of the named class
(:func:`remote_error`), so callers catch refusals by type and never compare strings: a
``StaleStep`` from a peer is caught by ``except StaleStep`` and by ``except PeerError`` alike.
"""

from __future__ import annotations

import functools


class SwarmdError(Exception):
    """Base of every deliberate swarmd error."""

    http_status: int = 500


class ConfigError(SwarmdError):
    """The user asked for something impossible; the CLI prints it and exits 2."""

    http_status = 400


class PortUnavailable(SwarmdError):
    """A port given to the daemon is taken (or below 1024 without privileges); the message names
    the flag and the address. Not a ConfigError: the same command works once the port is free."""

    http_status = 503


class WireError(SwarmdError):
    """A frame could not be decoded."""

    http_status = 400


class MalformedFrame(WireError):
    """Not msgpack, truncated, or a field with the wrong type or length."""


class UnsupportedVersion(WireError):
    """The frame's wire version is not one this build can read."""


class UnknownCodec(WireError):
    """A codec name that is not in the registry."""

    http_status = 422


class UnsupportedDtype(WireError):
    """A dtype outside the allow-list."""

    http_status = 422


class LimitExceeded(WireError):
    """The frame or one of its tensors is larger than the configured limits allow."""

    http_status = 413


class RequestError(SwarmdError):
    """A decodable request whose content does not fit this stage."""

    http_status = 422


class NonFinite(RequestError):
    """A request's tensors hold NaN or Inf (or its gradients overflow to them): refused, never applied."""


class WrongStage(SwarmdError):
    """The request targets a stage (or model) this peer does not serve."""

    http_status = 409


class UnsupportedMediaType(SwarmdError):
    """A data-plane body sent with another content type than application/x-msgpack."""

    http_status = 415


class RequestTimeout(SwarmdError):
    """The request body did not arrive within the read timeout."""

    http_status = 408


class PeerError(SwarmdError):
    """Client side: a peer refused a request (``status`` is its HTTP status) or was unreachable (0)."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(f"{error} ({status}): {message}" if status else f"{error}: {message}")
        self.status = status
        self.error = error
        self.message = message


class DHTError(SwarmdError):
    """The DHT layer cannot do what was asked (node not running, port not bindable)."""

    http_status = 503


class BootstrapError(DHTError):
    """No bootstrap address answered before the deadline; the message names each one and why."""


class RecordError(DHTError):
    """A signed DHT record was refused; ``reason`` is its key in the rejection counters."""

    http_status = 400
    reason: str = "invalid"


class MalformedRecord(RecordError):
    """Not msgpack, truncated, a missing field, or a field of the wrong type or range."""

    reason = "malformed"


class UnsupportedRecordVersion(RecordError):
    """An envelope version or record type that only a newer build can read."""

    reason = "version"


class BadSignature(RecordError):
    """The signature does not verify over the record's body with the enclosed key."""

    reason = "signature"


class PeerIdMismatch(RecordError):
    """The record's peer_id (or founder) is not the id derived from the signing key."""

    reason = "peer_id"


class RecordTooLarge(RecordError):
    """The record is larger than the limit; it is refused before being decoded."""

    http_status = 413
    reason = "oversized"


class RecordExpired(RecordError):
    """The record's absolute expiry time is in the past."""

    reason = "expired"


class InputsNotCached(SwarmdError):
    """A backward that omitted its stage inputs, naming a microbatch whose forward this peer does
    not hold (it restarted, evicted the entry, never ran that forward, or the forward came from
    another address): nothing was computed or counted; the sender resends it with the inputs
    (``swarmd.pipeline.stage.activation_cache``)."""

    http_status = 409


class StepMismatch(SwarmdError):
    """A request computed at another optimizer step than the one this peer is at."""

    http_status = 409


class StaleStep(StepMismatch):
    """The request's step is older than the peer's: its gradient is dropped, never mixed in."""


class PeerBehind(StepMismatch):
    """The request's step is newer than the peer's: this peer missed a step and must resync."""


class Unauthorized(SwarmdError):
    """A private swarm's peer got a request not signed with the swarm key (or a replayed one)."""

    http_status = 401


class Unavailable(SwarmdError):
    """The peer cannot serve the request right now; nothing is wrong with the request."""

    http_status = 503


class Busy(Unavailable):
    """The stage is in the middle of an all-reduce (or a state download); retry shortly."""


class Starting(Unavailable):
    """The peer has not built its stage yet (or is between two stages): ask another peer."""


class Draining(Unavailable):
    """The peer is shutting down and takes no new requests: ask another peer of the stage."""


class Migrating(Unavailable):
    """The peer is moving to another stage; in-flight requests finish, new ones go elsewhere."""


class MigrationRefused(SwarmdError):
    """A move between stages that cannot happen now (HTTP 409, or 422 for a stage that does not exist)."""

    http_status = 409

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.http_status = status


class NotHeld(SwarmdError):
    """``GET /v1/checkpoint/{stage}`` for a stage this peer holds no usable checkpoint of."""

    http_status = 404


class StageStateLost(SwarmdError):
    """The swarm has trained, and no live peer or checkpoint anywhere holds this stage's state."""

    http_status = 409


class StateTransferError(SwarmdError):
    """Client side: downloading a stage's state from ``url`` failed; try another neighbour.

    ``status`` is the HTTP status when the peer refused the download (404, 503, ...) and 0 when
    there was no refusal to report: unreachable, timed out, or a stream that was corrupt,
    truncated, oversized or rejected by the caller's header check. ``unreachable``: the peer could
    not be connected to, or sent no header before the deadline (a firewall, NAT or a wrong announced
    address, rather than a bad stream). Never a partial state.
    """

    http_status = 502

    def __init__(self, message: str, *, url: str = "", status: int = 0, unreachable: bool = False) -> None:
        super().__init__(f"state download from {url} failed: {message}" if url else message)
        self.url = url
        self.status = status
        self.message = message
        self.unreachable = unreachable  # no connection, or nothing heard before the deadline


def _remote_classes() -> dict[str, type[SwarmdError]]:
    """The classes a peer's refusal may name: every error of this module that a data plane
    raises, i.e. those built from a message alone (not the client-side ones with their own
    constructor, ``PeerError`` and ``StateTransferError``)."""
    found: dict[str, type[SwarmdError]] = {}
    stack: list[type[SwarmdError]] = [SwarmdError]
    while stack:
        cls = stack.pop()
        if cls.__module__ == __name__ and "__init__" not in vars(cls):
            found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


_REMOTE = _remote_classes()


@functools.cache
def _remote_class(name: str) -> type[PeerError]:
    """``PeerError`` mixed with the swarmd error class named ``name`` (one class per name)."""
    base = _REMOTE[name]
    return type(f"Remote{name}", (PeerError, base), {"__doc__": f"A peer refused the request with {name}."})


def remote_error(status: int, error: str, message: str) -> PeerError:
    """The client-side exception for a peer's refusal ``{"error": error, "message": message}``.

    Always a :class:`PeerError` (``status``, ``error`` and ``message`` kept); when ``error``
    names one of swarmd's own error classes, also an instance of that class. Any other name
    (a newer peer's, aiohttp's ``HTTPNotFound``, ...) gives a plain ``PeerError``: remote
    input picks among known classes only, it never creates one.
    """
    if error in _REMOTE:
        return _remote_class(error)(status, error, message)
    return PeerError(status, error, message)
