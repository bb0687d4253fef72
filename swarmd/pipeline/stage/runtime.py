"""A stage as one peer serves it: the executor that computes and the averager that steps it.

The daemon holds exactly one ``StageRuntime`` at a time (``Daemon.runtime``). The data plane
never keeps its own reference to an executor or averager: it is given a getter and asks for the
current runtime on every request, so a migration (``swarmd.pipeline.placement.migration``) that builds
the next stage's runtime swaps it in with one assignment, and no collaborator is patched from
outside.

The averager is attached once the peer takes part in its stage's rounds (after its state
download) and detached while it drains for a move; ``averager is None`` means "not averaging
now": progress is answered from the executor alone and contributions are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmd.pipeline.averaging.averager import StageAverager
    from swarmd.pipeline.stage.executor import StageExecutor


class StageRuntime:
    """One stage's executor and (while it takes part in rounds) its averager."""

    def __init__(self, executor: StageExecutor) -> None:
        self.executor = executor
        self.averager: StageAverager | None = None

    @property
    def stage(self) -> int:
        return self.executor.stage

    async def close(self) -> None:
        """Close the averager's rounds (if any) and stop the executor's worker thread."""
        if self.averager is not None:
            await self.averager.close()
            self.averager = None
        await self.executor.close()


#: How the data plane reaches the daemon's current runtime (None before the stage is built).
RuntimeGetter = Callable[[], "StageRuntime | None"]
