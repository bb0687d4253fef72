"""Run inside a lab host by tests/system/test_hosts.py: train through a swarm of lab hosts and report.

The lab's hosts are network namespaces, so the test process (in the root namespace) cannot reach
them; this script runs inside the founder's host (``ip netns exec``), where the founder's control
plane is on 127.0.0.1 and every daemon's data plane is reachable, and prints one JSON line: the
trainer's summary, and at which step it SIGKILLed the daemon it was asked to (``kill``).

    python tests/support/hosts_driver.py '{"api": ..., "token": ..., "steps": 5, "kill": [pid, step]}'
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from swarmd.train.trainer import Trainer, TrainerConfig  # noqa: E402


async def main(spec: dict[str, Any]) -> dict[str, Any]:
    kill = spec.get("kill")  # [pid, at_step]: SIGKILL that daemon once the swarm reached that step
    killed: list[int] = []

    def on_step(step: int, loss: float, info: dict[str, Any]) -> None:
        if kill and not killed and step >= kill[1]:
            os.kill(kill[0], signal.SIGKILL)
            killed.append(step)

    config = TrainerConfig(api=spec["api"], api_token=spec.get("token"), steps=spec["steps"], sync=True,
                           codec=spec.get("codec", "none"), verify_fraction=spec.get("verify_fraction", 0.02),
                           microbatch_size=4, window=4, val_every=0, max_corpus_bytes=1 << 20, seed=0,
                           stage_wait_timeout_s=60.0)
    summary = await Trainer(config, on_step=on_step).run()
    await asyncio.sleep(spec.get("settle_s", 0.0))
    return {"summary": summary.to_json(), "killed_at": killed[0] if killed else None}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
