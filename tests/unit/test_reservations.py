"""The lease book of sample reservations (swarmd.pipeline.reservations): pure logic, a fake clock."""

from __future__ import annotations

import pytest

from swarmd.pipeline.reservations import MAX_LEASE_S, MIN_LEASE_S, LeaseBook


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def book(target: int = 32, grace_s: float = 2.0) -> tuple[LeaseBook, Clock]:
    clock = Clock()
    return LeaseBook(target, clock=clock, grace_s=grace_s), clock


def reserve(b: LeaseBook, trainer: str = "a", *, step: int = 0, size: int = 8, count: int = 4, lease_s: float = 5.0,
            **kw: object):
    return b.reserve(trainer, step=step, size=size, count=count, lease_s=lease_s, **kw)  # type: ignore[arg-type]


def test_grants_never_exceed_the_target_and_the_last_one_is_cut_to_fit() -> None:
    b, _ = book(target=30)
    first = reserve(b, "a", count=3)
    second = reserve(b, "b", count=3)
    assert [n for _, n in first.leases] == [8, 8, 8] and [n for _, n in second.leases] == [6]
    assert second.reserved == 30 and second.full
    assert reserve(b, "c").leases == ()
    ids = [i for i, _ in first.leases + second.leases]
    assert len(set(ids)) == len(ids)


def test_a_new_step_voids_the_old_leases_and_starts_empty() -> None:
    b, _ = book()
    reserve(b, "a")
    assert reserve(b, "b").leases == ()
    nxt = reserve(b, "b", step=1)
    assert nxt.step == 1 and sum(n for _, n in nxt.leases) == 32


def test_open_leases_expire_unless_renewed_and_done_ones_never() -> None:
    b, clock = book()
    a = reserve(b, "a", count=2, lease_s=1.0)
    c = reserve(b, "c", count=2, lease_s=1.0)
    clock.now += 0.9
    reserve(b, "a", count=0, renew=[a.leases[0][0]], lease_s=1.0)  # a renews one, reports none done
    reserve(b, "c", count=0, done=[i for i, _ in c.leases])  # c finished both
    clock.now += 0.2
    again = reserve(b, "d", count=4)
    assert [n for _, n in again.leases] == [8]  # only a's unrenewed lease went back
    assert b.counters.expired == 1 and b.counters.expired_samples == 8 and b.counters.completed == 2
    clock.now += 10
    assert reserve(b, "d", count=4).leases[0][1] == 8  # a's renewed one expired too; c's done ones did not
    assert b.reserved == 32


def test_only_the_owner_marks_or_renews_a_lease() -> None:
    b, clock = book()
    a = reserve(b, "a", count=1, lease_s=1.0)
    lease = a.leases[0][0]
    reserve(b, "x", count=0, done=[lease], renew=[lease], lease_s=60.0)
    clock.now += 1.5
    reserve(b, "x", count=0)
    assert b.counters.expired == 1 and b.counters.completed == 0


def test_samples_held_without_a_lease_become_base() -> None:
    b, _ = book()
    grant = reserve(b, "a", count=4, held=16)  # a --sync top-up or an older trainer put 16 there
    assert sum(n for _, n in grant.leases) == 16 and b.base == 16 and b.counters.outside == 16


def test_a_short_lag_is_not_a_loss_but_a_lasting_deficit_is_written_off() -> None:
    b, clock = book(grace_s=2.0)
    grant = reserve(b, "a", count=4)
    done = [i for i, _ in grant.leases]
    reserve(b, "a", count=0, done=done, held=24)  # the last backward is not in the poll yet
    clock.now += 1.0
    assert reserve(b, "a", count=4, held=32).leases == ()  # it arrived: no deficit any more
    reserve(b, "a", count=0, held=24)  # a peer died holding 8 of them
    clock.now += 1.0
    assert reserve(b, "a", count=4, held=24).leases == ()
    clock.now += 1.5
    refill = reserve(b, "a", count=4, held=24)
    assert [n for _, n in refill.leases] == [8] and b.counters.written_off == 8 and refill.reserved == 32


def test_lease_times_are_clamped_and_the_book_is_bounded() -> None:
    b, clock = book(target=10**6)
    reserve(b, "a", count=1, lease_s=0.0)
    clock.now += MIN_LEASE_S
    reserve(b, "a", count=0)
    assert b.counters.expired == 1
    reserve(b, "a", count=1, lease_s=10**9)
    clock.now += MAX_LEASE_S - 1
    reserve(b, "a", count=0)
    assert b.counters.expired == 1
    grant = reserve(b, "a", size=1, count=10**5)
    assert len(b.leases) == 4096 and len(grant.leases) == 4095


def test_a_trainer_that_always_asks_last_still_gets_its_share_of_every_step() -> None:
    # three trainers whose windows each hold the whole step (4 microbatches of 8), asking in the same order at
    # every step, each as soon as its leases of the step before are done: first come, first served, "a" took
    # every step and "c" never got a lease (a loaded machine's full-suite run saw a trainer get 0 in 6 steps)
    b, clock = book(target=32)
    got: dict[str, list[int]] = {t: [] for t in "abc"}
    for step in range(7):
        for trainer in "abc":
            clock.now += 0.01
            grant = reserve(b, trainer, step=step, count=4)
            got[trainer].append(sum(n for _, n in grant.leases))
        assert b.reserved == 32, got
    # the first step goes first come (nobody else had asked yet; the latecomers start level with "a", no
    # catching up); from then on every trainer has a share of every step, and the spare microbatch goes round
    assert [got[t][0] for t in "abc"] == [32, 0, 0]
    assert all(n >= 8 for shares in got.values() for n in shares[1:]), got
    assert [sum(got[t][1:]) for t in "abc"] == [64, 64, 64], got


