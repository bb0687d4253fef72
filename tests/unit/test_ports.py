"""``swarmd.net.ports`` and the ``--join`` check: what a daemon binds and resolves before it starts anything.

Real sockets on 127.0.0.1; the command line's view of the same failures is in test_cli_failures.py.
"""

from __future__ import annotations

import errno
import socket

import pytest

from swarmd.errors import ConfigError, PortUnavailable
from swarmd.net.addresses import check_join_hosts
from swarmd.net.ports import Endpoint, _explain, bind_listeners

FREE = ("127.0.0.1", 0)


def test_three_sockets_bound_and_claimed_before_they_are_served() -> None:
    listeners = bind_listeners(FREE, FREE, FREE)
    try:
        assert listeners.data.type == listeners.api.type == socket.SOCK_STREAM
        assert listeners.dht.type == socket.SOCK_DGRAM
        for sock in (listeners.data, listeners.api):  # listening already: nobody can take the port meanwhile
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError) as taken:
                    other.bind(sock.getsockname())
                    other.listen()
                assert taken.value.errno == errno.EADDRINUSE
            with socket.create_connection(sock.getsockname(), timeout=5):
                pass  # a connection waits in the backlog until the server takes the socket
    finally:
        listeners.close()
        listeners.close()  # idempotent: the daemon closes what it never handed on


@pytest.mark.parametrize("which", ["data", "api", "dht"])
def test_a_taken_port_names_its_flag_and_frees_the_others(which: str) -> None:
    kind = socket.SOCK_DGRAM if which == "dht" else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as taken:
        taken.bind(FREE)
        if kind == socket.SOCK_STREAM:
            taken.listen()
        port = taken.getsockname()[1]
        spots = {"data": FREE, "api": FREE, "dht": FREE, which: ("127.0.0.1", port)}
        with pytest.raises(PortUnavailable) as failure:
            bind_listeners(spots["data"], spots["api"], spots["dht"])
    flag = {"data": "--port", "api": "--api-port", "dht": "--dht-port"}[which]
    assert str(failure.value).startswith(f"{flag} {port} on 127.0.0.1 is already in use")
    assert not isinstance(failure.value, ConfigError)  # the same command works once the port is free: exit 1


def test_one_port_for_both_planes_and_foreign_hosts_are_the_users_to_fix() -> None:
    with pytest.raises(ConfigError, match="--port and --api-port are both 8123 on 127.0.0.1"):
        bind_listeners(("127.0.0.1", 8123), ("127.0.0.1", 8123), FREE)
    with pytest.raises(ConfigError, match="--api-host 192.0.2.1 is not an address of this machine"):
        bind_listeners(FREE, ("192.0.2.1", 0), FREE)
    with pytest.raises(ConfigError, match="--dht-host nonexistent.invalid cannot be resolved"):
        bind_listeners(FREE, FREE, ("nonexistent.invalid", 0))


def test_a_privileged_port_is_explained() -> None:
    endpoint = Endpoint("--port", "--host", "0.0.0.0", 80, socket.SOCK_STREAM)
    error = _explain(PermissionError(errno.EACCES, "Permission denied"), endpoint, "--port 80 on 0.0.0.0")
    assert isinstance(error, PortUnavailable)
    assert str(error).startswith("--port 80 on 0.0.0.0 is not allowed (Permission denied): ports below 1024")


async def test_join_hosts_resolve_first_and_one_bad_name_is_only_a_warning() -> None:
    assert await check_join_hosts([]) == ([], [])
    fine = [("127.0.0.1", 31337), ("::1", 31337), ("localhost", 31337)]
    assert await check_join_hosts(fine) == (fine, [])
    with pytest.raises(ConfigError, match=r"--join nonexistent.invalid:31337: cannot resolve nonexistent.invalid"):
        await check_join_hosts([("nonexistent.invalid", 31337)])
    usable, problems = await check_join_hosts([("nonexistent.invalid", 31337), ("127.0.0.1", 31337)])
    assert usable == [("127.0.0.1", 31337)]
    assert len(problems) == 1 and "cannot resolve nonexistent.invalid" in problems[0]
