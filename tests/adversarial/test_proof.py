"""Proven peers (issue #18, item 2): the signed challenge, its table, and its endpoint over real HTTP.

A proof must show that the answerer holds the identity of the record (its key hashes to the
record's peer id), answers the nonce just sent (not a recorded answer), and serves at the address
the caller dialed; everything else (a tarpit, a refusing port, another peer at that address,
garbage) is a failure with a reason, backed off, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from swarmd.dht.identity import Identity
from swarmd.net.proof import (
    PROOF_PATH,
    ProofClaim,
    ProofReply,
    ProofService,
    ProvenPeers,
    Prover,
    check_proof,
    new_nonce,
    sign_proof,
)
from swarmd.net.server import DataPlane
from swarmd.net.wire import WireLimits
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.stage.runtime import StageRuntime
from tests.conftest import TINY, running_daemon


def claim(identity: Identity, nonce: str, addr: str = "127.0.0.1:7000", stage: int = 0) -> ProofClaim:
    return ProofClaim(nonce=nonce, peer_id=identity.peer_id, addr=addr, stage=stage, step=3, params_digest="ab" * 32)


def test_a_good_proof_verifies_and_each_defect_is_named() -> None:
    me, other = Identity.generate(), Identity.generate()
    nonce = new_nonce()
    good = sign_proof(me, claim(me, nonce))
    assert check_proof(good, nonce=nonce, peer_id=me.peer_id, addr="127.0.0.1:7000", stage=0) is None
    # survives its JSON round trip exactly
    assert ProofReply.from_json(good.to_json()) == good
    # replayed: a recorded answer to an earlier challenge does not answer this one
    assert check_proof(good, nonce=new_nonce(), peer_id=me.peer_id, addr="127.0.0.1:7000", stage=0) == "nonce"
    # wrong key: another identity signs a claim naming this peer id (a fake at a real peer's address, or
    # a real peer answering at a fake record's address)
    forged = sign_proof(other, claim(me, nonce))
    assert check_proof(forged, nonce=nonce, peer_id=me.peer_id, addr="127.0.0.1:7000", stage=0) == "key"
    # the answer of another peer, honestly signed, does not prove the record's peer
    theirs = sign_proof(other, claim(other, nonce))
    assert check_proof(theirs, nonce=nonce, peer_id=me.peer_id, addr="127.0.0.1:7000", stage=0) == "key"
    # a tampered claim breaks the signature
    tampered = ProofReply(claim(me, nonce, stage=1), good.public_key, good.signature)
    assert check_proof(tampered, nonce=nonce, peer_id=me.peer_id, addr="127.0.0.1:7000", stage=1) == "signature"
    # signed for another address than the one dialed, or another stage
    assert check_proof(good, nonce=nonce, peer_id=me.peer_id, addr="127.0.0.1:7001", stage=0) == "address"
    assert check_proof(good, nonce=nonce, peer_id=me.peer_id, addr="127.0.0.1:7000", stage=1) == "stage"


@pytest.mark.parametrize("mutate", [
    lambda j: "not a dict",
    lambda j: {**j, "nonce": 5},
    lambda j: {**j, "nonce": "XYZ"},
    lambda j: {**j, "peer_id": "00" * 21},
    lambda j: {**j, "stage": True},
    lambda j: {**j, "step": -1},
    lambda j: {**j, "addr": "x" * 400},
    lambda j: {**j, "params_digest": "NOT-HEX"},
    lambda j: {**j, "public_key": "zz"},
    lambda j: {**j, "signature": "00" * 10},
    lambda j: {k: v for k, v in j.items() if k != "signature"},
])
def test_malformed_answers_are_value_errors(mutate) -> None:
    me = Identity.generate()
    body = sign_proof(me, claim(me, new_nonce())).to_json()
    with pytest.raises(ValueError):
        ProofReply.from_json(mutate(body))


def test_the_table_expires_renews_and_backs_off_on_a_fake_clock() -> None:
    now = [1000.0]
    table = ProvenPeers(ttl_s=60, backoff_s=2, backoff_max_s=16, max_peers=3, clock=lambda: now[0])
    assert table.due("a", "h:1") and not table.tried("a")
    table.succeeded("a", "h:1", step=4, params_digest="cd")
    assert table.proof("a", "h:1") is not None and not table.due("a", "h:1")
    assert table.proof("a", "h:2") is None and table.due("a", "h:2")  # a proof is for one address
    now[0] += 31
    assert table.proof("a", "h:1") is not None and table.due("a", "h:1")  # renewed half-way, still valid
    now[0] += 30
    assert table.proof("a", "h:1") is None  # expired
    waits = [table.failed("b", "h:9", "timeout") for _ in range(6)]
    assert waits == [2, 4, 8, 16, 16, 16]  # doubling up to the cap
    assert not table.due("b", "h:9") and table.tried("b")
    now[0] += 16
    assert table.due("b", "h:9")
    assert table.status({"a": "h:1", "b": "h:9"})["unproven"] == 2
    assert table.status()["proofs_failed"] == {"timeout": 6}
    for i in range(10):  # bounded
        table.succeeded(f"p{i}", "h", 0, None)
    assert table.status()["proven"] <= 3


def test_a_peer_that_proved_itself_once_is_remembered_past_its_lapsed_proof_and_a_failed_challenge() -> None:
    # the all-reduce's quorum counts a peer that ever answered (membership (2)): a failed challenge under load
    # must not make a proven peer look like a record nobody serves (two coordinators both committed that way)
    now = [0.0]
    table = ProvenPeers(ttl_s=60, max_peers=2, clock=lambda: now[0])
    assert not table.ever_proved("a", "h:1")
    table.succeeded("a", "h:1", step=0, params_digest=None)
    table.failed("a", "h:1", "timeout")
    now[0] += 120
    assert table.proof("a", "h:1") is None and table.ever_proved("a", "h:1")
    assert not table.ever_proved("a", "h:2")  # at another address it must answer again
    for i in range(3):  # bounded
        table.succeeded(f"p{i}", "h", 0, None)
    assert not table.ever_proved("a", "h:1")


@contextlib.asynccontextmanager
async def serving(identity: Identity, announce: str | None = None) -> AsyncIterator[tuple[str, ProofService]]:
    """A data plane with the proof endpoint; ``announce``: the address it claims (default: its own)."""
    ex = StageExecutor(TINY, 0, "cpu")  # no threads=: process-wide
    runtime = StageRuntime(ex)
    plane = DataPlane(lambda: runtime, limits=WireLimits())
    addr: list[str] = []
    service = ProofService(lambda: identity, lambda: announce or addr[0], lambda: ex)
    service.install(plane.app)
    host, port = await plane.start("127.0.0.1", 0)
    addr.append(f"{host}:{port}")
    try:
        yield addr[0], service
    finally:
        await plane.close()
        await ex.close()


@contextlib.asynccontextmanager
async def tarpit() -> AsyncIterator[str]:
    """Accepts TCP connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


