"""Cost-balanced pipeline stages: how many blocks each stage holds.

A pipeline runs at the pace of its slowest stage (SWARM, Ryabinin et al. 2023, section 3:
the stages form a chain, and in sync mode every step waits for the last microbatch through
all of them). Cutting a model into equal numbers of blocks is not an equal cut of its
compute: stage 0 also embeds the tokens, and the last stage also holds the final norm, the
LM head and the loss, whose cost grows with the vocabulary (a 32k-token head costs as much
as several blocks of a small model). So the spec may carry an explicit partition, and
``partition: "balanced"`` computes one from a cost model of each piece:

- :func:`flop_costs`: an estimate of each piece's training FLOPs per token (forward and
  backward of the matrix products and the attention scores; elementwise work left out), for
  the built-in architectures, or from an architecture's own ``piece_flops(spec)``;
- :func:`balanced_partition`: the contiguous partition of the blocks into stages that
  minimises the most expensive stage, a pure function of integer costs (so every peer that
  runs it gets the same numbers; it is resolved once, before the spec is published, and the
  digest covers the result).

A quick *measurement* of the same pieces on the local machine is
:func:`swarmd.models.measure.measured_costs`; it returns :class:`PieceCosts` in nanoseconds,
which :func:`balanced_partition` takes as well.

The other partition a sync step needs is of its *batch* into microbatches
(:func:`tapered_sizes`, :func:`taper_depth`): in sync mode (paper, section 3.2, with one
global batch per step) the pipeline fills and drains at every step, and how the batch is cut
decides how long the stages idle while it does.

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmd.errors import ConfigError

if TYPE_CHECKING:
    from swarmd.pipeline.spec import ModelSpec

__all__ = [
    "PieceCosts", "balanced_partition", "balanced_partition_of", "flop_costs", "stage_costs", "taper_depth",
    "tapered_sizes",
]

# Training is one forward and a backward that costs about two forwards (gradients of both the
# inputs and the weights of every matrix product).
_TRAIN_FACTOR = 3


@dataclass(frozen=True)
class PieceCosts:
    """The cost of each piece of a model for one training token, in any one integer unit.

    ``embedding`` always sits on stage 0 and ``head`` (final norm, LM head, loss) on the last
    stage; ``blocks`` are the transformer blocks in order, the pieces a partition moves.
    """

    embedding: int
    blocks: tuple[int, ...]
    head: int

    def __post_init__(self) -> None:
        values = (self.embedding, self.head, *self.blocks)
        if not self.blocks or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values):
            raise ValueError(f"piece costs must be non-negative integers with at least one block, got {self}")


def flop_costs(spec: ModelSpec) -> PieceCosts:
    """Training FLOPs per token of each piece of ``spec`` (see the module docstring).

    Per token and forward, as multiply-accumulates: a GPT block has ``4 d^2`` (q, k, v, output)
    plus ``2 d f`` (MLP); a Llama block ``2 d^2 + 2 d d_kv`` (q and output, k and v at the
    key/value width) plus ``3 d f`` (SwiGLU); both add ``2 T d`` for the attention scores and
    their weighted sum. The head is ``d V`` plus a few operations per vocabulary entry for the
    softmax and the loss; the embedding is a lookup and a scatter-add of ``d`` values. Another
    architecture may define ``piece_flops(spec) -> PieceCosts`` on the stage class it registers.
    """
    d, f, vocab, seq = spec.d_model, spec.d_ff, spec.vocab_size, spec.seq_len
    n_blocks = spec.layers_per_stage * spec.n_stages
    if spec.arch == "gpt":
        block_macs = 4 * d * d + 2 * d * f
    elif spec.arch == "llama":
        kv_width = (spec.n_kv_heads or spec.n_heads) * (d // spec.n_heads)
        block_macs = 2 * d * d + 2 * d * kv_width + 3 * d * f
    else:
        from swarmd.models.registry import stage_builder

        own = getattr(stage_builder(spec.arch), "piece_flops", None)
        if own is None:
            raise ConfigError(
                f"arch {spec.arch!r} defines no piece_flops(spec), so swarmd cannot balance its stages; "
                "give the partition as numbers of blocks per stage"
            )
        costs = own(spec)
        if not isinstance(costs, PieceCosts) or len(costs.blocks) != n_blocks:
            raise ConfigError(f"arch {spec.arch!r}: piece_flops(spec) must return PieceCosts of {n_blocks} blocks")
        return costs
    block_macs += 2 * seq * d
    block = 2 * _TRAIN_FACTOR * block_macs
    head = 2 * _TRAIN_FACTOR * d * vocab + 10 * vocab  # the matmul, then softmax + cross-entropy
    embedding = 2 * d  # a gather forward, a scatter-add backward
    return PieceCosts(embedding=embedding, blocks=(block,) * n_blocks, head=head)


def stage_costs(costs: PieceCosts, partition: Sequence[int]) -> list[int]:
    """The cost of each stage under ``partition`` (blocks per stage, summing to the blocks)."""
    if sum(partition) != len(costs.blocks) or min(partition, default=0) < 1:
        raise ValueError(f"partition {list(partition)} does not cut {len(costs.blocks)} blocks into non-empty stages")
    out, start = [], 0
    for n in partition:
        out.append(sum(costs.blocks[start : start + n]))
        start += n
    out[0] += costs.embedding
    out[-1] += costs.head
    return out


def balanced_partition(costs: PieceCosts, n_stages: int) -> tuple[int, ...]:
    """Blocks per stage, contiguous and non-empty, minimising the most expensive stage.

    Stage 0 always holds block 0 and the embedding, the last stage the last block and the head,
    so the embedding and head costs ride on those two blocks. First the smallest feasible
    maximum ``M`` is found by bisection over integers (a greedy fill decides feasibility). Many
    cuts may reach ``M`` (a head that costs more than the rest fixes ``M`` alone), so among them
    the one with the smallest sum of squared stage costs is taken: the other stages are
    balanced too. Remaining ties go to the cut that fills earlier stages first. Integers only,
    so every peer computes the same cut.
    """
    n = len(costs.blocks)
    if not isinstance(n_stages, int) or isinstance(n_stages, bool) or not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {n_stages} non-empty stages")
    weights = list(costs.blocks)
    weights[0] += costs.embedding
    weights[-1] += costs.head
    low = max(max(weights), -(-sum(weights) // n_stages))
    high = sum(weights)
    while low < high:
        mid = (low + high) // 2
        if _front_fill(weights, n_stages, mid) is None:
            low = mid + 1
        else:
            high = mid
    latest = _front_fill(weights, n_stages, low)  # each boundary as late as it can be
    back = _front_fill(weights[::-1], n_stages, low)  # ... and, mirrored, as early
    if latest is None or back is None:  # bisection ends on a feasible bound: the full sum always is
        raise AssertionError("no feasible partition at the bisection's bound")
    late = _boundaries(latest)
    early = [n - b for b in reversed(_boundaries(back))]
    return _least_squares(weights, low, early, late)


def _boundaries(cut: Sequence[int]) -> list[int]:
    out = [0]
    for taken in cut:
        out.append(out[-1] + taken)
    return out


def _least_squares(weights: Sequence[int], limit: int, early: Sequence[int], late: Sequence[int]) -> tuple[int, ...]:
    """The cut with every stage at most ``limit`` and the least sum of squared stage costs.

    Every such cut has its k-th boundary in ``[early[k], late[k]]``, which keeps the dynamic
    programme small: the interval is the slack the maximum leaves.
    """
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    stages = len(early) - 1
    best: list[dict[int, tuple[int, int]]] = [{0: (0, -1)}]  # boundary -> (sum of squares, previous)
    for k in range(1, stages + 1):
        layer: dict[int, tuple[int, int]] = {}
        for b in range(early[k], late[k] + 1):
            chosen: tuple[int, int] | None = None
            for prev in sorted(best[k - 1], reverse=True):  # later previous boundaries win ties
                cost = prefix[b] - prefix[prev]
                if prev >= b or cost > limit:
                    continue
                total = best[k - 1][prev][0] + cost * cost
                if chosen is None or total < chosen[0]:
                    chosen = (total, prev)
            if chosen is not None:
                layer[b] = chosen
        best.append(layer)
    bounds = [len(weights)]
    for k in range(stages, 0, -1):
        bounds.append(best[k][bounds[-1]][1])
    bounds.reverse()
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def _front_fill(weights: Sequence[int], n_stages: int, limit: int) -> tuple[int, ...] | None:
    """Fill stages in order up to ``limit``, leaving one block per later stage; None if it fails."""
    out: list[int] = []
    i, n = 0, len(weights)
    for stage in range(n_stages):
        left_after = n_stages - stage - 1
        if stage == n_stages - 1:
            taken = n - i
            if taken < 1 or sum(weights[i:]) > limit:
                return None
        else:
            taken, total = 0, 0
            while i + taken < n - left_after and total + weights[i + taken] <= limit:
                total += weights[i + taken]
                taken += 1
            if taken == 0:
                return None
        out.append(taken)
        i += taken
    return tuple(out)


def balanced_partition_of(spec: ModelSpec) -> tuple[int, ...]:
    """The balanced partition of ``spec``'s blocks by :func:`flop_costs` (what ``"balanced"`` means)."""
    return balanced_partition(flop_costs(spec), spec.n_stages)


