"""Misbehaviour reports and the ledger that turns two independent ones into an exclusion.

Issue #17, item 3: a peer reported by two independent checks loses its place; stage-mates stop
averaging with it and trainers stop routing to it, for a ban period that grows on repeat. A
trainer that caught a peer lying in a spot check (``swarmd.train.verify``) signs a
:class:`MisbehaviourReport` with its ephemeral ed25519 identity (``swarmd.dht.identity``) and
posts it to the swarm's peers (``POST /v1/report``, ``swarmd.net.server``). Each daemon keeps
one :class:`ReportLedger`: accused peer -> the distinct reporters that accused it within
``window_s``; at ``reporters_needed`` (2) the accused is excluded for
``exclusion_base_s * 2 ** k`` (``k``: its earlier exclusions, capped at ``exclusion_max_s``).
The daemon's progress reply lists the excluded peers (``ProgressReply.excluded``) and its
averager leaves them out (``swarmd.pipeline.averaging.averager``, the ``exclude`` view). It also
lists the peers accused once (``ProgressReply.suspected``): not excluded, but the trainers check
their answers more until they have confirmed a few, so a liar one trainer caught is caught by a
second soon after whatever the sampled rate (issue #29; ``swarmd.train.verify.CheckLedger.watch``).

Independence. A trainer's identity costs nothing, so "two reporters" must not mean "two keys
one process minted": reporters count as independent only from distinct source addresses (the
address the report came from, as the data plane saw it), except loopback, where a local swarm's
trainers all live. One reporter key may file at most ``max_per_reporter`` reports per window.
What is left: a colluding pair of trainers on two hosts can get an honest peer excluded for
the ban period; see docs/SECURITY.md ("Wrong answers from members").

An ``averaging`` report is a round leader's conviction of hostile contributions, or a stage-mate
seconding one (``swarmd.pipeline.averaging.trust.accusations``): it carries the accused's own signed claims as
``evidence``, which the daemon checks before counting it; the ledger counts it like any other.

A report is evidence, not proof: it names the request's digest and the digests of the answers
the reporter got from each peer, which a reader can compare with its own logs, but it cannot be
checked by recomputation (the answers are not signed by the peers that gave them).

This module is pure: encoding and decoding with strict validation (every byte is hostile),
signing and verifying, and the ledger with an injected clock; no I/O.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from swarmd.dht.identity import PEER_ID_BYTES, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_of, verify
from swarmd.errors import RequestError

__all__ = [
    "KINDS",
    "REPORT_VERSION",
    "LedgerResult",
    "MisbehaviourReport",
    "ReportLedger",
    "digest_tensor_bytes",
]

REPORT_VERSION = 1
_SIGNING_PREFIX = b"swarmd-misbehaviour-report\x00"
#: What a report may accuse a peer of: a wrong answer to one of these calls, or hostile averaging
#: contributions (a round leader's conviction, or a stage-mate seconding it:
#: ``swarmd.pipeline.averaging.trust.accusations``).
KINDS = ("forward", "backward", "averaging")
MAX_REPORT_BYTES = 2048
MAX_ANSWERS = 3
#: A report dated further than this in the future (clock skew), or older than the ledger's
#: window, is refused.
MAX_CLOCK_SKEW_S = 60.0

_HEX = frozenset("0123456789abcdef")


def digest_tensor_bytes(*parts: bytes) -> str:
    """The SHA-256 hex digest of a request's or an answer's bytes, as reports carry them."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def _is_hex(value: object, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and set(value) <= _HEX


