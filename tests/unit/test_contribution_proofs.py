"""contribution_proofs: the sketch's linearity, the seed, the opening's wire form and its checks."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from swarmd.dht.identity import Identity
from swarmd.errors import RequestError
from swarmd.pipeline.averaging.trust.accusations import Claim, Evidence, decode_evidence
from swarmd.net.wire import decode_frame, encode_frame
from swarmd.pipeline.averaging.trust.contribution_proofs import (
    CHUNK,
    CODEC_TOLERANCE,
    K,
    LOSSY_TOLERANCE,
    TOLERANCE,
    Opening,
    OpeningEvidence,
    gap,
    inconsistency,
    parts_digest,
    proof_seed,
    sign_opening,
    sketch,
    sketch_pieces,
)

NUMEL = CHUNK + 1000  # two chunks: the indices of the second continue the first's stream
LEADER = Identity.generate().peer_id


def _grads(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) * (1 + i) for i in range(n)]


def _accumulated(parts: list[torch.Tensor]) -> torch.Tensor:
    """The float32 sum as the gradient accumulator makes it (fresh + held, in order)."""
    total = parts[0].clone()
    for p in parts[1:]:
        total = p.clone().add_(total)
    return total


def _opening(identity: Identity, parts: list[torch.Tensor], sent: torch.Tensor, *, extra: torch.Tensor | None = None,
             codec: str = "none", seed: int = 7) -> Opening:
    rows = sketch([*parts, extra, sent], seed, NUMEL)
    return Opening.signed(identity, stage=1, step=3, peer_id=identity.peer_id, leader=LEADER, digest="cd" * 32,
                          codec=codec, mbs=list(range(len(parts))), parts=rows[:len(parts)], extra=rows[-2],
                          sent=rows[-1])


def test_the_sketch_is_linear_deterministic_and_seeded() -> None:
    a, b = _grads(2)
    rows = sketch([a, b, a + b, None], 5, NUMEL)
    assert rows.shape == (4, K) and rows.dtype == torch.float64
    # a + b rounds to float32, and the buckets sum in float32 within a chunk: agreement to ~1e-5, far
    # under the checks' tolerance
    assert float((rows[0] + rows[1] - rows[2]).norm() / rows[2].norm()) < TOLERANCE / 20
    assert torch.equal(rows[3], torch.zeros(K, dtype=torch.float64))
    assert torch.equal(sketch([a], 5, NUMEL)[0], rows[0])  # the same seed, the same sketch
    assert not torch.allclose(sketch([a], 6, NUMEL)[0], rows[0])
    assert torch.allclose(sketch([-a], 5, NUMEL)[0], -rows[0])


def test_the_seed_depends_on_every_input() -> None:
    base = (1, 3, "ab" * 32, "01" * 32, "cd" * 32)
    seeds = {proof_seed(*base)}
    for i in range(5):
        changed = list(base)
        changed[i] = changed[i] + 1 if isinstance(changed[i], int) else "ef" * 32
        seeds.add(proof_seed(*changed))  # type: ignore[arg-type]
    assert len(seeds) == 6
    assert all(0 <= s < 2**63 for s in seeds)


def test_an_honest_opening_is_consistent_and_a_flipped_one_is_caught() -> None:
    me = Identity.generate()
    parts = _grads(3)
    c = _accumulated(parts)
    honest = _opening(me, parts, c)
    assert gap(honest.evidence.total, honest.evidence.extra, honest.evidence.sent) < 1e-5  # float32 sums and buckets: ~1e-6
    assert inconsistency(honest.evidence) is None
    assert honest.parts_gap() < 1e-9
    flipped = _opening(me, parts, -c)
    g = gap(flipped.evidence.total, flipped.evidence.extra, flipped.evidence.sent)
    assert g == pytest.approx(1.0, abs=1e-6)
    why = inconsistency(flipped.evidence)
    assert why is not None and "unaccountable" in why
    # the residual or handed-in gradients are explained by ``extra``; leaving them out is a lie too
    residual = torch.randn(NUMEL, generator=torch.Generator().manual_seed(9)) * 0.01
    assert inconsistency(_opening(me, parts, c + residual, extra=residual).evidence) is None
    assert inconsistency(_opening(me, parts, c + 5 * parts[0]).evidence) is not None


@pytest.mark.parametrize("codec", ["fp16", "8bit", "4bit", "5level"])
def test_each_codecs_honest_gap_is_well_under_its_tolerance_and_a_flip_above(codec: str) -> None:
    """What a lossy codec does to ``s`` (the leader decodes it), on heavy-tailed gradients: the measured gaps
    of CODEC_TOLERANCE's comment, at least 2x under the tolerance; a flipped contribution's near 1.0."""
    gen = torch.Generator().manual_seed(1)
    n = 66_496  # the liars' fixture's last stage
    worst = 0.0
    for seed in range(3):
        c = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))
        for sent, honest in ((c, True), (-c, False)):
            decoded = decode_frame(encode_frame("grads", {}, {"grads": sent}, codec)).tensors["grads"]
            rows = sketch([c, decoded], seed, n)
            g = gap(rows[0].tolist(), [0.0] * K, rows[1].tolist())
            if honest:
                worst = max(worst, g)
            else:
                assert g > 0.9 > CODEC_TOLERANCE[codec]
    assert worst * 2 < CODEC_TOLERANCE[codec], worst


def test_a_lossy_codec_widens_the_tolerance_but_not_to_a_sign_flip() -> None:
    me = Identity.generate()
    parts = _grads(2)
    c = _accumulated(parts)
    noisy = c + torch.randn(NUMEL, generator=torch.Generator().manual_seed(3)) * float(c.abs().mean()) * 0.2
    assert inconsistency(_opening(me, parts, noisy).evidence) is not None  # exact codec: a 20% change is caught
    assert inconsistency(_opening(me, parts, noisy, codec="8bit").evidence) is None
    assert inconsistency(_opening(me, parts, -c, codec="8bit").evidence) is not None
    assert TOLERANCE < LOSSY_TOLERANCE < 1.0


def test_the_opening_round_trips_and_its_evidence_is_checkable_by_anyone() -> None:
    me = Identity.generate()
    parts = _grads(2)
    opening = _opening(me, parts, -_accumulated(parts))
    raw = opening.encode()
    assert Opening.decode(raw) == opening
    evidence = opening.evidence
    small = evidence.encode()
    assert len(small) <= 1400  # it fits an averaging report (whatever the number of microbatches)
    back = decode_evidence(small)
    assert isinstance(back, OpeningEvidence) and back == evidence
    back.verify(1, me.peer_id)
    assert inconsistency(back) is not None
    with pytest.raises(RequestError):
        back.verify(0, me.peer_id)  # another stage's
    with pytest.raises(RequestError):
        back.verify(1, Identity.generate().peer_id)  # not the accused's
    forged = dataclasses.replace(evidence, sent=evidence.total)  # a leader making an honest-looking opening bad
    with pytest.raises(RequestError):
        forged.verify(1, me.peer_id)
    # the old kind of evidence still decodes as such
    claims = Evidence(LEADER, me.public_key_bytes, (Claim(1, 4, "cd" * 32, 1.0, b"\x00" * 64),))
    assert decode_evidence(claims.encode()) == claims


def test_malformed_openings_are_refused_with_a_reason() -> None:
    me = Identity.generate()
    parts = _grads(1)
    raw = _opening(me, parts, parts[0]).encode()
    fields = msgpack.unpackb(raw)
    bad = []
    for key, value in (("parts", [[1.0] * (K - 1)]), ("mbs", [-1]), ("total", [float("nan")] * K),
                       ("key", b"x"), ("leader", "zz"), ("step", -1)):
        bad.append(msgpack.packb({**fields, key: value}, use_bin_type=True))
    bad.append(msgpack.packb({**fields, "parts": [[2.0] * K]}, use_bin_type=True))  # not the signed parts
    bad.append(raw + b"\x00")
    bad.append(b"")
    bad.append(b"\xc1")
    for b in bad:
        with pytest.raises(RequestError):
            Opening.decode(b)
    with pytest.raises(RequestError):
        OpeningEvidence.decode(raw)  # the full opening is not evidence (too many fields)


def test_an_opening_signs_what_a_recomputation_needs_and_nothing_of_it_can_be_changed() -> None:
    """``ins``, ``at`` and ``lead`` (recomputation, "Seconded") are covered by the parts' digest, so by the
    signature; an opening without them keeps the encoding and digest it had before they existed."""
    me = Identity.generate()
    parts = _grads(2)
    rows = sketch([*parts, None, _accumulated(parts)], 7, NUMEL)
    kwargs = dict(stage=1, step=3, peer_id=me.peer_id, leader=LEADER, digest="cd" * 32, codec="none", mbs=[5, 6],
                  parts=rows[:2], extra=rows[2], sent=rows[3])
    signed = Opening.signed(me, **kwargs, ins=["a1" * 32, "b2" * 32], at=["e3" * 32, "fp32"], lead="f4" * 32)
    raw = signed.encode()
    back = Opening.decode(raw)
    assert back == signed and back.ins == ("a1" * 32, "b2" * 32) and back.at == ("e3" * 32, "fp32")
    back.evidence.verify(1, me.peer_id)
    assert back.part_of(6) == (back.parts[1], "b2" * 32) and back.part_of(7) is None
    plain = Opening.signed(me, **kwargs)
    assert set(msgpack.unpackb(plain.encode())) == set(msgpack.unpackb(raw)) - {"ins", "at", "lead"}
    assert plain.evidence.parts_digest == parts_digest([5, 6], plain.parts)
    assert plain.part_of(5) is None  # no inputs' digest: nothing a stage-mate could recompute
    fields = msgpack.unpackb(raw)
    for key, value in (("ins", ["a1" * 32, "c3" * 32]), ("at", ["e3" * 32, "bf16"]), ("lead", "00" * 32),
                       ("ins", ["a1" * 32]), ("at", ["e3" * 32]), ("at", ["e3" * 32, "fp64"]), ("lead", 5),
                       ("ins", ["zz"] * 2)):
        with pytest.raises(RequestError):  # each changed: not what the signature covers, or malformed
            Opening.decode(msgpack.packb({**fields, key: value}, use_bin_type=True))
    stripped = {k: v for k, v in fields.items() if k not in ("ins", "at", "lead")}
    with pytest.raises(RequestError):  # dropped: the parts' digest no longer matches
        Opening.decode(msgpack.packb(stripped, use_bin_type=True))


def test_the_pieces_of_a_vector_sketch_to_rows_that_add_up_to_its_sketch() -> None:
    """``sketch_pieces`` (an all-reduce member's parts sent, an owner's slice): the same draw as ``sketch``
    restricted to each range, across the chunk boundary, so the rows add up to the whole sketch and a slice alone
    sketches as it does among the others."""
    (a,) = _grads(1)
    bounds = [(0, 1000), (1000, CHUNK - 5), (CHUNK - 5, CHUNK + 10), (CHUNK + 10, NUMEL)]
    rows = sketch_pieces([(lo, a[lo:hi]) for lo, hi in bounds], 9, NUMEL)
    assert rows.shape == (4, K)
    whole = sketch([a], 9, NUMEL)[0]
    assert float((rows.sum(0) - whole).norm() / whole.norm()) < TOLERANCE / 20
    alone = sketch_pieces([(CHUNK - 5, a[CHUNK - 5 : CHUNK + 10])], 9, NUMEL)[0]
    assert torch.equal(alone, rows[2])  # one owner's sketch of its slice is the member's row for it, bit for bit
    assert not torch.equal(sketch_pieces([(0, a[:1000])], 10, NUMEL)[0], rows[0])  # another seed
    with pytest.raises(ValueError):
        sketch_pieces([(NUMEL - 5, a[:10])], 9, NUMEL)


def test_an_opening_signs_its_parts_sent_and_they_add_up_to_its_sent_sketch() -> None:
    me = Identity.generate()
    parts = _grads(2)
    sent = _accumulated(parts)
    bounds = ((0, 500), (500, CHUNK), (CHUNK, NUMEL))
    opening = sign_opening(me, stage=1, step=3, peer_id=me.peer_id, leader=LEADER, leader_digest="ab" * 32,
                           digest="cd" * 32, codec="none", parts=list(enumerate(parts)), decoded=sent, numel=NUMEL,
                           bounds=bounds, sent_digests=("a1" * 32, "b2" * 32, "c3" * 32))
    back = Opening.decode(opening.encode())
    assert back == opening and len(back.sent_parts) == 3 and back.sent_parts_gap() < TOLERANCE / 20
    assert back.sent_bounds == bounds and back.sent_digests == ("a1" * 32, "b2" * 32, "c3" * 32)
    back.evidence.verify(1, me.peer_id)
    # a changed row is not what the signature covers; a dropped one neither
    fields = msgpack.unpackb(opening.encode())
    for key, value in (("sp", [[0.0] * K] * 3), ("sp", fields["sp"][:2]), ("sp", [[0.0] * (K - 1)] * 3),
                       ("sb", [[0, 400], [400, CHUNK], [CHUNK, NUMEL]]), ("sb", [[0, 500], [500, CHUNK]]),
                       ("sb", [[5, 5], [500, CHUNK], [CHUNK, NUMEL]]), ("sd", ["a1" * 32, "b2" * 32, "c4" * 32]),
                       ("sd", ["a1" * 32, "b2" * 32])):
        with pytest.raises(RequestError):  # changed, or malformed
            Opening.decode(msgpack.packb({**fields, key: value}, use_bin_type=True))
    # a member that sent one thing and signs another part by part: its rows do not add up to its sent sketch
    liar = Opening.signed(me, stage=1, step=3, peer_id=me.peer_id, leader=LEADER, digest="cd" * 32, codec="none",
                          mbs=[], parts=torch.zeros(0, K, dtype=torch.float64), extra=sketch([sent], 7, NUMEL)[0],
                          sent=sketch([sent], 7, NUMEL)[0],
                          sent_parts=sketch_pieces([(lo, -sent[lo:hi]) for lo, hi in bounds], 7, NUMEL),
                          sent_bounds=bounds, sent_digests=("a1" * 32,) * 3)
    assert Opening.decode(liar.encode()).sent_parts_gap() > 0.9
