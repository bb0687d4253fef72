"""The all-reduce coordinator's check of the last stage's openings (``swarmd.pipeline.averaging.allreduce.openings``):
an honest opening is consistent, a sign-flipped contribution opened over its true microbatches is not, and an
opening of another round, for another coordinator or not signed by its sender is told apart; one that lists other
microbatches than its contribution named, or hides a lie in its extra term while every sample is a microbatch's,
is bad. The owners' strikes of a member that owes one: every slice of it left out, its samples counted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarmd.dht.identity import Identity
from swarmd.errors import RequestError
from swarmd.net.wire import decode_frame, encode_frame
from swarmd.pipeline.averaging.allreduce.messages import ArAck, ArInputs, ArInputsQuery, ArPart
from swarmd.pipeline.averaging.allreduce.openings import (
    ArAwaited,
    judge,
    open_contribution,
    opening_codec,
    round_digest,
)
from swarmd.pipeline.averaging.allreduce.owner import PartOwner
from swarmd.pipeline.averaging.allreduce.plan import RoundPlan, claim_digest, plan_round
from swarmd.pipeline.averaging.allreduce.recompute import InputsKept
from swarmd.pipeline.averaging.trust.contribution_proofs import Opening, proof_seed, sketch_pieces
from swarmd.pipeline.averaging.trust.recomputation import MicrobatchInputs
from swarmd.pipeline.stage.executor import Contribution

NUMEL = 1000


def _own(seed: int) -> Contribution:
    gen = torch.Generator().manual_seed(seed)
    parts = tuple((mb, torch.randn(NUMEL, generator=gen)) for mb in (11, 12, 13))
    total = torch.stack([t for _, t in parts]).sum(0)
    return Contribution(step=4, samples=12, grads=total, mbs=(11, 12, 13), parts=parts)


def _open(identity: Identity, own: Contribution, sent: torch.Tensor, coordinator: str = "c" * 40) -> bytes:
    return open_contribution(identity, stage=1, step=4, peer_id=identity.peer_id, coordinator=coordinator,
                             digests=("a" * 64, "b" * 64), claim="d" * 64, codec="none", own=own, decoded=sent,
                             numel=NUMEL)


def test_honest_and_flipped_openings_and_the_ones_not_awaited() -> None:
    member, coordinator = Identity.generate(), "c" * 40
    own = _own(0)
    assert own.grads is not None
    awaited = ArAwaited(4, "d" * 64)
    args = {"stage": 1, "peer_id": member.peer_id, "coordinator": coordinator, "awaited": awaited,
            "grad_codec": "none"}
    verdict, why, evidence = judge(_open(member, own, own.grads), **args)
    assert (verdict, why) == ("ok", "") and evidence is not None
    # sent minus its true gradients on two thirds of the vector, opened over its true microbatches
    lie = own.grads.clone()
    lie[: 2 * NUMEL // 3] *= -1
    verdict, why, evidence = judge(_open(member, own, lie), **args)
    assert verdict == "inconsistent" and why.startswith("unaccountable contribution") and evidence is not None
    # the opening of another step, or for another coordinator: the one awaited is still owed
    assert judge(_open(member, own, own.grads), **{**args, "awaited": ArAwaited(5, "d" * 64)})[0] == "other"
    assert judge(_open(member, own, own.grads, coordinator="e" * 40), **args)[0] == "other"
    # someone else's opening in its name, or garbage
    other = Identity.generate()
    assert judge(_open(other, own, own.grads), **args)[0] == "bad"
    assert judge(b"\x00garbage", **args)[0] == "bad"
    # the seed hashes the commit's digests: another commit, another sketch (the member cannot know it before)
    a = _open(member, own, own.grads)
    b = open_contribution(member, stage=1, step=4, peer_id=member.peer_id, coordinator=coordinator,
                          digests=("f" * 64, "b" * 64), claim="d" * 64, codec="none", own=own, decoded=own.grads,
                          numel=NUMEL)
    assert a != b


def test_an_openings_codec_is_the_loosest_of_its_parts() -> None:
    assert opening_codec(["none", "none"]) == "none"
    assert opening_codec(["none", "8bit", "fp16"]) == "8bit"
    assert opening_codec(["5level", "8bit"]) == "5level"


def _judge(raw: bytes, member: Identity, mbs: frozenset[int] | None, unexplained: int | None) -> tuple[str, str]:
    verdict, why, _ = judge(raw, stage=1, peer_id=member.peer_id, coordinator="c" * 40, grad_codec="none",
                            awaited=ArAwaited(4, "d" * 64, mbs, unexplained))
    return verdict, why


def test_an_opening_lists_the_microbatches_its_contribution_named() -> None:
    member, own = Identity.generate(), _own(1)
    assert own.grads is not None
    named = frozenset({11, 12, 13})
    assert _judge(_open(member, own, own.grads), member, named, 0) == ("ok", "")
    # one microbatch opened as a part no microbatch explains: consistent, but not what it named
    moved = dataclasses.replace(own, parts=((None, own.parts[0][1]), *own.parts[1:]))
    verdict, why = _judge(_open(member, moved, own.grads), member, named, 0)
    assert verdict == "bad" and "not those its contribution named" in why
    # not checked when nothing is known of what it named (delayed updates)
    assert _judge(_open(member, moved, own.grads), member, None, None)[0] == "ok"


@pytest.mark.parametrize("unexplained", [0, 3, None])
def test_a_lie_in_the_extra_term_is_bad_when_every_sample_is_a_microbatchs(unexplained: int | None) -> None:
    """The contribution flipped, opened consistently as its true microbatches plus an extra of ``-2 t``: bad
    when the member says every sample is a microbatch's; with samples handed in (or unsaid) not bounded."""
    member, own = Identity.generate(), _own(2)
    assert own.grads is not None
    lie = dataclasses.replace(own, grads=-own.grads, parts=(*own.parts, (None, -2 * own.grads)))
    verdict, why = _judge(_open(member, lie, -own.grads), member, frozenset({11, 12, 13}), unexplained)
    if unexplained == 0:
        assert verdict == "bad" and why.startswith("bad opening: what no microbatch of its explains"), why
    else:
        assert verdict == "ok", why


