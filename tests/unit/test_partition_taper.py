"""A sync step's batch cut into microbatches: the taper's sizes and when the finer one is used."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.errors import ConfigError
from swarmd.pipeline.partition import RAMP_MIN_CALL_S, taper_depth, tapered_sizes
from swarmd.pipeline.routing import StageRouter
from swarmd.train.data import BatchSampler
from swarmd.train.sync_steps import taper_depth_for
from swarmd.train.trainer import TrainerConfig, split_batch
from tests.support.routing import listed


@pytest.mark.parametrize(("batch", "micro", "sizes"), [
    (32, 8, [2, 4, 6, 8, 6, 4, 2]),  # the bench's step: ramps in quarters, one full microbatch between
    (64, 8, [2, 4, 6, 8, 8, 8, 8, 8, 6, 4, 2]),
    (36, 8, [2, 4, 6, 6, 6, 6, 4, 2]),  # 12 left in the middle: the fewest near-equal microbatches
    (33, 8, [2, 4, 6, 5, 4, 6, 4, 2]),
    (24, 8, [2, 4, 6, 6, 4, 2]),  # nothing left between the ramps
    (16, 8, [2, 4, 4, 4, 2]),  # too small for both full ramps: their smaller steps only
    (16, 4, [1, 2, 3, 4, 3, 2, 1]),
    (40, 16, [4, 8, 16, 8, 4]),
    (8, 8, [8]),
    (5, 8, [5]),
    (3, 1, [1, 1, 1]),
])
def test_the_quarter_ramp(batch: int, micro: int, sizes: list[int]) -> None:
    assert tapered_sizes(batch, micro, 2) == sizes


def test_depths_0_and_1_are_the_plain_and_the_halved_split() -> None:
    assert tapered_sizes(32, 8, 0) == split_batch(32, 8) == [8, 8, 8, 8]
    assert tapered_sizes(32, 8, 1) == split_batch(32, 8, taper=True) == [4, 8, 8, 8, 4]
    assert tapered_sizes(36, 8, 1) == [4, 8, 8, 8, 4, 4]


@settings(max_examples=150, deadline=None)
@given(batch=st.integers(1, 400), micro=st.integers(1, 64), depth=st.integers(0, 2))
def test_every_split_holds_the_whole_batch_in_microbatches_no_larger_than_asked(batch: int, micro: int,
                                                                                depth: int) -> None:
    sizes = tapered_sizes(batch, micro, depth)
    assert sum(sizes) == batch
    assert all(1 <= n <= micro for n in sizes)
    if depth == 2 and micro >= 4 and batch >= 4 * micro:  # room for both ramps: small at both ends
        assert sizes[0] == sizes[-1] <= -(-micro // 4)
        assert sizes[:3] == sorted(sizes[:3]) and sizes[-3:] == sorted(sizes[-3:], reverse=True)


def test_bad_arguments_are_refused() -> None:
    for args in ((0, 8, 1), (8, 0, 1), (8, 8, 3), (8, 8, -1)):
        with pytest.raises(ValueError):
            tapered_sizes(*args)


def test_a_finer_split_draws_the_same_samples() -> None:
    data = torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0))
    a, b = BatchSampler(data, 64, seed=3), BatchSampler(data, 64, seed=3)
    plain = torch.cat([a.sample(n)[0] for n in tapered_sizes(32, 8, 0)])
    ramped = torch.cat([b.sample(n)[0] for n in tapered_sizes(32, 8, 2)])
    assert torch.equal(plain, ramped)


def test_the_finer_taper_is_used_only_where_a_small_microbatch_is_worth_its_request() -> None:
    assert taper_depth(None, 8) == 1  # nothing measured yet
    small = 0.020  # seconds per sample on the slowest stage: ``small`` on one CPU thread
    tiny = 0.001  # a model whose calls are mostly HTTP and framing
    assert taper_depth(small, 8) == 2
    assert taper_depth(tiny, 8) == 1
    assert taper_depth(small, 2) == 1  # no quarter of a microbatch of 2
    assert taper_depth(RAMP_MIN_CALL_S / 2, 8) == 2 and taper_depth(RAMP_MIN_CALL_S / 2.01, 8) == 1


def test_a_sync_trainer_tapers_by_what_it_measured() -> None:
    def routers(stages: int = 2) -> list[StageRouter]:
        out = [StageRouter(k) for k in range(stages)]
        for k, router in enumerate(out):
            router.update_peers(listed({f"peer{k}": f"127.0.0.1:{4000 + k}"}, stage=k))
        return out

    def depth(of: list[StageRouter], taper: bool = True, most: int = 2) -> int:
        return taper_depth_for(of, taper=taper, most=most, microbatch_size=8)

    assert depth(routers()) == 1  # no latency yet: the halved taper
    for most, expected in ((2, 2), (1, 1)):
        measured = routers()
        measured[0].report_success("peer0", 8, 8 * 0.007, "forward")
        measured[0].report_success("peer0", 8, 8 * 0.013, "backward")
        measured[1].report_success("peer1", 8, 8 * 0.021, "backward")
        assert depth(measured, most=most) == expected
    quick = routers()
    quick[1].report_success("peer1", 8, 8 * 0.0008, "backward")
    assert depth(quick) == 1
    assert depth(routers(), taper=False) == 0
    assert depth(routers(1)) == 0  # one stage: no pipeline to fill
    with pytest.raises(ConfigError, match="max_taper_depth"):
        TrainerConfig(api="http://unused", max_taper_depth=3)
