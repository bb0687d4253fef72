"""ModelSpec: validation, the stable digest, (de)serialisation and load_spec's errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from swarmd.errors import ConfigError
from swarmd.pipeline.spec import PRESETS, ModelSpec, load_spec

# Changing this literal means every deployed peer would disagree with the new build about
# which model it serves (and every initial weight changes): only do it on purpose, together
# with DIGEST_VERSION.
TINY_DIGEST = "c56383f5e949f78d09240532b876290acff398a862ded763e4308554fe738502"

BASE_FIELDS: dict[str, Any] = {
    "name": "m",
    "d_model": 32,
    "n_heads": 4,
    "d_ff": 64,
    "layers_per_stage": 2,
    "n_stages": 3,
}


def _with(**changes: Any) -> dict[str, Any]:
    return {**BASE_FIELDS, **changes}


# ---- presets and digest ---------------------------------------------------------------------


def test_presets_are_valid_and_named_after_their_key() -> None:
    assert {"tiny", "small", "base"} <= set(PRESETS)
    for key, spec in PRESETS.items():
        assert spec.name == key
        assert ModelSpec.from_dict(spec.to_dict()) == spec
    tiny = PRESETS["tiny"]
    assert (tiny.d_model, tiny.n_heads, tiny.d_ff, tiny.layers_per_stage, tiny.n_stages) == (
        64, 4, 256, 1, 2,
    )
    assert (tiny.vocab_size, tiny.seq_len) == (256, 64)
    base = PRESETS["base"]
    assert base.n_layers == 12 and base.d_model == 768 and base.head_dim == 64


def test_presets_cannot_be_mutated() -> None:
    with pytest.raises(TypeError):
        PRESETS["tiny"] = PRESETS["small"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].d_model = 8  # type: ignore[misc]


def test_tiny_digest_is_the_literal() -> None:
    assert PRESETS["tiny"].digest == TINY_DIGEST


def test_digest_is_sha256_hex() -> None:
    digest = PRESETS["small"].digest
    assert len(digest) == 64 and int(digest, 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        {"d_model": 64},
        {"n_heads": 8},
        {"d_ff": 128},
        {"layers_per_stage": 1},
        {"n_stages": 2},
        {"vocab_size": 512},
        {"seq_len": 256},
        {"share_layers": True},
        {"seed": 1},
    ],
)
def test_digest_changes_with_every_field_but_name(change: dict[str, Any]) -> None:
    assert ModelSpec(**_with(**change)).digest != ModelSpec(**BASE_FIELDS).digest


def test_digest_ignores_name() -> None:
    assert ModelSpec(**_with(name="other")).digest == ModelSpec(**BASE_FIELDS).digest


def test_every_field_is_covered_by_the_digest_tests() -> None:
    # A new field must be added to the parametrised digest test above (and to the digest).
    names = {f.name for f in dataclasses.fields(ModelSpec)}
    assert names == {
        "name", "d_model", "n_heads", "d_ff", "layers_per_stage", "n_stages", "vocab_size",
        "seq_len", "share_layers", "seed",
    }


# ---- to_dict / from_dict --------------------------------------------------------------------


def test_round_trip_through_dict_and_json() -> None:
    spec = ModelSpec(**_with(share_layers=True, seed=7, vocab_size=1000, seq_len=33))
    as_dict = spec.to_dict()
    assert as_dict["share_layers"] is True and as_dict["seed"] == 7
    assert ModelSpec.from_dict(as_dict) == spec
    assert ModelSpec.from_dict(json.loads(json.dumps(as_dict))) == spec


def test_from_dict_fills_defaults() -> None:
    spec = ModelSpec.from_dict(BASE_FIELDS)
    assert (spec.vocab_size, spec.seq_len, spec.share_layers, spec.seed) == (256, 128, False, 0)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (_with(n_head=4), "unknown model spec field(s) 'n_head'"),
        ({k: v for k, v in BASE_FIELDS.items() if k != "d_ff"}, "missing required field(s): d_ff"),
        ({k: v for k, v in BASE_FIELDS.items() if k != "name"}, "missing required field(s): name"),
        (_with(d_model="64"), "'d_model' must be an integer, got str"),
        (_with(d_model=64.0), "'d_model' must be an integer, got float"),
        (_with(n_stages=True), "'n_stages' must be an integer, got bool"),
        (_with(seq_len=None), "'seq_len' must be an integer, got NoneType"),
        (_with(share_layers=1), "'share_layers' must be true or false, got int"),
        (_with(share_layers="yes"), "'share_layers' must be true or false"),
        (_with(d_model=30), "d_model=30 must be divisible by n_heads=4"),
        (_with(d_model=-32), "'d_model' must be between 1 and"),
        (_with(n_heads=0), "'n_heads' must be between 1 and"),
        (_with(layers_per_stage=-1), "'layers_per_stage' must be between 1 and"),
        (_with(vocab_size=0), "'vocab_size' must be between 1 and"),
        (_with(seed=-1), "'seed' must be between 0 and"),
        (_with(seed=2**63), "'seed' must be between 0 and"),
        (_with(d_ff=10**9), "'d_ff' must be between 1 and 262144, got 1000000000"),
        (_with(n_stages=5000), "'n_stages' must be between 1 and 1024"),
        (_with(name=""), "name '' is invalid"),
        (_with(name="has space"), "name 'has space' is invalid"),
        (_with(name=3), "'name' must be a string, got int"),
    ],
)
def test_from_dict_rejects_bad_fields(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        ModelSpec.from_dict(fields)
    assert needle in str(exc.value)


def test_unknown_field_error_lists_valid_fields() -> None:
    with pytest.raises(ConfigError, match="valid fields are: name, d_model"):
        ModelSpec.from_dict(_with(dmodel=3))


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        ModelSpec.from_dict([("name", "x")])  # type: ignore[arg-type]


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        ModelSpec(name="x", d_model=10, n_heads=3, d_ff=4, layers_per_stage=1, n_stages=1)
    with pytest.raises(ConfigError, match="between"):
        dataclasses.replace(PRESETS["tiny"], n_stages=0)


# ---- stage_range ----------------------------------------------------------------------------


def test_stage_range_partitions_the_blocks() -> None:
    spec = ModelSpec(**BASE_FIELDS)  # 2 layers/stage, 3 stages
    assert spec.n_layers == 6
    ranges = [spec.stage_range(k) for k in range(spec.n_stages)]
    assert ranges == [range(0, 2), range(2, 4), range(4, 6)]
    assert [i for r in ranges for i in r] == list(range(spec.n_layers))


@pytest.mark.parametrize("stage", [-1, 3, 100])
def test_stage_range_rejects_out_of_range(stage: int) -> None:
    with pytest.raises(ConfigError, match=r"stage .* is out of range: .* has stages 0\.\.2"):
        ModelSpec(**BASE_FIELDS).stage_range(stage)


@pytest.mark.parametrize("stage", [True, 1.0, "1"])
def test_stage_range_rejects_non_int(stage: Any) -> None:
    with pytest.raises(ConfigError, match="stage must be an integer"):
        ModelSpec(**BASE_FIELDS).stage_range(stage)


# ---- load_spec ------------------------------------------------------------------------------


def test_load_spec_presets() -> None:
    for name, spec in PRESETS.items():
        assert load_spec(name) is spec


def test_load_spec_unknown_preset_lists_presets() -> None:
    with pytest.raises(ConfigError) as exc:
        load_spec("tinny")
    message = str(exc.value)
    assert "unknown model 'tinny'" in message
    assert "base, small, tiny" in message


def test_load_spec_file_with_default_name(tmp_path: Path) -> None:
    path = tmp_path / "my-model.json"
    fields = {k: v for k, v in BASE_FIELDS.items() if k != "name"}
    path.write_text(json.dumps(fields))
    spec = load_spec(str(path))
    assert spec == ModelSpec(**_with(name="my-model"))


def test_load_spec_file_name_field_wins(tmp_path: Path) -> None:
    path = tmp_path / "file.json"
    path.write_text(json.dumps(PRESETS["small"].to_dict() | {"name": "mine"}))
    spec = load_spec(str(path))
    assert spec.name == "mine" and spec.digest == PRESETS["small"].digest


def test_load_spec_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model file .*nope.json' does not exist"):
        load_spec(str(tmp_path / "nope.json"))


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "is not valid JSON"),
        ("", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object of model spec fields, got list"),
        ('{"d_model": 32, "d_model": 64}', "field 'd_model' appears more than once"),
        (json.dumps(_with(n_head=4)), "is invalid: unknown model spec field(s) 'n_head'"),
        (json.dumps(_with(d_model=31)), "is invalid: model spec d_model=31 must be divisible"),
        (json.dumps(_with(n_stages=True)), "'n_stages' must be an integer, got bool"),
        (json.dumps(_with(seq_len=1e3)), "'seq_len' must be an integer, got float"),
    ],
)
def test_load_spec_bad_files(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        load_spec(str(path))
    assert needle in str(exc.value)


def test_load_spec_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read model file"):
        load_spec(str(path))


def test_load_spec_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read model file"):
        load_spec(str(tmp_path))


def test_load_spec_stem_that_is_not_a_valid_name(tmp_path: Path) -> None:
    path = tmp_path / "my model.json"
    path.write_text(json.dumps({k: v for k, v in BASE_FIELDS.items() if k != "name"}))
    with pytest.raises(ConfigError, match="name 'my model' is invalid"):
        load_spec(str(path))
