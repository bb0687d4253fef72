"""Spot checks: a trainer asks a second peer of a stage for the same answer (issues #17 and #29).

The SWARM paper (Ryabinin et al., 2023) assumes honest workers and names security against
malicious nodes as a limitation (section 6). swarmd has a lever for it: the peers of a stage
hold bit-identical parameters (they step together, ``swarmd.pipeline.averaging.averager``), so the same
request to two peers of a stage at the same step must give the same answer: exactly when both
run the same build on the same kind of hardware, within the error of the reply's codec
otherwise. A trainer runs a random ``fraction`` of its microbatches *paired* (issue #29: the
same sample through another peer of each stage too, as an ordinary microbatch,
``swarmd.train.spot_checks``) and compares; on a mismatch a third peer arbitrates, and the peer
that disagrees with the other two is the liar (banned by this trainer for :data:`LIAR_BAN_S`, and
reported: ``swarmd.pipeline.reports``).

A peer's first answer of each kind is always checked: every microbatch runs paired while a stage
has fewer than two peers confirmed, and past that a newer peer's first answer gets another peer's
opinion at once, its other answers waiting for the verdict (``swarmd.train.spot_checks``). The
trainer also pairs every microbatch while a peer is in a mismatch nobody settled: a peer that lies
from the start is caught at its first answer, and a mismatch is asked again until decided (and
counted against both peers meanwhile: :meth:`CheckLedger.against`). An unpaired answer whose size is far from its
stage-mates' is checked after it came (:class:`AnswerSizes`). Every verdict is
waited for before the microbatch goes on, and the majority's answer goes on when a peer is
convicted.

This module is the pure part: which calls to check (:class:`SpotChecker`, injected rng), how two
answers compare (:func:`tolerance`, :func:`agree`), what a check's answers mean
(:func:`arbitrate`), what a trainer's checks concluded of each peer so far (:class:`CheckLedger`),
and the counters a trainer reports (:class:`VerifyStats`). ``swarmd.train.spot_checks`` does the
I/O.

The comparison. An answer is the reply's tensor (a forward's outputs, a backward's input
gradients) plus, on the last stage, its loss, and the step it was computed at. Answers at
different steps are not compared (the stage may have stepped in between); the step itself is
the peer's claim, and is held to what the stage's peers report (:func:`step_lie`). Two answers
agree when equal, or when every element differs by at most
``tol x absmax`` (absmax over both tensors), where ``tol`` comes from the codec: both replies were
coded independently, each within the codec's bound of the exact value, so their distance is
within twice that bound, plus :data:`CROSS_BUILD_SLACK` for float rounding on another build
(8-bit: ``2 x EIGHT_BIT_REL_ERROR``, fp16: ``2 x 2**-11``, bf16: ``2 x 2**-8``, none: the slack
alone). A lie smaller than that (an output scaled by 1.01 over 8-bit) goes unnoticed; the
codec's own error is of the same size.

The first stage's backward answers no tensor (token ids have no gradient): only its step is
compared. Asking it for a digest or norm of the parameter gradients it computed would not help
alone: a peer can answer honestly and accumulate something else, on any stage. What a peer
accumulates leaves it only as its averaging contribution, so parameter-gradient poisoning is the
averaging's business (``swarmd.pipeline.averaging.trust.round_checks``,
``swarmd.pipeline.averaging.trust.robust_aggregation``).

Whose word a trainer takes about a stage (:func:`stage_distrust`, :func:`excluded_by_stage`). Its
progress polls tell each peer's step, held samples, params digest and the peers it excludes. A
peer that lied in a round is known first to its own stage-mates only (the leader that refused
its contribution, the contributors that refused its answer), and a refused leader *forks* its
stage: it applies its own lie and sits at the honest peers' step with another digest. So a
trainer that waits for a stage to step (``--sync``) counts neither the held samples nor the step
of a peer that a stage-mate excludes or whose digest a strict majority of its stage at that step
does not hold: the stage looks short and is topped up, as after a peer died. That direction is
safe: a liar naming honest peers costs extra samples, never a stall. Routing is stricter, since
a liar could name every honest peer: a trainer stops routing to a peer only when most of its
stage's answering peers exclude it (:func:`excluded_by_stage`), or when it holds a minority digest,
or when most of the whole swarm's answering peers list it (:func:`excluded_by_majority`).
"""

from __future__ import annotations

import enum
import math
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from swarmd.net.codecs import EIGHT_BIT_REL_ERROR

