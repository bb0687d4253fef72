"""ModelSpec and TrainingSpec: validation, the stable digests, (de)serialisation, load_spec's errors
and the learning-rate schedule."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.dht.identity import Identity
from swarmd.dht.records import MAX_RECORD_BYTES, SwarmRecord, open_record, sign_record
from swarmd.errors import ConfigError
from swarmd.pipeline.spec import PRESETS, ModelSpec, TrainingSpec
from swarmd.pipeline.spec_files import load_spec, with_partition

# Changing this literal means every deployed peer would disagree with the new build about
# which model it serves (and every initial weight changes): only do it on purpose, together
# with MODEL_DIGEST_VERSION.
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
        {"tokenizer": "ab" * 32},
        {"arch": "llama"},
        {"arch": "llama", "n_kv_heads": 2},
        {"partition": [3, 2, 1]},
        {"boundary_dim": 8},
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
        "seq_len", "share_layers", "seed", "tokenizer", "arch", "n_kv_heads", "partition", "boundary_dim",
    }


def test_late_fields_at_their_defaults_keep_the_old_digest() -> None:
    # specs from before arch / n_kv_heads / partition (and their checkpoints) keep their digest
    plain = ModelSpec(**BASE_FIELDS)
    spelled_out = ModelSpec(**_with(arch="gpt", n_kv_heads=0, partition="equal", boundary_dim=0))
    assert spelled_out.digest == plain.digest
    assert ModelSpec(**_with(partition=[2, 2, 2])).digest == plain.digest  # the equal cut, spelled out


def test_equal_models_have_one_canonical_form() -> None:
    mha = ModelSpec(**_with(arch="llama", n_kv_heads=4))  # as many kv heads as heads: plain MHA
    assert mha.n_kv_heads == 0 and mha.kv_heads == 4
    assert mha == ModelSpec(**_with(arch="llama")) and mha.digest == ModelSpec(**_with(arch="llama")).digest
    assert ModelSpec(**_with(partition=(2, 2, 2))).partition == ()
    assert ModelSpec(**_with(partition="3,2,1")) == ModelSpec(**_with(partition=[3, 2, 1]))


def test_llama_presets() -> None:
    assert {"llama-tiny", "llama-small", "llama-base"} <= set(PRESETS)
    for name in ("llama-tiny", "llama-small", "llama-base"):
        spec = PRESETS[name]
        assert spec.arch == "llama" and 0 < spec.kv_heads < spec.n_heads
        assert spec.digest != PRESETS[name.removeprefix("llama-")].digest


# ---- partitions ---------------------------------------------------------------------------


def test_partition_moves_the_stage_ranges() -> None:
    spec = ModelSpec(**_with(partition=[3, 2, 1]))
    assert spec.blocks_per_stage == (3, 2, 1) and spec.n_layers == 6
    assert [list(spec.stage_range(k)) for k in range(3)] == [[0, 1, 2], [3, 4], [5]]
    assert ModelSpec(**BASE_FIELDS).blocks_per_stage == (2, 2, 2)


def test_partition_travels_as_a_scalar_string() -> None:
    spec = ModelSpec(**_with(partition=[1, 1, 4]))
    as_dict = spec.to_dict()
    assert as_dict["partition"] == "1,1,4"
    assert ModelSpec.from_dict(json.loads(json.dumps(as_dict))) == spec
    # the equal cut (and every other field added after digest /1, at its default) is left out,
    # so records stay small and older builds can read them
    assert not {"partition", "arch", "n_kv_heads", "tokenizer"} & set(ModelSpec(**BASE_FIELDS).to_dict())
    assert ModelSpec.from_dict(ModelSpec(**BASE_FIELDS).to_dict()) == ModelSpec(**BASE_FIELDS)


def test_balanced_partition_is_resolved_to_numbers_before_anything_sees_it() -> None:
    # a 32k vocabulary makes the head cost several blocks of this width: the last stage gets fewer
    spec = with_partition(ModelSpec(**_with(n_stages=2, layers_per_stage=4, vocab_size=32_000)), "balanced")
    assert isinstance(spec.partition, tuple) and sum(spec.partition) == 8
    assert spec.partition[0] > spec.partition[1]
    assert spec.to_dict()["partition"] == ",".join(map(str, spec.partition))
    assert ModelSpec.from_dict(spec.to_dict()).digest == spec.digest
    # with a byte vocabulary the head is cheap and the balanced cut is the equal one
    assert with_partition(ModelSpec(**BASE_FIELDS), "balanced").partition == ()


@pytest.mark.parametrize("word", ["balanced", "measured", " balanced "])
def test_a_spec_from_the_network_never_runs_a_cost_model(word: str) -> None:
    # a DHT record or a welcome carries numbers; one that asks for a computation is refused
    with pytest.raises(ConfigError, match="must be resolved to numbers before the spec is built"):
        ModelSpec.from_dict(_with(partition=word))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"partition": [3, 3]}, "names 2 stage(s), but the model has n_stages=3"),
        ({"partition": [4, 2, 1]}, "holds 7 blocks, but the model has layers_per_stage x n_stages = 2 x 3 = 6"),
        ({"partition": [6, 0, 0]}, "every stage needs at least one block"),
        ({"partition": "lopsided"}, "'partition' must be \"equal\", \"balanced\", \"measured\", a list"),
        ({"partition": [2.0, 2, 2]}, "a list of integers"),
        ({"partition": [True, 2, 3]}, "a list of integers"),
        ({"partition": 6}, "a list of integers"),
        ({"arch": "Llama"}, "'arch' must be an architecture name"),
        ({"arch": 3}, "'arch' must be an architecture name"),
        ({"arch": "mamba"}, "arch 'mamba' is unknown: this build has gpt, llama"),
        ({"n_kv_heads": 2}, "arch 'gpt' has no grouped-query attention"),
        ({"arch": "llama", "n_kv_heads": 3}, "n_kv_heads=3 must divide n_heads=4"),
        ({"arch": "llama", "n_kv_heads": 8}, "n_kv_heads=8 must divide n_heads=4"),
        ({"arch": "llama", "n_kv_heads": -1}, "n_kv_heads=-1 must divide"),
        ({"arch": "llama", "n_kv_heads": "2"}, "'n_kv_heads' must be an integer, got str"),
        ({"arch": "llama", "d_model": 36, "n_heads": 4}, "needs an even head width"),
    ],
)
def test_new_fields_are_validated_with_a_sentence(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        ModelSpec.from_dict(_with(**change))
    assert needle in str(exc.value)


def test_load_spec_file_with_a_balanced_partition(tmp_path: Path) -> None:
    path = tmp_path / "wide.json"
    fields = _with(n_stages=2, layers_per_stage=4, vocab_size=32_000, arch="llama", n_kv_heads=2,
                   partition="balanced")
    path.write_text(json.dumps({k: v for k, v in fields.items() if k != "name"}))
    spec = load_spec(str(path))
    assert spec.name == "wide" and spec.arch == "llama" and len(spec.partition) == 2
    path.write_text(json.dumps({k: v for k, v in _with(partition=[5, 1]).items() if k != "name"}))
    with pytest.raises(ConfigError, match="wide.json.*names 2 stage"):
        load_spec(str(path))


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
    assert "base, llama-base, llama-small, llama-tiny, small, tiny" in message


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


# Changing this literal changes what every deployed peer computes for the default settings;
# only do it on purpose, together with TRAINING_DIGEST_VERSION (or, as when grad_codec's default became
# "auto" and averaging's "allreduce" in issue 28, for a new default value: the payload's format, hence every
# explicit spec's digest, stays).
DEFAULT_DIGEST = "a4321b003fb8811bf7e3a9aa550aded945adcb11e249527256b69d7b244bc50b"

# ---- TrainingSpec: validation -----------------------------------------------------------------


def test_defaults() -> None:
    spec = TrainingSpec()
    assert spec.to_dict() == {
        "target_batch_size": 32, "optimizer": "adamw", "lr": 1e-3, "beta1": 0.9, "beta2": 0.95,
        "eps": 1e-8, "weight_decay": 0.01, "warmup_steps": 10, "schedule": "cosine",
        "total_steps": 10_000, "min_lr_ratio": 0.1, "clip_norm": 1.0, "delay_updates": False,
        "averaging_timeout_s": 30.0, "grad_codec": "auto", "averaging": "allreduce",
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_batch_size": 0}, "'target_batch_size' must be between 1"),
        ({"target_batch_size": True}, "'target_batch_size' must be an integer"),
        ({"target_batch_size": 32.0}, "'target_batch_size' must be an integer"),
        ({"total_steps": 0}, "'total_steps' must be between 1"),
        ({"warmup_steps": -1}, "'warmup_steps' must be between 0"),
        ({"warmup_steps": 11, "total_steps": 10}, "warmup_steps=11 must not exceed total_steps=10"),
        ({"optimizer": "sgd"}, "'optimizer' must be one of adamw, lamb"),
        ({"optimizer": None}, "'optimizer' must be one of"),
        ({"schedule": "Cosine"}, "'schedule' must be one of constant, linear, cosine"),
        ({"lr": 0.0}, r"'lr' must lie in \(0, 10\]"),
        ({"lr": -1e-3}, "'lr' must lie in"),
        ({"lr": math.nan}, "'lr' must lie in"),
        ({"lr": math.inf}, "'lr' must lie in"),
        ({"lr": "1e-3"}, "'lr' must be a number"),
        ({"lr": True}, "'lr' must be a number"),
        ({"beta1": 1.0}, r"'beta1' must lie in \[0, 1\)"),
        ({"beta2": -0.1}, "'beta2' must lie in"),
        ({"eps": 0.0}, "'eps' must lie in"),
        ({"weight_decay": -0.01}, "'weight_decay' must lie in"),
        ({"min_lr_ratio": 1.5}, "'min_lr_ratio' must lie in"),
        ({"clip_norm": -1.0}, "'clip_norm' must lie in"),
        ({"averaging_timeout_s": 0}, "'averaging_timeout_s' must lie in"),
        ({"delay_updates": 1}, "'delay_updates' must be true or false"),
        ({"grad_codec": "bf16"}, "'grad_codec' must be one of auto, none, fp16, 8bit"),
    ],
)
def test_invalid_fields_raise_config_error(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainingSpec(**changes)
    with pytest.raises(ConfigError, match=message):
        TrainingSpec.from_dict(changes)


def test_ints_are_accepted_for_float_fields_and_stored_as_floats() -> None:
    spec = TrainingSpec(lr=1, weight_decay=0, clip_norm=0)
    assert type(spec.lr) is float and type(spec.weight_decay) is float and type(spec.clip_norm) is float
    assert spec == TrainingSpec(lr=1.0, weight_decay=0.0, clip_norm=0.0)
    assert spec.digest == TrainingSpec(lr=1.0, weight_decay=0.0, clip_norm=0.0).digest


# ---- TrainingSpec: dict form and digest -------------------------------------------------------


def test_to_dict_holds_only_scalars_and_round_trips() -> None:
    spec = TrainingSpec(optimizer="lamb", schedule="linear", lr=2e-3, delay_updates=True, warmup_steps=0)
    d = spec.to_dict()
    assert all(type(k) is str for k in d)
    assert all(type(v) in (bool, int, float, str) for v in d.values())
    assert TrainingSpec.from_dict(d) == spec
    assert TrainingSpec.from_dict(msgpack.unpackb(msgpack.packb(d))) == spec


def test_from_dict_ignores_unknown_keys_and_defaults_missing_ones() -> None:
    # A newer peer wrote the record: it knows a setting this build does not.
    d = {"lr": 3e-4, "schedule": "constant", "gradient_compression": "8bit", "zz": None}
    spec = TrainingSpec.from_dict(d)
    assert spec == TrainingSpec(lr=3e-4, schedule="constant", averaging="leader")  # no field: a leader record
    assert TrainingSpec.from_dict({}) == TrainingSpec(averaging="leader")
    assert TrainingSpec.from_dict({}, strict=True) == TrainingSpec()
    # Known keys are still validated next to unknown ones.
    with pytest.raises(ConfigError, match="'lr'"):
        TrainingSpec.from_dict({"lr": None, "new_field": 1})
    with pytest.raises(ConfigError, match="unknown training field.*'gradient_compression'"):
        TrainingSpec.from_dict(d, strict=True)
    with pytest.raises(ConfigError, match="must be a mapping"):
        TrainingSpec.from_dict([("lr", 1e-3)])  # type: ignore[arg-type]


def test_fits_a_signed_swarm_record_with_the_largest_preset() -> None:
    identity = Identity.generate()
    largest = dataclasses.replace(PRESETS["llama-base"], tokenizer="ab" * 32, partition=[4, 3, 3, 2])
    assert ModelSpec.from_dict(largest.to_dict()) == largest
    record = SwarmRecord(
        swarm="s" * 64, spec=largest.to_dict(),
        training=dict(TrainingSpec(optimizer="lamb", schedule="linear").to_dict()),
        founder=identity.peer_id, timestamp=1_000.0, expiry=1_300.0,
    )
    raw = sign_record(identity, record)
    assert len(raw) <= MAX_RECORD_BYTES
    opened = open_record(raw, now=1_100.0)
    assert isinstance(opened, SwarmRecord)
    assert TrainingSpec.from_dict(opened.training) == TrainingSpec(optimizer="lamb", schedule="linear")
    assert ModelSpec.from_dict(opened.spec) == largest


def test_digest_is_the_literal_and_sensitive_to_every_field() -> None:
    assert TrainingSpec().digest == DEFAULT_DIGEST
    assert TrainingSpec.from_dict(TrainingSpec().to_dict()).digest == DEFAULT_DIGEST
    changed: dict[str, Any] = {
        "target_batch_size": 33, "optimizer": "lamb", "lr": 1.1e-3, "beta1": 0.8, "beta2": 0.999,
        "eps": 1e-6, "weight_decay": 0.0, "warmup_steps": 11, "schedule": "linear",
        "total_steps": 10_001, "min_lr_ratio": 0.0, "clip_norm": 0.0, "delay_updates": True,
        "averaging_timeout_s": 31.0, "grad_codec": "fp16", "averaging": "leader",
    }
    assert set(changed) == {f.name for f in dataclasses.fields(TrainingSpec)}
    digests = {TrainingSpec(**{name: value}).digest for name, value in changed.items()}
    assert len(digests) == len(changed) and DEFAULT_DIGEST not in digests


def test_a_record_without_averaging_is_a_leader_swarm_and_a_typed_config_takes_the_all_reduce() -> None:
    # Records written before the all-reduce existed (and a founder's explicit "leader") lack the field:
    # a joiner must read them as the leader swarm they are, or its digest differs from the founder's.
    leader = TrainingSpec(averaging="leader")
    assert "averaging" not in leader.to_dict()
    assert TrainingSpec.from_dict(leader.to_dict()) == leader
    assert TrainingSpec.from_dict(leader.to_dict()).digest == leader.digest
    assert TrainingSpec.from_dict(TrainingSpec().to_dict()) == TrainingSpec()
    # What a person typed (strict) without the field takes the default.
    assert TrainingSpec.from_dict({"lr": 2e-3}, strict=True).averaging == "allreduce"
    assert TrainingSpec.from_dict({"lr": 2e-3}).averaging == "leader"


# ---- the learning-rate schedule ---------------------------------------------------------------


def test_lr_at_warmup_then_each_schedule_at_its_key_points() -> None:
    base: dict[str, Any] = {"lr": 1.0, "warmup_steps": 4, "total_steps": 104, "min_lr_ratio": 0.1}
    for schedule in ("constant", "linear", "cosine"):
        spec = TrainingSpec(schedule=schedule, **base)
        # Linear warmup: the first update already moves; update W-1 uses the full rate.
        assert [spec.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
        assert spec.lr_at(4) == 1.0
    constant = TrainingSpec(schedule="constant", **base)
    assert {constant.lr_at(s) for s in (4, 54, 104, 10**6)} == {1.0}
    linear = TrainingSpec(schedule="linear", **base)
    assert linear.lr_at(54) == pytest.approx(0.55)
    assert linear.lr_at(104) == pytest.approx(0.1) and linear.lr_at(10**6) == linear.lr_at(104)
    cosine = TrainingSpec(schedule="cosine", **base)
    assert cosine.lr_at(29) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cosine.lr_at(54) == pytest.approx(0.55)
    assert cosine.lr_at(104) == pytest.approx(0.1) and cosine.lr_at(10**6) == cosine.lr_at(104)


def test_lr_at_without_warmup_and_with_nothing_to_decay() -> None:
    no_warmup = TrainingSpec(lr=0.5, warmup_steps=0, total_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert no_warmup.lr_at(0) == 0.5 and no_warmup.lr_at(5) == 0.25 and no_warmup.lr_at(10) == 0.0
    # total_steps == warmup_steps: warm up, then straight to the floor.
    instant = TrainingSpec(lr=0.5, warmup_steps=2, total_steps=2, schedule="cosine", min_lr_ratio=0.2)
    assert [instant.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.1, 0.1]


@pytest.mark.parametrize("step", [-1, 1.0, True, None])
def test_lr_at_rejects_bad_steps(step: Any) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        TrainingSpec().lr_at(step)


@settings(max_examples=50, deadline=None)
@given(
    schedule=st.sampled_from(["constant", "linear", "cosine"]),
    warmup=st.integers(0, 50),
    extra=st.integers(0, 200),
    ratio=st.floats(0.0, 1.0),
)
def test_lr_at_warms_up_then_never_increases_and_stays_in_range(
    schedule: str, warmup: int, extra: int, ratio: float
) -> None:
    spec = TrainingSpec(lr=0.1, warmup_steps=warmup, total_steps=max(1, warmup + extra),
                        schedule=schedule, min_lr_ratio=ratio)
    rates = [spec.lr_at(s) for s in range(warmup + extra + 5)]
    assert all(0.0 < r <= 0.1 for r in rates[:warmup])
    assert rates[:warmup] == sorted(rates[:warmup])
    if warmup:
        assert rates[warmup - 1] == 0.1  # exactly the peak, not 0.1 * W / W
    after = rates[warmup:]
    assert after[0] == 0.1 or (warmup == spec.total_steps and schedule != "constant")
    assert all(b <= a for a, b in zip(after, after[1:], strict=False))
    assert all(0.1 * ratio <= r <= 0.1 for r in after)


# ---- no torch -----------------------------------------------------------------------------------


def test_the_specs_load_without_torch() -> None:
    # the CLI and the configuration build and check specs; torch takes seconds to import
    probe = ("import sys, swarmd.pipeline.spec as s, swarmd.pipeline.spec_files as f; "
             "f.with_partition(s.ModelSpec(name='x', d_model=64, n_heads=4, d_ff=256, layers_per_stage=2, n_stages=2"
             "), 'balanced'); f.load_spec('small'); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"
