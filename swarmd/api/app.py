"""The FastAPI control plane: what a person (or a trainer) asks a daemon over HTTP.

Served by uvicorn on the daemon's own event loop (see ``swarmd.daemon``), bound to
127.0.0.1:8080 by default. Endpoints read the daemon through a small protocol so this module
never reaches into its internals, and the OpenAPI docs at ``/docs`` describe every field.

Security: with an API token (required by the CLI when the control plane listens on anything
but loopback), every endpoint that changes state (``POST /migrate``, ``POST /trainers``, the
heartbeat) requires ``Authorization: Bearer <token>``, compared in constant time; a missing or
wrong token gets 401. The read-only endpoints that carry data (``/status``, ``/swarm``,
``/trainers``, ``/training``, ``/metrics``) are open on loopback and behind the same token
elsewhere (issue #15): a request from the machine itself (127.0.0.0/8, ``::1``) reads them freely,
as the owner's tools and trainers do, while one from another machine needs the token (a
Prometheus scrape config gives it as ``authorization: credentials``). Without a token the
control plane listens on loopback only, so every request is local. Always open: ``/healthz``
(liveness probes: the state only), the dashboard's page and assets (``/``, ``/static/...``: no data;
the page reads the documents above) and ``/docs``, ``/openapi.json`` (the schema). A reverse proxy
on the same machine makes every request look local: give the proxy its own authentication.

Seeing the swarm: ``GET /`` is a self-contained dashboard (``swarmd.api.dashboard``), ``GET
/metrics`` the Prometheus exposition (``swarmd.api.metrics``), ``GET /training`` the loss curves
(``swarmd.training_summary``).
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from typing import Any, Protocol

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.routing import Match

from swarmd import __version__
from swarmd.api import dashboard
from swarmd.api.metrics import CONTENT_TYPE, DaemonMetrics
from swarmd.api.models import (
    Detail,
    ErrorBody,
    Health,
    MigrateRequest,
    Migration,
    Status,
    SwarmView,
    TrainerInfo,
    TrainerReport,
    TrainerRequest,
    TrainerWelcome,
    TrainingView,
)
from swarmd.api.trainer_ranks import RankBook
from swarmd.api.trainers import TrainerRegistry
from swarmd.errors import SwarmdError
from swarmd.training_summary import TrainingLog

# Documented refusals, so that /openapi.json lists every status code the control plane answers.
Responses = dict[int | str, dict[str, Any]]
_BAD_JSON: Responses = {400: {"model": Detail, "description": "the body is not JSON (or not UTF-8)"}}
_TOKEN: Responses = {401: {"model": Detail, "description": "this daemon has an API token and the request lacks it"}}
_READ_TOKEN: Responses = {401: {"model": Detail, "description": "this daemon has an API token and the request, "
                                     "from another machine than the daemon's, lacks it"}}
_NOT_SERVING: Responses = {
    503: {"model": ErrorBody, "description": "this peer is not serving (starting, moving or draining)"},
}


class DaemonView(Protocol):
    """What the control plane needs from a daemon."""

    @property
    def state(self) -> str: ...

    def status(self) -> dict[str, Any]: ...

    async def swarm_view(self) -> dict[str, Any]: ...

    def welcome(self) -> dict[str, Any]: ...

    async def request_migration(self, stage: int, *, force: bool = False, reason: str = ...) -> dict[str, Any]: ...


def _is_loopback(host: str | None) -> bool:
    """Whether a client address is this machine's loopback (IPv4-mapped IPv6 included)."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False  # no address (or a name): not provably local
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _not_ready(state: str) -> JSONResponse:
    return JSONResponse({"error": "NotReady", "message": f"this peer is {state}", "state": str(state)}, status_code=503)