__all__ = [
    "CROSS_BUILD_SLACK",
    "FIRST_CHECKS",
    "FIRST_FORWARD_CHECKS",
    "BACKWARD_PASSES",
    "FORWARD_PASSES",
    "FUSED_PASSES",
    "SUSPICION_CHECKS",
    "LIAR_BAN_S",
    "Outlier",
    "PROBE_DROP",
    "PROBE_FRACTION",
    "SIZE_MIN",
    "SIZE_OWN_MIN",
    "SIZE_STEPS",
    "SIZE_WINDOW",
    "STEP_SLACK",
    "SUSPECT_BELOW",
    "SUSPECT_FACTOR",
    "UNSETTLED_LIMIT",
    "Answer",
    "AnswerSizes",
    "CheckLedger",
    "SpotChecker",
    "Verdict",
    "VerifyStats",
    "agree",
    "answer_size",
    "arbitrate",
    "call_passes",
    "descent_probe",
    "describe",
    "excluded_by_majority",
    "excluded_by_stage",
    "forks",
    "stage_distrust",
    "step_beyond",
    "step_lie",
    "tolerance",
]

#: Relative float rounding two honest builds (other BLAS, other hardware) may differ by.
CROSS_BUILD_SLACK = 1e-4
#: How long a trainer bans a peer it caught lying (the swarm's exclusion comes on top).
LIAR_BAN_S = 3600.0
#: Relative tolerance of two losses (float32 on both sides; exact on the same build).
LOSS_TOLERANCE = 1e-4
#: A peer's answers of each kind are checked always until this many were confirmed: a liar from the
#: start is caught at its first answer, before it has done much harm.
FIRST_CHECKS = 1
#: ... and its forwards (activations, or a validation loss) until this many: a liar on one forward in three
#: (``sometimes``, x1.05: within every size band) met one first check in three and was then left to the 2 %
#: pairs, excluded at step 6 or 16 or never in 40 (``scripts/bench_verify.py``). A forward is the cheapest
#: answer to ask again (a third of a backward, and its request is token ids or one activation), so each
#: trainer checks three: a peer's first three forwards all honest for both trainers is rare for such a liar.
#: Only the first of them pairs microbatches (``Pairing``); the others are opinions asked one by one.
FIRST_FORWARD_CHECKS = 3
#: A peer some daemon holds one report against (``ProgressReply.suspected``: a trainer caught it, or
#: says so) has its next answers of each kind checked always until this many more were confirmed: a
#: liar one trainer caught is caught by the others within a few of their calls, whatever the
#: sampled rate, and the second report excludes it. A liar on one answer in three escapes 8 checks of
#: its answers with probability (2/3)^8 = 4%; an honest peer falsely accused costs 8 paired answers.
SUSPICION_CHECKS = 8
#: ... armed at most once per peer in this long (the report ledger's window): a daemon that lists every
#: peer as suspected in every answer costs each trainer at most ``SUSPICION_CHECKS`` per peer per window.
SUSPICION_REARM_S = 600.0
#: The most accused peers a trainer remembers arming (half are forgotten, the oldest first, beyond it).
MAX_WATCHED = 4096
#: How far ahead of every stage-mate's reported step (``/v1/progress``) a reply's step may be: peers
#: of a stage step together, so an honest peer is at most one ahead of the most advanced of its
#: mates (it applied the round's update first); one more for a poll that raced a step.
STEP_SLACK = 2
#: Mismatches of a stage's only two peers that are redone before their answers go on unconfirmed
#: (:meth:`CheckLedger.unsettled`): one of two lies, which two peers cannot tell apart, and redoing
#: every microbatch for ever would stall training.
UNSETTLED_LIMIT = 3
#: An unpaired answer whose size (:func:`answer_size`) lies outside ``[1/SUSPECT_BELOW, SUSPECT_FACTOR]``
#: times the median of its stage-mates' recent answers of its kind is checked at once: a second opinion
#: asked after it came, which its own peer never sees (:class:`AnswerSizes`). The band is wider below: a
#: smaller answer moves the model less than its microbatch's due (no more than leaving it out), and an honest
#: stage's sizes fall several-fold in the step after a spike, whose answers are the reference then. Replayed
#: on the answers of ten honest 40-step runs (2 x 3 peers, ``tiny``: every size a trainer judged and kept,
#: in order), 1/3 below cut the false alarms by a quarter (33 to 25), and a simulated liar (one peer's
#: last-stage answers times 3, 2.5, 0.3 or 0 after its first three) was caught as soon (times 0.3: within 4
#: lies, 1.4 on average, against 3 and 1.3).
SUSPECT_FACTOR = 2.0
SUSPECT_BELOW = 3.0
#: How many of the stage-mates' recent answers an answer's size is held against, and how many it takes.
SIZE_WINDOW = 32
SIZE_MIN = 2
#: An answer is held to its stage-mates' answers of its own step when there is one (they ran on the same
#: parameters), else to those of the steps at most ``SIZE_STEPS`` from it (``SIZE_MIN`` of them). Sizes move
#: fast from one step to the next (an honest stage's by up to 10x in ``tiny``'s first 40 steps; one microbatch
#: of 4 samples may be 3x its step's others): most of an honest run's second opinions are such answers. A
#: wider band across steps (4x) was tried: it halved those opinions and let the check-aware liar's tripled
#: gradients through for 6 steps (1.05x the honest held-out loss), so the band is one step. One answer of its
#: own step is a better reference than two of the steps around it: replayed as at ``SUSPECT_BELOW``, it cut
#: the false alarms by a third (51 to 33) and caught the simulated liars as soon (times 2.5: sooner). Two
#: steps around it instead of one, tried in the replay: twice the false alarms. With a single answer of the
#: steps around it the reference is *thin* (:attr:`Outlier.THIN`): a quarter of the last stage's answers at 3
#: peers a stage, and where a third of the check-aware liar's first lies went through unchecked. Held to it,
#: the replayed liars' first lie is caught in 88% of cases instead of 63%, for 2.4 times the false alarms, so
#: an answer outside a thin reference's band is probed for direction (one forward) rather than given an
#: opinion (a fused call, twice the bytes): see ``swarmd.train.spot_checks``.
SIZE_STEPS = 1
SIZE_OWN_MIN = 1
#: What one sample of a call costs its peer, in forward passes (the usual FLOP count: a backward costs about
#: two forwards): a forward 1, a backward 2 (on the graph its forward kept), the last stage's fused
#: forward and backward 3. The checks' extra compute is counted in these (:attr:`VerifyStats.extra_passes`):
#: a probe, one forward, costs a third of the fused call it checks.
FORWARD_PASSES, BACKWARD_PASSES, FUSED_PASSES = 1, 2, 3
#: The share of the last stage's unpaired answers whose input gradient is probed for direction
#: (:func:`descent_probe`): a forward with targets, at the inputs moved against that gradient, to another peer.
PROBE_FRACTION = 0.1
#: How far a probe moves the inputs: far enough that the loss would drop by this share of itself to first order.
PROBE_DROP = 0.05

