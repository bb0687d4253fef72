"""The all-reduce coordinator's check of the last stage's openings (``swarmd.pipeline.averaging.allreduce.openings``):
an honest opening is consistent, a sign-flipped contribution opened over its true microbatches is not, and an
opening of another round, for another coordinator or not signed by its sender is told apart."""

from __future__ import annotations

import torch

from swarmd.dht.identity import Identity
from swarmd.pipeline.averaging.allreduce.openings import judge, open_contribution, opening_codec
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
    args = {"stage": 1, "peer_id": member.peer_id, "coordinator": coordinator, "step": 4, "claim": "d" * 64}
    verdict, why, evidence = judge(_open(member, own, own.grads), **args)
    assert (verdict, why) == ("ok", "") and evidence is not None
    # sent minus its true gradients on two thirds of the vector, opened over its true microbatches
    lie = own.grads.clone()
    lie[: 2 * NUMEL // 3] *= -1
    verdict, why, evidence = judge(_open(member, own, lie), **args)
    assert verdict == "inconsistent" and why.startswith("unaccountable contribution") and evidence is not None
    # the opening of another step, or for another coordinator: the one awaited is still owed
    assert judge(_open(member, own, own.grads), **{**args, "step": 5})[0] == "other"
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
