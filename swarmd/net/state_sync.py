"""State sync: which stage-mate a peer downloads its stage's state from, and how it is checked.

Once a swarm has stepped, nobody may serve fresh parameters: a joining peer, a peer that moved
to another stage and a peer that fell behind its stage's steps all adopt the state (parameters,
optimizer state, step) of a live stage-mate. The stream itself is ``swarmd.net.state_transfer``;
this module chooses the donor and checks what arrives:

- donors are the stage's *serving* peers (not this one) at step >= the step needed, newest step
  first and shuffled among equals, so joiners spread over the stage instead of all pulling from
  one peer (hivemind #169);
- the stream's header must name this stage and this model's digest, else the download stops
  before any tensor is allocated;
- the parameters that arrived must hash to the ``params_digest`` the donor put in its header
  *before* they are adopted: a donor whose state does not match its own digest changes nothing
  here, and the next donor is tried.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from swarmd.dht.records import PeerRecord
from swarmd.errors import StateTransferError, SwarmdError
from swarmd.net.addresses import dial_target, is_relayed
from swarmd.net.state_transfer import download_state
from swarmd.pipeline.executor import StageExecutor
from swarmd.pipeline.model import tensors_digest

log = logging.getLogger(__name__)


def choose_donors(
    records: Mapping[str, PeerRecord] | Iterable[PeerRecord],
    *,
    self_id: str | None,
    min_step: int,
    rng: random.Random | None = None,
) -> list[PeerRecord]:
    """The stage-mates to try, in order: serving and reachable, not this peer, at ``min_step`` or later,
    newest step first, in random order among equal steps."""
    peers = list(records.values()) if isinstance(records, Mapping) else list(records)
    donors = [r for r in peers if r.peer_id != self_id and r.usable and r.step >= min_step]
    (rng or random).shuffle(donors)
    # stable: the shuffle decides among equals; a relayed donor only when no direct one has the step
    donors.sort(key=lambda r: (is_relayed(r.data_addr), -r.step))
    return donors


@dataclass(frozen=True)
class SyncResult:
    """A state that was adopted: from whom, at which step, and how long it took."""

    donor: PeerRecord
    step: int
    params_digest: str
    seconds: float


async def adopt_state(
    session: aiohttp.ClientSession,
    executor: StageExecutor,
    donors: Iterable[PeerRecord],
    *,
    model_digest: str,
) -> SyncResult | None:
    """Download the stage's state from the first donor that serves a good one and adopt it.

    Returns None when every donor failed (each failure logged with the donor and why); the
    executor then holds what it held before.
    """
    stage = executor.stage
    tried = 0
    for donor in donors:
        tried += 1
        base, relay = dial_target(donor.data_addr)
        url = f"{base}/v1/state"

        def expected(meta: dict[str, Any], url: str = url) -> None:
            if meta.get("stage") != stage or meta.get("model") != model_digest:
                raise SwarmdError(f"{url} serves another stage or model")

        started = time.monotonic()
        try:
            snapshot = await download_state(session, url, expected=expected, headers=relay)
            params = [(k.removeprefix("param."), t) for k, t in snapshot.tensors.items() if k.startswith("param.")]
            digest = await asyncio.to_thread(tensors_digest, params)  # hashing a large state: off the loop
            if digest != snapshot.meta.get("params_digest"):
                raise StateTransferError("its parameters do not match the digest in its header", url=url)
            await executor.load_state(snapshot.meta, snapshot.tensors)
        except (SwarmdError, ValueError, KeyError, TypeError) as exc:
            # ValueError/KeyError/TypeError: a state whose tensors or optimizer layout do not fit this stage
            hint = ""
            if isinstance(exc, StateTransferError) and exc.status == 0 and ("Connect" in exc.message
                                                                             or "within" in exc.message):
                hint = " (could not connect: a firewall or NAT in the way, or a wrong --announce on that peer?)"
            log.warning("state download from %s at %s failed: %s%s; trying the next stage-mate",
                        donor.peer_id[:12], donor.data_addr, exc, hint)
            continue
        seconds = time.monotonic() - started
        log.info("adopted the state of stage %d at step %d from %s in %.2fs (params %s)",
                 stage, executor.step, donor.peer_id[:12], seconds, digest[:12])
        return SyncResult(donor=donor, step=executor.step, params_digest=digest, seconds=seconds)
    if tried:
        log.error("could not download the state of stage %d from any of %d peers", stage, tried)
    return None
