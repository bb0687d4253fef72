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
  here, and the next donor is tried;
- and before any download, the donors must *prove themselves* (:func:`proven_donors`,
  ``swarmd.net.proof``: a signed challenge at the address in their record, each bounded by a
  short timeout and all at once), so a fake record -- even one with the newest step, pointing at
  a port that never answers -- is never downloaded from (issue #18). Among the proven, the step
  and params digest most of them hold is preferred, and a minority digest at that step is not
  used at all: one liar cannot hand a joiner other parameters while honest donors exist.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from swarmd.dht.records import PeerRecord
from swarmd.errors import StateTransferError, SwarmdError
from swarmd.net.addresses import dial_target, is_relayed
from swarmd.net.state_transfer import download_state
from swarmd.pipeline.model import tensors_digest
from swarmd.pipeline.stage.executor import StageExecutor

if TYPE_CHECKING:
    from swarmd.net.proof import Proof, Prover

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


def rank_proven(donors: Iterable[PeerRecord], proofs: Mapping[str, Proof], *, min_step: int) -> list[PeerRecord]:
    """The proven donors worth downloading from, in order (pure): at ``min_step`` or later by their
    proof (which is fresher than their record); newest step first; at each step only the params
    digest most proven donors hold (ties: the digest that sorts first); a relayed donor after the
    direct ones; otherwise in the order given (``choose_donors`` shuffled it)."""
    proven = [d for d in donors if d.peer_id in proofs and proofs[d.peer_id].step >= min_step]
    held = Counter((proofs[d.peer_id].step, proofs[d.peer_id].params_digest) for d in proven)
    best: dict[int, str] = {}  # step -> the digest most proven donors hold at it
    for (step, digest), _ in sorted(held.items(), key=lambda item: (-item[1], item[0][1] or "")):
        best.setdefault(step, digest or "")
    kept = [d for d in proven if (proofs[d.peer_id].params_digest or "") == best[proofs[d.peer_id].step]]
    kept.sort(key=lambda d: (is_relayed(d.data_addr), -proofs[d.peer_id].step))
    return kept


async def proven_donors(prover: Prover, donors: Iterable[PeerRecord], *, stage: int, min_step: int,
                        exclude: Collection[str] = ()) -> list[PeerRecord]:
    """The donors of ``choose_donors`` that prove themselves now (all challenged afresh, at once, each
    within ``swarmd.net.proof.PROOF_TIMEOUT_S``; not those backing off after a failed challenge),
    ranked by :func:`rank_proven` on the steps and digests they hold now; never one of
    ``exclude`` (peers caught lying in rounds, or excluded by the trainers' reports)."""
    candidates = [d for d in donors if d.peer_id not in exclude]
    proofs = await prover.prove_all({d.peer_id: d.data_addr for d in candidates}, stage=stage, fresh=True)
    ranked = rank_proven(candidates, proofs, min_step=min_step)
    if len(ranked) < len(candidates):
        log.info("state donors of stage %d: %d listed, %d proven and agreeing", stage, len(candidates), len(ranked))
    return ranked


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
    on_received: Callable[[int], None] | None = None,
    path: str = "/v1/state",
) -> SyncResult | None:
    """Download the stage's state from the first donor that serves a good one and adopt it.

    Returns None when every donor failed (each failure logged with the donor and why); the
    executor then holds what it held before. ``on_received(n)``: every ``n`` bytes read from any
    donor (``download_state``), for the daemon's counters. ``path``: ``/v1/state`` (a live
    stage-mate's state) or a ``/v1/checkpoint/{stage}`` (a peer's checkpoint of the stage,
    ``swarmd.net.checkpoint_offers``): the same stream, checked the same way.
    """
    stage = executor.stage
    tried = 0
    for donor in donors:
        tried += 1
        base, relay = dial_target(donor.data_addr)
        url = f"{base}{path}"

        def expected(meta: dict[str, Any], url: str = url) -> None:
            if meta.get("stage") != stage or meta.get("model") != model_digest:
                raise SwarmdError(f"{url} serves another stage or model")

        started = time.monotonic()
        try:
            snapshot = await download_state(session, url, expected=expected, headers=relay, on_received=on_received)
            params = [(k.removeprefix("param."), t) for k, t in snapshot.tensors.items() if k.startswith("param.")]
            digest = await asyncio.to_thread(tensors_digest, params)  # hashing a large state: off the loop
            if digest != snapshot.meta.get("params_digest"):
                raise StateTransferError("its parameters do not match the digest in its header", url=url)
            await executor.load_state(snapshot.meta, snapshot.tensors)
        except (SwarmdError, ValueError, KeyError, TypeError) as exc:
            # ValueError/KeyError/TypeError: a state whose tensors or optimizer layout do not fit this stage
            hint = ""
            if isinstance(exc, StateTransferError) and exc.unreachable:
                hint = " (could not connect: a firewall or NAT in the way, or a wrong --announce on that peer?)"
            log.warning("state download from %s at %s failed: %s%s; trying the next one",
                        donor.peer_id[:12], donor.data_addr, exc, hint)
            continue
        seconds = time.monotonic() - started
        log.info("adopted the state of stage %d at step %d from %s in %.2fs (params %s)",
                 stage, executor.step, donor.peer_id[:12], seconds, digest[:12])
        return SyncResult(donor=donor, step=executor.step, params_digest=digest, seconds=seconds)
    if tried:
        log.error("could not download the state of stage %d from any of %d peers", stage, tried)
    return None
