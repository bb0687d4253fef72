"""The data plane's contract: one request and one reply type per endpoint, as pure code.

``swarmd.net.wire`` says how a frame is laid out (meta + tensors, versioned, hostile-proof);
this module says what each endpoint's frames *mean*. Every request and reply is a frozen
dataclass with an ``encode`` to the wire and a ``from_frame`` / ``from_json`` that validates
remote input and raises only typed errors (``RequestError`` 422, ``WrongStage`` 409, never an
``assert``). ``swarmd.net.server`` decodes requests and encodes replies with them,
``swarmd.net.client`` the other way round, so neither side handles string-keyed dicts.

Endpoints (frames are ``application/x-msgpack``; info and progress answer JSON):

================  ==========================  ==========================================
endpoint          request                     reply
================  ==========================  ==========================================
POST /v1/forward  :class:`ForwardRequest`     :class:`ForwardReply`
POST /v1/backward :class:`BackwardRequest`    :class:`BackwardReply`
POST /v1/average  :class:`AverageRequest`     :class:`AverageReply`
POST /v1/recheck  :class:`RecheckRequest`     :class:`ReportReply`
POST /v1/reserve  :class:`ReserveRequest`     :class:`ReserveReply`
POST /v1/claim    :class:`ClaimRequest`       :class:`ClaimReply`
POST /v1/report   :class:`ReportRequest`      :class:`ReportReply`
GET  /v1/info     (none)                      :class:`InfoReply`
GET  /v1/progress :class:`ProgressRequest`    :class:`ProgressReply` (one shape, always)
================  ==========================  ==========================================

``POST /v1/recheck`` also takes a :class:`PartRecheckRequest` (a conviction on a part an all-reduce member sent).

The frames are those of wire version 1, unchanged: compute requests carry ``meta.stage``
(required), ``meta.model`` (the spec digest, optional), ``meta.codec`` (the codec of the
reply's float tensors, default ``none``), and ``meta.mb``/``meta.step`` where they apply; every
reply carries ``meta.stage`` and ``meta.step``. Decoders ignore meta keys and tensors they do
not know, so a newer peer may add some. (``GET /v1/state`` has its own stream format:
``swarmd.net.state_transfer``.)

A request is checked in this order, so a request that is wrong in several ways always gets
the same answer: its meta types (``stage`` an integer), then whether it is meant for the
receiving peer (:class:`StageTarget`: stage 409, model 409), then ``codec``, then the
endpoint's own fields and tensors (422). The shapes and values of the tensors a stage
computes with are the executor's to check: only it knows the model.

The types live by endpoint: ``compute`` (forward, backward, peer-to-peer hops), ``averaging``
(average, progress), ``leases`` (reserve, claim, report), ``info``; ``fields`` holds the limits
and validators they share. Import them from here.
"""

from swarmd.net.messages.averaging import (
    AverageReply,
    AverageRequest,
    PartRecheckRequest,
    ProgressReply,
    ProgressRequest,
    RecheckRequest,
)
from swarmd.net.messages.compute import BackwardReply, BackwardRequest, ForwardReply, ForwardRequest, Hop, HopResult
from swarmd.net.messages.fields import (
    HOP_MARGIN_MS,
    MAX_EXCLUDED,
    MAX_PEER_ID_LEN,
    MAX_PROGRESS_WAIT_S,
    PRECISIONS,
    StageTarget,
)
from swarmd.net.messages.info import InfoLimits, InfoReply, ModelInfo
from swarmd.net.messages.leases import (
    ClaimReply,
    ClaimRequest,
    ReportReply,
    ReportRequest,
    ReserveReply,
    ReserveRequest,
)

__all__ = [
    "HOP_MARGIN_MS",
    "PRECISIONS",
    "MAX_PROGRESS_WAIT_S",
    "MAX_EXCLUDED",
    "MAX_PEER_ID_LEN",
    "AverageReply",
    "AverageRequest",
    "BackwardReply",
    "BackwardRequest",
    "ClaimReply",
    "ClaimRequest",
    "ForwardReply",
    "ForwardRequest",
    "Hop",
    "HopResult",
    "InfoLimits",
    "InfoReply",
    "ModelInfo",
    "ProgressReply",
    "ProgressRequest",
    "PartRecheckRequest",
    "RecheckRequest",
    "ReportReply",
    "ReportRequest",
    "ReserveReply",
    "ReserveRequest",
    "StageTarget",
]
