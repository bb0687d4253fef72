"""Proven peers: a stage-mate counts only once it has answered a signed challenge (issue #18).

An identity costs nothing: anyone can mint ed25519 keys and publish validly signed ``serving``
records that point at a port that never answers (a tarpit), at a port that refuses, or at
someone else's peer. A signed DHT record proves only that its signer wrote it. So the decisions
a stage takes on its members' behalf -- who leads an averaging round, whose contribution a round
waits for, whose state a joiner downloads (SWARM, section 3.2 assumes honest, live peers for all
three) -- are taken only among peers that *proved themselves* over the data plane:

- ``GET /v1/proof?nonce=<hex>``: the caller sends a fresh random nonce to the address in the
  peer's record; the peer answers with its public key and its ed25519 signature over (the
  nonce, its peer id, the data address it announces, its stage, step and params digest).
- The caller checks (:func:`check_proof`) that the signature verifies, that the key hashes to
  the peer id of the record (so it is the key that signed the record), that the nonce is the
  one it just sent (an answer recorded earlier, or taken from another peer, does not verify),
  that the signed address is the one it dialed and the stage the one it expects.

So a proof shows the answerer holds the record's identity *and* serves at the announced
address, now. It does not show that the peer computes correctly (``swarmd.pipeline.averaging.trust.round_checks``
and the trainers' spot checks do that); it makes fake records cost nothing but one bounded
challenge each, retried with a growing backoff (:class:`ProvenPeers`).

:class:`ProvenPeers` is the pure table (injected clock): proofs expire after ``ttl_s`` and are
renewed before that; a failed challenge backs off (2 s, doubling, up to 2 minutes). The async
shell, :class:`Prover`, challenges due peers concurrently, each bounded by
:data:`PROOF_TIMEOUT_S`, so a tarpit costs one short timeout per backoff period in a background
task and never a round. :class:`ProofService` is the endpoint, installed on the data plane's app
like ``swarmd.net.reachability``'s (same middleware: errors as JSON, private-swarm signatures).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import msgpack
from aiohttp import web

from swarmd.dht.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_of, verify
from swarmd.errors import RequestError, Starting
from swarmd.finite import json_response
from swarmd.net.addresses import dial_target


class Served(Protocol):
    """What a proof says of the stage a peer serves (``swarmd.pipeline.stage.executor.StageExecutor`` is one)."""

    @property
    def stage(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def digest(self) -> str | None: ...

__all__ = [
    "PROOF_PATH",
    "PROOF_TIMEOUT_S",
    "Proof",
    "ProofClaim",
    "ProofReply",
    "ProofService",
    "ProvenPeers",
    "Prover",
    "check_proof",
    "new_nonce",
    "sign_proof",
]

log = logging.getLogger(__name__)

PROOF_PATH = "/v1/proof"
#: One challenge may take this long (connect, sign, answer): a live peer answers in milliseconds,
#: so this bounds what a tarpit costs (once per backoff period, in a background task).
PROOF_TIMEOUT_S = 2.0
NONCE_BYTES = 16
_NONCE = re.compile(r"[0-9a-f]{32,128}")
_HEX_DIGEST = re.compile(r"(?:[0-9a-f]{2}){1,64}")
_PEER_ID = re.compile(r"[0-9a-f]{40}")
_DOMAIN = b"swarmd-proof/1\x00"
MAX_ADDR_CHARS = 300
MAX_PROOF_BYTES = 4096  # an answer is ~400 bytes of JSON
LOG_EVERY_S = 10.0  # failed proofs are logged at most this often (with the counts since the last line)


def new_nonce() -> str:
    """A fresh challenge: 16 random bytes as hex."""
    return secrets.token_hex(NONCE_BYTES)


@dataclass(frozen=True)
class ProofClaim:
    """What a challenged peer signs: the caller's nonce and where and what it serves."""

    nonce: str
    peer_id: str
    addr: str  # the data address it announces (``<id>@<relay>`` when relayed)
    stage: int
    step: int
    params_digest: str | None

    def message(self) -> bytes:
        """The signed bytes: a domain prefix, then the fields as one msgpack array (deterministic)."""
        body = [self.nonce, self.peer_id, self.addr, self.stage, self.step, self.params_digest or ""]
        return _DOMAIN + msgpack.packb(body, use_bin_type=True)


