"""The ``netlab`` fixture: hosts in Linux network namespaces (``scripts/netlab.py``), torn down after the test.

A test asks for ``netlab`` and calls it to build labs: ``lab = netlab(3, shapes={0: Shape(rate="20mbit")})``;
every lab it built is closed (processes stopped, namespaces deleted) when the test ends, passed or failed.
Where the lab cannot run (not root, no ``ip``, ``ip netns`` refused) the test is skipped with the reason.
The first use in a session also removes labs that earlier, killed runs left behind (by prefix, only those
whose owner process is gone, so a parallel run's labs stay).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from scripts.netlab import Lab, cleanup_stale, support_problem


@functools.cache
def lab_problem() -> str | None:
    """Why the lab cannot run on this machine (None: it can); checked once per session."""
    problem = support_problem()
    if problem is None:
        cleanup_stale()
    return problem


def require_lab() -> None:
    """Skip the calling test with the reason when the lab cannot run here."""
    problem = lab_problem()
    if problem is not None:
        pytest.skip(f"network lab unavailable: {problem}")


@pytest.fixture
def netlab() -> Iterator[Callable[..., Lab]]:
    """A factory of started labs (``netlab(hosts, rate=..., delay_s=..., shapes=...)``), all closed after."""
    require_lab()
    labs: list[Lab] = []

    def _make(hosts: int = 3, **kw: Any) -> Lab:
        lab = Lab(hosts, **kw)
        labs.append(lab)
        return lab.start()

    try:
        yield _make
    finally:
        for lab in labs:
            lab.close()
