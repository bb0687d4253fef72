"""What a peer measured of its links to the peers it calls: the throughput of transfers that already happen.

A stage's averaging rounds move the largest bodies a peer sends or receives (its gradients to the round's
leader or a part's owner, the mean back), so their timings measure the link between stage-mates for free:
no probe traffic, and a measurement of exactly what matters (TCP with its slow start after an idle second,
the relays in the path, the other traffic sharing the uplink). The data-plane client times every reply body
from its first byte to its last (:class:`swarmd.net.client.DataPlaneClient`) and records it here, keyed
by the address it dialled; ``swarmd.pipeline.averaging.codec_choice`` turns an estimate into a codec.

Only bodies of at least :data:`MIN_SAMPLE_BYTES` count: a smaller one fits in TCP's first window and
arrives in one burst, so its time says nothing about the link's rate. A sample of a cold connection reads
slower than the link is (slow start): the estimate is what a transfer *of about that size* gets, which is
what the codec choice needs. Estimates are exponentially weighted (:data:`NEWEST_WEIGHT`), so a link that
changes is followed within a few rounds.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from swarmd.net.addresses import is_loopback, parse_host_port

__all__ = ["MIN_SAMPLE_BYTES", "NEWEST_WEIGHT", "LinkEstimate", "LinkMeter", "dials_loopback"]

#: A body smaller than this fits in TCP's initial window (10 segments) with room to spare: not a sample.
MIN_SAMPLE_BYTES = 256 * 2**10
#: The newest sample's weight in the estimate.
NEWEST_WEIGHT = 0.5
#: A body read faster than this was buffered already (it arrived with the reply's headers): its time is
#: this, not zero, so one sample cannot claim an infinite rate.
MIN_SAMPLE_S = 1e-4


@dataclass(frozen=True)
class LinkEstimate:
    """A link's measured throughput (bytes a second) and how many transfers it rests on."""

    bytes_per_s: float
    samples: int


class LinkMeter:
    """Per-address throughput estimates of the transfers a peer made (see the module docstring).

    ``max_links``: addresses kept (the least recently measured is forgotten first), so a swarm's churn
    cannot grow it. ``loopback_is_local``: a loopback address is this machine (:meth:`is_local`); off,
    it is measured like any link (a test's stage-mates on 127.0.0.1 standing in for remote ones)."""

    def __init__(self, max_links: int = 1024, *, loopback_is_local: bool = True) -> None:
        self._links: OrderedDict[str, LinkEstimate] = OrderedDict()
        self._max = max_links
        self.loopback_is_local = loopback_is_local

    def is_local(self, addr: str) -> bool:
        """Whether ``addr`` is on this machine (its loopback): no link to measure."""
        return self.loopback_is_local and dials_loopback(addr)

    def record(self, addr: str, nbytes: int, seconds: float) -> LinkEstimate | None:
        """One transfer of ``nbytes`` to or from ``addr`` took ``seconds``; the link's new estimate
        (None, and nothing recorded, for a body too small to measure or a time that is no time)."""
        if nbytes < MIN_SAMPLE_BYTES or not math.isfinite(seconds) or seconds < 0:
            return None
        rate = nbytes / max(seconds, MIN_SAMPLE_S)
        old = self._links.pop(addr, None)
        if old is None:
            new = LinkEstimate(rate, 1)
        else:
            new = LinkEstimate(NEWEST_WEIGHT * rate + (1 - NEWEST_WEIGHT) * old.bytes_per_s, old.samples + 1)
        self._links[addr] = new
        while len(self._links) > self._max:
            self._links.popitem(last=False)
        return new

    def estimate(self, addr: str) -> LinkEstimate | None:
        """The link to ``addr`` as measured so far (None: never measured)."""
        return self._links.get(addr)

    def snapshot(self) -> dict[str, LinkEstimate]:
        """Every link's estimate, by address (for ``/status``)."""
        return dict(self._links)


def dials_loopback(addr: str) -> bool:
    """Whether a data-plane address (``host:port``, ``http://host:port`` or a relayed ``<id>@host:port``)
    is dialled on this machine's loopback."""
    host_port = addr.rpartition("@")[2].removeprefix("http://")
    try:
        host, _ = parse_host_port(host_port)
    except ValueError:
        return False
    return is_loopback(host)
