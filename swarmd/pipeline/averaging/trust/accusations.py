"""A leader's conviction of hostile contributions, made checkable by its stage-mates (issue #29, item 4).

A round's leader convicts a peer whose contributions it scored *far* ``STRIKES`` times in
``WINDOW`` rounds (``swarmd.pipeline.averaging.trust.hostile_contributions``). Alone, that verdict binds only
the leader: one hostile leader must not be able to ban honest peers swarm-wide. So the verdict
travels as a :class:`~swarmd.pipeline.reports.MisbehaviourReport` of kind ``averaging`` (the
same signed reports, the same ledger and the same two-independent-reporters rule that turn
trainers' spot checks into exclusions), carrying :class:`Evidence` that any stage-mate can check
against what it knows itself, and **second** with a report of its own:

* Every contributor signs, with its contribution, the contribution's **per-sample norm**
  (:func:`contribution_message`: stage, step, samples, gradients' digest, its peer id, the
  leader's, and that norm); the leader refuses a contribution whose signed norm is not the norm
  of the gradients it carries. The evidence is the accused's signed claims ``(step, samples,
  digest, norm, signature)`` of the rounds the leader struck as far, and its public key: nobody
  can forge them, so a leader cannot make an honest peer's contribution look larger than it was.
* A stage-mate that contributed to the same rounds knows its *own* per-sample norm and samples
  at each of those steps (:class:`OwnNorms`). It seconds (:func:`second`) when at least
  ``SECOND_CLAIMS`` (3) of the claims, of distinct steps within ``SPAN`` steps, are *far by norm* from its own:
  ``norm_i / (own_norm * sqrt(1 + own_samples / samples_i)) > FAR_FACTOR`` (the ``far`` score's
  normalisation: honest per-sample norms over ``n`` samples shrink as ``1/sqrt(n)`` when noise
  dominates, and since ``||g_i|| <= ||g_i - a|| + ||a||`` an honest peer's norm score is at most its
  ``far`` score plus one: in the honest runs of hostile_contributions' docstring, at most 2.3).
* A seconding stage-mate excludes the accused from its own rounds (its progress answer lists it,
  so the trainers, which follow a majority of a stage's answers, stop routing to it:
  ``swarmd.train.verify.excluded_by_stage``) and posts its own report; every daemon's ledger then
  holds two independent reporters and excludes the peer swarm-wide.

What one accuser can do: exclude the accused from the rounds it leads (as before), and post a
report that counts once in every ledger. It cannot get an honest peer excluded anywhere else:
the honest stage-mates second only contributions the accused itself signed as far from their own.
Two colluding peers (a hostile leader and a hostile stage-mate, or any two reporters from two
networks) can, as with spot-check reports (docs/SECURITY.md). What is not caught this way: a liar
whose contributions are far in direction only (a sign flip: its norm is honest; its own signed
opening convicts it instead, :class:`~swarmd.pipeline.averaging.trust.contribution_proofs.OpeningEvidence`, the
second kind of evidence :func:`decode_evidence` reads; a liar about one microbatch, consistent in its
opening, is convicted by recomputing that microbatch, which the stage-mates redo themselves from the
signed opening and inputs of :class:`RecomputedEvidence`), one that signs a
false norm (refused by the leader every round, so it never counts, but only the leader excludes
it), and a liar convicted by a leader none of whose stage-mates contributed to the same rounds.

Pure: encoding, validation (every byte is hostile: ``RequestError``) and the seconding rule.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from swarmd.dht.identity import PEER_ID_BYTES, PUBLIC_KEY_BYTES, SIGNATURE_BYTES, peer_id_of, verify
from swarmd.errors import RequestError
from swarmd.pipeline.averaging.trust.contribution_proofs import Opening, OpeningEvidence, proof_seed
from swarmd.pipeline.averaging.trust.hostile_contributions import FAR_FACTOR, STRIKES, WINDOW
from swarmd.pipeline.averaging.trust.recomputation import inputs_digest
from swarmd.pipeline.reports import MisbehaviourReport, unpack_bounded

__all__ = ["MAX_CLAIMS", "NORM_TOLERANCE", "SECOND_CLAIMS", "SPAN", "Claim", "Evidence", "OwnNorms",
           "RecomputedEvidence", "StruckClaims", "contribution_message", "decode_evidence", "second"]

_CONTRIBUTION_DOMAIN = b"swarmd-average/2\x00"
#: An accusation's claims all lie within this many steps (a leader cannot gather a peer's rare
#: heavy-tailed honest contributions over a long run into one accusation).
SPAN = 4 * WINDOW
#: At most this many claims in an accusation (the far strikes of one window).
MAX_CLAIMS = WINDOW
#: A stage-mate seconds when this many of the claims are far from its own contributions: one fewer
#: than a conviction's strikes, so that one round it did not share with the accused (turned away late,
#: resyncing) does not void a conviction of four (under load, one of five test runs); honest claims on the
#: last stage never scored over 2.5 in the measured runs (docs/BENCHMARKS.md).
SECOND_CLAIMS = STRIKES - 1
MAX_EVIDENCE_BYTES = 1400
#: A leader refuses a contribution whose signed per-sample norm differs from its gradients' by more
#: than this (relative: the contributor computed it on the same decoded float32 values, in float64).
NORM_TOLERANCE = 1e-6
_HEX = frozenset("0123456789abcdef")


def contribution_message(stage: int, step: int, samples: int, digest: str, peer_id: str, leader: str,
                         norm: float) -> bytes:
    """What a contributor signs: its contribution (with its per-sample ``norm``), and to whom it is
    sent (so it cannot be replayed to another leader or step)."""
    return _CONTRIBUTION_DOMAIN + msgpack.packb([stage, step, samples, digest, peer_id, leader, float(norm)],
                                                use_bin_type=True)


@dataclass(frozen=True)
class Claim:
    """One contribution as its sender signed it (see :func:`contribution_message`)."""

    step: int
    samples: int
    digest: str
    norm: float
    signature: bytes


@dataclass(frozen=True)
class Evidence:
    """The accused's signed claims of the rounds ``leader`` struck as far, and the accused's key."""

    leader: str
    key: bytes
    claims: tuple[Claim, ...]

    def encode(self) -> bytes:
        return msgpack.packb({"leader": self.leader, "key": self.key,
                              "claims": [[c.step, c.samples, c.digest, c.norm, c.signature] for c in self.claims]},
                             use_bin_type=True)

    @classmethod
    def decode(cls, raw: object) -> Evidence:
        """Shapes and ranges only (:meth:`verify` checks the signatures); ``RequestError`` naming what is wrong."""
        if type(raw) is not bytes or not 0 < len(raw) <= MAX_EVIDENCE_BYTES:
            raise RequestError(f"an accusation's evidence must be 1..{MAX_EVIDENCE_BYTES} bytes of msgpack")
        fields = unpack_bounded(raw, "an accusation's evidence", MAX_EVIDENCE_BYTES, max_array_len=16, max_map_len=4)
        if not isinstance(fields, dict) or set(fields) != {"leader", "key", "claims"}:
            raise RequestError("an accusation's evidence must be a map of leader, key and claims")
        leader, key, claims = fields["leader"], fields["key"], fields["claims"]
        if not (isinstance(leader, str) and len(leader) == 2 * PEER_ID_BYTES and set(leader) <= _HEX):
            raise RequestError("an accusation's 'leader' must be a peer id")
        if type(key) is not bytes or len(key) != PUBLIC_KEY_BYTES:
            raise RequestError(f"an accusation's 'key' must be a {PUBLIC_KEY_BYTES}-byte ed25519 public key")
        if not isinstance(claims, list) or not 1 <= len(claims) <= MAX_CLAIMS:
            raise RequestError(f"an accusation must carry 1..{MAX_CLAIMS} claims")
        out = []
        for c in claims:
            if not (isinstance(c, list) and len(c) == 5 and type(c[0]) is int and 0 <= c[0] <= 2**53
                    and type(c[1]) is int and 0 < c[1] <= 2**31 and isinstance(c[2], str) and len(c[2]) == 64
                    and set(c[2]) <= _HEX and type(c[3]) is float and math.isfinite(c[3]) and c[3] >= 0
                    and type(c[4]) is bytes and len(c[4]) == SIGNATURE_BYTES):
                raise RequestError("an accusation's claims must be [step, samples > 0, digest, norm >= 0, signature]")
            out.append(Claim(c[0], c[1], c[2], c[3], c[4]))
        evidence = cls(leader=leader, key=key, claims=tuple(out))
        if evidence.encode() != raw:
            raise RequestError("an accusation's evidence is not in its canonical encoding")
        return evidence

    def verify(self, stage: int, accused: str) -> None:
        """Every claim signed by ``accused`` (its key hashing to that id) for ``leader``'s rounds of
        ``stage``, each of a distinct step; ``RequestError`` when not."""
        if peer_id_of(self.key) != accused:
            raise RequestError("an accusation's key is not the accused's")
        if len({c.step for c in self.claims}) != len(self.claims):
            raise RequestError("an accusation's claims must be of distinct steps")
        for c in self.claims:
            message = contribution_message(stage, c.step, c.samples, c.digest, accused, self.leader, c.norm)
            if not verify(self.key, message, c.signature):
                raise RequestError(f"an accusation's claim of step {c.step} is not signed by the accused")


def norm_score(claim: Claim, own_norm: float, own_samples: int) -> float:
    """How far ``claim``'s per-sample norm lies above an honest one, judged against this peer's own
    contribution of the same round (the module docstring)."""
    if own_norm <= 0 or own_samples <= 0:
        return 0.0
    return claim.norm / (own_norm * math.sqrt(1 + own_samples / claim.samples))


class OwnNorms:
    """This peer's own contributions of its last ``keep`` rounds: step -> (leader, per-sample norm, samples)."""

    def __init__(self, keep: int = SPAN) -> None:
        self._rounds: dict[int, tuple[str, float, int]] = {}
        self._order: deque[int] = deque()
        self.keep = keep

    def note(self, step: int, leader: str, norm: float, samples: int) -> None:
        if samples <= 0 or step in self._rounds:
            return
        self._rounds[step] = (leader, norm, samples)
        self._order.append(step)
        while len(self._order) > self.keep:
            self._rounds.pop(self._order.popleft(), None)

    def get(self, step: int) -> tuple[str, float, int] | None:
        return self._rounds.get(step)