def test_owners_leave_a_struck_members_slices_out_and_count_its_samples() -> None:
    members = {"a" * 40: "127.0.0.1:1", "b" * 40: "127.0.0.1:2", "c" * 40: "127.0.0.1:3"}
    plan = plan_round(stage=1, step=4, coordinator="a" * 40, members=members, numel=6, nonce="n", timeout_s=5.0,
                      struck=["b" * 40, "a" * 40, "z" * 40])
    assert plan.struck == ("b" * 40,)  # members only, never the coordinator
    assert RoundPlan.from_wire(plan.to_wire(), numel=6) == plan
    with pytest.raises(ValueError, match="struck"):
        RoundPlan.from_wire({**plan.to_wire(), "struck": ["a" * 40]}, numel=6)
    for part, owner in enumerate(plan.owners):  # the struck member's own part too
        own = PartOwner(plan, part, owner, "none")
        lo, hi = plan.bounds[part]
        for k, pid in enumerate(sorted(members)):
            own.add(pid, 2, torch.full((hi - lo,), float(k + 1)))
        ready = own._reduce()
        assert dict(ready.samples) == dict.fromkeys(members, 2)  # every member's samples counted
        # the mean of the others' slices, over their samples (as the leader's mean of unstruck contributions)
        assert own.mean is not None and torch.allclose(own.mean, torch.full((hi - lo,), (1.0 + 3.0) / 4))


def test_an_opening_signs_the_inputs_its_member_committed() -> None:
    """(``allreduce.recompute``) A member commits its microbatches' inputs' digests with part 0; its opening must
    sign exactly those, the parameters they ran at and the commit's digest its seed hashes, or it is bad. Without
    a commitment (a member that named microbatches and committed none) it is ``uncommitted``: no draw could check
    it, so its next contribution is struck."""
    member, own = Identity.generate(), _own(3)
    assert own.grads is not None
    ins = tuple((mb, f"{mb:064x}") for mb in (11, 12, 13))
    digests = ("a" * 64, "b" * 64)
    lead = round_digest(digests)

    def opened(ins_signed: tuple[tuple[int, str], ...], at: tuple[str, str] | None = ("9" * 64, "fp32")) -> bytes:
        return open_contribution(member, stage=1, step=4, peer_id=member.peer_id, coordinator="c" * 40,
                                 digests=digests, claim="d" * 64, codec="none", own=own, decoded=own.grads,
                                 numel=NUMEL, ins=ins_signed, at=at)

    def verdict(raw: bytes, committed: tuple[tuple[int, str], ...] | None, lead_: str = lead) -> tuple[str, str]:
        v, why, _ = judge(raw, stage=1, peer_id=member.peer_id, coordinator="c" * 40, grad_codec="none",
                          awaited=ArAwaited(4, "d" * 64, frozenset({11, 12, 13}), 0, ins=committed, lead=lead_))
        return v, why

    honest = opened(ins)
    assert verdict(honest, ins) == ("ok", "")
    opening = Opening.decode(honest)
    assert opening.ins == tuple(d for _, d in ins) and opening.at == ("9" * 64, "fp32") and opening.lead == lead
    # signs other inputs than it committed (picked after the commit fixed the projection)
    swapped = ((11, "e" * 64), *ins[1:])
    v, why = verdict(opened(swapped), ins)
    assert v == "bad" and "does not sign the inputs it committed" in why
    # signs no inputs at all, or for another commit's seed
    assert verdict(opened(()), ins)[0] == "bad"
    assert verdict(honest, ins, lead_="f" * 64)[0] == "bad"
    # committed none of them, or some only: sound, but its next contribution is struck (``uncommitted``)
    v, why = verdict(opened(()), ())
    assert v == "uncommitted" and "without committing their inputs" in why
    assert verdict(opened(()), ins[:2])[0] == "uncommitted"
    # not checked where no recomputation is (delayed updates: ``None``)
    assert verdict(opened(()), None) == ("ok", "")


