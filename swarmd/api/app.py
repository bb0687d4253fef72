"""The FastAPI control plane: what a person (or a trainer) asks a daemon over HTTP.

Served by uvicorn on the daemon's own event loop (see ``swarmd.daemon``), bound to
127.0.0.1:8080 by default. Endpoints read the daemon through a small protocol so this module
never reaches into its internals, and the OpenAPI docs at ``/docs`` describe every field.

Security: with an API token (required by the CLI when the control plane listens on anything
but loopback), every endpoint that changes state (``POST /migrate``, ``POST /trainers``, the
heartbeat) requires ``Authorization: Bearer <token>``, compared in constant time; a missing or
wrong token gets 401. Read-only endpoints (``/status``, ``/swarm``, ``/trainers``, ``/healthz``,
``/docs``) stay open: they reveal nothing a swarm member could not read from the DHT.
"""

from __future__ import annotations

from typing import Any, Protocol

import hmac

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.routing import Match

from swarmd import __version__
from swarmd.api.trainers import TrainerRegistry
from swarmd.errors import SwarmdError


class ModelInfo(BaseModel):
    name: str = Field(description="the model spec's name (a preset name or the model file's stem)")
    digest: str = Field(description="stable sha256 of the spec; peers of one swarm must agree on it")


class Status(BaseModel):
    peer_id: str | None = Field(description="derived from the peer's ed25519 public key")
    stage: int | None = Field(description="the pipeline stage this peer serves (None while choosing)")
    n_stages: int | None
    state: str = Field(description="starting | joining | serving | draining | stopped")
    swarm: str = Field(description="the swarm's name")
    model: ModelInfo | None
    step: int = Field(description="optimizer steps applied to this stage's parameters")
    queue: int = Field(description="compute jobs waiting or running on the stage's worker thread")
    in_flight: int = Field(description="data-plane requests being served")
    throughput: float = Field(description="samples/s for forward+backward (bias-corrected EMA, alpha 0.1)")
    grad_samples: int = Field(description="samples whose gradients are accumulated since the last step")
    stale_dropped: int = Field(description="backwards refused because their forward ran at an older step")
    stale_applied: int = Field(description="delayed updates: backwards one step old, applied to the next update")
    activation_cache: dict[str, int] | None = Field(
        default=None,
        description="forwards' activations kept for their backward on this peer: entries, bytes, max_entries, "
        "max_bytes, hits, misses (recomputed), mismatches (same id, other inputs), evictions (dropped unused: "
        "expired, or the step changed), skipped (not kept: the cache was full)",
    )
    worker_cpu_s: float = Field(default=0.0, description="CPU seconds the stage's worker thread spent computing")
    params_digest: str | None = Field(description="sha256 of the stage's parameters at `step`")
    averaging: dict[str, Any] | None = Field(
        description="the stage's averaging rounds: rounds_ok, rounds_aborted, last_round"
    )
    synced_from: str | None = Field(description="the stage-mate whose state this peer downloaded last")
    migration: dict[str, Any] | None = Field(description="the last move between stages: from, to, phase, reason")
    served: dict[str, int] = Field(description="data-plane requests answered: forward, backward, rejected")
    auth: dict[str, Any] | None = Field(
        default=None,
        description="private swarms (--swarm-key): private, key_id (a fingerprint of the key), and refused: "
        "DHT datagrams and data-plane requests refused for lacking the key, by reason "
        "(missing, malformed, stale, bad_mac, replay)",
    )
    data_addr: str | None = Field(description="host:port of the aiohttp data plane")
    api_addr: str | None = Field(description="host:port of this control plane")
    dht_addr: str | None = Field(description="host:port of this peer's DHT node (UDP); others --join it")
    founder: bool = Field(description="whether this peer founded the swarm (started without --join)")
    announcements: int = Field(description="peer records this daemon published to the DHT")
    device: str
    version: str
    uptime_s: float


class SwarmPeer(BaseModel):
    peer_id: str
    state: str = Field(description="joining | serving | migrating | draining")
    data_addr: str
    api_addr: str
    throughput: float
    queue: int
    step: int
    params_digest: str | None
    version: str
    age_s: float = Field(description="seconds since the peer last announced itself")


class SwarmStage(BaseModel):
    stage: int
    throughput: float = Field(description="summed throughput of the stage's peers, samples/s")
    peers: list[SwarmPeer]


class SwarmModel(ModelInfo):
    spec: dict[str, Any]


class SwarmView(BaseModel):
    swarm: str
    model: SwarmModel
    training: dict[str, Any]
    stages: list[SwarmStage]
    dht: dict[str, Any] = Field(description="DHT health: routing_table_size, rejected records, dropped datagrams")


class TrainerRequest(BaseModel):
    name: str = Field(default="trainer", max_length=64, description="a label shown in GET /trainers")


class TrainerWelcome(BaseModel):
    trainer_id: str = Field(description="send heartbeats to POST /trainers/{trainer_id}/heartbeat")
    ttl_s: float = Field(description="the registration expires after this long without a heartbeat")
    swarm: str
    model: SwarmModel
    training: dict[str, Any] = Field(description="the swarm's TrainingSpec (target_batch_size, optimizer, ...)")
    step: int = Field(description="the optimizer step of the stage this daemon serves")


class TrainerInfo(BaseModel):
    trainer_id: str
    name: str
    registered_at: float = Field(description="unix time")
    last_seen_s: float = Field(description="seconds since its last heartbeat")


