"""The data-plane client's connections to a real daemon: kept open, TCP_NODELAY, reply bodies measured.

Over the internet a new connection costs a round trip and starts TCP's congestion window from
scratch, and a small request held back for a full segment costs a delayed ACK: the averaging rounds
between stage-mates (issue 28, item 4) want neither. Their bodies' timings are the link measurement
``grad_codec = "auto"`` chooses from (``swarmd.net.links``).
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import aiohttp
import torch

from swarmd.net.client import KEEPALIVE_S, DataPlaneClient, client_session
from swarmd.net.links import MIN_SAMPLE_BYTES
from tests.conftest import TINY, running_daemon


async def test_one_connection_is_kept_open_and_has_tcp_nodelay() -> None:
    created = 0

    async def on_create(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object) -> None:
        nonlocal created
        created += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_create)
    async with running_daemon(0) as d, client_session(None, trace_configs=[trace]) as session:
        assert isinstance(session.connector, aiohttp.TCPConnector)
        assert session.connector._keepalive_timeout == KEEPALIVE_S  # aiohttp's own default is 15 s
        for _ in range(3):
            async with session.get(f"http://{d.data_addr}/v1/progress") as resp:
                assert resp.status == 200
                await resp.read()
        assert created == 1  # three requests, one connection
        # the pooled connection (aiohttp's pool is private; a small reply releases it before it is read)
        pooled = [proto for conns in session.connector._conns.values() for proto, _ in conns]
        assert len(pooled) == 1 and pooled[0].transport is not None
        sock = pooled[0].transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_large_reply_bodies_measure_the_link_and_small_ones_do_not() -> None:
    async with running_daemon(0) as d, DataPlaneClient() as c:
        small = torch.randint(0, TINY.vocab_size, (1, TINY.seq_len))
        await c.forward(d.data_addr, 0, small, model=TINY.digest)  # 16 KiB of activations
        assert c.links.estimate(d.data_addr) is None
        rows = MIN_SAMPLE_BYTES // (TINY.seq_len * TINY.d_model * 4) + 1
        big = torch.randint(0, TINY.vocab_size, (rows, TINY.seq_len))
        reply = await c.forward(d.data_addr, 0, big, model=TINY.digest)
        assert reply.outputs.numel() * 4 >= MIN_SAMPLE_BYTES
        est = c.links.estimate(d.data_addr)
        assert est is not None and est.samples == 1 and est.bytes_per_s > 0