_CODEC_ERROR = {
    "none": 0.0,
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
    "8bit": EIGHT_BIT_REL_ERROR,
    # 4bit's bound is per rotated block (swarmd.net.codecs), not per element: per element it can
    # reach sqrt(n) / 15 of the block's norm. This is the practical figure instead: the largest
    # per-element error measured on Gaussian values with outliers stays below 0.2 of the
    # tensor's absmax (tests/unit/test_codec_4bit.py). Two honest peers of one build send identical
    # bytes; the check catches gross lies only, as with OUTLIER_FACTOR in round_checks.
    "4bit": 0.2,
}


def call_passes(kind: str, *, last_stage: bool) -> int:
    """What one sample of a call of ``kind`` costs its peer, in forward passes (:data:`FUSED_PASSES`)."""
    if kind == "forward":
        return FORWARD_PASSES
    return FUSED_PASSES if last_stage else BACKWARD_PASSES


def tolerance(codec: str) -> float:
    """The relative (to absmax) per-element distance two honest answers coded with ``codec`` may
    have: twice the codec's bound plus the cross-build slack. Unknown codecs: ValueError."""
    if codec not in _CODEC_ERROR:
        raise ValueError(f"no error bound known for codec {codec!r}")
    return 2.0 * _CODEC_ERROR[codec] + CROSS_BUILD_SLACK


@dataclass(frozen=True)
class Answer:
    """One peer's answer to a checked call: the step it was computed at, its tensor (None when
    the stage answers none), its loss (last stage) and who answered."""

    peer_id: str
    step: int
    tensor: torch.Tensor | None
    loss: float | None = None
    precision: str = "fp32"  # what computed it: answers of different precisions are never compared


def agree(a: Answer, b: Answer, tol: float) -> bool:
    """Whether two answers at the same step are the same up to ``tol`` (see the module
    docstring). Shapes, dtypes and presence must match exactly; a non-finite value never agrees."""
    if (a.loss is None) != (b.loss is None):
        return False
    if a.loss is not None and b.loss is not None:
        if not (math.isfinite(a.loss) and math.isfinite(b.loss)):
            return False
        if abs(a.loss - b.loss) > LOSS_TOLERANCE * max(1.0, abs(a.loss), abs(b.loss)):
            return False
    x, y = a.tensor, b.tensor
    if x is None or y is None:
        return x is None and y is None
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if torch.equal(x, y):
        return True
    if not x.is_floating_point():
        return False
    x, y = x.float(), y.float()
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
        return False
    scale = max(float(x.abs().max()), float(y.abs().max())) if x.numel() else 0.0
    return float((x - y).abs().max()) <= tol * scale


