"""grad_codec "auto": the averaging codec chosen per link from its measured throughput (issue 28 item 4)."""

from __future__ import annotations

import pytest
import torch

from swarmd.net.wire import encode_frame
from swarmd.pipeline.averaging.error_feedback import needs_feedback
from swarmd.pipeline.averaging.codec_choice import (
    AUTO,
    CPU_S_PER_VALUE,
    LADDER,
    LOSSLESS_SLACK,
    answer_codec,
    choose,
    resolve,
    round_s,
    wire_bytes,
)
from swarmd.pipeline.averaging.trust.round_checks import ANSWER_SLACK
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
        (1_000, "none"),  # 1 Gbit/s: 2 x 54 ms of wire, against 8bit's 2 x 13 ms and 84 ms of CPU
        (500, "8bit"),  # wan50's cap
        (100, "8bit"),  # wan100: 8bit 2 x 134 ms + 84 ms; 5level 2 x 43 ms + 587 ms of CPU
        (32, "8bit"),  # within LOSSLESS_SLACK of 5level
        (10, "5level"),  # a slow uplink: the wire dominates
        (1, "5level"),
    ],
)
def test_a_small_stage_gets_the_codec_that_ends_its_round_soonest(mbit_s: float, codec: str) -> None:
    assert choose(SMALL_STAGE, mbit_s * MBIT) == codec
    assert resolve(AUTO, SMALL_STAGE, mbit_s * MBIT) == codec


def test_the_choice_is_the_soonest_round_or_a_less_lossy_one_close_to_it() -> None:
    names = [c for c, _ in LADDER]
    for mbit_s in (1, 3, 10, 20, 30, 40, 60, 100, 300, 800, 900, 1_000, 1_200, 10_000):
        rate = mbit_s * MBIT
        times = {c: round_s(c, SMALL_STAGE, rate) for c in names}
        got = choose(SMALL_STAGE, rate)
        assert times[got] <= min(times.values()) * (1 + LOSSLESS_SLACK)
        assert all(times[c] > min(times.values()) * (1 + LOSSLESS_SLACK) for c in names[: names.index(got)])
    ranks = [names.index(choose(SMALL_STAGE, m * MBIT)) for m in (1, 10, 30, 100, 300, 1_000, 10_000)]
    assert ranks == sorted(ranks, reverse=True)  # faster links never get a lossier codec
    assert choose(0, 100 * MBIT) == "none" and choose(SMALL_STAGE, 0.0) == "none"
    assert CPU_S_PER_VALUE["none"] == 0.0 < CPU_S_PER_VALUE["8bit"] < CPU_S_PER_VALUE["5level"]


def test_an_unmeasured_link_and_loopback_get_none() -> None:
    assert choose(SMALL_STAGE, None) == "none"  # the first round over a link is its measurement
    assert resolve(AUTO, SMALL_STAGE, 1.0 * MBIT, loopback=True) == "none"


def test_the_ladder_s_sizes_are_what_the_codecs_put_on_the_wire() -> None:
    grads = torch.randn(SMALL_STAGE)
    for codec, _ in LADDER:
        real = len(encode_frame("grads", {}, {"grads": grads}, codec))
        assert real == pytest.approx(wire_bytes(codec, SMALL_STAGE), rel=0.01), codec


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


@pytest.mark.parametrize("codec", ["none", "8bit", "5level"])
def test_a_contribution_tells_the_leader_the_codec_it_travelled_with(codec: str) -> None:
    from swarmd.net.messages import AverageRequest
    from swarmd.net.wire import decode_frame

    grads = torch.randn(1000)
    sent = AverageRequest(stage=0, peer_id="p" * 8, step=3, samples=4, grads=grads, codec=codec)
    got = AverageRequest.from_frame(decode_frame(sent.encode()))
    assert got.codec == codec
    empty = AverageRequest(stage=0, peer_id="p" * 8, step=3, samples=0, grads=None, codec=codec)
    assert AverageRequest.from_frame(decode_frame(empty.encode())).codec == "none"  # no gradients, no codec
