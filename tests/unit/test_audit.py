"""The audit of a part owner (``swarmd.pipeline.averaging.allreduce.audit``), pure: the draw, the evidence on the
wire, its signatures and digests, and the recomputation, on a part reduced by the owner's own code
(``owner.PartOwner``) from slices signed by real ed25519 identities."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from swarmd.dht.identity import Identity
from swarmd.errors import RequestError
from swarmd.net.wire import decode_frame, encode_frame
from swarmd.pipeline.averaging.allreduce.audit import (
    AUDIT_ROUNDS,
    AUDIT_TOLERANCE,
    AuditVerdict,
    PartEvidence,
    draw,
    evidence_of,
    slices_per_piece,
)
from swarmd.pipeline.averaging.allreduce.messages import ArPart
from swarmd.pipeline.averaging.allreduce.owner import PartOwner
from swarmd.pipeline.averaging.allreduce.plan import RoundPlan, part_message
from swarmd.pipeline.averaging.trust.round_checks import tensor_digest

STAGE, SIZE = 1, 512


def _owner(codec: str = "none", *, scale: dict[int, float] | None = None, struck: tuple[int, ...] = (),
           seed: int = 0) -> tuple[PartOwner, list[Identity]]:
    """Part 1 of a round of three members, reduced by its owner (member 1) from slices of one true gradient
    plus noise, each sent as its member's signed ``ar_part`` frame in ``codec`` (the owner's own: kept in
    ``none``, as a member keeps its own part); ``scale``: a member's slice times a factor (a liar among them)."""
    ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
    members = tuple((i.peer_id, f"127.0.0.1:{9000 + k}") for k, i in enumerate(ids))
    plan = RoundPlan("7-abc-def", STAGE, 7, ids[0].peer_id, members, tuple(i.peer_id for i in ids),
                     ((0, SIZE), (SIZE, 2 * SIZE), (2 * SIZE, 3 * SIZE)), 10.0,
                     struck=tuple(ids[k].peer_id for k in struck))
    owner_id = ids[1]
    owner = PartOwner(plan, 1, owner_id.peer_id, codec)
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(SIZE, generator=g)
    for k, ident in enumerate(ids):
        samples = 4 * (k + 1)
        grads = (true + 0.3 * torch.randn(SIZE, generator=g)) * samples * (scale or {}).get(k, 1.0)
        sent_codec = "none" if ident is owner_id else codec
        decoded = decode_frame(encode_frame("x", {}, {"grads": grads}, sent_codec)).tensors["grads"]
        digest = tensor_digest(decoded)
        sig = ident.sign(part_message(STAGE, plan.round_id, 1, samples, digest, ident.peer_id, owner_id.peer_id))
        raw = ArPart(STAGE, plan.round_id, 1, ident.peer_id, samples, grads, digest, sent_codec,
                     ident.public_key_bytes, sig).encode()
        part = ArPart.from_frame(decode_frame(raw), SIZE)  # as the owner reads it
        assert torch.equal(part.grads, decoded)
        assert owner.add(ident.peer_id, samples, part.grads, digest, sent_codec, frame=raw) is None
    ready = owner._reduce()
    owner.ready = ready
    owner.ready_signed = (owner_id.public_key_bytes, owner_id.sign(ready.message(STAGE)))
    return owner, ids


def _evidence(owner: PartOwner) -> PartEvidence:
    evidence = evidence_of(owner, STAGE)
    assert isinstance(evidence, PartEvidence), evidence
    # through the wire, as an auditor gets it
    return PartEvidence.decode(decode_frame(evidence.encode()))


def _check(evidence: PartEvidence) -> AuditVerdict:
    verdict = evidence.check()
    assert isinstance(verdict, AuditVerdict), verdict
    return verdict


@pytest.mark.parametrize("codec", ["none", "8bit", "fp16"])
def test_an_honest_owners_part_recomputes_to_its_own_mean(codec: str) -> None:
    for seed in range(3):
        for scale, struck in (({}, ()), ({2: -20.0}, ()), ({}, (2,))):  # plain; a liar struck; the plan's struck
            verdict = _check(_evidence(_owner(codec, scale=scale, struck=struck, seed=seed)[0]))
            assert verdict.why is None and verdict.distance == 0.0, (codec, scale, struck, verdict)


@pytest.mark.parametrize("factor", [-1.0, -20.0, 1.5, 0.0])
def test_a_mean_off_the_rule_is_convicted_by_the_owners_own_signed_report(factor: float) -> None:
    """The owner's mean times ``factor``, its ready report signed over the lie (as a liar signs it): its
    signature and its members' hold, so anyone shown the evidence recomputes the part and convicts it."""
    owner, ids = _owner()
    honest = owner._rule
    owner._rule = lambda parts: (honest(parts)[0] * factor, honest(parts)[1])  # type: ignore[method-assign]
    owner.ready = owner._reduce()
    owner.ready_signed = (ids[1].public_key_bytes, ids[1].sign(owner.ready.message(STAGE)))
    verdict = _check(_evidence(owner))
    assert verdict.why is not None and verdict.distance > AUDIT_TOLERANCE
    expected = abs(1 - factor) / max(1.0, abs(factor))  # relative to the larger of the two means
    assert math.isclose(verdict.distance, expected, rel_tol=1e-3), (verdict.distance, expected)