@dataclass(frozen=True)
class ProofReply:
    """``GET /v1/proof``'s answer: the claim, the key it is signed with, the signature."""

    claim: ProofClaim
    public_key: bytes
    signature: bytes

    def to_json(self) -> dict[str, Any]:
        c = self.claim
        return {"nonce": c.nonce, "peer_id": c.peer_id, "addr": c.addr, "stage": c.stage, "step": c.step,
                "params_digest": c.params_digest, "public_key": self.public_key.hex(),
                "signature": self.signature.hex()}

    @classmethod
    def from_json(cls, body: Any) -> ProofReply:
        """Validate a peer's answer (remote input): ``ValueError`` naming the first bad field."""
        if not isinstance(body, dict):
            raise ValueError("a proof is a JSON object")

        def field_(key: str, kind: type) -> Any:
            value = body.get(key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"a proof's '{key}' must be a {kind.__name__}")
            return value

        nonce, peer_id, addr = field_("nonce", str), field_("peer_id", str), field_("addr", str)
        stage, step = field_("stage", int), field_("step", int)
        digest = body.get("params_digest")
        if digest is not None and not (isinstance(digest, str) and _HEX_DIGEST.fullmatch(digest)):
            raise ValueError("a proof's 'params_digest' must be null or lowercase hex")
        if not _NONCE.fullmatch(nonce) or not _PEER_ID.fullmatch(peer_id) or len(addr) > MAX_ADDR_CHARS:
            raise ValueError("a proof's nonce, peer id or address is malformed")
        if not 0 <= stage < 2**16 or not 0 <= step < 2**63:
            raise ValueError("a proof's stage or step is out of range")
        try:
            key, sig = bytes.fromhex(field_("public_key", str)), bytes.fromhex(field_("signature", str))
        except ValueError:
            raise ValueError("a proof's key and signature are hex") from None
        if len(key) != PUBLIC_KEY_BYTES or len(sig) != SIGNATURE_BYTES:
            raise ValueError("a proof's key or signature has the wrong length")
        return cls(ProofClaim(nonce, peer_id, addr, stage, step, digest), key, sig)


def sign_proof(identity: Identity, claim: ProofClaim) -> ProofReply:
    return ProofReply(claim=claim, public_key=identity.public_key_bytes, signature=identity.sign(claim.message()))


def check_proof(reply: ProofReply, *, nonce: str, peer_id: str, addr: str, stage: int | None) -> str | None:
    """Why ``reply`` does not prove that ``peer_id`` serves ``stage`` at ``addr`` now (None: it does).

    The reasons are short words, counted in ``/status``: ``nonce`` (not the challenge just sent:
    replayed or relayed from elsewhere), ``key`` (the key is not the record's peer id), ``signature``,
    ``address`` (signed for another address than the one dialed), ``stage``.
    """
    c = reply.claim
    if c.nonce != nonce:
        return "nonce"
    if c.peer_id != peer_id or peer_id_of(reply.public_key) != peer_id:
        return "key"
    if not verify(reply.public_key, c.message(), reply.signature):
        return "signature"
    if c.addr != addr:
        return "address"
    if stage is not None and c.stage != stage:
        return "stage"
    return None


# ---- the table (pure: injected clock) ------------------------------------------------------------


@dataclass(frozen=True)
class Proof:
    """A peer's last good answer: where, when, and the step and digest it held then."""

    addr: str
    at: float
    step: int
    params_digest: str | None


@dataclass
class _Failure:
    addr: str
    count: int
    until: float
    reason: str


