"""Checkpoints of a stage under ``--state-dir``: written atomically between steps, read back with suspicion.

A volunteer swarm's training otherwise lives only in the memory of its live peers: a stage that
loses every peer would restart from fresh parameters, a swarm that is stopped would lose
everything (SWARM's reference code saves each stage with ``torch.save``; Prime Intellect's
trainer and Psyche checkpoint to disk too). Every peer therefore writes its stage's state every
``--checkpoint-every`` steps and on graceful shutdown, and a restarted peer resumes from the
newest state of its stage that exists anywhere (``Daemon.obtain_state``).

On disk, in ``STATE_DIR/checkpoints/``, one checkpoint is two files::

    s<stage>-<step:010d>.safetensors   parameters ("param.<name>") and optimizer state ("opt.<name>")
    s<stage>-<step:010d>.json          the sidecar: format, swarm, stage, step, the model spec and the
                                       training settings (each with its digest), the parameters'
                                       digest, the optimizer's meta, created (unix time), and the
                                       tensor file's size and SHA-256

Tensors go through safetensors and metadata through strict JSON (no NaN, no duplicate keys):
nothing is ever unpickled. A write goes tensors first, then the sidecar, each to a temporary
file that is fsynced and renamed, then the directory is fsynced: the sidecar is the commit
mark, so a power cut leaves either a complete checkpoint or none. Reading checks the sidecar,
then the tensor file's size and hash (a truncated or corrupt file is refused with one log line
naming it, and the next newest is used), then the parameters' digest.

The decisions are pure functions over what was read: :func:`mismatch` (is this checkpoint of
this swarm, model and training settings) and :func:`prune` (which to delete to keep the last K
per stage); which state a peer takes for its stage (its own checkpoint, a live stage-mate's,
another peer's checkpoint, fresh) is ``swarmd.pipeline.placement.resume``'s. A peer offers the newest
checkpoint it holds of every stage to the swarm (:attr:`Checkpointer.held`).
:class:`Checkpointer` is the daemon's task that takes the snapshot on the stage's worker
thread (between jobs, so between steps) and writes it on another thread, so serving and
averaging never wait on the disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from swarmd.errors import SwarmdError
from swarmd.pipeline.model import tensors_digest

if TYPE_CHECKING:
    from swarmd.pipeline.spec import ModelSpec, TrainingSpec
    from swarmd.pipeline.stage.executor import StageExecutor

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "atomic_write",
    "checkpoint_dir",
    "find_checkpoints",
    "mismatch",
    "newest_valid",
    "prune",
    "read_checkpoint",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "swarmd-checkpoint/1"
SUBDIR = "checkpoints"
DEFAULT_EVERY = 50  # steps between checkpoints (--checkpoint-every)
DEFAULT_KEEP = 3  # checkpoints kept per stage (--keep-checkpoints)
MAX_SIDECAR_BYTES = 4 * 2**20
_NAME = re.compile(r"s(\d{1,5})-(\d{10})\.json")
_tmp_names = itertools.count()


class CheckpointError(SwarmdError):
    """A checkpoint that cannot be used: unreadable, truncated, corrupt, or of another swarm or model."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint on disk, as its sidecar describes it (the tensors are read on demand)."""

    path: Path  # the sidecar (.json); the tensors lie beside it (.safetensors)
    swarm: str
    stage: int
    step: int
    model: dict[str, Any]  # ModelSpec.to_dict()
    model_digest: str
    training: dict[str, Any]  # TrainingSpec.to_dict()
    training_digest: str
    params_digest: str
    state_meta: dict[str, Any]  # what StageExecutor.load_state takes: stage, step, digests, optimizer
    created: float
    tensors_bytes: int
    tensors_sha256: str

    @property
    def tensors_path(self) -> Path:
        return self.path.with_suffix(".safetensors")

    @property
    def bytes(self) -> int:
        """Both files together."""
        try:
            return self.tensors_bytes + self.path.stat().st_size
        except OSError:
            return self.tensors_bytes

    def sidecar(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "swarm": self.swarm,
            "stage": self.stage,
            "step": self.step,
            "model": self.model,
            "model_digest": self.model_digest,
            "training": self.training,
            "training_digest": self.training_digest,
            "params_digest": self.params_digest,
            "state": self.state_meta,
            "created": self.created,
            "tensors_bytes": self.tensors_bytes,
            "tensors_sha256": self.tensors_sha256,
        }


def checkpoint_dir(state_dir: Path) -> Path:
    return Path(state_dir) / SUBDIR


def checkpoint_stem(stage: int, step: int) -> str:
    return f"s{stage}-{step:010d}"


# ---- writing -----------------------------------------------------------------------------------


