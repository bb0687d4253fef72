"""bench_square_cube's accounting: swarmd's traffic per microbatch is two boundary frames plus the
stage's averaging share, and a given compute time is used as it is (no timing)."""

from __future__ import annotations

import argparse

import pytest
from scripts.bench_square_cube import _given, block_spec, frame_bytes, grad_frame_bytes, measure

from swarmd.pipeline.spec import ModelSpec


def test_a_given_compute_time_is_used_and_swarmd_counts_two_frames_plus_averaging() -> None:
    args = argparse.Namespace(seq=16, batch=2, repeats=1, compute_s=[(64, 0.5)], samples_per_step=64,
                              peers_per_stage=2)
    entry = measure(64, args)
    assert entry["compute_s"] == 0.5 and entry["compute_given"] is True
    assert entry["microbatches_per_peer_step"] == 16.0  # 64 samples / (2 peers x 2 per microbatch)
    for label, row in entry["codecs"].items():
        assert row["bytes_paper"] == 2 * row["frame_bytes"]
        assert row["bytes_swarmd"] == 2 * row["frame_bytes"] + row["averaging_bytes_per_microbatch"], label
    none, g3 = entry["codecs"]["none"], entry["codecs"]["b/4+4bit+g3bit"]
    assert none["averaging_bytes_per_microbatch"] == round(grad_frame_bytes(entry["params"], "none") / 16)
    assert g3["grad_codec"] == "3bit"
    assert g3["averaging_bytes_per_microbatch"] < none["averaging_bytes_per_microbatch"] / 9
    assert entry["codecs"]["b/8+4bit"]["frame_bytes"] < entry["codecs"]["b/4+4bit"]["frame_bytes"]
    assert none["frame_bytes"] == frame_bytes(*_spec_and_batch(args))
    assert none["at_mbit"]["100"]["swarmd"]["utilization"] < 1


def _spec_and_batch(args: argparse.Namespace) -> tuple[ModelSpec, int, str]:
    return block_spec(64, args.seq), args.batch, "none"


def test_compute_s_arguments() -> None:
    assert _given("256=0.0378") == (256, 0.0378)
    with pytest.raises(argparse.ArgumentTypeError):
        _given("256:0.1")
