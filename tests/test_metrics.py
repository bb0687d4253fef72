"""Seeing the swarm: /metrics, the training summary in the DHT and ``swarmd status``, against a live 2x2 swarm.

In-process daemons on 127.0.0.1 (real DHT, real HTTP, real torch) and a real trainer; ``swarmd
status`` runs as a child process against them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmd.cli.common import JSON_LOG_KEYS, JsonFormatter
from swarmd.cli.train import CSV_COLUMNS, run_trainer
from swarmd.train.plot import have_matplotlib, plot_training, read_csv
from swarmd.train.trainer import TrainerConfig
from tests.test_training import CORPUS_BYTES, MICRO, TINY, TRAINING, swarm


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


async def scrape(api: str) -> str:
    async with httpx.AsyncClient() as c:
        r = await c.get(f"http://{api}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


async def test_metrics_training_summary_and_status_cli_on_a_live_swarm(tmp_path: Path) -> None:
    async with swarm(TINY, TRAINING) as daemons:
        founder, other = daemons[0], daemons[1]
        api = founder.status()["api_addr"]
        before = samples(await scrape(api))
        assert before[("swarmd_served_requests_total", (("kind", "forward"),))] == 0
        assert before[("swarmd_step", ())] == 0

        run = TrainerConfig(api=f"http://{api}", steps=3, sync=True, codec="none", microbatch_size=MICRO,
                            val_every=2, max_corpus_bytes=CORPUS_BYTES)
        summary = await run_trainer(run, show_progress=False, log_csv=tmp_path / "run.csv")
        assert summary.steps == 3
        curve = read_csv(tmp_path / "run.csv")
        assert tuple(curve) == CSV_COLUMNS and curve["step"] == [1, 2, 3]
        assert curve["loss"] == pytest.approx(summary.step_losses) and curve["val_loss"][1] is not None

        text = await scrape(api)
        after = samples(text)
        assert {"swarmd_peer_info", "swarmd_state", "swarmd_throughput_samples_per_second", "swarmd_queue_jobs",
                "swarmd_in_flight_requests", "swarmd_step_age_seconds", "swarmd_params_digest_age_seconds",
                "swarmd_averaging_rounds", "swarmd_activation_cache_hits", "swarmd_auth_refusals",
                "swarmd_data_plane_requests", "swarmd_data_plane_request_duration_seconds",
                "swarmd_data_plane_received_bytes", "swarmd_data_plane_sent_bytes",
                "swarmd_control_plane_requests", "swarmd_checkpoint_age_seconds", "swarmd_relay_served_bytes",
                "swarmd_dht_routing_table_peers", "swarmd_trainers", "swarmd_trainer_loss"} <= families(text)
        stage = int(after[("swarmd_stage", ())])
        assert stage == founder.stage == 0 and after[("swarmd_state", (("state", "serving"),))] == 1
        assert after[("swarmd_step", ())] == founder.executor.step == 3
        assert after[("swarmd_served_requests_total", (("kind", "forward"),))] > 0
        forward = (("endpoint", "/v1/forward"), ("status", "200"))
        assert after[("swarmd_data_plane_requests_total", forward)] > 0
        assert after[("swarmd_data_plane_request_duration_seconds_count", (("endpoint", "/v1/forward"),))] > 0
        assert after[("swarmd_data_plane_received_bytes_total", (("endpoint", "/v1/forward"),))] > 1000
        assert after[("swarmd_data_plane_sent_bytes_total", (("endpoint", "/v1/forward"),))] > 1000
        assert after[("swarmd_averaging_rounds_total", (("result", "ok"),))] >= 1
        heartbeats = (("endpoint", "/trainers/{trainer_id}/heartbeat"), ("status", "204"))
        assert after[("swarmd_control_plane_requests_total", heartbeats)] >= 1  # the trainer's last report
        assert after[("swarmd_trainers", ())] == 1 and after[("swarmd_trainer_loss", ())] > 0

        # the trainer's steps reached the daemon it registered with ...
        async with httpx.AsyncClient() as c:
            local = (await c.get(f"http://{api}/training")).json()
            trainers = (await c.get(f"http://{api}/trainers")).json()
        assert [p["step"] for p in local["local"]] == [0, 1, 2]
        assert all(p["loss"] > 0 for p in local["local"]) and local["local"][1]["val_loss"] > 0
        assert trainers[0]["step"] == 2 and trainers[0]["samples"] == summary.samples
        # ... and, through the DHT, every daemon's view of the swarm's loss
        await founder.publish_training_summary()
        await other.publish_training_summary()
        other_api = other.status()["api_addr"]
        async with httpx.AsyncClient() as c:
            seen = (await c.get(f"http://{other_api}/training")).json()
        assert seen["local"] == []  # no trainer registered with this one
        assert seen["swarm"][-1]["step"] == 2 and seen["swarm"][-1]["publishers"] == 1
        assert abs(seen["swarm"][-1]["loss"] - local["local"][-1]["loss"]) < 1e-9
        assert samples(await scrape(other_api))[("swarmd_swarm_loss", ())] > 0

        # swarmd status, in a terminal: a table per stage with every peer, and the loss
        def status_cli(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "swarmd", "status", "--api", f"http://{other_api}", *extra],
                                  capture_output=True, text=True, timeout=60)

        shown, as_json = await asyncio.gather(asyncio.to_thread(status_cli), asyncio.to_thread(status_cli, "--json"))
        assert shown.returncode == 0, shown.stderr
        for d in daemons:
            assert d.peer_id[:12] in shown.stdout
        assert "stage 0: 2 serving of 2" in shown.stdout and "stage 1: 2 serving of 2" in shown.stdout
        assert "at step 2" in shown.stdout and "the swarm: 1 trainer(s) via 1 daemon(s)" in shown.stdout
        picture = json.loads(as_json.stdout)
        assert picture["status"]["peer_id"] == other.peer_id and len(picture["swarm"]["stages"]) == 2


def test_status_cli_names_an_unreachable_daemon() -> None:
    done = subprocess.run([sys.executable, "-m", "swarmd", "status", "--api", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot read http://127.0.0.1:9/status" in done.stderr


@pytest.mark.skipif(not have_matplotlib(), reason="matplotlib is not installed (pip install 'swarmd[plot]')")
def test_plot_training_draws_a_csv(tmp_path: Path) -> None:
    csv_path = tmp_path / "run.csv"
    csv_path.write_text("step,elapsed_s,loss,samples_per_s,val_loss\n1,0.5,5.5,10,\n2,1.0,5.0,12,5.2\n3,1.5,,12,\n")
    png = plot_training(csv_path, tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_json_logs_are_one_object_per_line_with_stable_keys() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("swarmd.daemon", logging.ERROR, __file__, 1, "peer %s: %s", ("ab", "x\ny"),
                                   exc_info=sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert set(JSON_LOG_KEYS) <= set(entry) and entry["msg"] == "peer ab: x\ny" and entry["level"] == "ERROR"
    assert "ValueError: boom" in entry["exc"]
