"""The dashboard read from another machine: its reads need the API token, given once as ``#token=...``.

``swarmd.api.app`` opens the read-only documents to loopback clients only (the client's address is
``127.0.0.0/8`` or ``::1``); a control plane exposed with ``--api-host`` and a token answers 401 to
anyone else. Here a daemon's control plane binds ``0.0.0.0`` with a token and a real headless
chromium opens it at this machine's own non-loopback address, so the daemon sees a client that is
not loopback, as it would a browser on another machine. Without the token the page must say how to
give it; with ``#token=`` in the address it must show the swarm's peers (the daemon answered the
page's reads with 200, which off loopback only the bearer header earns). Skips with the reason where
there is no chromium or no non-loopback address.
"""

from __future__ import annotations

import asyncio
import re
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from swarmd.daemon import Daemon
from tests.conftest import daemon_config
from tests.support.browser import CHROMIUM, chromium
from tests.support.metrics import samples, scrape

TOKEN = "dashboard-token-0123456789abcdef"


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback (the source address of a route; a UDP
    ``connect`` sends nothing), or None when it has no route but loopback."""
    for probe in ("192.0.2.1", "10.255.255.255", "172.16.255.255", "192.168.255.255"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((probe, 9))
            except OSError:
                continue
            host = s.getsockname()[0]
        if not host.startswith("127.") and host != "0.0.0.0":
            return host
    return None


HOST = non_loopback_ipv4()
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)"),
              pytest.mark.skipif(HOST is None, reason="this machine has no non-loopback IPv4 address to be read at")]


async def test_the_dashboard_off_loopback_asks_for_the_token_and_shows_the_peers_with_it(tmp_path: Path) -> None:
    cfg = daemon_config()
    d = Daemon(replace(cfg, api=replace(cfg.api, host="0.0.0.0", token=TOKEN)))
    try:
        await d.start()
        port = int(d.status()["api_addr"].rsplit(":", 1)[1])
        page = f"http://{HOST}:{port}/"
        local = f"127.0.0.1:{port}"  # the owner's own reads (and this test's scrapes) stay open on loopback

        without = await asyncio.to_thread(chromium, page, "--dump-dom", profile=tmp_path / "p1")
        assert without.returncode == 0, without.stderr[-2000:]
        assert "needs its API token" in without.stdout and f"{page}#token=" in without.stdout, without.stdout[-3000:]
        assert "data-peer-id" not in without.stdout
        refused = samples(await scrape(local))
        assert refused[("swarmd_control_plane_requests_total", (("endpoint", "/status"), ("status", "401")))] >= 1

        shown = await asyncio.to_thread(chromium, f"{page}#token={TOKEN}", "--dump-dom", profile=tmp_path / "p2")
        assert shown.returncode == 0, shown.stderr[-2000:]
        assert set(re.findall(r'data-peer-id="([0-9a-f]{40})"', shown.stdout)) == {d.peer_id}, shown.stdout[-3000:]
        assert f"This peer {d.peer_id[:12]} is serving" in shown.stdout and "needs its API token" not in shown.stdout
        assert "computing in fp32" in shown.stdout  # its precision (swarmd.pipeline.stage.precision)
        assert 'class="loss"' not in shown.stdout and "no trainer has reported yet" in shown.stdout  # no curve yet
        read = samples(await scrape(local))
        for endpoint in ("/status", "/swarm", "/training", "/trainers"):  # each read by the page, with the token
            assert read[("swarmd_control_plane_requests_total", (("endpoint", endpoint), ("status", "200")))] >= 1
    finally:
        await d.shutdown()
