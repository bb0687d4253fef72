"""The evidence of drawn parts an owner keeps past their round, for their audits (``audit``, ``auditor``).

A commit that draws a part for an audit obliges its owner to show that part's evidence (its signed ready
report, the mean, every member's signed slice) to whoever audits it, for as long as an audit can take: an
owner that will not is held to account as one that lied (``auditor``: ``unaccountable``). So an honest owner
must not forget it: not when the round's state is dropped (an owner holds its last 16 rounds' parts), and not
when its daemon restarts with the same identity (``--state-dir``). :class:`KeptEvidence` holds the last
``keep`` drawn parts in memory and, given a directory (``<state-dir>/audits``), as one file each, written off the
event loop and read back after a restart; the oldest are forgotten first. Files are this peer's own writing, read
back through the wire format's checks (``audit.PartEvidence.decode``), never unpickled.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from pathlib import Path

from swarmd.errors import RequestError, WireError
from swarmd.net.wire import decode_frame
from swarmd.pipeline.averaging.allreduce.audit import PartEvidence

__all__ = ["KEEP", "KeptEvidence"]

log = logging.getLogger(__name__)

#: Drawn parts kept: a stage draws one part in ``1 / AUDIT_SHARE`` commits, and an audit takes at most
#: ``AUDIT_ROUNDS`` commits plus a few unanswered requests, so a peer owning one part of the stage's is asked
#: for far fewer at once. Each holds about a gradient's worth of slices as the members' codec sent them.
KEEP = 8
_ROUND_ID = re.compile(r"[0-9]{1,20}-[0-9a-zA-Z_-]{1,96}")
_SUFFIX = ".audit"


class KeptEvidence:
    """The last ``keep`` drawn parts' evidence, by (round id, part); on disk too when given a ``directory``."""

    def __init__(self, directory: Path | None = None, keep: int = KEEP) -> None:
        self.directory = directory
        self.keep = keep
        self._mem: OrderedDict[tuple[str, int], PartEvidence] = OrderedDict()
        self._lock = asyncio.Lock()  # (file writes and prunes one at a time)

    def _path(self, round_id: str, part: int) -> Path | None:
        if self.directory is None or not _ROUND_ID.fullmatch(round_id) or not 0 <= part < 1 << 20:
            return None  # (round ids come from the network: only this shape names a file)
        return self.directory / f"{round_id}.{part}{_SUFFIX}"

    async def put(self, round_id: str, part: int, evidence: PartEvidence) -> None:
        """Keep ``evidence`` (in memory at once, then on disk when there is a directory)."""
        self._mem[(round_id, part)] = evidence
        while len(self._mem) > self.keep:
            self._mem.popitem(last=False)
        path = self._path(round_id, part)
        if path is None:
            return
        async with self._lock:
            try:
                await asyncio.to_thread(self._write, path, evidence)
            except OSError as exc:
                log.warning("could not keep the evidence of part %d of round %s on disk (%s): a restart would "
                            "forget it", part, round_id, exc)

    def _write(self, path: Path, evidence: PartEvidence) -> None:
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(evidence.encode())
        tmp.replace(path)
        files = sorted(self.directory.glob(f"*{_SUFFIX}"), key=lambda p: (p.stat().st_mtime_ns, p.name))
        for old in files[:-self.keep]:
            old.unlink(missing_ok=True)

    async def get(self, round_id: str, part: int) -> PartEvidence | None:
        """The evidence kept of a part, or None (from disk when memory forgot it: a restart)."""
        held = self._mem.get((round_id, part))
        if held is not None:
            return held
        path = self._path(round_id, part)
        if path is None:
            return None
        try:
            return await asyncio.to_thread(self._read, path)
        except FileNotFoundError:
            return None
        except (OSError, WireError, RequestError) as exc:
            log.warning("the evidence kept of part %d of round %s does not read (%s)", part, round_id, exc)
            return None

    @staticmethod
    def _read(path: Path) -> PartEvidence:
        return PartEvidence.decode(decode_frame(path.read_bytes()))

    def __len__(self) -> int:
        return len(self._mem)
