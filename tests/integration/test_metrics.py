"""Seeing the swarm: /metrics, the training summary in the DHT and ``swarmd status``, against a live 2x2 swarm.

In-process daemons on 127.0.0.1 (real DHT, real HTTP, real torch) and a real trainer; ``swarmd
status`` runs as a child process against them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from swarmd.cli.common import JSON_LOG_KEYS, JsonFormatter
from swarmd.cli.train import CSV_COLUMNS, run_trainer
from swarmd.daemon import Daemon
from swarmd.net.codecs import CODECS
from swarmd.net.wire import CONTENT_TYPE as WIRE_CONTENT_TYPE
from swarmd.net.wire import encode_frame
from swarmd.train.plot import have_matplotlib, plot_training, read_csv
from swarmd.train.trainer import TrainerConfig
from tests.conftest import daemon_config, running_daemon
from tests.support.metrics import samples, scrape
from tests.support.swarms import CORPUS_BYTES, MICRO, TINY, TRAINING, swarm


def families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


async def test_metrics_training_summary_and_status_cli_on_a_live_swarm(tmp_path: Path) -> None:
    # the single leader's round: its /v1/average bytes are counted below
    async with swarm(TINY, dataclasses.replace(TRAINING, averaging="leader")) as daemons:
        founder, other = daemons[0], daemons[1]
        api = founder.status()["api_addr"]
        before = samples(await scrape(api))
        assert before[("swarmd_served_requests_total", (("kind", "forward"),))] == 0
        assert before[("swarmd_step", ())] == 0

        assert before[("swarmd_averaging_round_duration_seconds_count", (("result", "ok"),))] == 0
        assert before[("swarmd_precision_info", (("precision", "fp32"),))] == 1
        assert ("swarmd_loss_scale", ()) not in before  # fp32: no loss scale

        # activations travel as fp16: the byte counters say so, by the codec each request named
        run = TrainerConfig(api=f"http://{api}", steps=3, sync=True, codec="fp16", microbatch_size=MICRO,
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
                "swarmd_dht_routing_table_peers", "swarmd_trainers", "swarmd_trainer_loss",
                "swarmd_averaging_round_duration_seconds", "swarmd_migrations", "swarmd_state_transfer_bytes",
                "swarmd_state_downloads", "swarmd_precision_info", "swarmd_trainer_spot_checks",
                "swarmd_trainer_retries", "swarmd_trainer_bans",
                "swarmd_relay_served_requests"} <= families(text)
        stage = int(after[("swarmd_stage", ())])
        assert stage == founder.stage == 0 and after[("swarmd_state", (("state", "serving"),))] == 1
        assert after[("swarmd_step", ())] == founder.executor.step == 3
        assert after[("swarmd_served_requests_total", (("kind", "forward"),))] > 0
        forward = (("endpoint", "/v1/forward"), ("status", "200"))
        assert after[("swarmd_data_plane_requests_total", forward)] > 0
        assert after[("swarmd_data_plane_request_duration_seconds_count", (("endpoint", "/v1/forward"),))] > 0
        fp16_forward = (("codec", "fp16"), ("endpoint", "/v1/forward"))
        assert after[("swarmd_data_plane_received_bytes_total", fp16_forward)] > 1000
        assert after[("swarmd_data_plane_sent_bytes_total", fp16_forward)] > 1000
        assert (("swarmd_data_plane_sent_bytes_total", (("codec", "none"), ("endpoint", "/v1/forward")))
                not in after)  # nothing was asked for uncompressed
        # a request naming a codec that does not exist is refused, and grows no label: every codec label is a codec
        async with httpx.AsyncClient() as c:
            bogus = encode_frame("forward", {"stage": 0, "codec": "x" * 40},
                                 {"inputs": torch.zeros(1, 4, dtype=torch.long)})
            r = await c.post(f"http://{founder.status()['data_addr']}/v1/forward", content=bogus,
                             headers={"Content-Type": WIRE_CONTENT_TYPE})
        assert r.status_code == 422, r.text
        codecs = {dict(labels).get("codec") for (name, labels) in samples(await scrape(api))
                  if name.startswith("swarmd_data_plane_") and name.endswith("_bytes_total")}
        assert codecs <= set(CODECS) and {"none", "fp16"} <= codecs, codecs
        # the stage-mates' gradients travel to their round's leader with the swarm's grad_codec (none here)
        leader = next(d for d in daemons if d.peer_id == founder.averager.last_round["leader"])
        led = samples(await scrape(leader.status()["api_addr"]))
        assert led[("swarmd_data_plane_received_bytes_total", (("codec", "none"), ("endpoint", "/v1/average")))] > 0
        rounds_ok = after[("swarmd_averaging_rounds_total", (("result", "ok"),))]
        assert rounds_ok >= 1
        # every recorded round is timed: as many observations as rounds, each within the averaging timeout
        timed = after[("swarmd_averaging_round_duration_seconds_count", (("result", "ok"),))]
        assert timed == rounds_ok and 0 < after[("swarmd_averaging_round_duration_seconds_sum", (("result", "ok"),))]
        assert all(0 < r["duration_s"] < TRAINING.averaging_timeout_s
                   for r in founder.status()["averaging"]["recent"] if r["status"] == "ok")
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
        # the trainer's spot checks of peers' answers (issue 17: a peer's first answers are always checked)
        spot = trainers[0]["spot_checks"]
        assert 0 < spot["checks"] <= summary.verify["checks"] and spot["mismatches"] == 0, (spot, summary.verify)
        assert after[("swarmd_trainer_spot_checks_total", ())] == spot["checks"]
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

        # swarmd status, in a terminal: a table per stage with every peer, and the loss. Other peers' steps are
        # their last announcements' (each at most an announce period old): wait until every stage's says step 3
        async def stage_steps() -> list[int | None]:
            async with httpx.AsyncClient() as c:
                view = (await c.get(f"http://{other_api}/swarm")).json()
            return [s["health"]["step"] for s in view["stages"]]

        deadline = asyncio.get_running_loop().time() + 15
        while await stage_steps() != [3, 3] and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)

        def status_cli(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "swarmd", "status", "--api", f"http://{other_api}", *extra],
                                  capture_output=True, text=True, timeout=60)

        shown, as_json = await asyncio.gather(asyncio.to_thread(status_cli), asyncio.to_thread(status_cli, "--json"))
        assert shown.returncode == 0, shown.stderr
        for d in daemons:
            assert d.peer_id[:12] in shown.stdout
        assert "stage 0: ok, 2 serving of 2, step 3 (reported" in shown.stdout
        assert "stage 1: ok, 2 serving of 2, step 3 (reported" in shown.stdout
        assert "loss " in shown.stdout and " -> " not in shown.stdout  # one point of the swarm's curve: no "a -> a"
        assert "at step 2" in shown.stdout and "the swarm: 1 trainer(s) via 1 daemon(s); reported" in shown.stdout
        assert ", precision fp32" in shown.stdout.splitlines()[0]
        picture = json.loads(as_json.stdout)
        assert picture["status"]["peer_id"] == other.peer_id and len(picture["swarm"]["stages"]) == 2

        # a move between stages: counted by how it ended; the mover downloads its new stage's state, which
        # a stage-0 peer serves (the same bytes on both sides)
        mover, donors = daemons[3], [daemons[0], daemons[2]]
        assert mover.stage == 1
        mover_api = mover.status()["api_addr"]
        start = samples(await scrape(mover_api))
        served_before = [samples(await scrape(d.status()["api_addr"])) for d in donors]
        async with httpx.AsyncClient(base_url=f"http://{mover_api}") as c:
            assert (await c.post("/migrate", json={"stage": 1})).status_code == 409  # it is there already
            assert (await c.post("/migrate", json={"stage": 0})).status_code == 202
        deadline = asyncio.get_running_loop().time() + 30
        while (mover.migration or {}).get("phase") != "done":
            assert asyncio.get_running_loop().time() < deadline, mover.migration
            await asyncio.sleep(0.05)
        moved = samples(await scrape(mover_api))
        served_after = [samples(await scrape(d.status()["api_addr"])) for d in donors]
        for result, count in (("refused", 1), ("done", 1), ("failed", 0), ("cancelled", 0)):
            assert start[("swarmd_migrations_total", (("result", result),))] == 0
            assert moved[("swarmd_migrations_total", (("result", result),))] == count, result
        down = ("swarmd_state_transfer_bytes_total", (("direction", "downloaded"),))
        served = ("swarmd_state_transfer_bytes_total", (("direction", "served"),))
        downloaded = moved[down] - start[down]
        assert downloaded > 100_000  # parameters and optimizer state of a tiny stage
        assert sum(a[served] - b[served] for a, b in zip(served_after, served_before, strict=True)) == downloaded
        assert moved[("swarmd_state_downloads_total", (("result", "ok"),))] == \
            start[("swarmd_state_downloads_total", (("result", "ok"),))] + 1
        assert mover.status()["state_transfer"]["last_download_s"] > 0


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


SPOT = ("swarmd_trainer_spot_checks_total", "swarmd_trainer_spot_check_mismatches_total",
        "swarmd_trainer_spot_check_arbitrations_total", "swarmd_trainer_liars_caught_total",
        "swarmd_trainer_reports_sent_total")


async def test_trainers_retries_bans_and_spot_checks_from_heartbeats_are_counters() -> None:
    """Trainers report their retries, bans and spot checks (issue 17) so far with each heartbeat; the
    daemon counts what they grew by, so the counters never go down (a repeated or older report adds
    nothing, and a heartbeat without spot checks, from an older trainer, is accepted and changes none).
    The daemon computes in fp16 here: /status and /metrics show its precision and loss scale."""
    cfg = daemon_config()
    async with contextlib.AsyncExitStack() as stack:
        d = Daemon(replace(cfg, pipeline=replace(cfg.pipeline, precision="fp16")))
        stack.push_async_callback(d.shutdown)
        await d.start()
        api = d.status()["api_addr"]
        async with httpx.AsyncClient(base_url=f"http://{api}") as c:
            first = samples(await scrape(api))
            assert first[("swarmd_trainer_retries_total", ())] == 0 and first[("swarmd_trainer_bans_total", ())] == 0
            assert all(first[(name, ())] == 0 for name in SPOT)
            ids = [(await c.post("/trainers", json={"name": name})).json()["trainer_id"] for name in ("a", "b")]
            for trainer_id, retries, bans, spot in (
                    (ids[0], 3, 1, {"checks": 4, "mismatches": 1, "arbitrations": 1, "liars": 1, "reports_sent": 2}),
                    (ids[1], 2, 0, None),  # an older trainer: no spot checks
                    (ids[0], 5, 1, {"checks": 9, "mismatches": 1, "arbitrations": 1, "liars": 1, "reports_sent": 2}),
                    (ids[0], 4, 1, {"checks": 7}),  # older, out of order: adds nothing
                    (ids[1], 2, 0, {"checks": 3})):
                body = {"retries": retries, "bans": bans, **({"spot_checks": spot} if spot is not None else {})}
                r = await c.post(f"/trainers/{trainer_id}/heartbeat", json=body)
                assert r.status_code == 204, r.text
            after = samples(await scrape(api))
            listed = {t["trainer_id"]: (t["retries"], t["bans"], t["spot_checks"])
                      for t in (await c.get("/trainers")).json()}
            refused = [await c.post(f"/trainers/{ids[1]}/heartbeat", json=body)
                       for body in ({"retries": -1}, {"spot_checks": {"checks": -1}}, {"spot_checks": [1]})]
            status = (await c.get("/status")).json()
        assert after[("swarmd_trainer_retries_total", ())] == 5 + 2 and after[("swarmd_trainer_bans_total", ())] == 1
        assert [after[(name, ())] for name in SPOT] == [9 + 3, 1, 1, 1, 2]
        assert listed == {ids[0]: (5, 1, {"checks": 9, "mismatches": 1, "arbitrations": 1, "liars": 1,
                                          "reports_sent": 2}),
                          ids[1]: (2, 0, {"checks": 3, "mismatches": 0, "arbitrations": 0, "liars": 0,
                                          "reports_sent": 0})}
        assert [r.status_code for r in refused] == [422, 422, 422]
        assert status["precision"] == {"mode": "fp16", "loss_scale": 2.0**16, "overflows": 0}
        assert after[("swarmd_precision_info", (("precision", "fp16"),))] == 1
        assert after[("swarmd_loss_scale", ())] == 2.0**16 and after[("swarmd_loss_scale_overflows_total", ())] == 0


def strict_loads(text: str) -> object:
    """json.loads that refuses NaN and Infinity, as jq and browsers do."""
    def refuse(constant: str) -> object:
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


async def test_a_non_finite_number_in_a_document_is_served_as_null() -> None:
    """Strict JSON (issue #13): /status, /swarm and /training go through their response models,
    which write NaN and Infinity as null; ``swarmd status --json`` writes them as null too."""
    async with running_daemon() as d:
        api = d.status()["api_addr"]
        real_status, real_swarm = d.status, d.swarm_view

        async def swarm_view() -> dict:
            view = await real_swarm()
            view["stages"][0]["throughput"] = float("inf")
            return view

        d.status = lambda: {**real_status(), "throughput": float("nan"), "uptime_s": float("-inf")}  # type: ignore
        d.swarm_view = swarm_view  # type: ignore[method-assign]
        async with httpx.AsyncClient(base_url=f"http://{api}") as c:
            status, swarm = (await c.get("/status")), (await c.get("/swarm"))
        assert status.status_code == 200 and swarm.status_code == 200
        assert strict_loads(status.text)["throughput"] is None and strict_loads(status.text)["uptime_s"] is None
        assert strict_loads(swarm.text)["stages"][0]["throughput"] is None
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "swarmd", "status", "--api",
                                                       f"http://{api}", "--json"],
                                      capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert strict_loads(out.stdout)["status"]["throughput"] is None


def test_round_checks_proofs_and_reports_become_families() -> None:
    """The round checks, proofs (issues #17, #18) and misbehaviour reports of /status, as counters and
    gauges: each value of the document is the value of its sample."""
    from swarmd.api.metrics import DaemonMetrics
    from swarmd.api.trainers import TrainerRegistry
    from swarmd.training_summary import TrainingLog

    class Source:  # what the collector reads from a daemon: a /status document and two registries
        training_log, trainers = TrainingLog(), TrainerRegistry()

        def status(self) -> dict:
            return {"peer_id": "p0", "model": None, "synced_from": None, "migration": None, "data_addr": None,
                    "api_addr": None, "dht_addr": None, "founder": False,
                    "swarm": "s", "version": "v", "device": "cpu", "state": "serving", "stage": 1, "n_stages": 2,
                    "throughput": 1.0, "queue": 0, "in_flight": 0, "step": 3, "params_digest": "ab",
                    "grad_samples": 0, "stale_dropped": 0, "stale_applied": 0, "worker_cpu_s": 0.0, "served": {},
                    "announcements": 1, "task_crashes": {}, "uptime_s": 1.0,
                    "averaging": {"rounds_ok": 2, "rounds_aborted": 1, "rounds_refused": 4,
                                  "contributions_refused": {"outlier": 2, "nonfinite": 1}, "refused_samples": 24,
                                  "leaders_refused": {"p4": 2, "p5": 1}, "leaders_stalling": {"p4": 1},
                                  "silent_contributors": 6, "duplicate_microbatches": 7,
                                  "hostile_convictions": {"p6": 2, "p7": 1}, "contributions_clipped": 5,
                                  "contributions_struck": 8, "openings": {"sent": 4, "ok": 3, "inconsistent": 1},
                                  "accusations": {"sent": 1, "seconded": 2, "seconded_sent": 2, "accepted_by_mates": 3,
                                                  "rechecked": 2, "unchecked": 1, "recheck_not_taken": 1},
                                  "excluded": {"p1": {"offences": 1, "excluded_for_s": 30.0, "reason": "outlier: 80x"}}, "excluded_by_reports": ["p2", "p3"],
                                  "proofs": {"proven": 2, "failing": 1, "unproven": 0, "proofs_ok": 9,
                                             "proofs_failed": {"unreachable": 3}}},
                    "reports": {"received": 5, "accepted": 3, "exclusions": 1, "refused": {"duplicate": 2},
                                "excluded_now": 1, "suspected": ["ab" * 20, "cd" * 20]}}

        def dht_stats(self) -> None:
            return None

    text = DaemonMetrics(Source()).render().decode()
    got = samples(text)
    assert got[("swarmd_averaging_rounds_refused_total", ())] == 4
    assert got[("swarmd_averaging_contributions_refused_total", (("reason", "outlier"),))] == 2
    assert got[("swarmd_averaging_contributions_refused_total", (("reason", "nonfinite"),))] == 1
    assert got[("swarmd_averaging_refused_samples_total", ())] == 24
    assert got[("swarmd_averaging_leaders_refused_total", ())] == 3
    assert got[("swarmd_averaging_leaders_stalling_total", ())] == 1
    assert got[("swarmd_averaging_silent_contributors_total", ())] == 6
    assert got[("swarmd_averaging_duplicate_microbatches_total", ())] == 7
    assert got[("swarmd_averaging_hostile_convictions_total", ())] == 3  # issue 29: robust averaging
    assert got[("swarmd_averaging_contributions_clipped_total", ())] == 5
    assert got[("swarmd_averaging_contributions_struck_total", ())] == 8
    assert got[("swarmd_averaging_openings_total", (("outcome", "inconsistent"),))] == 1  # issue 29, item 3
    assert got[("swarmd_averaging_openings_total", (("outcome", "bad"),))] == 0
    # the accusations (issue 29, item 4): shown, seconded and shown on, counted by the mates, and convictions by
    # recomputation redone here or not, or not taken up by a mate
    assert got[("swarmd_averaging_accusations_total", (("outcome", "seconded_sent"),))] == 2
    assert got[("swarmd_averaging_accusations_total", (("outcome", "not_seconded"),))] == 0
    assert got[("swarmd_averaging_accusations_accepted_total", ())] == 3
    assert got[("swarmd_averaging_rechecks_total", (("outcome", "rechecked"),))] == 2
    assert got[("swarmd_averaging_rechecks_total", (("outcome", "unchecked"),))] == 1
    assert got[("swarmd_averaging_rechecks_not_taken_total", ())] == 1
    assert "# HELP swarmd_averaging_rechecks_total stage-mates' convictions by recomputation" in text
    assert got[("swarmd_averaging_excluded_peers", (("by", "checks"),))] == 1
    assert got[("swarmd_averaging_excluded_peers", (("by", "reports"),))] == 2
    assert got[("swarmd_proof_peers", (("state", "failing"),))] == 1 and got[("swarmd_proofs_ok_total", ())] == 9
    assert got[("swarmd_proofs_failed_total", (("reason", "unreachable"),))] == 3
    assert got[("swarmd_reports_total", (("outcome", "received"),))] == 5
    assert got[("swarmd_reports_total", (("outcome", "accepted"),))] == 3
    assert got[("swarmd_reports_refused_total", (("reason", "duplicate"),))] == 2
    assert got[("swarmd_report_exclusions_total", ())] == 1 and got[("swarmd_reports_excluded_peers", ())] == 1
    assert got[("swarmd_reports_suspected_peers", ())] == 2  # issue 29: accused once, checked more by trainers