class MigrateRequest(BaseModel):
    model_config = {"extra": "forbid"}

    stage: int = Field(ge=0, description="the stage to move to")
    force: bool = Field(default=False, description="move even if this peer is the last one of its stage")


class Migration(BaseModel):
    model_config = {"extra": "allow"}

    to: int = Field(description="the stage this peer is moving to")
    phase: str = Field(description="starting | draining | building | downloading | done | failed")
    reason: str


class Health(BaseModel):
    ok: bool
    state: str


class DaemonView(Protocol):
    """What the control plane needs from a daemon."""

    @property
    def state(self) -> str: ...

    def status(self) -> dict[str, Any]: ...

    async def swarm_view(self) -> dict[str, Any]: ...

    def welcome(self) -> dict[str, Any]: ...

    async def request_migration(self, stage: int, *, force: bool = False, reason: str = ...) -> dict[str, Any]: ...


def create_app(daemon: DaemonView, trainers: TrainerRegistry | None = None, api_token: str | None = None) -> FastAPI:
    registry = trainers or TrainerRegistry()
    app = FastAPI(
        title="swarmd control plane",
        version=__version__,
        description="Status and control of one swarmd peer (SWARM parallelism).",
    )
    app.state.trainers = registry  # the daemon's registered trainers (read by tests and tools)
    expected = f"Bearer {api_token}".encode() if api_token else None

    async def authorized(request: Request) -> None:
        """Mutating endpoints: a constant-time check of the bearer token, when one is set."""
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise HTTPException(status_code=401, detail="this endpoint needs 'Authorization: Bearer <api token>'",
                                headers={"WWW-Authenticate": "Bearer"})

    guarded = [Depends(authorized)]

    def _is_guarded(route: Any) -> bool:
        return isinstance(route, APIRoute) and any(dep.dependency is authorized for dep in route.dependencies)

    if expected is not None:

        @app.middleware("http")
        async def token_before_body(request: Request, call_next: Any) -> Response:
            """The token is checked before FastAPI parses the body, which it does before running
            ``authorized``: without this, a request with no token and a bad body got 422, not 401.
            Which requests are guarded is read from the routes declared with ``guarded``."""
            if any(_is_guarded(route) and route.matches(request.scope)[0] is Match.FULL for route in app.routes):
                try:
                    await authorized(request)
                except HTTPException as exc:
                    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
            return await call_next(request)

    @app.get("/status", response_model=Status, summary="This peer's identity, stage, load and addresses")
    async def status() -> dict[str, Any]:
        return daemon.status()

    @app.get("/swarm", response_model=SwarmView, summary="The model and every stage's live peers, from the DHT")
    async def swarm() -> Any:
        if daemon.state not in ("joining", "serving", "migrating"):
            return JSONResponse({"error": "NotReady", "message": f"this peer is {daemon.state}"}, status_code=503)
        return await daemon.swarm_view()

    @app.post("/trainers", response_model=TrainerWelcome, status_code=201, dependencies=guarded,
              summary="Register a trainer; returns its id, the swarm's model, training settings and step",
              responses={503: {"description": "not serving yet, or too many trainers"}})
    async def register_trainer(body: TrainerRequest | None = None) -> Any:
        if daemon.state != "serving":
            return JSONResponse({"error": "NotReady", "message": f"this peer is {daemon.state}"}, status_code=503)
        reg = registry.register((body or TrainerRequest()).name)
        if reg is None:
            return JSONResponse({"error": "TooManyTrainers", "message": "the registry is full; retry later"},
                                status_code=503)
        return {"trainer_id": reg.trainer_id, "ttl_s": registry.ttl_s, **daemon.welcome()}

    @app.get("/trainers", response_model=list[TrainerInfo], summary="Trainers registered here, with last-seen times")
    async def list_trainers() -> Any:
        return registry.live()

    @app.post("/trainers/{trainer_id}/heartbeat", status_code=204, response_model=None, dependencies=guarded,
              summary="Keep a registration alive",
              responses={404: {"description": "unknown or expired registration: register again"}})
    async def heartbeat(trainer_id: str) -> Response:
        if not registry.heartbeat(trainer_id):
            return JSONResponse({"error": "UnknownTrainer", "message": "unknown or expired trainer id; register again"},
                                status_code=404)
        return Response(status_code=204)

    @app.post("/migrate", response_model=Migration, status_code=202, dependencies=guarded,
              summary="Move this peer to another stage (drain, download the stage's state, serve it)",
              responses={409: {"description": "it would empty this peer's stage (unless force), or the peer "
                               "is not serving"}, 422: {"description": "a bad body or a stage that does not exist"}})
    async def migrate(body: MigrateRequest) -> Any:
        try:
            return await daemon.request_migration(body.stage, force=body.force, reason="POST /migrate")
        except SwarmdError as exc:
            return JSONResponse({"error": type(exc).__name__, "message": str(exc)}, status_code=exc.http_status)

    @app.get(
        "/healthz",
        response_model=Health,
        summary="200 while the peer serves its stage, 503 otherwise",
        responses={503: {"model": Health}},
    )
    async def healthz() -> Any:
        state = daemon.state
        ok = state == "serving"
        return JSONResponse({"ok": ok, "state": state}, status_code=200 if ok else 503)

    return app