class ProvenPeers:
    """Which peers proved themselves recently, and when to challenge the others again.

    Keyed by peer id, and a proof is for one address: a record that moves to another address
    must prove itself there. ``ttl_s``: how long a proof counts (renewed from ``ttl_s / 2`` on, so
    a live peer never lapses); a failure backs off ``backoff_s * 2**(k-1)`` up to ``backoff_max_s``.
    Bounded: at most ``max_peers`` entries (the oldest are forgotten first).
    """

    def __init__(self, *, ttl_s: float = 60.0, backoff_s: float = 2.0, backoff_max_s: float = 120.0,
                 max_peers: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.max_peers = max_peers
        self.clock = clock
        self._proofs: dict[str, Proof] = {}
        self._failures: dict[str, _Failure] = {}
        self._answered: dict[str, str] = {}  # peer id -> the address it last proved itself at, kept past failures
        self.succeeded_total = 0
        self.failed_total: Counter[str] = Counter()

    def proof(self, peer_id: str, addr: str) -> Proof | None:
        """The peer's proof for ``addr`` if it is still valid."""
        p = self._proofs.get(peer_id)
        if p is None or p.addr != addr or self.clock() - p.at > self.ttl_s:
            return None
        return p

    def due(self, peer_id: str, addr: str) -> bool:
        """Whether to challenge the peer now: no valid proof (or one half-way to expiry) and not
        backing off after a failure at this address."""
        if self.backing_off(peer_id, addr):
            return False
        now = self.clock()
        p = self._proofs.get(peer_id)
        return p is None or p.addr != addr or now - p.at > self.ttl_s / 2

    def backing_off(self, peer_id: str, addr: str) -> bool:
        """Whether a failed challenge at ``addr`` holds off the next one now."""
        f = self._failures.get(peer_id)
        return f is not None and f.addr == addr and self.clock() < f.until

    def failures(self, peer_id: str, addr: str) -> int:
        """How many challenges at ``addr`` failed in a row (0 once it proves itself)."""
        f = self._failures.get(peer_id)
        return f.count if f is not None and f.addr == addr else 0

    def ever_proved(self, peer_id: str, addr: str) -> bool:
        """Whether the peer ever proved itself at ``addr`` (remembered after its proof lapsed or a later
        challenge failed: it answered there once, so it is a live peer, not a record nobody serves)."""
        return self._answered.get(peer_id) == addr

    def tried(self, peer_id: str) -> bool:
        """Whether the peer was ever challenged (and the answer is still remembered)."""
        return peer_id in self._proofs or peer_id in self._failures

    def succeeded(self, peer_id: str, addr: str, step: int, params_digest: str | None) -> None:
        self._failures.pop(peer_id, None)
        self._proofs.pop(peer_id, None)
        self._proofs[peer_id] = Proof(addr=addr, at=self.clock(), step=step, params_digest=params_digest)
        self._answered.pop(peer_id, None)
        self._answered[peer_id] = addr
        self.succeeded_total += 1
        self._bound(self._proofs)
        self._bound(self._answered)

    def failed(self, peer_id: str, addr: str, reason: str) -> float:
        """Record a failed challenge; returns how long until the next one."""
        now = self.clock()
        self._proofs.pop(peer_id, None)
        prev = self._failures.pop(peer_id, None)
        count = prev.count + 1 if prev is not None and prev.addr == addr else 1
        wait = min(self.backoff_max_s, self.backoff_s * 2 ** (count - 1))
        self._failures[peer_id] = _Failure(addr=addr, count=count, until=now + wait, reason=reason)
        self.failed_total[reason] += 1
        self._bound(self._failures)
        return wait

    def forget(self, peer_id: str) -> None:
        """Drop what is known of a peer (e.g. it was caught lying: it must prove itself again)."""
        self._proofs.pop(peer_id, None)

    def status(self, peers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Counts for ``/status``: proven now, failing now (with why), and totals. With ``peers``
        (id -> address, e.g. the stage's records), also how many of them are unproven."""
        now = self.clock()
        proven = {pid for pid, p in self._proofs.items() if now - p.at <= self.ttl_s}
        failing = {pid: f.reason for pid, f in self._failures.items() if now < f.until}
        out: dict[str, Any] = {
            "proven": len(proven),
            "failing": len(failing),
            "failing_reasons": dict(Counter(failing.values())),
            "proofs_ok": self.succeeded_total,
            "proofs_failed": dict(self.failed_total),
        }
        if peers is not None:
            out["unproven"] = sum(1 for pid, addr in peers.items() if self.proof(pid, addr) is None)
        return out

    def _bound(self, table: dict[str, Any]) -> None:
        while len(table) > self.max_peers:
            table.pop(next(iter(table)))


# ---- the async shell -----------------------------------------------------------------------------


class Prover:
    """Challenges peers over the data plane and keeps the results in a :class:`ProvenPeers`.

    ``session``: the daemon's (signed in a private swarm). One ``Prover`` per daemon, shared by
    the averager and the state download, so a peer proven for one counts for the other.
    """

    def __init__(self, session: Callable[[], aiohttp.ClientSession | None], table: ProvenPeers | None = None, *,
                 timeout_s: float = PROOF_TIMEOUT_S, max_concurrent: int = 64) -> None:
        self._session = session
        self.table = table or ProvenPeers()
        self.timeout_s = timeout_s
        self._limit = asyncio.Semaphore(max_concurrent)
        self._logged_at = -1e9
        self._unlogged: Counter[str] = Counter()

    def proven(self, peers: Mapping[str, str]) -> dict[str, Proof]:
        """The peers of ``peers`` (id -> address) with a valid proof now (no I/O)."""
        out = {}
        for pid, addr in peers.items():
            p = self.table.proof(pid, addr)
            if p is not None:
                out[pid] = p
        return out

    def due(self, peers: Mapping[str, str]) -> dict[str, str]:
        return {pid: addr for pid, addr in peers.items() if self.table.due(pid, addr)}

    async def prove_all(self, peers: Mapping[str, str], *, stage: int | None, fresh: bool = False) -> dict[str, Proof]:
        """Challenge the due ones among ``peers`` (concurrently, each within the timeout); return
        every peer of ``peers`` proven afterwards. ``fresh``: challenge every peer not backing off
        after a failure, proven or not, so that the proofs say the step and digest they hold *now*
        (a state donor must be at the step its taker needs)."""
        due = {pid: addr for pid, addr in peers.items() if not self.table.backing_off(pid, addr)} if fresh \
            else self.due(peers)
        if due:
            await asyncio.gather(*(self.prove(pid, addr, stage=stage) for pid, addr in due.items()))
        return self.proven(peers)

    async def prove(self, peer_id: str, addr: str, *, stage: int | None) -> Proof | None:
        """One challenge of ``peer_id`` at ``addr``; the proof, or None (recorded, logged rate-limited)."""
        session = self._session()
        if session is None:
            return None
        nonce = new_nonce()
        base, relay = dial_target(addr)
        why: str | None
        reply: ProofReply | None = None
        async with self._limit:
            try:
                timeout = aiohttp.ClientTimeout(total=self.timeout_s)
                async with session.get(f"{base}{PROOF_PATH}", params={"nonce": nonce}, headers=relay,
                                       timeout=timeout) as resp:
                    raw = await resp.content.read(MAX_PROOF_BYTES + 1)
                    if resp.status != 200:
                        why = f"http {resp.status}"
                    elif len(raw) > MAX_PROOF_BYTES:
                        why = "too large"
                    else:
                        reply = ProofReply.from_json(json.loads(raw))
                        why = check_proof(reply, nonce=nonce, peer_id=peer_id, addr=addr, stage=stage)
            except asyncio.TimeoutError:
                why = "timeout"
            except aiohttp.ClientError as exc:
                why = f"unreachable ({type(exc).__name__})"
            except ValueError as exc:  # json or ProofReply: an answer that is not a proof
                why = f"malformed ({str(exc)[:60]})"
        if why is None and reply is not None:
            self.table.succeeded(peer_id, addr, reply.claim.step, reply.claim.params_digest)
            return self.table.proof(peer_id, addr)
        reason = why or "malformed"
        wait = self.table.failed(peer_id, addr, reason.split(" ")[0])
        self._log_failure(peer_id, addr, reason, wait)
        return None

    def _log_failure(self, peer_id: str, addr: str, reason: str, wait: float) -> None:
        """One warning per :data:`LOG_EVERY_S` at most, with what failed since the last one: a flood of
        fake records must not flood the log (its first failure is said at once, then counted)."""
        self._unlogged[reason.split(" ")[0]] += 1
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = now
        counts = ", ".join(f"{why} {n}" for why, n in self._unlogged.most_common())
        self._unlogged.clear()
        log.warning("peer %s at %s failed its proof (%s): not trusted for rounds or state downloads; next try "
                    "in %.0fs (failed proofs since the last such line: %s)", peer_id[:12], addr, reason, wait, counts)


class ProofService:
    """``GET /v1/proof``, added to a data plane's aiohttp app by :meth:`install`."""

    def __init__(self, identity: Callable[[], Identity | None], addr: Callable[[], str | None],
                 served: Callable[[], Served | None]) -> None:
        """``served``: the stage this peer serves now (None while it has none)."""
        self._identity = identity
        self._addr = addr
        self._served = served
        self.served = 0

    def install(self, app: web.Application) -> None:
        app.router.add_get(PROOF_PATH, self.handle, allow_head=False)

    async def handle(self, request: web.Request) -> web.Response:
        nonce = request.query.get("nonce", "")
        if not _NONCE.fullmatch(nonce):
            raise RequestError("nonce must be 32-128 lowercase hex characters")
        identity, addr, ex = self._identity(), self._addr(), self._served()
        if identity is None or addr is None or ex is None:
            raise Starting("this peer has no stage built yet; ask again shortly")
        claim = ProofClaim(nonce=nonce, peer_id=identity.peer_id, addr=addr, stage=ex.stage, step=ex.step,
                           params_digest=ex.digest)
        self.served += 1
        return json_response(sign_proof(identity, claim).to_json())
