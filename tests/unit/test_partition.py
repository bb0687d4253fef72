"""The cost model and the balanced partition (pure functions, no torch)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.pipeline.partition import PieceCosts, balanced_partition, flop_costs, stage_costs
from swarmd.pipeline.spec import PRESETS
from swarmd.pipeline.spec_files import with_partition


def _compositions(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to cut n blocks into ``parts`` non-empty contiguous stages."""
    return [
        tuple(b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True))
        for cuts in itertools.combinations(range(1, n), parts - 1)
    ]


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.lists(st.integers(0, 1000), min_size=1, max_size=9),
    embedding=st.integers(0, 3000),
    head=st.integers(0, 3000),
    data=st.data(),
)
def test_balanced_partition_minimises_the_most_expensive_stage(
    blocks: list[int], embedding: int, head: int, data: st.DataObject
) -> None:
    costs = PieceCosts(embedding=embedding, blocks=tuple(blocks), head=head)
    n_stages = data.draw(st.integers(1, len(blocks)))
    cut = balanced_partition(costs, n_stages)
    assert len(cut) == n_stages and min(cut) >= 1 and sum(cut) == len(blocks)
    every = [stage_costs(costs, c) for c in _compositions(len(blocks), n_stages)]
    best = min(max(c) for c in every)
    assert max(stage_costs(costs, cut)) == best
    # among the cuts that reach it, the other stages are balanced too (least sum of squares)
    assert sum(c * c for c in stage_costs(costs, cut)) == min(sum(c * c for c in s) for s in every if max(s) == best)
    assert balanced_partition(costs, n_stages) == cut  # deterministic


def test_ties_fill_the_front_stages_first() -> None:
    costs = PieceCosts(embedding=0, blocks=(1, 1, 1), head=0)
    assert balanced_partition(costs, 2) == (2, 1)
    assert balanced_partition(PieceCosts(embedding=0, blocks=(5,) * 8, head=0), 4) == (2, 2, 2, 2)


def test_an_expensive_head_or_embedding_moves_blocks_away_from_its_stage() -> None:
    even = PieceCosts(embedding=0, blocks=(10,) * 8, head=0)
    assert balanced_partition(even, 2) == (4, 4)
    assert balanced_partition(dataclasses.replace(even, head=35), 2) == (6, 2)  # 60 vs 55
    assert balanced_partition(dataclasses.replace(even, embedding=35), 2) == (2, 6)
    assert balanced_partition(dataclasses.replace(even, head=1000), 3) == (4, 3, 1)


def test_flop_costs_follow_the_architecture_and_the_vocabulary() -> None:
    small = PRESETS["small"]
    gpt = flop_costs(small)
    assert len(gpt.blocks) == small.n_layers and len(set(gpt.blocks)) == 1
    d, f, t = small.d_model, small.d_ff, small.seq_len
    assert gpt.blocks[0] == 6 * (4 * d * d + 2 * d * f + 2 * t * d)
    wide = flop_costs(dataclasses.replace(small, vocab_size=32_000))
    assert wide.blocks == gpt.blocks and wide.head > 100 * gpt.head
    # Llama: SwiGLU has three matrices; fewer key/value heads make the block cheaper
    llama = PRESETS["llama-small"]
    gqa = flop_costs(llama).blocks[0]
    mha = flop_costs(dataclasses.replace(llama, n_kv_heads=0)).blocks[0]
    assert gqa < mha
    assert mha == 6 * (4 * d * d + 3 * d * llama.d_ff + 2 * t * d)


def test_presets_with_a_byte_vocabulary_balance_to_the_equal_cut() -> None:
    for name in ("tiny", "small", "base", "llama-tiny", "llama-small", "llama-base"):
        spec = PRESETS[name]
        assert balanced_partition(flop_costs(spec), spec.n_stages) == spec.blocks_per_stage, name


def test_a_large_vocabulary_is_balanced_across_the_stages() -> None:
    spec = dataclasses.replace(PRESETS["base"], vocab_size=32_000)
    costs = flop_costs(spec)
    cut = balanced_partition(costs, spec.n_stages)
    assert cut == (3, 4, 4, 1)
    assert max(stage_costs(costs, cut)) < 0.75 * max(stage_costs(costs, spec.blocks_per_stage))