def write_checkpoint(
    directory: Path,
    *,
    swarm: str,
    spec: ModelSpec,
    training: TrainingSpec,
    meta: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    now: float | None = None,
) -> CheckpointInfo:
    """Write one checkpoint atomically from a stage snapshot (``StageExecutor.snapshot_state``).

    OSError when the disk refuses (the caller warns and serves on); ValueError when the
    optimizer's meta is not strict JSON.
    """
    stage, step = int(meta["stage"]), int(meta["step"])
    state_meta = json.loads(_dumps(dict(meta)))  # fails here, before any file, if it is not strict JSON
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    stem = checkpoint_stem(stage, step)
    blob = save_safetensors({k: t.contiguous() for k, t in tensors.items()},
                            metadata={"format": CHECKPOINT_FORMAT, "stage": str(stage), "step": str(step)})
    info = CheckpointInfo(
        path=directory / f"{stem}.json",
        swarm=swarm,
        stage=stage,
        step=step,
        model=spec.to_dict(),
        model_digest=spec.digest,
        training=dict(training.to_dict()),
        training_digest=training.digest,
        params_digest=str(meta["params_digest"]),
        state_meta=state_meta,
        created=time.time() if now is None else now,
        tensors_bytes=len(blob),
        tensors_sha256=hashlib.sha256(blob).hexdigest(),
    )
    atomic_write(info.tensors_path, blob)  # tensors first: the sidecar is the commit mark
    atomic_write(info.path, (_dumps(info.sidecar()) + "\n").encode())
    _fsync_dir(directory)
    return info


def _dumps(value: Any) -> str:
    return json.dumps(value, allow_nan=False, sort_keys=True, separators=(",", ":"))


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_tmp_names)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- reading -----------------------------------------------------------------------------------


