"""How long a trainer waits for what: every timeout, grace and pause of its loops, with its reason.

A trainer waits on peers it does not control (SWARM, section 3.2: any peer may be slow, leave or
lie), so each of its waits is a trade: too short and an honest peer on a loaded machine is banned
or a stage is topped up for nothing; too long and a dead or lying peer stalls the swarm. The values
live here, in one frozen :class:`Timing`, so each is read in one place with its reason, and a test
shortens a grace by passing ``TrainerConfig(timing=Timing(stuck_grace_s=0.2))`` instead of patching
module globals. What a call's timeout is *per peer* comes from what the stage takes
(``StageRouter.timeout_for``); these are the floors, ceilings and graces around it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = ["Timing"]


@dataclass(frozen=True)
class Timing:
    """Every wait of a trainer (seconds unless named otherwise)."""

    # ---- calls to a stage (swarmd.train.stage_calls) ----------------------------------------------
    #: The shortest per-call timeout: below it, scheduling noise on a loaded machine would ban honest peers.
    timeout_floor_s: float = 2.0
    #: A call to a peer on probation while the stage has no latency estimate yet waits at most this long.
    probation_timeout_s: float = 15.0
    #: A backward's peer adds its gradient only within this share of the call's timeout, and at least
    #: ``backward_slack_s`` before it (the rest covers the way there and back, on a loaded machine too):
    #: past it the trainer may have given up and retried elsewhere, and the gradient must not count twice.
    deadline_share: float = 0.75
    backward_slack_s: float = 5.0
    #: Asking a peer whether it counted a backward whose answer was lost: no compute, so short.
    claim_timeout_s: float = 3.0
    #: A peer busy averaging (``Busy``) serves again within moments: asked again after this.
    busy_retry_s: float = 0.02
    #: ... by a spot check's opinion, which has only a few tries: spaced further apart.
    opinion_busy_retry_s: float = 0.05
    #: A reply's step that a poll finds beyond its stage-mates' steps (its own peer not naming an earlier one) is
    #: polled again after this before its peer is convicted: a mate's answer may lag its step (spot_checks).
    step_recheck_s: float = 0.5
    #: Every usable peer failed this call once: it goes round them again after this pause.
    round_again_s: float = 0.05
    #: No usable peer at all: look again (re-reading the stage map) at least this often.
    no_peer_poll_s: float = 0.5
    #: A forward to a peer on probation re-reads its timeout this often: the stage's latency estimate
    #: may appear while it runs, and a tarpit must then cost about one typical call (issue #18).
    watch_s: float = 0.25
    #: How often a short wait (a probation slot to free up, a stage to take its round) looks again.
    tick_s: float = 0.01

    # ---- progress polls and the control plane (swarmd.train.swarm_view, swarm_client) --------------
    #: How long one ``/v1/progress`` long-poll may wait for a step.
    progress_wait_s: float = 0.5
    #: How long one progress poll of a peer may take (a long-poll: on top of its wait) ...
    progress_timeout_s: float = 5.0
    #: ... of a peer that has never answered this trainer (on probation: a tarpit must not hold up
    #: every poll of the trainer's loop for ``progress_timeout_s``).
    probation_progress_timeout_s: float = 3.0
    #: How long the last report (and the goodbye) to the daemon may take when the trainer finishes.
    flush_timeout_s: float = 5.0

    # ---- asynchronous pacing (swarmd.train.pacing) -------------------------------------------------
    #: How long a leased microbatch waits for a stage still at the previous step (finishing its round)
    #: before it is sent anyway (a stage short of samples would never step without it).
    stage_catch_up_s: float = 2.0
    #: A peer-to-peer forward of a sync step whose later stages may still be taking the step before
    #: (``meta.min_step``): how much longer its hops are given, to wait there for that step.
    chain_step_wait_s: float = 2.0
    #: A lease request (no compute) to a peer that has answered this trainer ...
    reserve_timeout_s: float = 10.0
    #: ... and to one that has not yet (the trainer's first, or a newcomer).
    probation_reserve_timeout_s: float = 5.0
    #: A lease-book peer seen behind the first stage's front step is waited for this long before the
    #: trainer turns to the next peer's book: at every step some stage-mate applies its update a moment
    #: after the others, and a trainer that switched books then would lease samples the stage's book
    #: never learns of (a second book: overfilled steps, and samples no write-off can account for).
    book_lag_grace_s: float = 2.0
    #: The lease book did not answer: asked again after this.
    book_retry_s: float = 0.1
    #: While microbatches are in flight, the swarm's progress is read at least this often.
    window_poll_s: float = 1.0

    # ---- synchronous steps (swarmd.train.sync_steps) -----------------------------------------------
    #: A stage short of the target batch (a peer died holding gradients) is topped up after this grace,
    #: which lets gradients still on their way arrive first.
    topup_grace_s: float = 1.0
    #: A stage that holds the target batch yet has not stepped for this long gets one more microbatch
    #: (an honest stage starts its round within a poll period of holding it).
    stuck_grace_s: float = 10.0
    #: A peer that most of its stage left behind this long is not waited for (a resync takes seconds; a
    #: peer that claims an old step forever must not stall the trainer until it gives up).
    lag_grace_s: float = 30.0
    #: The step wait polls at most this often (a long-poll already waits; a peer that answered at once,
    #: or not at all, did not).
    step_poll_period_s: float = 0.05
    #: ... and re-reads the stage map (when due) only once it has waited this long since the batch was sent:
    #: that read is a DHT lookup behind the control plane (up to a second on long links), which a wait that
    #: ends within a round trip or two must not have on its path; a longer one needs it (a dead peer's
    #: record expires, a new one appears).
    wait_refresh_after_s: float = 1.0

    # ---- registration (swarmd.train.swarm_client) -------------------------------------------------
    #: A daemon that answers "not ready" (still joining: building its stage, downloading its state) is
    #: waited for this long: peers and a trainer started together, as the README's tour does, train as
    #: soon as the daemon serves. A daemon that does not answer at all fails at once.
    register_wait_s: float = 120.0
    #: Between two registration attempts while it is not ready.
    register_retry_s: float = 1.0

    # ---- spot checks (swarmd.train.spot_checks) ----------------------------------------------------
    #: A misbehaviour report to one peer.
    report_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"Timing.{f.name} must be positive, got {value}")
        if self.deadline_share > 1.0:
            raise ValueError(f"Timing.deadline_share must be at most 1, got {self.deadline_share}")

    @property
    def backward_timeout_floor_s(self) -> float:
        """The shortest timeout of a backward: its deadline must leave the peer time to compute."""
        return 2 * self.backward_slack_s

    def timeout_floor(self, kind: Literal["forward", "backward"], ceiling_s: float) -> float:
        """The shortest timeout of a call of ``kind`` (a backward's leaves room for its deadline),
        never above the configured ``ceiling_s``."""
        return min(self.backward_timeout_floor_s if kind == "backward" else self.timeout_floor_s, ceiling_s)

    def backward_deadline_ms(self, timeout_s: float) -> int:
        """The ``deadline_ms`` of a backward the trainer waits ``timeout_s`` for: ``deadline_share`` of
        it, and at least ``backward_slack_s`` short of it (never negative)."""
        return int(1000 * max(0.0, min(timeout_s * self.deadline_share, timeout_s - self.backward_slack_s)))
