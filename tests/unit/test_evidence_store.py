"""The evidence an owner keeps of its drawn parts (``allreduce.evidence_store``): in memory, on disk across a
restart, the oldest forgotten first, and never a file named by what came from the network."""

from __future__ import annotations

from pathlib import Path

from swarmd.pipeline.averaging.allreduce.audit import PartEvidence
from swarmd.pipeline.averaging.allreduce.evidence_store import KeptEvidence
from swarmd.pipeline.averaging.allreduce.plan import Ready


def _evidence(round_id: str, part: int) -> PartEvidence:
    ready = Ready(round_id, part, "owner", "ab" * 32, (("m1", 3), ("m2", 5)))
    return PartEvidence(0, ready, b"k" * 32, b"s" * 64, "8bit", b"mean-frame", (b"slice-1", b"slice-22"))


async def test_kept_evidence_survives_a_restart_and_forgets_the_oldest(tmp_path: Path) -> None:
    store = KeptEvidence(tmp_path / "audits", keep=2)
    for k in range(3):
        await store.put(f"{10 + k}-abcdef-0123", 1, _evidence(f"{10 + k}-abcdef-0123", 1))
    assert len(store) == 2 and await store.get("12-abcdef-0123", 1) == _evidence("12-abcdef-0123", 1)
    restarted = KeptEvidence(tmp_path / "audits", keep=2)  # (a new process: nothing in memory)
    assert await restarted.get("12-abcdef-0123", 1) == _evidence("12-abcdef-0123", 1)
    assert await restarted.get("11-abcdef-0123", 1) == _evidence("11-abcdef-0123", 1)
    assert await restarted.get("10-abcdef-0123", 1) is None  # the oldest file pruned
    assert await restarted.get("12-abcdef-0123", 0) is None  # another part of the round
    assert sorted(p.name for p in (tmp_path / "audits").iterdir()) == ["11-abcdef-0123.1.audit",
                                                                       "12-abcdef-0123.1.audit"]


async def test_round_ids_that_are_not_round_ids_name_no_file(tmp_path: Path) -> None:
    store = KeptEvidence(tmp_path / "audits")
    for bad in ("../../etc/passwd", "12-ab/cd", "", "x-1", "12-" + "a" * 200):
        await store.put(bad, 0, _evidence("1-a", 0))  # kept in memory only
        assert await store.get(bad, 0) is not None
        assert await KeptEvidence(tmp_path / "audits").get(bad, 0) is None
    assert not (tmp_path / "audits").exists()


async def test_a_damaged_file_reads_as_nothing_kept(tmp_path: Path) -> None:
    store = KeptEvidence(tmp_path)
    await store.put("3-abc-def", 2, _evidence("3-abc-def", 2))
    (tmp_path / "3-abc-def.2.audit").write_bytes(b"\x93not a frame")
    assert await KeptEvidence(tmp_path).get("3-abc-def", 2) is None