def _strict_json(data: bytes, where: Path) -> Any:
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise ValueError(f"duplicate key {k!r}")
            out[k] = v
        return out

    try:
        return json.loads(data.decode("utf-8"), parse_constant=no_constants, object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {where} is not valid JSON ({exc})") from None


def _field(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: Path) -> Any:
    value = d.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise CheckpointError(f"checkpoint {where} has no valid {key!r}")
    return value


def read_sidecar(path: Path) -> CheckpointInfo:
    """A checkpoint's sidecar, checked for shape (not yet its tensors); CheckpointError if unusable."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SIDECAR_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_SIDECAR_BYTES:
        raise CheckpointError(f"checkpoint {path} is larger than {MAX_SIDECAR_BYTES} bytes")
    d = _strict_json(data, path)
    if not isinstance(d, dict) or d.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a {CHECKPOINT_FORMAT} checkpoint")
    info = CheckpointInfo(
        path=path,
        swarm=_field(d, "swarm", str, path),
        stage=_field(d, "stage", int, path),
        step=_field(d, "step", int, path),
        model=_field(d, "model", dict, path),
        model_digest=_field(d, "model_digest", str, path),
        training=_field(d, "training", dict, path),
        training_digest=_field(d, "training_digest", str, path),
        params_digest=_field(d, "params_digest", str, path),
        state_meta=_field(d, "state", dict, path),
        created=float(_field(d, "created", (int, float), path)),
        tensors_bytes=_field(d, "tensors_bytes", int, path),
        tensors_sha256=_field(d, "tensors_sha256", str, path),
    )
    if info.stage < 0 or info.step < 0 or info.state_meta.get("step") != info.step \
            or info.state_meta.get("stage") != info.stage:
        raise CheckpointError(f"checkpoint {path} contradicts itself (stage or step)")
    return info


def read_tensors(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, after checking size, SHA-256 and the parameters' digest."""
    path = info.tensors_path
    try:
        size = path.stat().st_size
        if size != info.tensors_bytes:
            raise CheckpointError(f"checkpoint {path} is truncated or overwritten: {size} bytes, "
                                  f"its sidecar says {info.tensors_bytes}")
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    if hashlib.sha256(data).hexdigest() != info.tensors_sha256:
        raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 does not match its sidecar")
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is not a readable safetensors file ({exc})") from exc
    params = [(k.removeprefix("param."), t) for k, t in tensors.items() if k.startswith("param.")]
    if tensors_digest(params) != info.params_digest:
        raise CheckpointError(f"checkpoint {path}: its parameters do not match their digest")
    return tensors


def read_checkpoint(path: Path) -> tuple[CheckpointInfo, dict[str, torch.Tensor]]:
    """Sidecar and verified tensors of the checkpoint whose sidecar is ``path``."""
    info = read_sidecar(path)
    return info, read_tensors(info)


def find_checkpoints(directory: Path, *, on_refused: Callable[[str], None] | None = None) -> list[CheckpointInfo]:
    """Every checkpoint in ``directory`` whose sidecar reads, newest step first (tensors not yet checked).

    A sidecar that does not read is reported once through ``on_refused`` (default: a warning).
    A missing directory holds no checkpoints.
    """
    report = on_refused or log.warning
    try:
        names = sorted(p for p in directory.iterdir() if _NAME.fullmatch(p.name))
    except OSError:
        return []
    found: list[CheckpointInfo] = []
    for path in names:
        try:
            found.append(read_sidecar(path))
        except CheckpointError as exc:
            report(f"{exc}; ignored")
    found.sort(key=lambda c: (-c.step, c.stage, c.created))
    return found


# ---- pure decisions ----------------------------------------------------------------------------


def mismatch(info: CheckpointInfo, *, swarm: str, model_digest: str, training_digest: str | None = None) -> str | None:
    """Why ``info`` cannot be resumed in this swarm with this model (and these settings), or None."""
    if info.swarm != swarm:
        return f"checkpoint {info.path} is of swarm {info.swarm!r}, not {swarm!r}; not used"
    if info.model_digest != model_digest:
        return (f"checkpoint {info.path} is of another model ({info.model_digest[:12]}, this swarm trains "
                f"{model_digest[:12]}); not used")
    if training_digest is not None and info.training_digest != training_digest:
        return (f"checkpoint {info.path} was trained with other training settings ({info.training_digest[:12]}, "
                f"this swarm's are {training_digest[:12]}); not used")
    return None


def prune(checkpoints: Iterable[CheckpointInfo], keep: int) -> list[CheckpointInfo]:
    """The checkpoints to delete so that the ``keep`` newest of each (swarm, model, stage) remain."""
    groups: dict[tuple[str, str, int], list[CheckpointInfo]] = {}
    for c in checkpoints:
        groups.setdefault((c.swarm, c.model_digest, c.stage), []).append(c)
    doomed: list[CheckpointInfo] = []
    for group in groups.values():
        group.sort(key=lambda c: (-c.step, -c.created))
        doomed.extend(group[max(keep, 0):])
    return sorted(doomed, key=lambda c: (c.stage, c.step))


# ---- the daemon's task -------------------------------------------------------------------------


class Checkpointer:
    """Writes the served stage's checkpoints every ``every`` steps (0: never), keeps ``keep``.

    ``save`` takes the snapshot on the stage's worker thread (a job like any other, so between
    steps) and writes it on a thread of its own; one write at a time. A disk that refuses is
    logged (once per distinct error) and counted, and the peer serves on.
    """

    def __init__(self, state_dir: Path, *, swarm: str, every: int = DEFAULT_EVERY, keep: int = DEFAULT_KEEP) -> None:
        self.directory = checkpoint_dir(state_dir)
        self.swarm = swarm
        self.every = every
        self.keep = keep
        self.newest: CheckpointInfo | None = None  # the newest written or resumed from, of the served stage
        self.resumed_from: CheckpointInfo | None = None
        # stage -> step of the newest checkpoint held of it that ``accept`` takes: offered to the swarm
        # (PeerRecord.held, GET /v1/checkpoint/{stage}), whatever stage this peer serves now
        self.held: dict[int, int] = {}
        self.accept: Callable[[CheckpointInfo], str | None] = lambda info: None
        self.writes = 0
        self.failures = 0
        self.last_error: str | None = None
        self.last_write_s: float | None = None
        self._write_lock = asyncio.Lock()
        self._warned: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.every > 0

    async def scan(self, accept: Callable[[CheckpointInfo], str | None] | None = None) -> dict[int, int]:
        """Read the sidecars on disk (off the loop) and note the newest checkpoint of each stage that
        ``accept`` (a :func:`mismatch` for this swarm, model and training settings) takes."""
        if accept is not None:
            self.accept = accept
        found = await asyncio.to_thread(find_checkpoints, self.directory, on_refused=log.debug)
        held: dict[int, int] = {}
        for info in found:
            if self.accept(info) is None and info.step > held.get(info.stage, -1):
                held[info.stage] = info.step
        self.held = held
        return dict(held)

    def mine(self, stage: int) -> list[CheckpointInfo]:
        """This peer's checkpoints of ``stage`` that ``accept`` takes, newest first (sidecars only)."""
        found = find_checkpoints(self.directory, on_refused=log.debug)
        return [c for c in found if c.stage == stage and self.accept(c) is None]

    async def load_newest(self, stage: int) -> tuple[CheckpointInfo, dict[str, torch.Tensor]] | None:
        """The newest checkpoint of ``stage`` whose tensors verify (read and hashed off the loop), or None."""
        def read() -> tuple[CheckpointInfo, dict[str, torch.Tensor]] | None:
            return newest_valid(self.mine(stage), accept=self.accept)

        return await asyncio.to_thread(read)

    def newest_step(self, stage: int | None) -> int | None:
        """The newest checkpoint step held for ``stage`` (for the peer record), None if none."""
        if self.newest is None or self.newest.stage != stage:
            return None
        return self.newest.step

    async def save(self, executor: StageExecutor, training: TrainingSpec) -> CheckpointInfo | None:
        """Snapshot ``executor`` now and write it; None when it was not written (disabled, failed)."""
        if not self.enabled:
            return None
        async with self._write_lock:
            if self.newest is not None and self.newest.stage == executor.stage and self.newest.step == executor.step:
                return self.newest  # nothing new since the last one
            meta, tensors = await executor.snapshot_state()
            started = time.perf_counter()
            write = asyncio.ensure_future(asyncio.to_thread(
                write_checkpoint, self.directory, swarm=self.swarm, spec=executor.spec, training=training,
                meta=meta, tensors=tensors))
            try:
                info = await asyncio.shield(write)  # a cancelled caller does not cut a write short
            except (OSError, ValueError) as exc:
                self._failed(exc)
                return None
            self.last_write_s = time.perf_counter() - started
            self.writes += 1
            self.newest = info
            self.held[info.stage] = max(info.step, self.held.get(info.stage, -1))
            self.last_error = None
            log.info("checkpoint of stage %d at step %d written to %s in %.2fs (%d bytes)",
                     info.stage, info.step, info.path.with_suffix(""), self.last_write_s, info.bytes)
            await asyncio.to_thread(self._prune)
            return info

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        text = f"{type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}"
        self.last_error = text
        if text not in self._warned:
            self._warned.add(text)
            log.warning("cannot write a checkpoint to %s (%s); serving on without one", self.directory, text)

    def _prune(self) -> None:
        for old in prune(find_checkpoints(self.directory, on_refused=log.debug), self.keep):
            for path in (old.path, old.tensors_path):  # the sidecar first: no half checkpoint is ever listed
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    log.debug("could not delete old checkpoint %s: %s", path, exc)

    async def run(self, current: Callable[[], tuple[StageExecutor, TrainingSpec] | None]) -> None:
        """The periodic task: a checkpoint each time the served stage passes a multiple of ``every``.

        Due is the first multiple after this peer's newest checkpoint of the stage; a stage already
        past it (it stepped while this loop waited on the stage it served before a move, or the peer
        downloaded a trained stage it holds no checkpoint of) is written at once."""
        if not self.enabled:
            return
        while True:
            served = current()
            if served is None:
                await asyncio.sleep(1.0)
                continue
            executor, training = served
            target = ((self.newest_step(executor.stage) or 0) // self.every + 1) * self.every
            reached = executor.step >= target or await executor.wait_progress(5.0, step=target)  # also notices a move
            now = current()
            if reached and now is not None and now[0] is executor:
                try:
                    await self.save(executor, training)
                except RuntimeError:  # the executor was closed under us (a move, a shutdown): next one
                    continue

    def status(self) -> dict[str, Any]:
        newest = self.newest
        return {
            "every": self.every,
            "keep": self.keep,
            "dir": str(self.directory),
            "newest": None if newest is None else {
                "step": newest.step,
                "stage": newest.stage,
                "age_s": round(max(0.0, time.time() - newest.created), 3),
                "bytes": newest.bytes,
                "path": str(newest.path.with_suffix("")),
            },
            "resumed_from_step": self.resumed_from.step if self.resumed_from is not None else None,
            "writes": self.writes,
            "failures": self.failures,
            "last_error": self.last_error,
            "last_write_s": None if self.last_write_s is None else round(self.last_write_s, 4),
        }


def newest_valid(
    checkpoints: Iterable[CheckpointInfo],
    *,
    accept: Callable[[CheckpointInfo], str | None],
    on_refused: Callable[[str], None] | None = None,
) -> tuple[CheckpointInfo, dict[str, torch.Tensor]] | None:
    """The newest checkpoint that ``accept`` (a :func:`mismatch`) takes and whose tensors verify;
    every one refused on the way is reported once (default: a warning naming its file)."""
    report = on_refused or log.warning
    for info in sorted(checkpoints, key=lambda c: -c.step):
        why = accept(info)
        if why is not None:
            report(why)
            continue
        try:
            return info, read_tensors(info)
        except CheckpointError as exc:
            report(f"{exc}; trying the next newest")
    return None
