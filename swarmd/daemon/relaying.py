"""Can others dial this peer, and if not, which member relays for it.

Before a peer announces ``serving`` it asks up to three members to dial its announced data
address (``swarmd.net.reachability``); the answer goes into its record, and a peer nobody can
dial is listed but never used. Such a peer (behind a NAT, most home machines) keeps one outbound
WebSocket to a reachable member that relays requests to it (``swarmd.net.relay``) and announces
``<peer id>@<relay address>``; reachable peers relay for others. This module is the daemon's glue
around both.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from swarmd.errors import SwarmdError
from swarmd.net import reachability
from swarmd.net.addresses import format_addr, is_relayed, is_wildcard
from swarmd.net.relay import RelayClient
from swarmd.peer_state import PeerState

if TYPE_CHECKING:
    from swarmd.daemon.host import Host
    from swarmd.dht.records import PeerRecord

__all__ = ["REACHABILITY_TASK", "RELAY_TASK", "Relaying"]

log = logging.getLogger(__name__)

RELAY_TASK = "relay"
REACHABILITY_TASK = "reachability"


class Relaying:
    """Checks this peer's reachability, relays through a member when nobody can dial it."""

    def __init__(self, host: Host) -> None:
        self.host = host

    async def check(self) -> None:
        """Ask other members to dial the announced data address (``swarmd.net.reachability``)."""
        host = self.host
        assert host.membership is not None and host.spec is not None and host.session is not None
        addr, peer_id = host.data_addr, host.peer_id
        if addr is None or peer_id is None:
            return
        try:
            members = await host.membership.all_peers(host.spec.n_stages)
        except SwarmdError as exc:
            log.warning("cannot check this peer's reachability: %s", exc)
            return
        proven = host.prover.proven({r.peer_id: r.data_addr for r in members})
        if proven:  # members that answered a signed challenge: a fake prober costs a timeout, or lies (issue 18)
            members = [r for r in members if r.peer_id in proven]
        result = await reachability.check(host.session, peer_id=peer_id, addr=addr, members=members,
                                          probers=reachability.PROBERS if proven else reachability.UNPROVEN_PROBERS)
        changed = result.status != host.reachability.status
        host.reachability = result
        if result.status == "no" and host.relayed_addr is None:
            log.error("no member of the swarm could dial this peer's data plane at %s (%s): it will serve through "
                      "a relay if one accepts. Open TCP port %s in the firewall, forward it through the NAT, or give "
                      "--announce HOST:PORT", addr, "; ".join(f"{pid[:12]}: {why}" for pid, why in result.by.items()),
                      addr.rsplit(":", 1)[-1])
        elif changed and result.status == "yes":
            log.info("reachable at %s (checked by %d member(s))", addr, sum(v == "reached" for v in result.by.values()))

    def check_later(self) -> None:
        """While nobody has said (a founder alone at first), ask again in a task of its own: probers that
        never answer (fake records at a tarpit, issue 18) must not hold up the announcements."""
        host = self.host
        if host.reachability.status == "unknown" and not host.tasks.running(REACHABILITY_TASK):
            host.tasks.spawn(REACHABILITY_TASK, self._recheck, restart=True)

    async def _recheck(self) -> None:
        try:
            await self.check()
        except SwarmdError as exc:
            log.warning("could not check this peer's reachability: %s", exc)
            return
        if self.host.reachability.status == "no":
            self.start()

    def for_others(self) -> bool:
        """A peer relays when others can dial it directly (and --relay-max-peers is not 0)."""
        host = self.host
        return (host.config.net.relay_max_peers > 0 and host.relayed_addr is None
                and host.reachability.status != "no" and host.state in (PeerState.SERVING, PeerState.MIGRATING))

    def start(self) -> None:
        """Nobody could dial this peer: serve through a relay (a task that keeps one attached)."""
        host = self.host
        assert host.identity is not None and host.session is not None  # started
        if host.tasks.running(RELAY_TASK):
            return
        host.relay_client = RelayClient(host.identity, host.session, local_base=self._local_base,
                                        candidates=self._candidates, on_change=self._on_change,
                                        retry_s=host.config.dht.announce_period_s)
        host.tasks.spawn(RELAY_TASK, host.relay_client.run, restart=True)

    def _local_base(self) -> str:
        """This peer's own data plane, as it dials it itself (relayed requests are served there)."""
        data_plane = self.host.data_plane
        assert data_plane is not None and data_plane.address is not None
        host, port = data_plane.address
        if is_wildcard(host):
            host = "::1" if ":" in host else "127.0.0.1"
        return f"http://{format_addr((host, port))}"

    async def _candidates(self) -> list[PeerRecord]:
        """Members that may relay: serving, dialled directly by others, not relayed themselves."""
        host = self.host
        assert host.membership is not None and host.spec is not None
        try:
            members = await host.membership.all_peers(host.spec.n_stages)
        except SwarmdError as exc:
            log.warning("cannot list possible relays: %s", exc)
            return []
        return [r for r in members
                if r.usable and r.reachable == "yes" and not is_relayed(r.data_addr) and r.peer_id != host.peer_id]

    async def _on_change(self, relayed: str | None) -> None:
        """Announce the relayed address at once (or stop announcing one), then check it."""
        host = self.host
        host.relayed_addr = relayed
        host.forget_stage_mates()  # this peer's own entry among them changed
        if relayed is None:
            host.reachability = reachability.Reachability(status="no", addr=host.data_addr)
        else:
            await self.check()  # through the relay, by the same probers
        try:
            await host.announce()
        except SwarmdError as exc:
            log.warning("could not announce the relayed address: %s", exc)