# ---- the batch of a sync step, in microbatches ---------------------------------------------------

#: The finest taper is used only when the smallest microbatch it makes still computes this long on
#: the slowest stage: below it a request's fixed costs (HTTP, framing, the hop to the worker thread,
#: a few milliseconds on CPUs) outweigh the shorter fill and drain (tiny models).
RAMP_MIN_CALL_S = 0.02


def tapered_sizes(batch: int, microbatch: int, depth: int = 1) -> list[int]:
    """Microbatch sizes for one sync step's global batch, tapered at both ends by ``depth``.

    ``depth`` 0: ``microbatch`` each, the remainder last (``32, 8`` gives ``8 8 8 8``). 1: the
    first and the last microbatch halved (``4 8 8 8 4``). 2: a ramp in quarters at both ends
    (``2 4 6 8 6 4 2``), the samples left in the middle cut into the fewest nearly equal
    microbatches of at most ``microbatch`` (``36, 8``: ``2 4 6 6 6 6 4 2``); a batch too small
    for both ramps keeps their smaller steps only.

    Why. In a sync step only stage 0 works until the first microbatch's forward is back, and
    only stage 0 works after the last stage's last fused forward + backward (it still has the
    backwards of the microbatches before the last one queued, then the last one's). Stage 0's
    forward costs about a third of a stage's per-sample work and its backward two thirds, so
    the ramp up may grow fast (the next forward must be done before the last stage finishes
    the current microbatch) and the ramp down must shrink each microbatch by at most ~1.5x
    (stage 0's backward of one must fit into the last stage's time for the next). On ``small``
    (a model of the pipeline with per-call costs from a bench trace) depth 2 shortens a step's
    microbatch phase by ~50 ms of ~770 (depth 1 saved ~55 over depth 0), within 7-12 ms of the
    best of 1,787 unimodal schedules tried; when stage 0 is the slower stage no taper helps, and
    this one costs under 1%. The samples (drawn one after another) and so the step's gradient
    are the same however the batch is split, up to float rounding.
    """
    if batch < 1 or microbatch < 1:
        raise ValueError(f"a batch of {batch} in microbatches of {microbatch}: both must be at least 1")
    if depth not in (0, 1, 2):
        raise ValueError(f"taper depth must be 0, 1 or 2, got {depth}")
    if depth == 0 or microbatch == 1 or batch <= microbatch:
        return _plain(batch, microbatch)
    if depth == 1:
        rest = batch - microbatch // 2
        sizes = [microbatch // 2, *_plain(rest, microbatch)]
        if rest % microbatch == 0 and len(sizes) > 2:  # the last is a full one: halve it too
            sizes[-1:] = [microbatch - microbatch // 2, microbatch // 2]
        return sizes
    ramp = sorted({max(1, (k * microbatch + 2) // 4) for k in (1, 2, 3)} - {microbatch})
    while ramp and 2 * sum(ramp) > batch:
        ramp.pop()
    middle = batch - 2 * sum(ramp)
    parts = -(-middle // microbatch)
    body = [middle // parts + (1 if i < middle % parts else 0) for i in range(parts)] if parts else []
    return [*ramp, *body, *reversed(ramp)]


def _plain(batch: int, microbatch: int) -> list[int]:
    return [microbatch] * (batch // microbatch) + ([batch % microbatch] if batch % microbatch else [])


def taper_depth(seconds_per_sample: float | None, microbatch: int) -> int:
    """How finely to taper a sync step (:func:`tapered_sizes`), given the slowest stage's typical
    seconds per sample as a trainer measured them (None: nothing measured yet).

    The quarter ramp adds two requests per stage and step; it pays when its smallest
    microbatch computes for at least :data:`RAMP_MIN_CALL_S` (the per-sample latency includes
    each call's fixed costs, so on a model whose calls are mostly overhead it stays at 1).
    """
    if seconds_per_sample is None or microbatch < 4:
        return 1
    smallest = max(1, (microbatch + 2) // 4)
    return 2 if seconds_per_sample * smallest >= RAMP_MIN_CALL_S else 1