@pytest.mark.parametrize("n_stages", [0, 4, -1])
def test_rejects_impossible_cuts(n_stages: int) -> None:
    with pytest.raises(ValueError, match="non-empty stages"):
        balanced_partition(PieceCosts(embedding=0, blocks=(1, 2, 3), head=0), n_stages)


def test_piece_costs_and_stage_costs_validate() -> None:
    with pytest.raises(ValueError):
        PieceCosts(embedding=0, blocks=(), head=0)
    with pytest.raises(ValueError):
        PieceCosts(embedding=-1, blocks=(1,), head=0)
    with pytest.raises(ValueError, match="does not cut 3 blocks"):
        stage_costs(PieceCosts(embedding=0, blocks=(1, 2, 3), head=0), [1, 1])
    assert stage_costs(PieceCosts(embedding=5, blocks=(1, 2, 3), head=7), [1, 2]) == [6, 12]


def test_hundreds_of_blocks_balance() -> None:
    costs = PieceCosts(embedding=10, blocks=tuple(range(1, 401)), head=10_000)
    cut = balanced_partition(costs, 32)
    assert sum(cut) == 400 and len(cut) == 32


def test_measured_costs_time_each_piece_and_resolve_to_numbers() -> None:
    from swarmd.models.measure import measured_costs

    spec = dataclasses.replace(PRESETS["llama-tiny"], layers_per_stage=2, seq_len=16)
    costs = measured_costs(spec, batch=1, repeats=1)
    assert len(costs.blocks) == 4 and len(set(costs.blocks)) == 1 and costs.blocks[0] > 0 and costs.head > 0
    measured = with_partition(spec, "measured")
    assert sum(measured.blocks_per_stage) == 4 and measured.to_dict().get("partition", "") in ("", "1,3", "2,2", "3,1")


def test_the_partition_flag_cuts_a_founded_model_before_it_is_published() -> None:
    from swarmd.cli.serve import build_parser, config_from_args
    from swarmd.errors import ConfigError

    parser = build_parser()
    config = config_from_args(parser.parse_args(["--model", "llama-small", "--partition", "3,1", "--device", "cpu"]))
    assert config.pipeline.spec is not None and config.pipeline.spec.partition == (3, 1)
    founded = config_from_args(parser.parse_args(["--partition", "balanced", "--device", "cpu"])).pipeline.spec
    assert founded is not None and founded.name == "tiny" and founded.partition == ()  # tiny balances equally
    with pytest.raises(ConfigError, match="--partition sets the model of a swarm being founded"):
        config_from_args(parser.parse_args(["--join", "127.0.0.1:1", "--partition", "balanced", "--device", "cpu"]))
    with pytest.raises(ConfigError, match="holds 5 blocks"):
        config_from_args(parser.parse_args(["--model", "small", "--partition", "4,1", "--device", "cpu"]))


def test_a_tokenizer_vocabulary_is_weighed_before_a_model_file_is_balanced(tmp_path) -> None:
    from swarmd.pipeline.partition import balanced_partition_of
    from swarmd.pipeline.spec_files import load_spec

    path = tmp_path / "six.json"  # small's width, 6 blocks, a byte vocabulary: balanced is the equal cut
    path.write_text('{"d_model": 256, "n_heads": 8, "d_ff": 1024, "layers_per_stage": 3, "n_stages": 2, '
                    '"vocab_size": 256, "seq_len": 128, "partition": "balanced"}')
    digest = "ab" * 32
    assert load_spec(str(path)).blocks_per_stage == (3, 3)
    wide = load_spec(str(path), vocab=(8192, digest))  # a real tokenizer's head: a block moves to stage 0
    assert (wide.vocab_size, wide.tokenizer) == (8192, digest)
    assert wide.blocks_per_stage == (4, 2) == balanced_partition_of(dataclasses.replace(wide, partition=()))
    preset = load_spec("small", vocab=(8192, digest))
    assert (preset.vocab_size, preset.tokenizer, preset.blocks_per_stage) == (8192, digest, (2, 2))
