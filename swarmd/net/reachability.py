"""Reachability: can the swarm dial the data address this peer announces?

A peer behind a NAT, a firewall, or with a wrong ``--announce`` can dial out (its DHT works, it
can download state) while nobody can dial in: listed as serving, it would cost every trainer a
timeout per request (issue #11; LESSONS: "a swarm that lists unreachable peers wastes every
trainer's time"). So before a peer announces ``serving`` it asks up to :data:`PROBERS` other
members to dial its announced address, the way Petals' reachability check and libp2p's AutoNAT do:

- ``POST /v1/probe`` ``{"peer_id", "addr", "nonce"}`` (asked of a member): the member dials
  ``GET http://<addr>/v1/ping?nonce=<nonce>`` within :data:`DIAL_TIMEOUT_S` and answers
  ``{"reachable", "reason", "rtt_ms"}``; it counts as reached only if the answer names the
  asking peer's id and echoes the nonce (so a different service at that address, or another
  peer, does not count);
- ``GET /v1/ping?nonce=...`` answers ``{"peer_id", "nonce"}``.

The result goes into the peer's record (``reachable``: ``yes`` when at least one member reached
it, ``no`` when members answered and none did, ``unknown`` when no member could be asked, e.g.
the founder) and into ``/status`` with who was asked. Trainers, stage-mates and the rebalancer
use only peers that are not ``no`` (``PeerRecord.usable``).

A probe makes this peer dial an address someone else chose, so it is bounded: the address must
be an IP literal (no name lookups), only the fixed ``/v1/ping`` path is requested, at most
:data:`MAX_CONCURRENT_PROBES` run at once (more get 503), each within :data:`DIAL_TIMEOUT_S`.
In a private swarm both requests are signed like every other data-plane request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import random
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from swarmd.dht.records import PeerRecord
from swarmd.finite import json_response
from swarmd.net.addresses import RELAY_HEADER, dial_target, is_wildcard, parse_host_port

log = logging.getLogger(__name__)

PROBERS = 3  # members asked to dial this peer
#: ... when none of them has proven itself (issue #18: some may be fakes that never answer); the
#: first "reached" ends the check, so a fake prober costs nothing once an honest one answered
UNPROVEN_PROBERS = 6
DIAL_TIMEOUT_S = 3.0  # a prober's dial of the announced address
ASK_TIMEOUT_S = DIAL_TIMEOUT_S + 3.0  # this peer's wait for a prober's answer
MAX_CONCURRENT_PROBES = 4
MAX_PROBE_BODY = 1024
_NONCE = re.compile(r"[0-9a-f]{16,64}")
_PEER_ID = re.compile(r"[0-9a-f]{40}")


def _bad(message: str) -> web.Response:
    return json_response({"error": "RequestError", "message": message}, status=422)


@dataclass
class Reachability:
    """What this peer knows about being dialable (``/status`` → ``reachability``)."""

    status: str = "unknown"  # unknown | yes | no
    addr: str | None = None  # the address that was probed
    by: dict[str, str] = field(default_factory=dict)  # prober peer id -> "reached" or why not
    checked_at: float | None = None  # unix time of the last check

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "addr": self.addr, "by": dict(self.by), "checked_at": self.checked_at}


class ProbeService:
    """The two endpoints above, added to a data plane's aiohttp app by :meth:`install`."""

    def __init__(self, peer_id: Callable[[], str | None], session: Callable[[], aiohttp.ClientSession | None]) -> None:
        self._peer_id = peer_id
        self._session = session
        self._running = 0
        self.probes_served = 0

    def install(self, app: web.Application) -> None:
        app.router.add_get("/v1/ping", self.ping, allow_head=False)
        app.router.add_post("/v1/probe", self.probe)

    async def ping(self, request: web.Request) -> web.Response:
        nonce = request.query.get("nonce", "")
        if not _NONCE.fullmatch(nonce):
            return _bad("nonce must be 16-64 lowercase hex characters")
        return json_response({"peer_id": self._peer_id(), "nonce": nonce})

    async def probe(self, request: web.Request) -> web.Response:
        if (request.content_length or 0) > MAX_PROBE_BODY:
            return json_response({"error": "LimitExceeded", "message": "a probe body is a few hundred bytes"},
                                     status=413)
        raw = await request.read()
        if len(raw) > MAX_PROBE_BODY:
            return json_response({"error": "LimitExceeded", "message": "a probe body is a few hundred bytes"},
                                     status=413)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return _bad("the body must be a JSON object {peer_id, addr, nonce}")
        if not isinstance(body, dict):
            return _bad("the body must be a JSON object {peer_id, addr, nonce}")
        peer_id, addr, nonce = body.get("peer_id"), body.get("addr"), body.get("nonce")
        if not (isinstance(peer_id, str) and _PEER_ID.fullmatch(peer_id)):
            return _bad("peer_id must be 40 lowercase hex characters")
        if not (isinstance(nonce, str) and _NONCE.fullmatch(nonce)):
            return _bad("nonce must be 16-64 lowercase hex characters")
        if not isinstance(addr, str) or len(addr) > 128:
            return _bad("addr must be a string HOST:PORT (or PEER_ID@HOST:PORT for a relayed peer)")
        relayed, _, addr = addr.rpartition("@")
        if relayed and not _PEER_ID.fullmatch(relayed):
            return _bad("a relayed address is PEER_ID@HOST:PORT with a 40-hex peer id")
        try:
            host, port = parse_host_port(addr)
            ip = ipaddress.ip_address(host)
        except ValueError as exc:
            return _bad(f"addr must be an IP address and a port: {exc}")
        if port is None or is_wildcard(host):
            return _bad("addr must name a specific IP address and a port")
        session = self._session()
        if session is None or self._running >= MAX_CONCURRENT_PROBES:
            return json_response({"error": "Busy", "message": "too many probes at once; retry later"}, status=503)
        self._running += 1
        try:
            reachable, reason, rtt = await dial(session, ip, port, peer_id=peer_id, nonce=nonce, relayed=relayed)
        finally:
            self._running -= 1
        self.probes_served += 1
        return json_response({"reachable": reachable, "reason": reason, "rtt_ms": rtt})


