"""A headless chromium for dashboard tests (the Debian package; skipped where it is missing)."""


from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CHROMIUM = next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))),
                None)


def chromium(url: str, *action: str, profile: Path) -> subprocess.CompletedProcess[str]:
    """Headless chromium on ``url``; the page's script runs for 4 s of virtual time first."""
    assert CHROMIUM is not None
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            f"--user-data-dir={profile}", "--hide-scrollbars", "--virtual-time-budget=4000", *action, url]
    return subprocess.run(args, capture_output=True, text=True, timeout=90)