def step_beyond(step: int, mates: Sequence[int], slack: int = STEP_SLACK) -> bool:
    """Whether ``step`` is further ahead of every one of ``mates``' reported steps (the other peers
    of its stage, from ``/v1/progress``) than ``slack``. No mates: False (nothing to hold it against)."""
    return bool(mates) and step > max(mates) + slack


def step_lie(step: int, own: int | None, mates: Sequence[int], slack: int = STEP_SLACK) -> bool:
    """Whether a reply's ``step`` is a lie, judged on a ``/v1/progress`` poll made *after* the reply:
    ahead of the step its own peer reports now (``own``; a peer's step never goes back while it
    serves), or :func:`step_beyond` its stage-mates'. The step a reply names is its peer's claim:
    checked, not believed. Only steps ahead are lies: an honest peer may be behind (catching up),
    and the step rule (``swarmd.pipeline.stage.step_protocol``) refuses its backwards anyway."""
    return (own is not None and step > own) or step_beyond(step, mates, slack)


class Verdict(enum.Enum):
    """What a check's answers say (see :func:`arbitrate`)."""

    AGREE = "agree"  # the two answers agree
    MISMATCH = "mismatch"  # they disagree: a third peer must arbitrate
    LIAR = "liar"  # the third sided with one of them: the other lied
    INCONCLUSIVE = "inconclusive"  # a step changed in between, or three different answers


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    liar: str | None = None  # with LIAR: the peer that disagreed with the other two


def arbitrate(answers: Sequence[Answer], tol: float) -> Outcome:
    """The verdict of two answers (primary, second) or three (with the arbiter's).

    Answers at different steps, or computed in different precisions (bf16 against fp32 differ
    by more than any codec's tolerance), are inconclusive. Two that agree: AGREE; two that do not:
    MISMATCH (ask a third). Of three: the one disagreeing with the two that agree is the LIAR;
    if no two agree, INCONCLUSIVE (no peer is blamed on a three-way split: it takes two to
    convict one).
    """
    if len(answers) not in (2, 3):
        raise ValueError("a check compares two answers, or three with an arbiter")
    if len({a.step for a in answers}) > 1 or len({a.precision for a in answers}) > 1:
        return Outcome(Verdict.INCONCLUSIVE)
    if len(answers) == 2:
        return Outcome(Verdict.AGREE if agree(answers[0], answers[1], tol) else Verdict.MISMATCH)
    first, second, third = answers
    if agree(first, second, tol):  # the arbiter was not needed after all (it may still lie): no one is blamed
        return Outcome(Verdict.AGREE)
    with_first, with_second = agree(third, first, tol), agree(third, second, tol)
    if with_first and not with_second:
        return Outcome(Verdict.LIAR, second.peer_id)
    if with_second and not with_first:
        return Outcome(Verdict.LIAR, first.peer_id)
    return Outcome(Verdict.INCONCLUSIVE)