def _url(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    return f"http://[{ip}]:{port}" if ip.version == 6 else f"http://{ip}:{port}"


async def dial(session: aiohttp.ClientSession, ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, *,
               peer_id: str, nonce: str, relayed: str = "") -> tuple[bool, str | None, float | None]:
    """Dial ``ip:port``'s ``/v1/ping`` (through that relay, for peer ``relayed``, when given):
    (reached, why not, round trip in ms)."""
    started = time.monotonic()
    headers = {RELAY_HEADER: relayed} if relayed else {}
    try:
        async with session.get(f"{_url(ip, port)}/v1/ping", params={"nonce": nonce}, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=DIAL_TIMEOUT_S)) as resp:
            if resp.status != 200:
                return False, f"it answered HTTP {resp.status}", None
            answer = await resp.json(content_type=None)
    except asyncio.TimeoutError:
        return False, f"no answer within {DIAL_TIMEOUT_S:g} s (a firewall or NAT drops connections?)", None
    except aiohttp.ClientConnectorError as exc:
        return False, f"cannot connect ({exc.os_error.strerror or exc})", None
    except (aiohttp.ClientError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {exc}", None
    if not isinstance(answer, dict) or answer.get("nonce") != nonce or answer.get("peer_id") != peer_id:
        return False, "another service (or another peer) answers at that address", None
    return True, None, round((time.monotonic() - started) * 1000, 2)


def verdict(answers: Sequence[bool | None]) -> str:
    """``yes`` when any prober reached the peer, else ``no`` when any could not, else ``unknown``
    (nobody could probe): one honest prober's success outweighs any number of failures or lies."""
    if any(a is True for a in answers):
        return "yes"
    return "no" if any(a is False for a in answers) else "unknown"


async def check(session: aiohttp.ClientSession, *, peer_id: str, addr: str, members: Sequence[PeerRecord],
                rng: random.Random | None = None, probers: int = PROBERS) -> Reachability:
    """Ask up to ``probers`` of ``members`` (serving, usable, not this peer) at once to dial ``addr``;
    the first that reached it ends the check (the others' asks are cancelled: "not needed")."""
    candidates = [r for r in members if r.peer_id != peer_id and r.usable and r.data_addr]
    (rng or random).shuffle(candidates)
    chosen = candidates[:probers]
    result = Reachability(addr=addr, checked_at=time.time())
    if not chosen:
        return result
    nonce = secrets.token_hex(16)

    async def ask(member: PeerRecord) -> tuple[str, bool | None, str]:
        base, relay = dial_target(member.data_addr)
        try:
            async with session.post(f"{base}/v1/probe", headers=relay,
                                    json={"peer_id": peer_id, "addr": addr, "nonce": nonce},
                                    timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)) as resp:
                answer = await resp.json(content_type=None)
                if resp.status != 200 or not isinstance(answer, dict) or type(answer.get("reachable")) is not bool:
                    return member.peer_id, None, f"could not probe (HTTP {resp.status})"
                return member.peer_id, answer["reachable"], "reached" if answer["reachable"] else str(
                    answer.get("reason") or "not reached")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return member.peer_id, None, f"could not probe ({type(exc).__name__})"

    pending = {asyncio.create_task(ask(m)): m.peer_id for m in chosen}
    answers: list[tuple[str, bool | None, str]] = []
    try:
        while pending and verdict([ok for _, ok, _ in answers]) != "yes":
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                del pending[task]
                answers.append(task.result())
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    result.by = {pid: why for pid, _, why in answers} | {
        pid: "not needed: another member reached this peer" for pid in pending.values()}
    result.status = verdict([ok for _, ok, _ in answers])
    return result
