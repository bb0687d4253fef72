"""swarmd.net.links: per-address throughput from the timings of transfers that already happen."""

from __future__ import annotations

import math

import pytest

from swarmd.net.links import MIN_SAMPLE_BYTES, MIN_SAMPLE_S, NEWEST_WEIGHT, LinkMeter, dials_loopback

MB = 2**20


def test_a_link_is_unknown_until_a_large_enough_body_crossed_it() -> None:
    links = LinkMeter()
    assert links.estimate("10.0.0.1:7000") is None
    assert links.record("10.0.0.1:7000", MIN_SAMPLE_BYTES - 1, 1.0) is None  # fits TCP's first window
    assert links.estimate("10.0.0.1:7000") is None
    est = links.record("10.0.0.1:7000", 4 * MB, 0.5)
    assert est is not None and est.bytes_per_s == pytest.approx(8 * MB) and est.samples == 1
    assert links.estimate("10.0.0.2:7000") is None  # per address


def test_estimates_follow_the_newest_samples() -> None:
    links = LinkMeter()
    links.record("a:1", 10 * MB, 1.0)
    est = links.record("a:1", 2 * MB, 1.0)
    assert est is not None and est.samples == 2
    assert est.bytes_per_s == pytest.approx(NEWEST_WEIGHT * 2 * MB + (1 - NEWEST_WEIGHT) * 10 * MB)
    for _ in range(20):
        links.record("a:1", 2 * MB, 1.0)
    final = links.estimate("a:1")
    assert final is not None and final.bytes_per_s == pytest.approx(2 * MB, rel=1e-4)


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf])
def test_times_that_are_no_time_are_not_samples(seconds: float) -> None:
    links = LinkMeter()
    assert links.record("a:1", 4 * MB, seconds) is None
    assert links.estimate("a:1") is None


def test_a_body_that_arrived_with_its_headers_claims_a_bounded_rate() -> None:
    est = LinkMeter().record("a:1", 4 * MB, 0.0)
    assert est is not None and est.bytes_per_s == pytest.approx(4 * MB / MIN_SAMPLE_S)


def test_the_meter_forgets_the_least_recently_measured_links_first() -> None:
    links = LinkMeter(max_links=2)
    links.record("a:1", MB, 1.0)
    links.record("b:1", MB, 1.0)
    links.record("a:1", MB, 1.0)  # a measured again: b is now the oldest
    links.record("c:1", MB, 1.0)
    assert set(links.snapshot()) == {"a:1", "c:1"}


@pytest.mark.parametrize(
    ("addr", "loopback"),
    [
        ("127.0.0.1:7000", True), ("127.0.0.5:7000", True), ("http://127.0.0.1:80", True), ("[::1]:7000", True),
        ("localhost:7000", True), ("peerid@127.0.0.1:7000", True), ("10.213.7.1:7000", False),
        ("peerid@10.0.0.9:7000", False), ("[2001:db8::1]:7000", False), ("example.org:7000", False), ("", False),
    ],
)
def test_loopback_addresses_are_told_apart(addr: str, loopback: bool) -> None:
    assert dials_loopback(addr) is loopback


def test_a_meter_can_measure_loopback_like_any_link() -> None:
    assert LinkMeter().is_local("127.0.0.1:7000") and not LinkMeter().is_local("10.0.0.1:7000")
    assert not LinkMeter(loopback_is_local=False).is_local("127.0.0.1:7000")
