"""A quick measurement of what each piece of a model costs to train on this machine.

The FLOP estimates of :func:`swarmd.pipeline.partition.flop_costs` leave out everything that
is not a matrix product: norms, activations, softmax, the loss, memory traffic. On small
models or unusual hardware those matter, so ``partition: "measured"`` times the pieces
instead: one stage of a one-block copy of the model, forward and backward of the embedding,
of a block and of the final norm + head + loss, each the median of a few repeats, in
nanoseconds per token (CPU time of the process on the CPU, wall time on a GPU). The founder
measures once and publishes the resulting numbers, so peers never need to agree on a timing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from swarmd.pipeline.partition import PieceCosts
from swarmd.pipeline.spec import ModelSpec

__all__ = ["measured_costs"]


def measured_costs(spec: ModelSpec, *, batch: int = 4, repeats: int = 5, device: str = "cpu") -> PieceCosts:
    """Nanoseconds per training token of each piece of ``spec`` (forward + backward), measured here."""
    from swarmd.pipeline.model import build_stage

    probe = dataclasses.replace(spec, name=f"{spec.name}-probe"[:64], n_stages=1, layers_per_stage=1,
                                partition=(), share_layers=False)
    stage = build_stage(probe, 0, device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (batch, spec.seq_len), generator=g).to(device)
    hidden = torch.randn(batch, spec.seq_len, spec.d_model, generator=g).to(device)

    def embed() -> None:
        stage.embed(tokens).sum().backward()

    def block() -> None:
        x = hidden.detach().requires_grad_(True)
        out = stage.blocks[0](x)
        torch.autograd.backward(out, torch.ones_like(out))

    def head() -> None:
        x = hidden.detach().requires_grad_(True)
        logits = stage.logits(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1)).backward()

    per_token = batch * spec.seq_len
    costs = [_median_ns(fn, repeats, device) // per_token for fn in (embed, block, head)]
    return PieceCosts(embedding=costs[0], blocks=(max(1, costs[1]),) * spec.n_layers, head=costs[2])


def _median_ns(fn: Callable[[], None], repeats: int, device: str) -> int:
    """Median cost of ``fn``: on a GPU its wall time (synchronized), on the CPU the CPU time of this
    process (all of torch's threads), which other processes' load on a shared machine barely moves."""
    cuda = device.startswith("cuda")
    clock = time.perf_counter_ns if cuda else time.process_time_ns
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(max(1, repeats)):
        if cuda:
            torch.cuda.synchronize()
        started = clock()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(clock() - started)
    return int(statistics.median(times))
