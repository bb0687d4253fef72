"""The trainer's failure classifier (swarmd.pipeline.failures): every refusal gets its action."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmd import errors
from swarmd.errors import PeerError, remote_error
from swarmd.pipeline.failures import Action, classify

# Every error class a peer may name, with the action its refusal calls for. The test below
# checks this table covers all of them, so a new error class must be classified on purpose.
BY_CLASS: dict[str, Action] = {
    "StaleStep": Action.REDO,
    "Busy": Action.RETRY_SOON,
    "Unavailable": Action.RETRY_SOON,
    "Starting": Action.RETRY_ELSEWHERE,
    "Draining": Action.RETRY_ELSEWHERE,
    "Migrating": Action.RETRY_ELSEWHERE,
    "PeerBehind": Action.RETRY_ELSEWHERE,
    "WrongStage": Action.RETRY_ELSEWHERE,
    "InputsNotCached": Action.RETRY_ELSEWHERE,  # the trainer resends with inputs first (stage_calls)
    "RequestTimeout": Action.BAN,  # 408: the peer did not read our body in time
    "StepMismatch": Action.FATAL,  # 409 of neither direction: nothing to retry
    "RequestError": Action.FATAL,
    "NonFinite": Action.FATAL,  # 422: NaN or Inf in what we sent (as before it had its own class)
    "WireError": Action.FATAL,
    "MalformedFrame": Action.FATAL,
    "UnsupportedVersion": Action.FATAL,
    "UnknownCodec": Action.FATAL,
    "UnsupportedDtype": Action.FATAL,
    "LimitExceeded": Action.FATAL,
    "UnsupportedMediaType": Action.FATAL,
    "Unauthorized": Action.FATAL,
    "ConfigError": Action.FATAL,
    # never sent by a data plane, but a name a peer could send: by their status
    "SwarmdError": Action.BAN,  # 500
    "DHTError": Action.RETRY_SOON,  # 503
    "BootstrapError": Action.RETRY_SOON,
    "RecordError": Action.FATAL,
    "MalformedRecord": Action.FATAL,
    "UnsupportedRecordVersion": Action.FATAL,
    "BadSignature": Action.FATAL,
    "PeerIdMismatch": Action.FATAL,
    "RecordTooLarge": Action.FATAL,
    "RecordExpired": Action.FATAL,
    "NotHeld": Action.FATAL,  # 404: GET /v1/checkpoint/{stage} of a stage the peer holds no checkpoint of
    "StageStateLost": Action.FATAL,  # 409: a daemon's own refusal to serve a stage whose state is nowhere
    "PortUnavailable": Action.RETRY_SOON,  # 503: a daemon's start-up error, never a data plane's
}


def test_the_table_covers_every_error_a_peer_can_name() -> None:
    assert set(BY_CLASS) == set(errors._REMOTE)


@pytest.mark.parametrize(("name", "action"), sorted(BY_CLASS.items()))
def test_a_refusal_is_classified_by_its_class(name: str, action: Action) -> None:
    cls = getattr(errors, name)
    assert classify(remote_error(cls.http_status, name, "why")) is action


@pytest.mark.parametrize(("status", "action"), [
    (0, Action.BAN),  # unreachable, timed out
    (200, Action.BAN),  # answered something unreadable
    (400, Action.FATAL),
    (401, Action.FATAL),
    (404, Action.FATAL),  # an older peer without the endpoint
    (405, Action.FATAL),
    (408, Action.BAN),
    (409, Action.FATAL),
    (413, Action.FATAL),
    (422, Action.FATAL),
    (500, Action.BAN),
    (502, Action.BAN),
    (503, Action.RETRY_SOON),  # a name we do not know, but "unavailable" all the same
    (504, Action.BAN),
])
def test_an_unknown_name_is_classified_by_its_status(status: int, action: Action) -> None:
    assert classify(PeerError(status, "SomethingNewer", "m")) is action


def test_the_class_wins_over_the_status() -> None:
    # a Draining peer answers 503, which alone would mean "retry soon, same peer"
    assert classify(remote_error(503, "Draining", "")) is Action.RETRY_ELSEWHERE
    # a StaleStep is a 409, which alone would be fatal
    assert classify(remote_error(409, "StaleStep", "")) is Action.REDO


@given(status=st.integers(0, 999), name=st.text(max_size=20))
def test_every_peer_error_gets_an_action(status: int, name: str) -> None:
    assert isinstance(classify(remote_error(status, name, "")), Action)


async def test_a_timeout_is_told_by_the_cause_s_type_not_by_a_name() -> None:
    """``timed_out``: this client gave up waiting (status 0, raised from a TimeoutError: asyncio's,
    aiohttp's, or the trainer's own cut of a probation call), not any error whose name says so."""
    import asyncio

    import aiohttp

    from swarmd.net.client import DataPlaneClient
    from swarmd.pipeline.failures import timed_out

    def raised_from(cause: BaseException, status: int = 0, name: str = "X") -> PeerError:
        try:
            raise PeerError(status, name, "m") from cause
        except PeerError as exc:
            return exc

    assert timed_out(raised_from(asyncio.TimeoutError()))
    assert timed_out(raised_from(aiohttp.ServerTimeoutError()))
    assert timed_out(raised_from(aiohttp.ConnectionTimeoutError()))
    assert not timed_out(raised_from(aiohttp.ClientConnectionError()))  # refused, reset: not a timeout
    assert not timed_out(PeerError(0, "TimeoutError", "a name alone says nothing"))
    assert not timed_out(remote_error(408, "RequestTimeout", "the peer's own refusal"))
    assert not timed_out(raised_from(asyncio.TimeoutError(), status=503))  # an answer came
    # a real one: a listener that accepts and never answers, and a client that waits 0.2 s
    release = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with DataPlaneClient(timeout_s=0.2) as client:
            with pytest.raises(PeerError) as held:
                await client.progress(f"127.0.0.1:{port}")
        assert held.value.status == 0 and timed_out(held.value)
    finally:
        release.set()
        server.close()
        await server.wait_closed()


async def test_a_refused_connection_is_a_gone_peer_and_a_timeout_is_not() -> None:
    """``refused_connection``: nothing listens at the address (a dead process), told apart from a
    peer that holds the call (loaded) by a real refused connect and a real timeout."""
    import asyncio

    from swarmd.net.client import DataPlaneClient
    from swarmd.pipeline.failures import refused_connection

    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # the port is closed now: connecting to it is refused
    async with DataPlaneClient(timeout_s=2.0) as client:
        with pytest.raises(PeerError) as refused:
            await client.progress(f"127.0.0.1:{port}")
    assert refused_connection(refused.value), repr(refused.value.__cause__)
    assert not refused_connection(PeerError(0, "ConnectionRefusedError", "a name alone says nothing"))
    assert not refused_connection(remote_error(503, "Busy", "an answer"))
