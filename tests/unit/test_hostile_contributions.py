"""Bounded influence in a leader's reduction and its consequences (issue #29, items 2 and 4): the
the plain mean of a round of two, the scores of hostile contributions against the leader's own, convictions
at ``STRIKES`` in ``WINDOW``, the reduction that leaves struck contributions out without aborting,
and contributors accepting every robust mean an honest leader computes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.pipeline.averaging.reduction import plain_mean, reduce_contributions
from swarmd.pipeline.averaging.trust.hostile_contributions import (
    AGAINST_COS,
    FAR_FACTOR,
    STRIKES,
    WINDOW,
    HostileWatch,
    PartTerms,
    Score,
    combine_terms,
    part_terms,
    score_owner,
    score_round,
)
from swarmd.pipeline.averaging.trust.robust_aggregation import Contribution
from swarmd.pipeline.averaging.trust.round_checks import Used, check_answer, per_sample_norm, tensor_digest
from swarmd.pipeline.stage.executor import Contribution as Held

DIM = 4096


def honest(seed: int, samples: list[int], *, noise: float = 0.3) -> list[Contribution]:
    """Gradient sums of one true gradient plus per-sample noise (its mean's noise shrinks as 1/sqrt(n))."""
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(DIM, generator=g, dtype=torch.float64)
    out = []
    for i, n in enumerate(samples):
        mean = true + noise / math.sqrt(n) * torch.randn(DIM, generator=g, dtype=torch.float64)
        out.append(Contribution(f"{i:02d}" * 20, (mean * n).to(torch.float32), n))
    return out


def poisoned(c: Contribution, factor: float) -> Contribution:
    return Contribution(c.peer_id, c.grads * factor, c.samples)


def test_a_round_of_two_takes_the_plain_mean_and_leaves_a_far_or_reversed_contribution_out() -> None:
    # a median of two cannot tell the liar: an honest pair's mean is the plain one, bit for bit (sync
    # training stays equal to single-process training), and what bounds a liar is the leader's scoring
    for noise in (3.0, 0.3):  # noise-dominated: further apart than the leader's gradient is long
        a, b = honest(3, [4, 8], noise=noise)
        pair = {c.peer_id: Held(step=0, samples=c.samples, grads=c.grads, mbs=()) for c in (a, b)}
        out = reduce_contributions(pair, {}, leader=a.peer_id, target=12, numel=DIM, watch=HostileWatch())
        assert not out.robust and not out.struck
        assert torch.equal(out.mean, plain_mean(pair, DIM, 12))
    for factor in (-20.0, -1.0):
        lying = dict(pair, **{b.peer_id: Held(step=0, samples=8, grads=b.grads * factor, mbs=())})
        out = reduce_contributions(lying, {}, leader=a.peer_id, target=12, numel=DIM, watch=HostileWatch())
        assert out.struck == (b.peer_id,) and out.total == 12
        assert torch.allclose(out.mean, a.grads / 4)


def test_honest_contributions_score_near_and_along_the_leaders_own() -> None:
    for seed in range(20):
        items = honest(seed, [4, 8, 4, 1, 16], noise=3.0)  # noise-dominated: the hard case
        scores = score_round(items, items[1].peer_id)
        assert set(scores) == {c.peer_id for c in items} - {items[1].peer_id}
        assert all(s.strike() is None for s in scores.values()), scores


def test_the_liars_of_the_table_strike_on_every_round() -> None:
    for seed in range(10):
        items = honest(seed, [8, 4, 4])
        for factor in (-20.0, -1.0):
            liar = poisoned(items[2], factor)
            scores = score_round([items[0], items[1], liar], items[0].peer_id)
            assert scores[liar.peer_id].strike() is not None, (factor, scores)
            assert scores[items[1].peer_id].strike() is None
        assert score_round([items[0], poisoned(items[2], -20.0)], items[0].peer_id)[items[2].peer_id].far > FAR_FACTOR


def test_no_scores_without_the_leaders_own_samples() -> None:
    items = honest(1, [4, 4, 4])
    assert score_round(items[1:], items[0].peer_id) == {}
    assert score_round(items, "someone else") == {}


def test_a_peer_is_convicted_at_strikes_in_its_window_and_starts_afresh() -> None:
    watch = HostileWatch()
    bad, good = Score(far=20.0, cos=-1.0), Score(far=1.0, cos=0.9)
    # single strikes spread out never convict
    for i in range(4 * WINDOW):
        assert watch.observe({"p": bad if i % (WINDOW // 2 + 1) == 0 else good}) == {}
    for _ in range(STRIKES - 1):
        assert watch.observe({"q": bad}) == {}
    convicted = watch.observe({"q": bad, "p": good})
    assert list(convicted) == ["q"] and convicted["q"].startswith(f"{STRIKES} of its last {STRIKES} contributions struck")
    assert watch.strikes_of("q") == 0
    # pointing against the leader's own leaves a contribution out, every time, but never convicts
    against = Score(far=1.5, cos=-0.9)
    assert against.strike() is not None and against.far_strike() is None
    assert all(watch.observe({"r": against}) == {} for _ in range(4 * WINDOW))


def held(items: list[Contribution]) -> dict[str, Held]:
    return {c.peer_id: Held(step=0, samples=c.samples, grads=c.grads) for c in items}


def test_an_honest_round_is_bit_for_bit_the_plain_mean() -> None:
    for seed in range(10):
        items = honest(seed, [4, 8, 4])
        contributions = held(items)
        red = reduce_contributions(contributions, {}, leader=items[0].peer_id, target=16, numel=DIM,
                                   watch=HostileWatch())
        assert red.mean is not None and not red.robust and not red.struck and not red.convicted
        assert torch.equal(red.mean, plain_mean(contributions, DIM, 16))


@pytest.mark.parametrize("factor", [-20.0, -1.0])
def test_a_struck_contribution_counts_its_samples_but_moves_nothing(factor: float) -> None:
    items = honest(5, [8, 4, 4])
    liar = poisoned(items[2], factor)
    red = reduce_contributions(held([items[0], items[1], liar]), {}, leader=items[0].peer_id, target=16,
                               numel=DIM, watch=HostileWatch())
    assert red.mean is not None and red.total == 16 and red.struck == (liar.peer_id,)
    assert sum(u.samples for u in red.used) == 16
    assert torch.equal(red.mean, plain_mean(held(items[:2]), DIM, 12))  # the mean of the honest two


@pytest.mark.parametrize("noise", [0.3, 3.0])
def test_an_honest_part_owner_is_never_struck_by_its_own_score(noise: float) -> None:
    """``score_own`` (an all-reduce part's owner): honest slices, noise-dominated ones too, never strike the
    owner's own against their median, and the part's mean stays bit for bit the plain mean."""
    for seed in range(20):
        for samples in ([4, 8, 4], [4, 8, 4, 1, 16], [1, 1, 1]):
            items = honest(seed, samples, noise=noise)
            for owner in (items[0], items[-1]):
                judged = score_owner(items, owner.peer_id)
                assert judged is not None and judged[0].strike() is None, (seed, samples, judged)
                red = reduce_contributions(held(items), {}, leader=owner.peer_id, target=0, numel=DIM, score=True,
                                           score_own=True)
                assert not red.struck and red.mean is not None
                assert torch.equal(red.mean, plain_mean(held(items), DIM, sum(samples)))


@pytest.mark.parametrize("factor", [-20.0, -1.0])
def test_a_part_owner_whose_own_slice_lies_is_left_out_of_its_own_part(factor: float) -> None:
    """Issue 29: every member of a chunked all-reduce owns a part; scored only against its own slice, a liar's
    lie was its part's reference, the honest slices were struck as against it and its lie was the part's mean.
    Scored against the part's median, its own slice is struck and the honest ones make the mean."""
    for seed in range(10):
        items = honest(seed, [8, 4, 4])
        liar = poisoned(items[2], factor)
        slices = held([items[0], items[1], liar])
        before = reduce_contributions(slices, {}, leader=liar.peer_id, target=16, numel=DIM, score=True)
        assert before.mean is not None and set(before.struck) == {items[0].peer_id, items[1].peer_id}
        red = reduce_contributions(slices, {}, leader=liar.peer_id, target=16, numel=DIM, score=True,
                                   score_own=True)
        assert red.mean is not None and red.total == 16 and red.struck == (liar.peer_id,), (seed, red.struck)
        assert torch.equal(red.mean, plain_mean(held(items[:2]), DIM, 12))  # the mean of the honest two
        # an honest owner with the liar among its members strikes the liar, as before
        red = reduce_contributions(slices, {}, leader=items[0].peer_id, target=16, numel=DIM, score=True,
                                   score_own=True)
        assert red.struck == (liar.peer_id,)
    # two slices: a median of two is either of them, so the owner is judged by nobody but itself (as the
    # leader of a round of two is)
    items = honest(3, [4, 4])
    assert score_owner([items[0], poisoned(items[1], -20.0)], items[1].peer_id) is None


def test_a_contribution_owing_its_opening_is_struck_but_never_all_of_the_mean() -> None:
    """``strike`` (averaging_openings: a sender that did not open its last contribution): left out of the
    mean, its samples counted; never the leader's own, and never every sample of the mean."""
    items = honest(6, [8, 4, 4])
    contributions = held(items)
    red = reduce_contributions(contributions, {}, leader=items[0].peer_id, target=16, numel=DIM,
                               watch=HostileWatch(), strike=frozenset({items[2].peer_id, items[0].peer_id}))
    assert red.mean is not None and red.total == 16 and red.struck == (items[2].peer_id,)
    assert torch.equal(red.mean, plain_mean(held(items[:2]), DIM, 12))
    empty = {items[0].peer_id: Held(step=0, samples=0, grads=None, mbs=()), **held(items[1:2])}
    red = reduce_contributions(empty, {}, leader=items[0].peer_id, target=4, numel=DIM,
                               strike=frozenset({items[1].peer_id}))
    assert red.mean is not None and not red.struck  # the only samples: kept in


def test_a_convicted_peer_is_turned_away_when_the_others_hold_the_target_else_left_out() -> None:
    items = honest(6, [8, 8, 4])
    liar = poisoned(items[2], -20.0)
    watch = HostileWatch()
    for _ in range(STRIKES - 1):
        red = reduce_contributions(held([items[0], items[1], liar]), {}, leader=items[0].peer_id, target=16,
                                   numel=DIM, watch=watch)
        assert not red.convicted and red.total == 20
    red = reduce_contributions(held([items[0], items[1], liar]), {}, leader=items[0].peer_id, target=16,
                               numel=DIM, watch=watch)
    assert list(red.convicted) == [liar.peer_id] and liar.peer_id in red.refused
    assert red.total == 16 and red.refused_samples == 4 and red.mean is not None
    for _ in range(STRIKES):
        red = reduce_contributions(held([items[0], items[1], liar]), {}, leader=items[0].peer_id, target=20,
                                   numel=DIM, watch=watch)
    assert list(red.convicted) == [liar.peer_id] and not red.refused  # the round needs its samples
    assert red.total == 20 and red.struck == (liar.peer_id,) and red.mean is not None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), samples=st.lists(st.integers(1, 16), min_size=2, max_size=6),
       j=st.integers(0, 5), scale=st.sampled_from([-20.0, -1.0, 0.0, 1.0, 30.0]))
def test_every_contributor_accepts_an_honest_leaders_robust_mean(seed: int, samples: list[int], j: int,
                                                                 scale: float) -> None:
    items = honest(seed, samples, noise=2.0)
    j %= len(items)
    if j:  # the leader (item 0) does not poison its own
        items[j] = poisoned(items[j], scale)
    digests = {c.peer_id: tensor_digest(c.grads) for c in items}
    red = reduce_contributions(held(items), digests, leader=items[0].peer_id, target=1, numel=DIM,
                               watch=HostileWatch())
    assert red.mean is not None
    for c in items:
        if c.peer_id in red.refused:
            continue
        own = Used(c.peer_id, c.samples, digests[c.peer_id], per_sample_norm(c.grads, c.samples))
        why = check_answer(own=own, own_grads=c.grads, mean=red.mean, used=red.used, total=red.total,
                           leader=items[0].peer_id, codec="none")
        assert why is None, why


def test_repeated_honest_rounds_never_convict_anyone() -> None:
    """100 honest rounds of 3-5 peers, from signal-dominated to noise-dominated gradients, sample
    counts 1-16 each: one watch across them all convicts nobody (a struck round now and then is the
    price, and it is rare)."""
    watch = HostileWatch()
    g = torch.Generator().manual_seed(7)
    struck = scored = 0
    for step in range(100):
        n = int(torch.randint(3, 6, (1,), generator=g))
        samples = [int(x) for x in torch.randint(1, 17, (n,), generator=g)]
        items = honest(1000 + step, samples, noise=0.1 + 4.0 * step / 100)
        leader = items[int(torch.randint(0, n, (1,), generator=g))].peer_id
        red = reduce_contributions(held(items), {}, leader=leader, target=1, numel=DIM, watch=watch)
        assert not red.convicted, (step, red.convicted)
        struck += len(red.struck)
        scored += len(red.scores)
    assert struck <= scored // 20, (struck, scored)


# ---- the chunked all-reduce: per-part terms, summed by the coordinator ------------------------------


def _split(c: Contribution, bounds: list[tuple[int, int]]) -> list[Contribution]:
    return [Contribution(c.peer_id, c.grads[lo:hi], c.samples) for lo, hi in bounds]


def test_summed_part_terms_are_the_leaders_score_with_the_owners_slices_as_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    honest = torch.randn(300, generator=gen)
    contributions = [Contribution("a", honest * 8 + torch.randn(300, generator=gen), 8),
                     Contribution("b", honest * 4 + torch.randn(300, generator=gen), 4),
                     Contribution("c", honest * -20 * 4, 4)]
    # one part: the leader's own score, exactly
    whole = combine_terms([part_terms(contributions, "a")])
    leader = score_round(contributions, "a")
    assert set(whole) == set(leader) == {"b", "c"}
    for pid in whole:
        assert whole[pid].far == pytest.approx(leader[pid].far, rel=1e-12)
        assert whole[pid].cos == pytest.approx(leader[pid].cos, rel=1e-12)
    # three parts owned by one peer: still the leader's score (the terms add up)
    bounds = [(0, 100), (100, 250), (250, 300)]
    pieces = [_split(c, bounds) for c in contributions]
    parts = [part_terms([p[j] for p in pieces], "a") for j in range(3)]
    summed = combine_terms(parts)
    for pid in summed:
        assert summed[pid].far == pytest.approx(leader[pid].far, rel=1e-9)
        assert summed[pid].cos == pytest.approx(leader[pid].cos, rel=1e-9)
    # each part owned by another member: the liar strikes (far, against), the honest do not
    owned = [part_terms([p[j] for p in pieces], owner) for j, owner in enumerate("abc")]
    scores = combine_terms(owned)
    assert scores["c"].far > FAR_FACTOR and scores["c"].cos < -AGAINST_COS and scores["c"].far_strike()
    assert scores["a"].strike() is None and scores["b"].strike() is None
    # a member's own part is scored by nobody; an owner without samples scores nobody
    assert "a" not in owned[0] and part_terms([Contribution("a", honest, 0), contributions[1]], "a") == {}


@pytest.mark.parametrize("scale", [0.0, 1e-3, 0.5, 3.0, -20.0, 1e3])
def test_a_lying_owner_cannot_make_an_honest_member_far(scale: float) -> None:
    """Whatever slice a lying owner takes for its own part, the honest member's summed ``far`` stays
    within a small constant (the module docstring's bound), far under FAR_FACTOR."""
    gen = torch.Generator().manual_seed(5)
    truth = torch.randn(400, generator=gen)
    honest = [Contribution(pid, truth * 8 + torch.randn(400, generator=gen) * 2, 8) for pid in "abd"]
    liar = Contribution("z", truth * 8 * scale, 8)
    bounds = [(0, 100), (100, 200), (200, 300), (300, 400)]
    pieces = {c.peer_id: _split(c, bounds) for c in [*honest, liar]}
    owners = ["a", "b", "d", "z"]
    terms = []
    for j, owner in enumerate(owners):
        slices = [pieces[pid][j] for pid in pieces]
        if owner == "z":  # its "own" slice is whatever it likes; the members' slices are as sent
            slices = [s for s in slices if s.peer_id != "z"] + [Contribution("z", liar.grads[300:400], 8)]
        terms.append(part_terms(slices, owner))
    scores = combine_terms(terms)
    for pid in "abd":
        assert scores[pid].far < 3.0, (pid, scores[pid])


def test_part_terms_from_the_wire_refuse_bad_values() -> None:
    ok = PartTerms(1.0, 2.0, -0.5, 3.0)
    assert PartTerms.from_wire(ok.to_wire()) == ok
    for bad in ([1.0, 2.0, 3.0], [1.0, -2.0, 0.0, 1.0], [float("nan"), 1.0, 1.0, 1.0], "x", [1, 2, 3, 4]):
        with pytest.raises(ValueError):
            PartTerms.from_wire(bad)
