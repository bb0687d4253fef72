"""Prometheus text read back: scrape a daemon's /metrics and parse its samples."""


from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def scrape(api: str) -> str:
    async with httpx.AsyncClient() as c:
        r = await c.get(f"http://{api}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text