class SpotChecker:
    """Which calls a trainer checks: each with probability ``fraction``, from ``rng``.

    A call is checkable when its answer holds something comparable (a tensor or a loss: not the
    first stage's backward of a multi-stage model) and another peer of the stage could answer it.
    """

    def __init__(self, fraction: float, rng: random.Random | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("the verify fraction must lie in [0, 1]")
        self.fraction = fraction
        self._rng = rng if rng is not None else random.Random()

    def draw(self, p: float) -> bool:
        """True with probability ``p``, from the same rng (which answers a direction probe looks at)."""
        return self._rng.random() < p

    def choice(self, n: int) -> int:
        """One of ``range(n)``, drawn from the same rng (which validation batch runs paired)."""
        return self._rng.randrange(n)

    def should_check(self, *, comparable: bool, other_peers: int) -> bool:
        if self.fraction == 0.0 or other_peers < 1 or not comparable:
            return False
        return self._rng.random() < self.fraction


@dataclass
class VerifyStats:
    """The cost and the catch of spot checks, for the trainer's summary (``--json``)."""

    calls: int = 0  # forward and backward calls the trainer made (checked or not)
    checks: int = 0  # calls whose two halves (a paired microbatch's) went to two peers and were compared
    paired: int = 0  # microbatches (and validation batches) run paired, their redos included
    first_checks: int = 0  # of which: paired because a stage had fewer than two peers confirmed yet
    first_opinions: int = 0  # a newer peer's first answers checked by another's opinion instead (spot_checks)
    suspicion_checks: int = 0  # ... or because a usable peer was accused once (ProgressReply.suspected)
    agreements: int = 0
    mismatches: int = 0
    arbitrations: int = 0  # third opinions asked for
    liars: int = 0  # distinct peers caught (banned and reported once each)
    inconclusive: int = 0  # a step changed in between, no third peer, or a three-way split
    failed: int = 0  # checks whose second or third peer did not answer
    skipped: int = 0  # drawn for a check while as many checks as the window were running already
    redone: int = 0  # microbatches redone: a first check's mismatch that no third peer settled
    rechecks: int = 0  # microbatches paired because a peer was in a mismatch not settled yet (asked again)
    suspicions: int = 0  # unpaired answers checked after they came, for their size or direction
    probes: int = 0  # last-stage answers whose gradient's direction was probed (descent_probe)
    outlier_probes: int = 0  # ... of which: drawn by their size against a thin reference (Outlier.THIN)
    probes_missed: int = 0  # ... that told nothing: unanswered, or answered at another step
    unconfirmed: int = 0  # first answers neither confirmed nor refuted even so (let through, or redone)
    extra_requests: int = 0  # requests sent for them (second and third opinions, rechecks, retries)
    extra_samples: int = 0  # samples computed again for the checks
    extra_bytes: int = 0  # tensor bytes sent for them
    extra_wire_bytes: int = 0  # their requests' and replies' bodies on the wire (TrainSummary.wire_bytes: the rest)
    extra_wire_by_reason: dict[str, int] = field(default_factory=dict)  # ... by what they were for
    extra_by_reason: dict[str, int] = field(default_factory=dict)  # extra samples: pair / opinion / probe
    extra_passes: int = 0  # ... in forward passes a sample (call_passes): the checks' extra compute
    extra_passes_by_reason: dict[str, int] = field(default_factory=dict)  # ... by what they were for
    work_passes: int = 0  # the microbatches' own calls that were judged, in forward passes a sample
    reports_sent: int = 0  # signed reports peers accepted
    caught: tuple[str, ...] = ()  # the liars' peer ids

    @property
    def fraction(self) -> float:
        """Extra requests per call: the traffic spot checks added (every request they sent)."""
        return self.extra_requests / self.calls if self.calls else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["caught"] = list(self.caught)
        out["traffic_fraction"] = round(self.fraction, 6)
        return out


def describe(verify: dict[str, Any], wire_bytes: int = 0) -> str | None:
    """One line for the trainer's plain summary from its ``verify`` JSON (``VerifyStats.to_json``):
    what the checks cost and caught; None when it checked nothing. ``wire_bytes``: the bodies of the
    trainer's own calls (``TrainSummary.wire_bytes``): the checks' traffic is said per byte of them
    when given, else per call (the share of requests)."""
    checks = int(verify.get("checks", 0))
    if not checks:
        return None
    caught = [str(p)[:12] for p in verify.get("caught", ())]
    liars = f"{len(caught)} liar(s) caught: {', '.join(caught)}" if caught else "no liar caught"
    extra = int(verify.get("extra_wire_bytes", 0))
    traffic = 100 * (extra / wire_bytes if wire_bytes > 0 else float(verify.get("traffic_fraction", 0.0)))
    return (f"spot checks: {checks} of {verify.get('calls', 0)} calls, {verify.get('extra_requests', 0)} extra "
            f"requests (+{traffic:.1f}% traffic), {verify.get('mismatches', 0)} mismatches, {liars}")


class CheckLedger:
    """What one trainer's spot checks concluded about each peer so far, per kind of answer
    (``forward``, ``backward``): whose answers were confirmed, who is disputed, which pairs of a
    stage's only two peers keep disagreeing, and whose first answers are not checked any more."""

    def __init__(self, *, first_checks: int = FIRST_CHECKS, first_forward_checks: int = FIRST_FORWARD_CHECKS,
                 unsettled_limit: int = UNSETTLED_LIMIT, suspicion_checks: int = SUSPICION_CHECKS,
                 rearm_s: float = SUSPICION_REARM_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.first_checks = first_checks
        self.first_forward_checks = max(first_checks, first_forward_checks)
        self.unsettled_limit = unsettled_limit
        self.suspicion_checks = suspicion_checks
        self.rearm_s = rearm_s
        self._clock = clock
        self._suspected: dict[str, tuple[float, dict[str, int]]] = {}  # peer -> (armed at, kind -> confirmed wanted)
        self._confirmed: Counter[tuple[str, str]] = Counter()  # (peer, kind) -> its answers a check confirmed
        self._disputed: set[str] = set()  # peers in a mismatch no conviction cleared
        self._unsettled: Counter[tuple[str, str]] = Counter()  # (peer, kind) -> mismatches nobody could settle
        self._gave_up: set[tuple[str, str]] = set()  # (peer, kind): not first-checked any more
        self._agreed: set[tuple[frozenset[str], str]] = set()  # ({a, b}, kind): answered alike at one step
        self._against: dict[tuple[str, str], set[str]] = {}  # (peer, kind) -> mates in its unsettled mismatches

    def confirmed(self, peer_id: str, kind: str) -> int:
        """How many of ``peer_id``'s answers of ``kind`` a check confirmed."""
        return self._confirmed[(peer_id, kind)]

    def wants_first_check(self, peer_id: str, kind: str) -> bool:
        """Whether ``peer_id``'s next answer of ``kind`` is checked whatever the draw: it has fewer
        than ``first_checks`` confirmed (``first_forward_checks`` of forwards), and its first checks
        were not given up."""
        wanted = self.first_forward_checks if kind == "forward" else self.first_checks
        return self.confirmed(peer_id, kind) < wanted and not self.gave_up(peer_id, kind)

    def introduced(self, peer_id: str, kind: str) -> bool:
        """Whether ``peer_id``'s first ``first_checks`` answers of ``kind`` were confirmed (or its first
        checks given up): what pairing every microbatch waits for (``Pairing``), the further first
        checks of its forwards being opinions asked one by one."""
        return self.confirmed(peer_id, kind) >= self.first_checks or self.gave_up(peer_id, kind)

    def watch(self, suspected: Iterable[str]) -> None:
        """Peers accused once (``ProgressReply.suspected``): each one's answers of every kind are
        checked always until ``suspicion_checks`` more than it has now were confirmed
        (:meth:`wants_suspicion_check`). A peer is armed at most once per ``rearm_s``, whoever
        names it how often: bounded cost for a false accusation or a daemon that lists everybody."""
        now = self._clock()
        for peer_id in suspected:
            armed = self._suspected.get(peer_id)
            if armed is not None and now - armed[0] < self.rearm_s:
                continue
            self._suspected[peer_id] = (now, {kind: self._confirmed[(peer_id, kind)] + self.suspicion_checks
                                              for kind in ("forward", "backward")})
        if len(self._suspected) > MAX_WATCHED:  # bounded: forget those armed longest ago
            for peer_id, _ in sorted(self._suspected.items(), key=lambda kv: kv[1][0])[:len(self._suspected) // 2]:
                del self._suspected[peer_id]

    def wants_suspicion_check(self, peer_id: str, kind: str) -> bool:
        """Whether ``peer_id``'s next answer of ``kind`` is checked whatever the draw because it was
        accused (:meth:`watch`) and fewer than the wanted answers were confirmed since."""
        armed = self._suspected.get(peer_id)
        return (armed is not None and self._confirmed[(peer_id, kind)] < armed[1][kind]
                and not self.gave_up(peer_id, kind))

    def credit(self, answers: Sequence[Answer], kind: str, uncredited: str | None = None) -> None:
        """Count a confirmed answer for each of ``answers``' peers but ``uncredited``."""
        for a in answers:
            if a.peer_id != uncredited:
                self._confirmed[(a.peer_id, kind)] += 1

    def agreed(self, a: str, b: str, kind: str) -> None:
        """``a`` and ``b`` gave the same answer of ``kind`` at one step."""
        if a != b:
            self._agreed.add((frozenset((a, b)), kind))

    def against(self, a: str, b: str, kind: str) -> str | None:
        """Count a mismatch of ``a`` and ``b`` that no third answer of the same step settled against
        both, and name the odd one out if there is one now: a peer of the two that has such
        mismatches with two distinct peers who, in another check, gave the same answer as each other.
        Answers of different steps cannot be compared, but verdicts can: with one liar in a stage, only
        the liar disagrees with two peers that agree. None: not decided yet (the microbatch is redone,
        and the mismatch stays counted whatever the peers answer next)."""
        for peer, mate in ((a, b), (b, a)):
            self._against.setdefault((peer, kind), set()).add(mate)
        odd = [p for p in (a, b) if self._odd_one_out(p, kind)]
        return odd[0] if len(odd) == 1 else None

    def _odd_one_out(self, peer: str, kind: str) -> bool:
        mates = sorted(self._against.get((peer, kind), ()))
        return any((frozenset((x, y)), kind) in self._agreed for i, x in enumerate(mates) for y in mates[i + 1:])

    def dispute(self, peers: Iterable[str]) -> None:
        """``peers`` were in a mismatch: until a conviction clears them, an answer of theirs that no
        check can confirm is not let through."""
        self._disputed.update(peers)

    def clear(self, peers: Iterable[str]) -> None:
        """``peers`` agreed on the truth against a convicted liar: no longer disputed."""
        self._disputed.difference_update(peers)

    def disputed(self, peer_id: str) -> bool:
        return peer_id in self._disputed

    def unsettled(self, a: str, b: str, kind: str, *, pair_only: bool) -> bool:
        """Count a mismatch of ``a`` and ``b`` that no third peer settled; True when their first
        checks are given up from now on: they are their stage's only usable peers (``pair_only``) and
        both reached ``unsettled_limit`` such mismatches."""
        self._unsettled[(a, kind)] += 1
        self._unsettled[(b, kind)] += 1
        if not pair_only or min(self._unsettled[(a, kind)], self._unsettled[(b, kind)]) < self.unsettled_limit:
            return False
        self._gave_up |= {(a, kind), (b, kind)}
        return True

    def give_up(self, peer_id: str, kind: str) -> bool:
        """Stop first-checking ``peer_id``'s answers of ``kind``; False when that was so already."""
        if (peer_id, kind) in self._gave_up:
            return False
        self._gave_up.add((peer_id, kind))
        return True

    def gave_up(self, peer_id: str, kind: str) -> bool:
        return (peer_id, kind) in self._gave_up


def answer_size(answer: Answer) -> float | None:
    """The root mean square of an answer's tensor (None when it has none, or one value: a loss);
    infinite when a value is not finite."""
    t = answer.tensor
    if t is None or t.numel() < 2 or not t.is_floating_point():
        return None
    size = float(t.detach().float().pow(2).mean().sqrt())
    return size if math.isfinite(size) else math.inf


def descent_probe(inputs: torch.Tensor, grad: torch.Tensor, loss: float,
                  drop: float = PROBE_DROP) -> torch.Tensor | None:
    """The inputs a direction probe sends: ``inputs`` moved against ``grad`` (the last stage's answer:
    the gradient of its mean ``loss`` with respect to them) by ``drop * loss / |grad|^2``, so that
    the loss would fall by ``drop`` of itself to first order. A true gradient makes the loss fall
    there (tiny, 8-bit activations, 30 batches: by 0.3-1.2% at a 5% drop, never a rise); a negated one
    makes it rise. None when nothing can be probed (no loss, a zero or non-finite gradient)."""
    g = grad.detach().float()
    norm2 = float(g.pow(2).sum())
    if not (math.isfinite(loss) and loss > 0.0 and math.isfinite(norm2) and norm2 > 0.0):
        return None
    return (inputs.detach().float() - (drop * loss / norm2) * g).to(inputs.dtype)


class Outlier(enum.Enum):
    """What an answer's size says against its stage-mates' (:meth:`AnswerSizes.outlier`)."""

    NO = "no"  # within the band, or nothing to hold it against
    THIN = "thin"  # outside the band of one stage-mate's answer of a step around it: a weak sign
    FIRM = "firm"  # outside the band of its own step's answers, or of ``SIZE_MIN`` of the steps around it


class AnswerSizes:
    """The sizes of the answers a trainer went on with, per stage and kind, to tell a suspicious one.

    A liar that knows the checks lies where it is not paired; paired checks catch it only at the
    pairing rate. An answer far larger or smaller than its stage-mates' recent answers (a gradient
    tripled, activations scaled by 3) is suspicious whatever the draw, and is checked after it came
    (``swarmd.train.spot_checks``): its peer saw an ordinary request and cannot tell afterwards that
    another peer was asked the same. An answer is held only against *other* peers' answers, so a liar
    cannot move its own reference; a lie that keeps the size (a sign flip) is left to the random
    pairs and the direction probes. A false suspicion costs one second opinion, never a conviction.
    An answer checked as an outlier is not made a reference even when it was confirmed (the caller does
    not :meth:`observe` it): it is one microbatch's extreme, and the step after a spike held to the spike's
    answers alarmed again (replayed as at ``SUSPECT_BELOW``: 25 false alarms to 23 at 3 peers a stage, 28 to 20
    in four runs at 6)."""

    def __init__(self, *, factor: float = SUSPECT_FACTOR, below: float = SUSPECT_BELOW, window: int = SIZE_WINDOW,
                 minimum: int = SIZE_MIN, own_minimum: int = SIZE_OWN_MIN) -> None:
        if factor <= 1.0 or below <= 1.0 or window < 1 or minimum < 1 or own_minimum < 1:
            raise ValueError("the size rule needs factors above 1 and a positive window and minimums")
        self.factor, self.below, self.window = factor, below, window
        self.minimum, self.own_minimum = minimum, own_minimum
        self._recent: dict[tuple[int, str], deque[tuple[str, int, float]]] = {}

    def outlier(self, stage: int, kind: str, answer: Answer) -> Outlier:
        """Whether ``answer``'s size is outside ``[median / below, median x factor]``, the median of the
        last ``window`` answers of ``kind`` its stage-mates gave at its step (at least ``own_minimum`` of
        them), else of those at most ``SIZE_STEPS`` from it: ``FIRM`` with at least ``minimum`` of them,
        ``THIN`` with fewer (one); with none, ``NO``."""
        size = answer_size(answer)
        if size is None:
            return Outlier.NO
        recent = [(step, s) for p, step, s in self._recent.get((stage, kind), ()) if p != answer.peer_id]
        # the answers of its own step when there are any (the stage's parameters, hence its sizes, can
        # jump tenfold from one step to the next: a loss spike), else those of the steps around it
        others = [s for step, s in recent if step == answer.step]
        firm = True
        if len(others) < self.own_minimum:
            others = [s for step, s in recent if abs(step - answer.step) <= SIZE_STEPS]
            firm = len(others) >= self.minimum
            if not others:
                return Outlier.NO
        median = statistics.median(others)
        if not median > 0.0:
            out = size > 0.0 and not math.isfinite(size)
        else:
            out = not median / self.below <= size <= median * self.factor
        return Outlier.NO if not out else Outlier.FIRM if firm else Outlier.THIN

    def observe(self, stage: int, kind: str, answer: Answer) -> None:
        """Remember the size of an answer the trainer went on with (unsuspicious, or confirmed in a pair)."""
        size = answer_size(answer)
        if size is not None and math.isfinite(size):
            recent = self._recent.setdefault((stage, kind), deque(maxlen=self.window))
            recent.append((answer.peer_id, answer.step, size))


class Standing(Protocol):
    """What a trainer's progress poll learnt of one peer (``swarmd.train.swarm_client.PeerProgress``)."""

    @property
    def peer_id(self) -> str: ...
    @property
    def step(self) -> int | None: ...  # None: it did not answer
    @property
    def excluded(self) -> tuple[str, ...]: ...
    @property
    def params_digest(self) -> str | None: ...


def forks(stage: Sequence[Standing]) -> frozenset[str]:
    """The peers of one stage that hold another params digest than a strict majority of the
    stage's peers at the same step (a refused leader that applied its own lie). Peers that
    step together hold bit-identical parameters, so an honest stage has no fork; a tie (two
    peers, two digests) names nobody."""
    by_step: dict[int, Counter[str]] = {}
    for p in stage:
        if p.step is not None and p.params_digest:
            by_step.setdefault(p.step, Counter())[p.params_digest] += 1
    out = set()
    for p in stage:
        if p.step is None or not p.params_digest:
            continue
        counts = by_step[p.step].most_common(2)
        top, n = counts[0]
        if p.params_digest != top and (len(counts) < 2 or n > counts[1][1]):
            out.add(p.peer_id)
    return frozenset(out)


def stage_distrust(stage: Sequence[Standing]) -> frozenset[str]:
    """The peers of one stage whose held samples and step a trainer waiting for the stage's step
    must not count on: excluded by another answering peer of the stage (its round checks or its
    report ledger), or :func:`forks`. Wrongly naming an honest peer only makes the trainer top the
    stage up (more samples than the target), so one accuser is enough here."""
    ids = {p.peer_id for p in stage}
    named = {e for p in stage if p.step is not None for e in p.excluded if e != p.peer_id and e in ids}
    return frozenset(named) | forks(stage)


def excluded_by_stage(stage: Sequence[Standing]) -> frozenset[str]:
    """The peers of one stage that more than half of the stage's answering peers (and at least
    two) exclude: a peer caught lying in rounds is known to its stage-mates only, and one liar
    must not cut an honest peer off (two colluding liars in a 3-peer stage can: a majority of a
    stage can do anything, docs/SECURITY.md)."""
    answers = [p for p in stage if p.step is not None]
    counts = Counter(e for p in answers for e in set(p.excluded) if e != p.peer_id)
    need = max(2, len(answers) // 2 + 1)
    return frozenset(pid for pid, n in counts.items() if n >= need)


def excluded_by_majority(answers: Sequence[Standing]) -> frozenset[str]:
    """The peers listed as excluded by more than half of ``answers`` (and by at least two), all
    stages together.

    Each daemon keeps its own ledger of signed misbehaviour reports
    (``swarmd.pipeline.reports``), and a lying daemon could list honest peers: believing any one
    answer would let it cut them off. A majority of the peers that answered must agree.
    """
    counts = Counter(peer_id for answer in answers for peer_id in set(answer.excluded))
    need = max(2, len(answers) // 2 + 1)
    return frozenset(p for p, n in counts.items() if n >= need)
