"""Export: one safetensors file holding the whole trained model, from the live swarm or from checkpoints.

A swarm's model lives cut into stages on many machines; to use it, it has to come back together.
:func:`from_swarm` asks a daemon's control plane for the swarm (``GET /swarm``), downloads each
stage's state from a serving peer at the stage's newest step (``GET /v1/state``, the joiners'
checksummed stream) and checks each against its parameters' digest; :func:`from_checkpoints`
takes the newest valid checkpoint of each stage found in the given state or checkpoint
directories (``swarmd.checkpoint``). Either gives an :class:`ExportedModel`, which
:func:`write_model` writes as one safetensors file: every parameter under the name
:class:`~swarmd.pipeline.model.FullModel` gives it (``stages.<k>.<name>``), and as metadata the
model spec (JSON), its digest, each stage's step and parameters' digest. :func:`load_model`
reads it back into a ``FullModel``, checking every digest. Nothing is pickled.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarmd.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    atomic_write,
    checkpoint_dir,
    find_checkpoints,
    read_tensors,
)
from swarmd.errors import ConfigError, SwarmdError
from swarmd.pipeline.model import FullModel, tensors_digest
from swarmd.pipeline.spec import ModelSpec

__all__ = ["MODEL_FORMAT", "ExportedModel", "from_checkpoints", "from_swarm", "load_model", "write_model"]

log = logging.getLogger(__name__)

MODEL_FORMAT = "swarmd-model/1"
Progress = Callable[[int, int], None]  # (stages done, stages in all)


class ExportError(SwarmdError):
    """The model cannot be assembled or read: a stage missing, digests that disagree, a bad file."""


@dataclass
class ExportedModel:
    """Every stage's parameters (names within the stage), with the step and digest each was at."""

    spec: ModelSpec
    stages: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    swarm: str | None = None

    def add(self, stage: int, params: dict[str, torch.Tensor], *, step: int, digest: str, source: str) -> None:
        got = tensors_digest(params.items())
        if got != digest:
            raise ExportError(f"the parameters of stage {stage} from {source} do not match their digest")
        self.stages[stage], self.steps[stage], self.digests[stage] = params, step, digest

    def check_complete(self) -> None:
        missing = [k for k in range(self.spec.n_stages) if k not in self.stages]
        if missing:
            raise ExportError(f"no state of stage(s) {', '.join(map(str, missing))} was found; "
                              f"the model has stages 0..{self.spec.n_stages - 1}")
        if len(set(self.steps.values())) > 1:
            log.warning("the stages are at different steps (%s): the model mixes them, as the swarm does",
                        ", ".join(f"stage {k}: {s}" for k, s in sorted(self.steps.items())))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"stages.{k}.{name}": t for k in sorted(self.stages) for name, t in sorted(self.stages[k].items())}

    def metadata(self) -> dict[str, str]:
        return {
            "format": MODEL_FORMAT,
            "spec": json.dumps(self.spec.to_dict(), sort_keys=True),
            "model_digest": self.spec.digest,
            "steps": json.dumps({str(k): v for k, v in sorted(self.steps.items())}),
            "params_digests": json.dumps({str(k): v for k, v in sorted(self.digests.items())}),
            **({"swarm": self.swarm} if self.swarm is not None else {}),
        }

    def to_full_model(self) -> FullModel:
        self.check_complete()
        model = FullModel(self.spec)
        model.load_state_dict(self.state_dict(), strict=True)
        return model.eval()


def _params(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("param."): t for k, t in tensors.items() if k.startswith("param.")}


def from_checkpoints(dirs: Sequence[Path], *, progress: Progress | None = None) -> ExportedModel:
    """The newest valid checkpoint of every stage found in ``dirs`` (state dirs or their checkpoints/)."""
    found: list[CheckpointInfo] = []
    for d in dirs:
        d = Path(d)
        found += find_checkpoints(d) + find_checkpoints(checkpoint_dir(d))
    if not found:
        raise ExportError(f"no checkpoint in {', '.join(map(str, dirs))}")
    newest = max(found, key=lambda c: (c.step, c.created))
    spec = _spec_of(newest)
    model = ExportedModel(spec=spec, swarm=newest.swarm)
    others = {c.model_digest for c in found} - {spec.digest}
    if others:
        log.warning("ignoring checkpoints of %d other model(s) (%s)", len(others), ", ".join(o[:12] for o in others))
    by_stage = sorted((c for c in found if c.model_digest == spec.digest and c.swarm == newest.swarm),
                      key=lambda c: (c.stage, -c.step, -c.created))
    for stage in range(spec.n_stages):
        for c in (c for c in by_stage if c.stage == stage):
            try:
                tensors = read_tensors(c)
            except CheckpointError as exc:
                log.warning("%s; trying the next newest", exc)
                continue
            model.add(stage, _params(tensors), step=c.step, digest=c.params_digest, source=str(c.path))
            break
        if progress is not None:
            progress(stage + 1, spec.n_stages)
    model.check_complete()
    return model


