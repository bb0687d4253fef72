"""Network addresses as swarmd writes them: ``host:port``, with IPv6 hosts in brackets."""

from __future__ import annotations


def format_addr(addr: tuple[str, int] | None) -> str | None:
    """``("10.0.0.1", 7000)`` → ``"10.0.0.1:7000"``; ``("2001:db8::1", 7000)`` → ``"[2001:db8::1]:7000"``."""
    if addr is None:
        return None
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
