"""The dashboard at ``GET /`` in a real headless browser (Debian's ``chromium``), against a live 2x2 swarm.

The page must show every peer of the swarm and, once a trainer has run, a loss curve; after the peer
moved between stages, that move, and how long its averaging rounds took. A screenshot
is saved as a test artifact (``$SWARMD_TEST_ARTIFACTS/dashboard.png``, else the test's tmp dir).
Skips with the reason where no chromium is installed (``scripts/test`` installs it as root, through
``scripts/_test_packages.sh``).
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import httpx
import pytest

from swarmd.train.trainer import Trainer, TrainerConfig
from tests.support.browser import CHROMIUM, chromium
from tests.support.swarms import CORPUS_BYTES, MICRO, TINY, TRAINING, swarm

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")


async def test_dashboard_shows_every_peer_and_the_loss_curve(tmp_path: Path) -> None:
    async with swarm(TINY, TRAINING) as daemons:
        api = f"http://{daemons[0].status()['api_addr']}"
        async with httpx.AsyncClient() as c:
            page = await c.get(f"{api}/")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "https://" not in page.text and "http://" not in page.text  # nothing fetched from elsewhere
            script = await c.get(f"{api}/static/dashboard.js")
            assert script.status_code == 200 and "fetch(" in script.text
            assert (await c.get(f"{api}/static/..%2Fapp.py")).status_code == 404

        # (before any trainer the page draws no curve: tests/system/test_dashboard_token.py checks that, off loopback)
        # the founder (whose page this is) moves to stage 1, its stage-mate staying: the page shows the move
        async with httpx.AsyncClient() as c:
            assert (await c.post(f"{api}/migrate", json={"stage": 1})).status_code == 202
        deadline = asyncio.get_running_loop().time() + 30
        while (daemons[0].migration or {}).get("phase") != "done":
            assert asyncio.get_running_loop().time() < deadline, daemons[0].migration
            await asyncio.sleep(0.05)
        run = TrainerConfig(api=api, steps=3, sync=True, codec="none", microbatch_size=MICRO, val_every=2,
                            max_corpus_bytes=CORPUS_BYTES)
        await Trainer(run).run()
        after = await asyncio.to_thread(chromium, f"{api}/", "--dump-dom", profile=tmp_path / "p2")
        assert after.returncode == 0, after.stderr[-2000:]
        shown = set(re.findall(r'data-peer-id="([0-9a-f]{40})"', after.stdout))
        assert shown == {d.peer_id for d in daemons}, after.stdout[-3000:]
        curve = re.search(r'<path class="loss" d="M[^"]+" data-points="(\d+)"', after.stdout)
        assert curve is not None and int(curve.group(1)) == 3, after.stdout[-3000:]
        assert re.search(r'<path class="val" d="M[^"]+" data-points="1"', after.stdout)
        assert "at step 2" in after.stdout and "; reported " in after.stdout  # the loss says how old it is
        # the founder left stage 0 with one peer: its column says so, with what to do; each stage's step says its age
        assert re.search(r'data-stage="0" data-health="thin"', after.stdout), after.stdout[-3000:]
        assert "one peer serves stage 0" in after.stdout and re.search(r"· step \d+ \(\d+ s ago\)", after.stdout)
        assert "stage 0 → 1: done (POST /migrate)" in after.stdout and "moves so far: 1 done" in after.stdout
        assert re.search(r'<td class="num">\d+\.\d\d s</td>', after.stdout)  # how long its rounds took
        assert "computing in fp32" in after.stdout

        artifacts = Path(os.environ.get("SWARMD_TEST_ARTIFACTS", tmp_path))
        artifacts.mkdir(parents=True, exist_ok=True)
        png = artifacts / "dashboard.png"
        shot = await asyncio.to_thread(chromium, f"{api}/", f"--screenshot={png}", "--window-size=1366,1100",
                                       profile=tmp_path / "p3")
        assert shot.returncode == 0 and png.stat().st_size > 10_000, shot.stderr[-2000:]