def second(evidence: Evidence, own: OwnNorms) -> str | None:
    """Why this peer seconds the accusation (None: it does not): at least ``SECOND_CLAIMS`` claims, of
    distinct steps within ``SPAN``, of rounds this peer also contributed to under the same leader,
    each far by norm from its own contribution (the signatures are checked already: :meth:`Evidence.verify`)."""
    far = []
    for c in evidence.claims:
        mine = own.get(c.step)
        if mine is None or mine[0] != evidence.leader:
            continue
        score = norm_score(c, mine[1], mine[2])
        if score > FAR_FACTOR:
            far.append((c.step, score))
    if len(far) < SECOND_CLAIMS:
        return None
    steps = sorted(s for s, _ in far)
    if steps[-1] - steps[0] >= SPAN:
        return None
    return (f"hostile: {len(far)} of its signed contributions at {min(sc for _, sc in far):.1f}x or more "
            f"the per-sample norm of this peer's own (over {FAR_FACTOR:g}), steps {steps[0]}..{steps[-1]}")


class StruckClaims:
    """The leader's side: each peer's signed claims of its far-struck contributions in the current
    window, kept for the evidence of a conviction. Bounded to ``max_peers`` peers."""

    def __init__(self, *, window: int = WINDOW, max_peers: int = 64) -> None:
        self.window = window
        self.max_peers = max_peers
        self._claims: dict[str, tuple[bytes, deque[Claim | None]]] = {}

    def note(self, peer_id: str, key: bytes, claim: Claim, *, far: bool) -> None:
        """One scored contribution of ``peer_id``: kept when ``far``; the oldest fall out of the window."""
        entry = self._claims.pop(peer_id, None)
        if entry is None or entry[0] != key:
            entry = (key, deque(maxlen=self.window))
        entry[1].append(claim if far else None)  # None keeps the window's length
        self._claims[peer_id] = entry
        while len(self._claims) > self.max_peers:
            self._claims.pop(next(iter(self._claims)))

    def take(self, peer_id: str, leader: str) -> Evidence | None:
        """The evidence against ``peer_id`` (its far claims in the window), forgotten here; None without any."""
        entry = self._claims.pop(peer_id, None)
        if entry is None:
            return None
        claims = tuple(c for c in entry[1] if c is not None)
        return Evidence(leader=leader, key=entry[0], claims=claims) if claims else None


