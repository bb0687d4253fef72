"""The daemon's state directory (``--state-dir``): one per daemon, held by a lock for its life.

It keeps the peer's ed25519 key (``swarmd.dht.identity``), so a restarted peer keeps its peer
id, and its checkpoints (``checkpoints/``, ``swarmd.checkpoint``), so it resumes its stage.
Two daemons sharing one directory would share that key, announce the same peer id and
overwrite each other's records: the lock makes the second one exit with a sentence instead.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from swarmd.errors import ConfigError


def lock_state_dir(state_dir: Path) -> IO[str]:
    """Create ``state_dir`` (mode 0700) and hold an exclusive lock on it until the returned
    handle is closed; ConfigError when it cannot be used or another daemon holds it."""
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        handle = open(state_dir / "lock", "a+")
    except OSError as exc:
        raise ConfigError(f"cannot use --state-dir {state_dir}: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ConfigError(
            f"another swarmd is running with --state-dir {state_dir}; give each daemon its own --state-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
