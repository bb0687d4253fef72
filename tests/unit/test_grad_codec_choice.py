"""grad_codec "auto": the averaging codec chosen per link from its measured throughput (issue 28 item 4)."""

from __future__ import annotations

import pytest
import torch

from swarmd.net.wire import encode_frame
from swarmd.pipeline.error_feedback import needs_feedback
from swarmd.pipeline.grad_codec_choice import AUTO, BUDGET_S, LADDER, answer_codec, choose, resolve, wire_bytes
from swarmd.pipeline.round_checks import ANSWER_SLACK
from swarmd.pipeline.spec import GRAD_CODECS, TrainingSpec

SMALL_STAGE = 1_677_824  # gradient values of a `small` stage (6.7 MB as float32)
MBIT = 1e6 / 8  # bytes a second in one Mbit/s


def test_auto_is_the_default_and_a_founder_can_pin_any_codec() -> None:
    assert TrainingSpec().grad_codec == AUTO and AUTO in GRAD_CODECS
    for codec in GRAD_CODECS:
        if codec != AUTO:
            assert resolve(codec, SMALL_STAGE, 1.0 * MBIT) == codec  # pinned: whatever the link
            assert resolve(codec, SMALL_STAGE, None, loopback=True) == codec


@pytest.mark.parametrize(
    ("mbit_s", "codec"),
    [
        (10_000, "none"),  # a LAN: 6.7 MB in 5 ms
        (1_000, "none"),  # 1 Gbit/s: 54 ms
        (500, "8bit"),  # wan50's cap: uncompressed 107 ms, 8bit 27 ms
        (200, "8bit"),
        (100, "5level"),  # wan100: 8bit would take 134 ms
        (32, "5level"),  # a cold 100 Mbit/s link at 100 ms RTT, as measured (slow start)
        (1, "5level"),  # nothing fits: the most compressed
    ],
)
def test_a_small_stage_gets_the_least_lossy_codec_that_fits_the_budget(mbit_s: float, codec: str) -> None:
    assert choose(SMALL_STAGE, mbit_s * MBIT) == codec
    assert resolve(AUTO, SMALL_STAGE, mbit_s * MBIT) == codec


def test_the_choice_moves_with_the_size_and_the_budget() -> None:
    rate = 100 * MBIT  # 12.5 MB/s
    assert choose(70_000, rate) == "none"  # tiny's 282 kB crosses in 23 ms
    assert choose(SMALL_STAGE, rate, budget_s=1.0) == "none"
    assert choose(SMALL_STAGE, rate, budget_s=0.2) == "8bit"
    assert choose(0, rate) == "none"
    ranks = [[c for c, _ in LADDER].index(choose(SMALL_STAGE, m * MBIT)) for m in (1, 10, 100, 300, 1_000, 10_000)]
    assert ranks == sorted(ranks, reverse=True)  # faster links never get a lossier codec


def test_an_unmeasured_link_and_loopback_get_none() -> None:
    assert choose(SMALL_STAGE, None) == "none"  # the first round over a link is its measurement
    assert resolve(AUTO, SMALL_STAGE, 1.0 * MBIT, loopback=True) == "none"


def test_the_ladder_s_sizes_are_what_the_codecs_put_on_the_wire() -> None:
    grads = torch.randn(SMALL_STAGE)
    for codec, _ in LADDER:
        real = len(encode_frame("grads", {}, {"grads": grads}, codec))
        assert real == pytest.approx(wire_bytes(codec, SMALL_STAGE), rel=0.01), codec
    assert BUDGET_S > 0


def test_the_answer_is_as_compressed_as_the_most_compressed_contribution() -> None:
    assert answer_codec(AUTO, []) == "none"
    assert answer_codec(AUTO, ["none", "none"]) == "none"
    assert answer_codec(AUTO, ["none", "8bit"]) == "8bit"
    assert answer_codec(AUTO, ["5level", "none", "8bit"]) == "5level"
    assert answer_codec(AUTO, ["4bit", "fp16"]) == "none"  # outside the ladder: a sender's claim, not a command
    assert answer_codec("8bit", ["5level"]) == "8bit"  # pinned: the founder's, whatever was sent
    assert answer_codec("none", ["8bit"]) == "none"


def test_auto_carries_error_feedback_and_the_loosest_answer_slack_of_its_ladder() -> None:
    assert needs_feedback(AUTO)
    assert ANSWER_SLACK[AUTO] == max(ANSWER_SLACK[c] for c, _ in LADDER)