@dataclass(frozen=True)
class RecomputedEvidence:
    """A conviction by recomputation as a stage-mate receives it (``POST /v1/recheck``), every signature and
    digest checked (:meth:`check`): the reporter's ``averaging`` report, resting on the accused's signed
    opening, and the inputs of its microbatch ``mb`` that the opening signs (``recomputation``, "Seconded")."""

    report: MisbehaviourReport
    opening: Opening
    mb: int
    part: tuple[float, ...]  # the accused's signed part of that microbatch
    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def step(self) -> int:
        return self.opening.evidence.step

    @property
    def params(self) -> str:
        """The digest of the parameters the accused signed its microbatches ran at."""
        return self.opening.at[0]

    @property
    def precision(self) -> str:
        return self.opening.at[1]

    def seed(self) -> int:
        """The seed of the sketches the accused signed (``contribution_proofs.proof_seed``), from its signed fields."""
        ev = self.opening.evidence
        return proof_seed(ev.stage, ev.step, ev.leader, self.opening.lead, ev.digest)

    @classmethod
    def check(cls, body: bytes, signature: bytes, opening: bytes, mb: int, inputs: torch.Tensor,
              targets: torch.Tensor) -> RecomputedEvidence:
        """Everything but the recomputation (off the loop: it hashes the inputs); ``RequestError`` naming
        what does not hold: the report's signature, its kind, the opening's signature by the accused, the
        report resting on that opening, a signed part and inputs' digest for ``mb``, and those inputs."""
        report = MisbehaviourReport.decode(body, signature)
        if report.kind != "averaging":
            raise RequestError("a recheck's report must be an 'averaging' one")
        signed = Opening.decode(opening)
        ev = signed.evidence
        ev.verify(report.stage, report.accused)
        if report.evidence != ev.encode():
            raise RequestError("a recheck's report must rest on the opening it carries (its evidence)")
        if not signed.at:  # (``lead`` may be empty: a leader with no gradients of its own that round)
            raise RequestError("a recheck's opening signs no parameters to recompute at")
        found = signed.part_of(mb)
        if found is None:
            raise RequestError(f"a recheck's opening signs no part and inputs of microbatch {mb:#x}")
        part, digest = found
        if inputs_digest(mb, inputs, targets) != digest:
            raise RequestError(f"a recheck's inputs are not those the accused signed for microbatch {mb:#x}")
        return cls(report=report, opening=signed, mb=mb, part=part, inputs=inputs, targets=targets)


