"""The dashboard at ``GET /``: a small self-contained page served from the package.

The page (``swarmd/api/static/``: one HTML file, one script, one stylesheet) polls this
daemon's own JSON endpoints (``/status``, ``/swarm``, ``/training``) and draws the swarm: the
stages as columns of peers, the loss and validation curves and samples/s as inline SVG, recent
averaging rounds and migrations. Nothing is fetched from anywhere else (no CDN, no fonts), so it
works on an offline LAN. The files are package data (``setup.cfg``), read once and served from
memory; only the names listed in :data:`ASSETS` are served, so no path reaches the disk.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import HTTPException
from fastapi.responses import Response

__all__ = ["ASSETS", "asset", "index"]

#: The files the page is made of, with their content types.
ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}

# the page runs only its own script and style, and talks only to this daemon
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@cache
def _read(name: str) -> bytes:
    return resources.files("swarmd.api").joinpath("static").joinpath(name).read_bytes()


def asset(name: str) -> Response:
    """One of the page's files, or 404 for any other name."""
    content_type = ASSETS.get(name)
    if content_type is None:
        raise HTTPException(status_code=404, detail=f"no dashboard file named {name[:64]!r}")
    return Response(_read(name), media_type=content_type,
                    headers={"Cache-Control": "no-cache", "Content-Security-Policy": _CSP,
                             "X-Content-Type-Options": "nosniff"})


def index() -> Response:
    return asset("index.html")
