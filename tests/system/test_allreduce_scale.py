"""The chunked all-reduce at scale (issue #28 item 6): 2 stages x 8 peers of ``tiny`` on loopback,
child processes through the real CLI (``--averaging allreduce``), 2 trainers, and one part owner
SIGKILLed in the middle of a round: after receiving every member's part and reducing its own
(a sitecustomize hook in every daemon, fired by a control file naming the victim's pid, as in
tests/integration/test_many_trainers.py). Nothing is lost (every microbatch issued completes), every stage's
surviving peers end bit-identical, and every step of every stage is a full batch.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from swarmd.local_swarm import DaemonProcess
from swarmd.train.trainer import Trainer
from tests.support.trainers import trainer_config

TARGET = 32
PEERS = 8

KILL_HOOK = '''
import json, os, signal

_CTL = os.environ.get("SWARMD_TEST_KILL_CTL")
if _CTL:
    from swarmd.pipeline.averaging.allreduce import owner as _owner

    _settle = _owner.PartOwner.settle

    async def settle(self, wait_s):
        ready = await _settle(self, wait_s)
        try:
            with open(_CTL) as f:
                ctl = json.load(f)
        except (OSError, ValueError):
            ctl = {}
        if ctl.get("pid") == os.getpid() and self.plan.step >= ctl.get("min_step", 0):
            with open(_CTL + ".fired", "w") as f:
                json.dump({"step": self.plan.step, "part": self.part, "members": len(self.plan.members)}, f)
            os.kill(os.getpid(), signal.SIGKILL)  # mid-round: its part reduced, not yet reported nor served
        return ready

    _owner.PartOwner.settle = settle
'''


def ok_rounds(status: dict) -> list[dict]:
    return [r for r in (status.get("averaging") or {}).get("recent", []) if r["status"] == "ok"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_two_stages_of_eight_lose_nothing_when_a_part_owner_is_killed_mid_round(spawn, tmp_path,
                                                                                        monkeypatch) -> None:
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(KILL_HOOK)
    ctl = tmp_path / "kill.json"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SWARMD_TEST_KILL_CTL", str(ctl))
    common = ["--announce-period", "1", "--rebalance-policy", "none", "--log-level", "WARNING"]
    founder = spawn("--model", "tiny", "--stage", "0", *common, "--target-batch-size", str(TARGET),
                    "--averaging-timeout", "5", "--lr", "0.001", "--averaging", "allreduce")
    info = await asyncio.to_thread(founder.wait_ready, 300)
    others: list[DaemonProcess] = []
    for batch in range(1, 2 * PEERS, 4):  # four at a time: sixteen torch imports at once starve a small machine
        started = [spawn("--join", info["dht_addr"], "--stage", str(i % 2), *common)
                   for i in range(batch, min(batch + 4, 2 * PEERS))]
        for d in started:
            await asyncio.to_thread(d.wait_ready, 600)
        others += started
    peers: list[DaemonProcess] = [founder, *others]
    first = {d: await d.status_async() for d in peers}
    assert sorted(st["stage"] for st in first.values()) == [0] * PEERS + [1] * PEERS
    stage0 = sorted((d for d in peers if first[d]["stage"] == 0), key=lambda d: first[d]["peer_id"])
    victim = stage0[3]  # a part owner; not the coordinator (the smallest id), nor the lease book's holder
    ctl.write_text(json.dumps({"pid": victim.pid, "min_step": 1}))
    api = next(d for d in peers if first[d]["stage"] == 1).api  # a stage-1 peer: it outlives the kill
    trainers = [Trainer(trainer_config(api, f"s{i}", steps=6)) for i in range(2)]
    summaries = await asyncio.wait_for(asyncio.gather(*(t.run() for t in trainers)), 600)
    fired = Path(f"{ctl}.fired")
    assert fired.exists() and victim.proc.wait(timeout=10) == -9, "the victim was never killed mid-round"
    for s in summaries:
        assert s.microbatches_issued == s.microbatches_completed, s.to_json()  # nothing lost
    survivors = [d for d in peers if d is not victim]
    async with httpx.AsyncClient(timeout=5) as client:
        for _ in range(300):  # the stages settle: every survivor of a stage at one step with one digest
            statuses = {d: (await client.get(f"{d.api}/status")).json() for d in survivors}
            views = {}
            for st in statuses.values():
                views.setdefault(st["stage"], set()).add((st["step"], st["params_digest"]))
            if all(len(v) == 1 for v in views.values()) and not any(
                    (st.get("averaging") or {}).get("last_round") is None for st in statuses.values()):
                break
            await asyncio.sleep(0.2)
    detail = json.dumps({"fired": json.loads(fired.read_text()), "views": {k: sorted(v) for k, v in views.items()},
                         "rounds": [[(r["step"], r["samples"], r["status"]) for r in
                                     (st.get("averaging") or {}).get("recent", [])]
                                    for st in statuses.values()]}, default=str)
    assert all(len(v) == 1 for v in views.values()), detail  # every stage's peers identical
    for st in statuses.values():
        assert ok_rounds(st) and all(r["samples"] >= TARGET for r in ok_rounds(st)), detail  # full batches
    assert min(step for v in views.values() for step, _ in v) >= 6, detail