def answers_of(evidence: Evidence | OpeningEvidence, accused: str, reporter: str) -> dict[str, str]:
    """A report's ``answers`` for an accusation: the accused's last far claim's digest (or the digest of
    the contribution it opened), and the reporter's digest of the evidence (so the report names what it
    rests on)."""
    digest = evidence.digest if isinstance(evidence, OpeningEvidence) else evidence.claims[-1].digest
    return {accused: digest, reporter: hashlib.sha256(evidence.encode()).hexdigest()}


def decode_evidence(raw: object) -> Evidence | OpeningEvidence:
    """An ``averaging`` report's evidence: signed far claims (:class:`Evidence`), or a signed opening that
    contradicts itself (``contribution_proofs.OpeningEvidence``), told apart by their fields;
    ``RequestError`` when it is neither."""
    if type(raw) is bytes and 0 < len(raw) <= MAX_EVIDENCE_BYTES:
        fields = unpack_bounded(raw, "an accusation's evidence", MAX_EVIDENCE_BYTES, max_array_len=16, max_map_len=12)
        if isinstance(fields, dict) and "sent" in fields:
            return OpeningEvidence.decode(raw)
    return Evidence.decode(raw)


def describe(claims: Iterable[Claim], own: OwnNorms | None = None) -> Any:
    """The claims' steps, samples and norms (and, with ``own``, this peer's own samples and norm of
    that round, and the claim's norm score, when it contributed to it), for a log line."""
    out = []
    for c in claims:
        row: tuple[Any, ...] = (c.step, c.samples, round(c.norm, 4))
        mine = own.get(c.step) if own is not None else None
        if mine is not None:
            row += (mine[0][:8], mine[2], round(mine[1], 4), round(norm_score(c, mine[1], mine[2]), 2))
        out.append(row)
    return out