def test_the_inputs_wire_messages_round_trip_and_refuse_bad_input() -> None:
    x, y = torch.randn(2, 3, 4), torch.randint(0, 50, (2, 3))
    got = ArInputs.from_frame(decode_frame(ArInputs("r1", 2**64 - 5, x, y).encode()))
    assert (got.round_id, got.mb) == ("r1", 2**64 - 5) and torch.equal(got.inputs, x) and torch.equal(got.targets, y)
    q = ArInputsQuery.from_frame(decode_frame(ArInputsQuery(1, "r1", 2**64 - 1).encode()))
    assert q == ArInputsQuery(1, "r1", 2**64 - 1)
    for meta in ({"stage": 1, "round_id": "r1", "mb": -1}, {"stage": 1, "round_id": "r1", "mb": "7"},
                 {"stage": 1, "round_id": "r1"}):
        with pytest.raises(RequestError):
            ArInputsQuery.from_frame(decode_frame(encode_frame(ArInputsQuery.KIND, meta, {})))
    with pytest.raises(RequestError):  # no inputs at all
        ArInputs.from_frame(decode_frame(encode_frame(ArInputs.KIND, {"round_id": "r1"}, {})))
    # part 0's committed digests: read back, and refused when malformed
    part = ArPart(1, "r1", 0, "p" * 40, 2, torch.zeros(4), "0" * 64, ins=((3, "a" * 64), (2**64 - 1, "b" * 64)))
    assert ArPart.from_frame(decode_frame(part.encode()), 4).ins == part.ins
    for bad in ([[3, "a" * 63]], [[3, "A" * 64]], [[-1, "a" * 64]], [[3, "a" * 64], [3, "b" * 64]], "x", [[3]]):
        frame = decode_frame(part.encode())
        with pytest.raises(RequestError):
            ArPart.from_frame(dataclasses.replace(frame, meta={**frame.meta, "ins": bad}), 4)


def test_a_member_answers_the_inputs_of_the_rounds_it_kept_only() -> None:
    kept = InputsKept(keep=2)
    x, y = torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.int64)
    for k in range(3):
        kept.keep_round(f"r{k}", [MicrobatchInputs(7, x + k, y)])
    assert isinstance(kept.answer(ArInputsQuery(1, "r0", 7)), ArAck)  # forgotten: only the last two are kept
    got = kept.answer(ArInputsQuery(1, "r2", 7))
    assert isinstance(got, ArInputs) and torch.equal(got.inputs, x + 2)
    assert isinstance(kept.answer(ArInputsQuery(1, "r2", 8)), ArAck)  # not one of its microbatches


def test_an_opening_sketches_each_part_sent_and_the_coordinators_own_part_is_checked() -> None:
    """(``allreduce.sent_parts``) A member that sent its owners a flipped contribution but opens (consistently)
    its true one is caught on the part the coordinator owns: its opening's sketch of that part is not the slice
    the coordinator received. An opening without the per-part sketches is bad."""
    member, own = Identity.generate(), _own(4)
    assert own.grads is not None
    bounds = ((0, 400), (400, 700), (700, NUMEL))
    digests = ("a" * 64, "b" * 64, "c" * 64)
    lead, coordinator, claim = round_digest(digests), "c" * 40, claim_digest(digests)
    seed = proof_seed(1, 4, coordinator, lead, claim)

    def opened(with_bounds: tuple[tuple[int, int], ...] = bounds, parts: tuple[str, ...] = digests) -> bytes:
        return open_contribution(member, stage=1, step=4, peer_id=member.peer_id, coordinator=coordinator,
                                 digests=digests, claim=claim, codec="none", own=own, decoded=own.grads,
                                 numel=NUMEL, bounds=with_bounds, part_digests=parts if with_bounds else ())

    def verdict(raw: bytes, received: torch.Tensor) -> tuple[str, str]:
        row = sketch_pieces([(0, received[:400])], seed, NUMEL)[0]
        awaited = ArAwaited(4, claim, bounds=bounds, own_part=0, own_sketch=tuple(float(x) for x in row.tolist()))
        v, why, _ = judge(raw, stage=1, peer_id=member.peer_id, coordinator=coordinator, awaited=awaited,
                          grad_codec="none")
        return v, why

    assert verdict(opened(), own.grads) == ("ok", "")
    v, why = verdict(opened(), -own.grads)  # it sent the flip, and opened the truth
    assert v == "misstated" and "sketches part 0" in why, why
    v, why = verdict(opened(()), own.grads)
    assert v == "bad" and "does not sketch each part it sent" in why
    # ranges other than the round's, or parts' digests that do not hash to its claim: the stage-mates could not
    # check a conviction on them (``sent_parts.check_shown_part``), so the coordinator refuses them
    v, why = verdict(opened(((0, 400), (400, 800), (800, NUMEL))), own.grads)
    assert v == "bad" and "the round's ranges" in why, why
    v, why = verdict(opened(parts=("a" * 64, "b" * 64, "e" * 64)), own.grads)
    assert v == "bad" and "the round's ranges" in why, why