def create_app(daemon: DaemonView, trainers: TrainerRegistry | None = None, api_token: str | None = None, *,
               metrics: DaemonMetrics | None = None, training: TrainingLog | None = None,
               ranks: RankBook | None = None) -> FastAPI:
    """The control plane of ``daemon``; ``metrics`` (``GET /metrics``) and ``training`` (``GET
    /training``, the dashboard's curves) are the daemon's own, and answer 404 when not given;
    ``ranks`` makes trainers' ranks unique across the swarm (without it, among this daemon's)."""
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

    async def readable(request: Request) -> None:
        """Read-only data: open to loopback clients, behind the token for everyone else."""
        if expected is not None and not _is_loopback(request.client.host if request.client else None):
            await authorized(request)

    guarded = [Depends(authorized)]
    read_guarded = [Depends(readable)]

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

    if metrics is not None:

        @app.middleware("http")
        async def observe(request: Request, call_next: Any) -> Response:
            """Counts and times every request by its route's template (``swarmd_control_plane_...``)."""
            started = time.perf_counter()
            response: Response = await call_next(request)
            route = request.scope.get("route")
            endpoint = route.path if isinstance(route, APIRoute) else "other"
            metrics.observe_api(endpoint, response.status_code, time.perf_counter() - started)
            return response

    @app.get("/", response_class=Response, summary="The dashboard: the swarm's stages, peers and loss, live",
             responses={200: {"content": {"text/html": {}}, "description": "a self-contained HTML page"}})
    async def index() -> Response:
        return dashboard.index()

    @app.get("/static/{name}", response_class=Response, summary="The dashboard's script and stylesheet",
             responses={200: {"content": {"text/javascript": {}, "text/css": {}, "text/html": {}}},
                        404: {"model": Detail, "description": "no such file"}})
    async def static(name: str) -> Response:
        return dashboard.asset(name)

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics of this peer (text format)",
             dependencies=read_guarded,
             responses={200: {"content": {CONTENT_TYPE: {}}, "description": "the Prometheus text exposition"},
                        **_READ_TOKEN,
                        404: {"model": Detail, "description": "this control plane has no metrics registry"}})
    async def prometheus_metrics() -> Response:
        if metrics is None:
            raise HTTPException(status_code=404, detail="no metrics registry on this control plane")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/training", response_model=TrainingView, summary="Loss curves: this daemon's trainers and the swarm's",
             dependencies=read_guarded,
             responses={**_READ_TOKEN,
                        404: {"model": Detail, "description": "this control plane keeps no training log"}})
    async def training_view(limit: int = Query(default=1024, ge=1, le=4096)) -> Any:
        if training is None:
            raise HTTPException(status_code=404, detail="no training log on this control plane")
        return training.view(limit=limit)

    @app.get("/status", response_model=Status, summary="This peer's identity, stage, load and addresses",
             dependencies=read_guarded, responses={**_READ_TOKEN})
    async def status() -> dict[str, Any]:
        return daemon.status()

    @app.get("/swarm", response_model=SwarmView, summary="The model and every stage's live peers, from the DHT",
             dependencies=read_guarded, responses={**_READ_TOKEN, **_NOT_SERVING})
    async def swarm() -> Any:
        if daemon.state not in ("joining", "serving", "migrating"):
            return _not_ready(daemon.state)
        return await daemon.swarm_view()

    @app.post("/trainers", response_model=TrainerWelcome, status_code=201, dependencies=guarded,
              summary="Register a trainer; returns its id, the swarm's model, training settings and step",
              responses={**_BAD_JSON, **_TOKEN,
                         409: {"model": ErrorBody, "description": "a --sync trainer would share the swarm"},
                         503: {"model": ErrorBody, "description": "not serving yet, or too many trainers"}})
    async def register_trainer(body: TrainerRequest | None = None) -> Any:
        if daemon.state != "serving":
            return _not_ready(daemon.state)
        request = body or TrainerRequest()
        conflict = registry.conflict(sync=request.sync)
        if conflict is not None:
            return JSONResponse({"error": "SyncConflict", "message": conflict}, status_code=409)
        reg = registry.register(request.name, sync=request.sync)
        if reg is None:
            return JSONResponse({"error": "TooManyTrainers", "message": "the registry is full; retry later"},
                                status_code=503)
        if ranks is not None:
            await ranks.assign(reg)
        return {"trainer_id": reg.trainer_id, "ttl_s": registry.ttl_s, "rank": reg.rank, **daemon.welcome()}

    @app.get("/trainers", response_model=list[TrainerInfo], summary="Trainers registered here, with last-seen times",
             dependencies=read_guarded, responses={**_READ_TOKEN})
    async def list_trainers() -> Any:
        return registry.live()

    @app.delete("/trainers/{trainer_id}", status_code=204, response_model=None, dependencies=guarded,
                summary="A trainer finished: listed until it expires, it holds no rank or --sync claim any more",
                responses={**_TOKEN, 404: {"model": ErrorBody, "description": "unknown or expired registration"}})
    async def finish_trainer(trainer_id: str) -> Response:
        if not registry.finish(trainer_id):
            return JSONResponse({"error": "UnknownTrainer", "message": "unknown or expired trainer id"},
                                status_code=404)
        if ranks is not None:
            try:  # its rank is free for the swarm's next trainer now, not an announce period later
                await ranks.publish()
            except SwarmdError:
                pass  # the next period's publication frees it
        return Response(status_code=204)

    @app.post("/trainers/{trainer_id}/heartbeat", status_code=204, response_model=None, dependencies=guarded,
              summary="Keep a registration alive; the body (optional) reports the trainer's steps and losses",
              responses={**_BAD_JSON, **_TOKEN,
                         404: {"model": ErrorBody, "description": "unknown or expired registration: register again"},
                         422: {"description": "a report that is not a TrainerReport"}})
    async def heartbeat(trainer_id: str, body: TrainerReport | None = None) -> Response:
        if not registry.heartbeat(trainer_id, body):
            return JSONResponse({"error": "UnknownTrainer", "message": "unknown or expired trainer id; register again"},
                                status_code=404)
        return Response(status_code=204)

    @app.post("/migrate", response_model=Migration, status_code=202, dependencies=guarded,
              summary="Move this peer to another stage (drain, download the stage's state, serve it)",
              responses={**_BAD_JSON, **_TOKEN,
                         409: {"model": ErrorBody, "description": "it would empty this peer's stage (unless force), "
                               "or the peer is not serving"},
                         422: {"description": "a bad body or a stage that does not exist"}})
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