def _int(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    value = body.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise RequestError(f"a report's '{key}' must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def unpack_bounded(raw: bytes, what: str, max_bytes: int, *, max_array_len: int, max_map_len: int) -> object:
    """Remote msgpack decoded with every length bounded (strings and binaries by ``max_bytes``);
    ``RequestError`` (422) naming ``what`` when it is not valid msgpack. Shapes are the caller's."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=max_bytes,
                               max_array_len=max_array_len, max_map_len=max_map_len)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise RequestError(f"{what} is not valid msgpack: {exc}") from None


@dataclass(frozen=True)
class MisbehaviourReport:
    """One spot check's evidence against one peer, signed by the reporter.

    ``answers``: ``(peer_id, answer digest)`` of every peer asked (the accused's, the one that
    disagreed with it, the arbiter's), sorted by peer id; the accused is among them.
    ``reporter``: the reporter's raw ed25519 public key; ``at``: unix time of the verdict.
    ``evidence``: only in an ``averaging`` report (and required there): the accused's signed claims,
    encoded (``swarmd.pipeline.averaging.trust.accusations.Evidence``; checked by the daemon, not here).
    """

    accused: str
    stage: int
    step: int
    kind: str
    mb: int
    request_digest: str
    answers: tuple[tuple[str, str], ...]
    reporter: bytes
    at: float
    signature: bytes = field(default=b"", repr=False)
    evidence: bytes = field(default=b"", repr=False)

    @property
    def reporter_id(self) -> str:
        return peer_id_of(self.reporter)

    def _body(self) -> bytes:
        fields: dict[str, Any] = {
            "v": REPORT_VERSION, "accused": self.accused, "stage": self.stage, "step": self.step,
            "kind": self.kind, "mb": self.mb, "request": self.request_digest,
            "answers": [list(a) for a in self.answers], "reporter": self.reporter, "at": self.at}
        if self.evidence:
            fields["evidence"] = self.evidence
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def signed(
        cls, identity: Identity, *, accused: str, stage: int, step: int, kind: str, mb: int, request_digest: str,
        answers: Mapping[str, str], at: float, evidence: bytes = b"",
    ) -> MisbehaviourReport:
        """A report by ``identity``; validated as a receiver would (ValueError-free: RequestError)."""
        unsigned = cls(accused=accused, stage=stage, step=step, kind=kind, mb=mb, request_digest=request_digest,
                       answers=tuple(sorted(answers.items())), reporter=identity.public_key_bytes, at=at,
                       evidence=evidence)
        body = unsigned._body()
        report = cls.decode(body, identity.sign(_SIGNING_PREFIX + body))
        return report

    def encode(self) -> tuple[bytes, bytes]:
        """``(body, signature)``: what ``POST /v1/report`` carries (meta ``body`` and ``sig``)."""
        return self._body(), self.signature

    @classmethod
    def decode(cls, body: object, signature: object) -> MisbehaviourReport:
        """Validate a report from the network: types, sizes, ranges, and the signature.

        Raises ``RequestError`` (422) naming what is wrong; never anything else."""
        if type(body) is not bytes or not 0 < len(body) <= MAX_REPORT_BYTES:
            raise RequestError(f"a report's body must be 1..{MAX_REPORT_BYTES} bytes of msgpack")
        if type(signature) is not bytes or len(signature) != SIGNATURE_BYTES:
            raise RequestError(f"a report's signature must be {SIGNATURE_BYTES} bytes")
        fields = unpack_bounded(body, "a report's body", MAX_REPORT_BYTES, max_array_len=16, max_map_len=16)
        if not isinstance(fields, dict):
            raise RequestError("a report's body must be a map")
        if fields.get("v") != REPORT_VERSION:
            raise RequestError(f"unknown report version {fields.get('v')!r:.20} (this peer reads {REPORT_VERSION})")
        accused = fields.get("accused")
        if not _is_hex(accused, 2 * PEER_ID_BYTES):
            raise RequestError("a report's 'accused' must be a peer id (40 lowercase hex characters)")
        kind = fields.get("kind")
        if kind not in KINDS:
            raise RequestError(f"a report's 'kind' must be one of {', '.join(KINDS)}")
        request = fields.get("request")
        if not _is_hex(request, 64):
            raise RequestError("a report's 'request' must be a SHA-256 hex digest")
        answers = fields.get("answers")
        if not isinstance(answers, list) or not 2 <= len(answers) <= MAX_ANSWERS or not all(
            isinstance(a, list) and len(a) == 2 and _is_hex(a[0], 2 * PEER_ID_BYTES) and _is_hex(a[1], 64)
            for a in answers
        ):
            raise RequestError(f"a report's 'answers' must list 2..{MAX_ANSWERS} [peer id, answer digest] pairs")
        pairs = tuple((str(a[0]), str(a[1])) for a in answers)
        if list(pairs) != sorted(pairs) or len({p for p, _ in pairs}) != len(pairs) or accused not in dict(pairs):
            raise RequestError("a report's answers must be sorted, name each peer once, and include the accused's")
        reporter = fields.get("reporter")
        if type(reporter) is not bytes or len(reporter) != PUBLIC_KEY_BYTES:
            raise RequestError(f"a report's 'reporter' must be a {PUBLIC_KEY_BYTES}-byte ed25519 public key")
        at = fields.get("at")
        if type(at) is not float or not math.isfinite(at) or at <= 0:
            raise RequestError("a report's 'at' must be a positive unix time (float)")
        evidence = fields.get("evidence", b"")
        if (kind == "averaging") != (type(evidence) is bytes and len(evidence) > 0):
            raise RequestError("an 'averaging' report must carry its 'evidence' (bytes), and only it")
        report = cls(accused=str(accused), stage=_int(fields, "stage", 0, 2**16), step=_int(fields, "step", 0, 2**53),
                     kind=str(kind), mb=_int(fields, "mb", 0, 2**64 - 1), request_digest=str(request), answers=pairs,
                     reporter=reporter, at=at, signature=signature, evidence=evidence)
        if report._body() != body:  # one encoding only: what is signed is exactly what is read
            raise RequestError("a report's body is not in its canonical encoding")
        if not verify(reporter, _SIGNING_PREFIX + body, signature):
            raise RequestError("a report's signature does not verify against its reporter's key")
        if report.reporter_id == report.accused:
            raise RequestError("a peer cannot report itself")
        return report


@dataclass(frozen=True)
class LedgerResult:
    """What the ledger made of one report: ``accepted`` (counted towards an exclusion), why
    not (``reason``), and whether the accused is excluded now."""

    accepted: bool
    reason: str
    excluded: bool


def _source_key(source: str) -> str | None:
    """The network a report came from (an IPv4 /24, an IPv6 /64), or None for loopback (a local
    swarm: every trainer shares the address, so each key counts on its own)."""
    try:
        address = ipaddress.ip_address(source)
    except ValueError:
        return source  # not an IP (a relay's name, a unix socket): counted as itself
    if address.is_loopback:
        return None
    prefix = 24 if address.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{prefix}", strict=False))


@dataclass
class _Accusations:
    reporters: dict[str, tuple[float, str | None]] = field(default_factory=dict)  # reporter id -> (at, source)
    exclusions: int = 0  # how often this peer was excluded before (the next one lasts longer)
    excluded_until: float | None = None
    evidence: MisbehaviourReport | None = None  # the latest accepted report (for the log line)


class ReportLedger:
    """Accused peer -> distinct reporters within a window; two make an exclusion (see the module
    docstring). Bounded: at most ``max_accused`` peers tracked (the least recently accused are
    forgotten first, never a peer excluded now)."""

    def __init__(
        self,
        *,
        window_s: float = 600.0,
        reporters_needed: int = 2,
        exclusion_base_s: float = 600.0,
        exclusion_max_s: float = 24 * 3600.0,
        max_per_reporter: int = 20,
        max_accused: int = 4096,
        clock: Callable[[], float] = time.time,
        on_exclude: Callable[[str, float, MisbehaviourReport], None] | None = None,
    ) -> None:
        if not (window_s > 0 and reporters_needed >= 1 and 0 < exclusion_base_s <= exclusion_max_s
                and max_per_reporter >= 1 and max_accused >= 1):
            raise ValueError("bad ledger parameters")
        self.window_s = window_s
        self.reporters_needed = reporters_needed
        self.exclusion_base_s = exclusion_base_s
        self.exclusion_max_s = exclusion_max_s
        self.max_per_reporter = max_per_reporter
        self.max_accused = max_accused
        self._clock = clock
        self._on_exclude = on_exclude
        self._accused: OrderedDict[str, _Accusations] = OrderedDict()
        self._filed: dict[str, list[float]] = {}  # reporter id -> when its accepted reports arrived
        self.counts: dict[str, int] = {"received": 0, "accepted": 0, "exclusions": 0}
        self.refused: dict[str, int] = {}

    def add(self, report: MisbehaviourReport, source: str) -> LedgerResult:
        """Count ``report`` (already decoded and verified) that arrived from ``source``."""
        now = self._clock()
        self.counts["received"] += 1
        entry = self._accused.get(report.accused)
        excluded = entry is not None and self._excluded(entry, now)
        if report.at > now + MAX_CLOCK_SKEW_S or report.at < now - self.window_s:
            return self._refuse("stale", excluded)
        filed = [t for t in self._filed.get(report.reporter_id, []) if t > now - self.window_s]
        if len(filed) >= self.max_per_reporter:
            return self._refuse("rate_limited", excluded)
        if entry is None:
            entry = self._accused[report.accused] = _Accusations()
            self._trim()
        self._accused.move_to_end(report.accused)
        if excluded:
            return self._refuse("already_excluded", True)
        entry.reporters = {r: v for r, v in entry.reporters.items() if v[0] > now - self.window_s}
        if report.reporter_id in entry.reporters:
            return self._refuse("duplicate", False)
        source_key = _source_key(source)
        if source_key is not None and any(src == source_key for _, src in entry.reporters.values()):
            return self._refuse("same_source", False)  # another key from the same network: one reporter
        entry.reporters[report.reporter_id] = (now, source_key)
        entry.evidence = report
        self._filed[report.reporter_id] = [*filed, now]
        self.counts["accepted"] += 1
        if len(entry.reporters) >= self.reporters_needed:
            length = min(self.exclusion_base_s * 2.0 ** min(entry.exclusions, 64), self.exclusion_max_s)
            entry.excluded_until = now + length
            entry.exclusions += 1
            entry.reporters = {}
            self.counts["exclusions"] += 1
            if self._on_exclude is not None:
                self._on_exclude(report.accused, length, report)
            return LedgerResult(True, "excluded", True)
        return LedgerResult(True, "counted", False)

    def excluded(self) -> frozenset[str]:
        """The peers excluded right now."""
        now = self._clock()
        return frozenset(p for p, e in self._accused.items() if self._excluded(e, now))

    def suspected(self, limit: int | None = None) -> list[str]:
        """The peers accused by a report within the window and not excluded (yet): the most recently
        accused first, at most ``limit``. One report excludes nobody (its reporter may lie), but it
        tells trainers whose answers to check more (``swarmd.train.verify.CheckLedger.watch``), so a
        peer that one trainer caught lying is caught by a second soon after, whatever the sampled
        rate (issue #29). What a false report costs the swarm: a few more checks of an honest peer."""
        now = self._clock()
        found: list[str] = []
        for peer_id, entry in reversed(self._accused.items()):
            if limit is not None and len(found) >= limit:
                break
            if not self._excluded(entry, now) and any(at > now - self.window_s for at, _ in entry.reporters.values()):
                found.append(peer_id)
        return found

    def status(self) -> dict[str, Any]:
        """Counters for ``/status``: reports received, accepted, refused by reason, exclusions, and the
        peers accused once (``suspected``: checked more by trainers, not excluded)."""
        excluded = sorted(self.excluded())
        return {**self.counts, "refused": dict(self.refused), "excluded": excluded, "excluded_now": len(excluded),
                "suspected": sorted(self.suspected()), "accused": len(self._accused)}

    @staticmethod
    def _excluded(entry: _Accusations, now: float) -> bool:
        return entry.excluded_until is not None and entry.excluded_until > now

    def _refuse(self, reason: str, excluded: bool) -> LedgerResult:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return LedgerResult(False, reason, excluded)

    def _trim(self) -> None:
        now = self._clock()
        while len(self._accused) > self.max_accused:
            for peer_id, entry in self._accused.items():
                if not self._excluded(entry, now):
                    del self._accused[peer_id]
                    break
            else:
                return
        for reporter in [r for r, ts in self._filed.items() if not ts or ts[-1] < now - self.window_s]:
            del self._filed[reporter]