def test_evidence_that_does_not_hold_up_convicts_nobody() -> None:
    owner, ids = _owner("8bit")
    good = _evidence(owner)

    def changed(**kw: object) -> PartEvidence:
        return dataclasses.replace(good, **kw)  # type: ignore[arg-type]

    # a slice the owner changed (its member's signature is over the one it sent)
    frame = decode_frame(good.part_frames[0])
    forged = encode_frame(frame.kind, frame.meta, {"grads": frame.tensors["grads"] * 2}, "none")
    assert "is not signed by its member" in str(changed(part_frames=(forged, *good.part_frames[1:])).check())
    # a slice left out, or one twice
    assert changed(part_frames=good.part_frames[1:]).check() == "the slices are not the members the owner reduced"
    twice = (good.part_frames[0], *good.part_frames[:2])
    assert changed(part_frames=twice).check() == "the slices are not the members the owner reduced"
    # another mean than the signed report names
    mean = decode_frame(good.mean_frame)
    other = encode_frame(mean.kind, mean.meta, {"grads": -mean.tensors["grads"]}, "none")
    assert changed(mean_frame=other).check() == "the mean is not the one the owner's signed report names"
    # signed by someone else than the owner (an auditor framing it cannot sign for it)
    assert changed(ready_key=ids[0].public_key_bytes, ready_sig=ids[0].sign(good.ready.message(STAGE))).check() \
        == "the ready report is not signed by the part's owner"
    # another stage than the one signed; frames that do not read
    assert isinstance(changed(stage=good.stage + 1).check(), str)
    assert "does not read" in str(changed(mean_frame=b"garbage").check())
    assert "does not read" in str(changed(part_frames=(b"\x00" * 40, *good.part_frames[1:])).check())


def test_malformed_evidence_is_refused_before_anything_is_checked() -> None:
    good = _evidence(_owner()[0])
    frame = decode_frame(good.encode())
    for meta_change in ({"codec": "gzip"}, {"ready": [1, 2]}, {"lengths": [1, 2]}, {"lengths": [0, 0]},
                        {"ready_pk": b"short"}, {"lengths": "all"}, {"stage": -1}, {"piece": [3, 2]},
                        {"piece": [1, 3]}, {"piece": "all"}):
        bad = encode_frame(frame.kind, {**frame.meta, **meta_change}, frame.tensors)
        with pytest.raises(RequestError):
            PartEvidence.decode(decode_frame(bad))
    for tensors in ({}, {"frames": frame.tensors["frames"].to(torch.int32)}, {"frames": frame.tensors["frames"][:5]}):
        with pytest.raises(RequestError):
            PartEvidence.decode(decode_frame(encode_frame(frame.kind, frame.meta, tensors)))
    with pytest.raises(RequestError):
        PartEvidence.decode(decode_frame(encode_frame("ar_ack", {"ok": False}, {})))


@pytest.mark.parametrize("slices", [1, 3, 8, 9, 20])
def test_the_evidence_travels_in_pieces_of_a_few_slices_and_is_put_together_again(slices: int) -> None:
    """An auditor fetches the evidence a piece a round (``AUDIT_ROUNDS`` pieces at most, the mean with the
    first): the pieces, through the wire and put together, are the evidence; out of order, short, or of
    another part they are refused."""
    owner, _ = _owner("8bit")
    whole = _evidence(owner)
    frames = (whole.part_frames * slices)[:slices]  # (a stand-in for a part of `slices` members: sizes only)
    evidence = dataclasses.replace(whole, part_frames=frames)
    pieces, start = [], 0
    while (piece := evidence.piece(start)) is not None:
        got = PartEvidence.decode(decode_frame(piece.encode()))
        assert got.piece_of == (start, slices) and bool(got.mean_frame) == (start == 0)
        pieces.append(got)
        start += len(got.part_frames)
    assert start == slices and len(pieces) <= AUDIT_ROUNDS and len(pieces[0].part_frames) == slices_per_piece(slices)
    assert PartEvidence.assemble(pieces) == evidence
    assert "a piece" in str(pieces[0].check())  # a piece alone judges nothing
    if len(pieces) > 1:
        assert isinstance(PartEvidence.assemble(pieces[::-1]), str)
        assert isinstance(PartEvidence.assemble(pieces[:-1]), str)
        other = dataclasses.replace(pieces[1], codec="none" if pieces[1].codec != "none" else "8bit")
        assert isinstance(PartEvidence.assemble([pieces[0], other, *pieces[2:]]), str)
    assert PartEvidence.assemble([]) == "no pieces" and PartEvidence.assemble([evidence]) == "no pieces"
    # the owner's three slices, a piece each, put together: its mean holds up
    parts = [PartEvidence.decode(decode_frame(p.encode())) for k in range(3) if (p := whole.piece(k)) is not None]
    together = PartEvidence.assemble(parts)
    assert isinstance(together, PartEvidence) and _check(together).why is None


def test_the_draw_is_the_commits_never_the_owner_and_spread_evenly() -> None:
    owners = ("a", "b", "c", "d")
    seen: Counter[tuple[int, str]] = Counter()
    for k in range(4000):
        drawn = draw(f"commit {k}".encode(), bytes(64), owners, owners, left_out=("d",) if k % 2 else ())
        assert drawn is not None
        part, auditor = drawn
        assert auditor != owners[part] and (auditor != "d" or k % 2 == 0)
        seen[drawn] += 1
        assert draw(f"commit {k}".encode(), bytes(64), owners, owners) == draw(f"commit {k}".encode(), bytes(64),
                                                                                owners, owners)
    parts = Counter(p for p, _ in seen.elements())
    assert all(800 < parts[j] < 1200 for j in range(4)), parts  # each part about a quarter of the commits
    audited = sum(draw(f"commit {k}".encode(), None, owners, owners, share=0.25) is not None for k in range(4000))
    assert 800 < audited < 1200  # a quarter of the commits
    assert draw(b"x", None, ("a",), ("a",)) is None  # a round of one: nobody but its owner
    assert draw(b"x", None, (), ("a",)) is None