def test_the_spare_of_a_step_goes_to_the_trainer_granted_least() -> None:
    # five trainers of one microbatch each, four microbatches per step: the one left out of a step is first next
    b, clock = book(target=32)
    left_out = []
    for step in range(6):
        for trainer in "abcde":  # in the same order at every step
            clock.now += 0.01
            if not reserve(b, trainer, step=step, count=1).leases:
                left_out.append(trainer)
        for trainer in "abcde":  # each asks again once its microbatch is done (the step is full: it waits)
            assert reserve(b, trainer, step=step, count=1).leases == ()
    assert len(left_out) == 6 and all(x != y for x, y in zip(left_out, left_out[1:], strict=False)), left_out
    # what each was granted (a latecomer counted from the level of the least granted) is within one microbatch
    credit = [b.askers[t].granted for t in "abcde"]
    assert max(credit) - min(credit) <= 8, (credit, left_out)


def test_a_share_kept_for_a_trainer_that_stopped_asking_lapses_and_a_last_report_withdraws_it() -> None:
    b, clock = book(target=32)
    b.active_s = 2.0
    reserve(b, "dead", count=4)  # takes the step, asks again (full), and at the next step never asks again
    reserve(b, "dead", count=4)
    first = reserve(b, "a", step=1, count=4)
    assert sum(n for _, n in first.leases) == 16 and first.promised == 16 and first.full
    clock.now += 1.0
    assert reserve(b, "a", step=1, count=4).leases == ()  # still kept for it
    clock.now += 1.5
    rest = reserve(b, "a", step=1, count=4)
    assert sum(n for _, n in rest.leases) == 16 and b.reserved == 32 and "dead" not in b.askers
    # at step 2, "a" (which asked for 16 more at its last request) claims its share; a report for no leases
    # withdraws that claim, and the whole step is the others'
    second = reserve(b, "b", step=2, count=4)
    assert sum(n for _, n in second.leases) == 16 and second.promised == 16
    reserve(b, "a", step=2, count=0)
    assert sum(n for _, n in reserve(b, "b", step=2, count=4).leases) == 16 and b.reserved == 32


def test_the_book_remembers_a_bounded_number_of_claims() -> None:
    from swarmd.pipeline.reservations import MAX_ASKERS

    b, clock = book(target=32)
    for i in range(MAX_ASKERS + 10):
        clock.now += 0.001
        reserve(b, f"t{i}", count=0)
    assert len(b.askers) == MAX_ASKERS and "t0" not in b.askers and f"t{MAX_ASKERS + 9}" in b.askers


@pytest.mark.parametrize("size,count", [(0, 4), (8, 0)])
def test_nothing_is_granted_for_nothing_asked(size: int, count: int) -> None:
    b, _ = book()
    assert reserve(b, size=size, count=count).leases == ()


async def test_a_stage_counts_a_microbatch_once_per_step_and_never_past_its_deadline() -> None:
    import time

    import torch

    from swarmd.errors import RequestTimeout
    from swarmd.pipeline.stage.executor import StageExecutor
    from swarmd.pipeline.spec import PRESETS

    spec = PRESETS["tiny"]
    ex = StageExecutor(spec, spec.n_stages - 1)
    try:
        x = torch.randn(2, spec.seq_len, spec.d_model)
        y = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
        first = await ex.backward(x, targets=y, mb=7)
        again = await ex.backward(x, targets=y, mb=7)  # a retry whose first answer was lost
        assert not first.duplicate and again.duplicate and ex.grad_samples == 2 and ex.duplicates == 1
        assert torch.equal(first.grad_inputs, again.grad_inputs)  # answered all the same
        with pytest.raises(RequestTimeout):
            await ex.backward(x, targets=y, mb=8, deadline=time.monotonic() - 1.0)
        assert ex.grad_samples == 2 and ex.late_refused == 1
        await ex.backward(x, targets=y, mb=8, deadline=time.monotonic() + 60.0)  # not counted before: it counts
        assert ex.grad_samples == 4
    finally:
        await ex.close()


def test_reserve_messages_round_trip_and_refuse_bad_input() -> None:
    from swarmd.errors import RequestError
    from swarmd.net.messages import ReserveReply, ReserveRequest
    from swarmd.net.wire import decode_frame

    req = ReserveRequest(stage=0, trainer="t", step=3, size=8, count=2, lease_s=5.0, done=(1, 2), renew=(3,), held=16)
    assert ReserveRequest.from_frame(decode_frame(req.encode())) == req
    reply = ReserveReply(stage=0, step=3, leases=((4, 8), (5, 8)), reserved=32, target=32)
    assert ReserveReply.from_frame(decode_frame(reply.encode())) == reply
    for bad in ({"lease_s": float("nan")}, {"trainer": ""}, {"count": 10**6}, {"done": (-1,)}):
        fields = {**req.__dict__, **bad}
        with pytest.raises(RequestError):
            ReserveRequest.from_frame(decode_frame(ReserveRequest(**fields).encode()))
