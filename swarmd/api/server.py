"""The control plane's HTTP server: uvicorn embedded in the daemon's event loop.

The daemon owns the loop and the signals, so uvicorn runs as one of its tasks
(:class:`EmbeddedUvicorn`), on a socket the daemon binds itself (:func:`bind_socket`, so port 0
can be read back before serving), with a per-request deadline (:class:`DeadlineH11Protocol`) so
that a slow sender cannot hold a connection open forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["DeadlineH11Protocol", "EmbeddedUvicorn", "bind_socket", "embedded_server"]


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn on our loop: the daemon, not uvicorn, owns signal handling."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request: its headers and body must arrive
    within ``request_timeout_s`` of the connection opening or of the previous answer, or the
    connection is closed. uvicorn arms no timer before a first request and cancels its keep-alive
    timer on any byte, so a client sending a header byte now and then held a connection forever."""

    def __init__(self, *args: Any, request_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._request_timeout_s = request_timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self._request_timeout_s, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        waiting = self.cycle is None or self.cycle.response_complete  # for headers
        if (waiting or self.conn.their_state is h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (0: a free port), IPv4 or IPv6 as host says."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def embedded_server(app: FastAPI, *, request_timeout_s: float) -> EmbeddedUvicorn:
    """A uvicorn server for ``app`` to run as a task of the caller's loop (``serve(sockets=...)``)."""
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
        # uvicorn calls ``http`` as a protocol factory; its annotation asks for the class itself
        http=functools.partial(DeadlineH11Protocol, request_timeout_s=request_timeout_s),  # type: ignore[arg-type]
    )
    return EmbeddedUvicorn(config)