def _spec_of(info: CheckpointInfo) -> ModelSpec:
    try:
        spec = ModelSpec.from_dict(info.model)
    except ConfigError as exc:
        raise ExportError(f"checkpoint {info.path} holds an unreadable model spec: {exc}") from exc
    if spec.digest != info.model_digest:
        raise ExportError(f"checkpoint {info.path}: its model spec does not match its digest")
    return spec


async def from_swarm(api: str, *, swarm_key: Any = None, api_token: str | None = None,
                     progress: Progress | None = None) -> ExportedModel:
    """Download every stage's state from a serving peer at its stage's newest step, through ``api``'s view."""
    import aiohttp

    from swarmd.net.client import client_session
    from swarmd.net.state_transfer import download_state

    headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        try:
            async with http.get(f"{api.rstrip('/')}/swarm", headers=headers) as resp:
                if resp.status != 200:
                    raise ExportError(f"{api}/swarm answered {resp.status}: {(await resp.text())[:200]}")
                view = await resp.json()
        except aiohttp.ClientError as exc:
            raise ExportError(f"cannot reach the control plane at {api}: {exc}") from exc
    try:
        spec = ModelSpec.from_dict(view["model"]["spec"])
    except (KeyError, TypeError, ConfigError) as exc:
        raise ExportError(f"{api}/swarm did not describe the model: {exc}") from exc
    if spec.digest != view["model"].get("digest"):
        raise ExportError(f"{api}/swarm: the model spec does not match its digest")
    model = ExportedModel(spec=spec, swarm=view.get("swarm"))
    async with client_session(swarm_key) as session:
        for entry in view.get("stages", []):
            stage = entry["stage"]
            peers = sorted((p for p in entry["peers"] if p["state"] == "serving" and p.get("reachable") != "no"),
                           key=lambda p: -p["step"])
            failures: list[str] = []
            for peer in peers:
                url = f"http://{peer['data_addr']}/v1/state"

                def expected(meta: dict[str, Any], stage: int = stage) -> None:
                    if meta.get("stage") != stage or meta.get("model") != spec.digest:
                        raise SwarmdError("it serves another stage or model")

                try:
                    snapshot = await download_state(session, url, expected=expected)
                    model.add(stage, _params(snapshot.tensors), step=int(snapshot.meta["step"]),
                              digest=str(snapshot.meta.get("params_digest")), source=url)
                except SwarmdError as exc:
                    failures.append(f"{peer['data_addr']}: {exc}")
                    continue
                break
            else:
                raise ExportError(f"no serving peer of stage {stage} gave its state"
                                  + (f" ({'; '.join(failures)})" if failures else ""))
            if progress is not None:
                progress(len(model.stages), spec.n_stages)
    model.check_complete()
    return model


def write_model(model: ExportedModel, path: Path) -> int:
    """Write ``model`` as one safetensors file (atomically); its size in bytes."""
    from safetensors.torch import save

    model.check_complete()
    blob = save({k: t.contiguous() for k, t in model.state_dict().items()}, metadata=model.metadata())
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, blob)
    return len(blob)


def load_model(path: Path, device: str = "cpu") -> FullModel:
    """A ``FullModel`` from an exported file, every digest checked; ExportError if it is not one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError as exc:
        raise ExportError(f"the model file {path} does not exist; write one with 'swarmd export'") from exc
    except OSError as exc:
        raise ExportError(f"cannot read the model file {path}: {exc.strerror or exc}") from exc
    except SafetensorError as exc:  # its own words ("header too large") say nothing to a user
        raise ExportError(f"{path} is not a swarmd model file (made by 'swarmd export'): it is not a safetensors "
                          "file") from exc
    if meta.get("format") != MODEL_FORMAT:
        raise ExportError(f"{path} is not a swarmd model file (made by 'swarmd export')")
    try:
        spec = ModelSpec.from_dict(json.loads(meta["spec"]))
        digests = {int(k): v for k, v in json.loads(meta["params_digests"]).items()}
        steps = {int(k): v for k, v in json.loads(meta["steps"]).items()}
    except (KeyError, ValueError, TypeError, ConfigError) as exc:
        raise ExportError(f"{path} has unreadable metadata: {exc}") from exc
    if spec.digest != meta.get("model_digest"):
        raise ExportError(f"{path}: its model spec does not match its digest")
    model = ExportedModel(spec=spec)
    for stage in range(spec.n_stages):
        prefix = f"stages.{stage}."
        params = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}
        model.add(stage, params, step=steps.get(stage, 0), digest=digests.get(stage, ""), source=str(path))
    full = model.to_full_model()
    return full.to(device)


def stage_summary(model: ExportedModel) -> Iterable[str]:
    for k in sorted(model.stages):
        yield f"stage {k}: step {model.steps[k]}, params {model.digests[k][:12]}"