async def test_challenges_over_real_http() -> None:
    me, other = Identity.generate(), Identity.generate()
    async with aiohttp.ClientSession() as session, serving(me) as (addr, service), tarpit() as pit, \
            serving(other, announce="10.9.9.9:1") as (elsewhere, _):
        prover = Prover(lambda: session, timeout_s=0.5)
        proof = await prover.prove(me.peer_id, addr, stage=0)
        assert proof is not None and proof.step == 0 and proof.params_digest and service.served == 1
        assert prover.proven({me.peer_id: addr}) == {me.peer_id: proof}
        # the right address, the wrong stage expected
        assert await prover.prove(me.peer_id, addr, stage=1) is None
        # a fake record naming this peer's id at a tarpit: one bounded timeout, then backed off
        fake = Identity.generate()
        assert await prover.prove(fake.peer_id, pit, stage=0) is None
        # a fake record pointing at a real peer: that peer answers with its own key
        assert await prover.prove(Identity.generate().peer_id, addr, stage=0) is None
        # a peer that announces another address than the one in the record
        assert await prover.prove(other.peer_id, elsewhere, stage=0) is None
        # a refusing port (discard: nothing listens there on a test machine)
        assert await prover.prove(Identity.generate().peer_id, "127.0.0.1:9", stage=0) is None
        status = prover.table.status()
        assert status["proofs_failed"] == {"stage": 1, "timeout": 1, "key": 1, "address": 1, "unreachable": 1}, status
        # the tarpit is backed off: a second round of challenges does not dial it again
        assert prover.due({fake.peer_id: pit}) == {}
        # bad input to the endpoint: a clear 422, never a 500
        for query in ({}, {"nonce": "short"}, {"nonce": "G" * 32}, {"nonce": "a" * 200}):
            async with session.get(f"http://{addr}{PROOF_PATH}", params=query) as r:
                body = await r.json()
                assert r.status == 422 and body["error"] == "RequestError", (query, r.status, body)


async def test_a_daemon_answers_its_own_proof() -> None:
    async with running_daemon(0) as d, aiohttp.ClientSession() as session:
        assert d.peer_id is not None and d.data_addr is not None
        proof = await Prover(lambda: session).prove(d.peer_id, d.data_addr, stage=0)
        assert proof is not None and d.executor is not None and proof.params_digest == d.executor.digest
        averaging = d.status()["averaging"]
        assert averaging["proofs"]["proofs_failed"] == {} and averaging["rounds_refused"] == 0


def test_donors_are_only_proven_ones_holding_the_majority_digest_of_the_newest_step() -> None:
    from swarmd.dht.records import PeerRecord
    from swarmd.net.proof import Proof
    from swarmd.pipeline.placement.state_sync import rank_proven

    def record(pid: str, addr: str) -> PeerRecord:
        return PeerRecord(peer_id=pid, stage=0, state="serving", data_addr=addr, api_addr="", throughput=1.0, queue=0,
                          step=9, params_digest="aa", version="0", timestamp=1.0, expiry=2e9)

    ids = {name: f"{i:040x}" for i, name in enumerate("abcdefg")}
    donors = [record(ids["a"], "h:1"), record(ids["b"], "h:2"), record(ids["c"], "h:3"), record(ids["d"], "h:4"),
              record(ids["e"], f"{ids['e']}@h:9"), record(ids["f"], "h:6"), record(ids["g"], "h:7")]
    proofs = {ids["a"]: Proof("h:1", 0, 5, "aa"), ids["b"]: Proof("h:2", 0, 5, "aa"),
              ids["c"]: Proof("h:3", 0, 5, "bb"),  # a minority digest at step 5: never a donor
              ids["e"]: Proof(f"{ids['e']}@h:9", 0, 5, "aa"),  # relayed: after the direct ones
              ids["f"]: Proof("h:6", 0, 3, "cc"),  # an older step: after the newer ones
              ids["g"]: Proof("h:7", 0, 1, "dd")}  # below min_step
    # d's record claims the newest step of all, but it did not prove itself: never a donor
    ranked = [r.peer_id for r in rank_proven(donors, proofs, min_step=2)]
    assert ranked == [ids["a"], ids["b"], ids["f"], ids["e"]], ranked
    assert rank_proven(donors, {}, min_step=0) == []
