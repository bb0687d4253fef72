"""A move's record as /status shows it: every phase's record fits the control plane's schema."""

from __future__ import annotations

from swarmd.api.models import MigrationInfo
from swarmd.pipeline.placement.migration import MigrationPhase, MigrationStatus


def test_every_phase_of_a_move_fits_the_status_schema() -> None:
    for phase in MigrationPhase:
        record = MigrationStatus(src=1, to=0, reason="POST /migrate", phase=phase).to_dict()  # dropped_samples: None
        info = MigrationInfo.model_validate(record)
        assert info.from_stage == 1 and info.phase == phase.value
        assert info.model_dump(mode="json", by_alias=True)["from"] == 1
