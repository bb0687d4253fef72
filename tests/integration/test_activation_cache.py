"""The peer's activation cache: a backward reuses its forward's graph only when that is exact.

A hit must give bit-identical gradients to the stateless recompute; anything else (another
peer, another step, other inputs under the same id, an evicted or expired entry) recomputes.
"""

from __future__ import annotations

import asyncio
import gc
from dataclasses import replace

import aiohttp
import pytest
import torch

from swarmd.errors import InputsNotCached, PeerError, RequestError, StaleStep
from swarmd.net.client import DataPlaneClient
from swarmd.net.wire import CONTENT_TYPE, encode_frame
from swarmd.pipeline.stage.activation_cache import ActivationCache, CacheStats, CapturedForward
from swarmd.pipeline.stage.executor import StageExecutor
from swarmd.pipeline.routing import StageRouter
from swarmd.pipeline.spec import PRESETS, TrainingSpec
from tests.conftest import TINY, running_daemon
from tests.support.routing import listed

# three stages of two blocks: stage 0 takes token ids, stage 1 hidden states (a middle stage)
SPEC = replace(PRESETS["tiny"], name="cache", n_stages=3, layers_per_stage=2)
B, T = 3, 16


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def hidden(seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, SPEC.d_model, generator=torch.Generator().manual_seed(seed))


def grad_out(seed: int = 2) -> torch.Tensor:
    return torch.randn(B, T, SPEC.d_model, generator=torch.Generator().manual_seed(seed))


def inputs_for(stage: int, seed: int = 0) -> torch.Tensor:
    return tokens(seed) if stage == 0 else hidden(seed + 1)


def grads(ex: StageExecutor) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in ex.module.named_parameters() if p.grad is not None}


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


async def step(ex: StageExecutor) -> None:
    """One update from the executor's own gradients (what a one-peer averaging round does)."""
    contribution = await ex.take_contribution()
    assert contribution.grads is not None
    await ex.apply_average(contribution.grads / contribution.samples, contribution.step)


@pytest.fixture
async def executors():
    made: list[StageExecutor] = []

    def make(stage: int, **kwargs: object) -> StageExecutor:
        # threads=None: torch.set_num_threads is process-wide state, and later tests compare a
        # daemon's gradients bit for bit with ones computed on the test's own thread
        ex = StageExecutor(SPEC, stage, **kwargs)  # type: ignore[arg-type]
        made.append(ex)
        return ex

    yield make
    for ex in made:
        await ex.close()


@pytest.mark.parametrize("stage", [0, 1], ids=["first", "middle"])
async def test_cached_backward_is_bit_identical_to_the_recompute(executors, stage: int) -> None:
    cached, stateless = executors(stage), executors(stage)
    x, g = inputs_for(stage), grad_out()
    fwd_cached = await cached.forward(x, mb=42)
    fwd_plain = await stateless.forward(x)
    assert torch.equal(fwd_cached.outputs, fwd_plain.outputs)  # the graph-keeping forward computes the same
    assert cached.cache_stats()["entries"] == 1 and cached.cache_bytes > 0

    b_cached = await cached.backward(x, g, step=0, mb=42)
    b_plain = await stateless.backward(x, g, step=0)
    assert cached.cache_stats()["hits"] == 1 and stateless.cache_stats()["hits"] == 0
    assert_bit_identical(grads(cached), grads(stateless))
    if stage == 0:
        assert b_cached.grad_inputs is None and b_plain.grad_inputs is None
    else:
        assert torch.equal(b_cached.grad_inputs, b_plain.grad_inputs)
    assert b_cached.samples == b_plain.samples == B and cached.grad_samples == B
    # consumed: the entry and its bytes are gone; a second backward under the id at the same step (a
    # retried request) recomputes its answer but counts once (exactly-once, swarmd.pipeline.stage.step_protocol)
    assert cached.cache_stats()["entries"] == 0 and cached.cache_bytes == 0
    again = await cached.backward(x, g, step=0, mb=42)
    assert again.duplicate and cached.duplicates == 1 and cached.grad_samples == B
    if stage != 0:
        assert torch.equal(again.grad_inputs, b_plain.grad_inputs)
    assert_bit_identical(grads(cached), grads(stateless))


@pytest.mark.parametrize("stage", [0, 1], ids=["first", "middle"])
async def test_a_backward_without_inputs_uses_the_kept_ones_bit_for_bit(executors, stage: int) -> None:
    kept, stateless = executors(stage), executors(stage)
    x, g = inputs_for(stage), grad_out()
    forward = await kept.forward(x, mb=42, source="10.0.0.1")
    assert forward.kept and not (await kept.forward(x)).kept  # no id: nothing kept, nothing to omit
    b_kept = await kept.backward(None, g, step=0, mb=42, source="10.0.0.1")
    b_plain = await stateless.backward(x, g, step=0)
    stats = kept.cache_stats()
    assert (stats["hits"], stats["held"], stats["unheld"], stats["entries"], stats["bytes"]) == (1, 1, 0, 0, 0)
    assert_bit_identical(grads(kept), grads(stateless))
    assert kept.grad_samples == B and b_kept.samples == B and not b_kept.duplicate
    if stage:
        assert torch.equal(b_kept.grad_inputs, b_plain.grad_inputs)


async def test_a_backward_without_inputs_the_peer_does_not_hold_is_refused_uncounted(executors) -> None:
    ex, never_ran = executors(1), executors(1)
    x, g = hidden(), grad_out()
    await ex.forward(x, mb=7, source="10.0.0.1")
    # another peer (a failover, a spot check's second opinion) never ran the forward: it needs the inputs
    with pytest.raises(InputsNotCached):
        await never_ran.backward(None, g, step=0, mb=7, source="10.0.0.1")
    # another sender naming the id neither uses nor spends the entry
    with pytest.raises(InputsNotCached):
        await ex.backward(None, g, step=0, mb=7, source="10.6.6.6")
    assert ex.cache_stats()["entries"] == 1
    for e in (ex, never_ran):  # refused before anything was computed or counted: the resend counts once
        assert e.grad_samples == 0 and e.duplicates == 0 and e.cache_stats()["unheld"] == 1
    resent = await never_ran.backward(x, g, step=0, mb=7, source="10.0.0.1")
    assert never_ran.grad_samples == B and not resent.duplicate
    # the sender's own backward still finds it; a repeat of it (its answer lost) must resend the inputs
    await ex.backward(None, g, step=0, mb=7, source="10.0.0.1")
    with pytest.raises(InputsNotCached):
        await ex.backward(None, g, step=0, mb=7, source="10.0.0.1")
    again = await ex.backward(x, g, step=0, mb=7, source="10.0.0.1")
    assert again.duplicate and ex.grad_samples == B and ex.duplicates == 1
    assert torch.equal(again.grad_inputs, resent.grad_inputs)
    # an expired entry: gone, resend
    short = executors(1, activation_cache_ttl_s=0.0)
    assert (await short.forward(x, mb=8)).kept
    await asyncio.sleep(0.01)
    with pytest.raises(InputsNotCached):
        await short.backward(None, g, step=0, mb=8)
    # one of the step before, under delayed updates (which accept it): its inputs outlive the update,
    # its graph does not; two updates old, the step rule refuses it before the cache is asked
    delayed = executors(1, training=TrainingSpec(delay_updates=True))
    await delayed.backward(hidden(5), g, step=0)
    await delayed.forward(x, mb=9)
    await delayed.forward(x, mb=10)
    await step(delayed)
    assert delayed.cache_stats()["entries"] == 2
    await delayed.backward(None, g, step=0, mb=9)
    assert delayed.stale_applied == 1 and delayed.grad_samples == B
    await step(delayed)
    assert delayed.cache_stats()["entries"] == 0
    with pytest.raises(StaleStep):
        await delayed.backward(None, g, step=0, mb=10)
    # a full cache does not keep the forward, and says so: its backward carries the inputs from the start
    full = executors(1, activation_cache_entries=1)
    assert (await full.forward(x, mb=1)).kept and not (await full.forward(x, mb=2)).kept


async def test_the_last_stage_and_an_unnamed_backward_need_their_inputs(executors) -> None:
    last = executors(SPEC.n_stages - 1)
    y = tokens()
    with pytest.raises(RequestError, match="'inputs'"):
        await last.backward(None, None, y, mb=1)
    with pytest.raises(RequestError, match="mb"):
        await executors(1).backward(None, grad_out(), step=0)
    assert last.grad_samples == 0


async def test_a_backward_on_another_peer_recomputes_and_agrees(executors) -> None:
    ran_forward, other = executors(1), executors(1)
    x, g = hidden(), grad_out()
    await ran_forward.forward(x, mb=7)
    b_other = await other.backward(x, g, step=0, mb=7)  # failover: the forward's peer is gone
    assert other.cache_stats()["misses"] == 1 and other.cache_stats()["hits"] == 0
    b_same = await ran_forward.backward(x, g, step=0, mb=7)
    assert ran_forward.cache_stats()["hits"] == 1
    assert torch.equal(b_other.grad_inputs, b_same.grad_inputs)
    assert_bit_identical(grads(other), grads(ran_forward))


async def test_other_inputs_under_a_cached_id_do_not_use_the_graph(executors) -> None:
    ex, reference = executors(1), executors(1)
    g = grad_out()
    await ex.forward(hidden(1), mb=5)
    b = await ex.backward(hidden(9), g, step=0, mb=5)  # same id, different inputs
    stats = ex.cache_stats()
    assert stats["hits"] == 0 and stats["misses"] == 1 and stats["mismatches"] == 1
    assert stats["entries"] == 0 and ex.cache_bytes == 0
    b_ref = await reference.backward(hidden(9), g, step=0)
    assert torch.equal(b.grad_inputs, b_ref.grad_inputs)
    assert_bit_identical(grads(ex), grads(reference))


async def test_a_step_empties_the_cache_and_stale_backwards_stay_refused(executors) -> None:
    ex = executors(0)
    g = grad_out()
    for mb in range(3):
        await ex.forward(tokens(mb), mb=mb)
    await ex.backward(tokens(0), g, step=0, mb=0)  # something to step with
    assert ex.cache_stats()["entries"] == 2 and ex.cache_bytes > 0
    await step(ex)
    assert ex.step == 1
    stats = ex.cache_stats()
    assert stats["entries"] == 0 and stats["bytes"] == 0 and stats["evictions"] == 2
    with pytest.raises(StaleStep):  # the step rule comes first, cache or not
        await ex.backward(tokens(1), g, step=0, mb=1)
    # a snapshot adopted from a stage-mate changes the parameters too
    await ex.forward(tokens(1), mb=11)
    meta, tensors = await ex.snapshot_state()
    await ex.load_state(meta, tensors)
    assert ex.cache_stats()["entries"] == 0 and ex.cache_bytes == 0


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter))


@pytest.mark.parametrize("stage", [0, 1], ids=["first", "middle"])
async def test_entries_dropped_unused_free_their_graph(executors, stage: int) -> None:
    # a saved-tensor hook that kept the saved tensors themselves made, for saved outputs, a
    # reference cycle (node -> saved tensor -> node) that only a backward broke: every entry
    # dropped unused leaked its graph (1.7 GB of RSS after 60 microbatches in delayed mode)
    ex = executors(stage)
    g = grad_out()
    await ex.backward(inputs_for(stage, 9), g, step=0)
    await step(ex)  # the optimizer's state exists from here on
    before = live_tensors()
    for mb in range(3):
        await ex.forward(inputs_for(stage, mb), mb=mb)
    await ex.backward(inputs_for(stage, 9), g, step=1)
    await step(ex)  # evicts the three entries unused
    assert ex.cache_stats()["evictions"] == 3
    assert live_tensors() - before <= 5


async def test_delayed_updates_recompute_a_backward_one_step_old(executors) -> None:
    delayed = TrainingSpec(delay_updates=True)
    ex, reference = executors(1, training=delayed), executors(1, training=delayed)
    x, g = hidden(), grad_out()
    for e in (ex, reference):
        await e.backward(hidden(5), g, step=0)
        await step(e)
    await ex.forward(x, mb=3)  # at step 1
    # the stage moved on while the microbatch was out: the old graph is gone, the backward
    # (staleness 1, accepted) recomputes at the current parameters, like a peer without a cache
    await ex.backward(hidden(6), g, step=1)
    await reference.backward(hidden(6), g, step=1)
    await step(ex)
    await step(reference)
    b = await ex.backward(x, g, step=1, mb=3)
    b_ref = await reference.backward(x, g, step=1)
    assert ex.stale_applied == 1 and ex.cache_stats()["hits"] == 0
    assert torch.equal(b.grad_inputs, b_ref.grad_inputs)
    assert_bit_identical(grads(ex), grads(reference))
    # and without its inputs: the peer kept them across the update and recomputes from them, bit for bit
    await ex.forward(x, mb=4)
    for e in (ex, reference):
        await step(e)
    held = await ex.backward(None, g, step=2, mb=4)
    resent = await reference.backward(x, g, step=2)
    assert ex.cache_stats()["held"] == 1 and ex.stale_applied == 2
    assert torch.equal(held.grad_inputs, resent.grad_inputs)
    assert_bit_identical(grads(ex), grads(reference))


async def test_the_cache_is_bounded_by_entries_and_bytes(executors) -> None:
    by_count = executors(1, activation_cache_entries=2)
    for mb in range(3):
        await by_count.forward(hidden(mb), mb=mb)
    stats = by_count.cache_stats()
    assert stats["entries"] == 2 and stats["skipped"] == 1 and stats["evictions"] == 0
    one_entry = stats["bytes"] // 2
    # full: the newest was not kept, so the oldest (the next backward, in pipeline order) hits
    await by_count.backward(hidden(0), grad_out(), step=0, mb=0)
    await by_count.backward(hidden(2), grad_out(), step=0, mb=2)
    stats = by_count.cache_stats()
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["entries"] == 1
    await by_count.forward(hidden(3), mb=3)  # room again
    assert by_count.cache_stats()["entries"] == 2

    by_bytes = executors(1, activation_cache_bytes=one_entry * 2 + one_entry // 2)
    for mb in range(4):
        await by_bytes.forward(hidden(mb), mb=mb)
        assert by_bytes.cache_bytes <= by_bytes.cache_max_bytes
    assert by_bytes.cache_stats()["entries"] == 2 and by_bytes.cache_stats()["skipped"] == 2

    too_small = executors(1, activation_cache_bytes=one_entry // 2)
    await too_small.forward(hidden(), mb=1)
    assert too_small.cache_stats()["entries"] == 0 and too_small.cache_bytes == 0

    off = executors(1, activation_cache_entries=0)
    await off.forward(hidden(), mb=1)
    await off.backward(hidden(), grad_out(), step=0, mb=1)
    assert off.cache_stats()["entries"] == 0 and off.cache_stats()["misses"] == 1


async def test_entries_expire(executors) -> None:
    ex = executors(1, activation_cache_ttl_s=0.0)
    await ex.forward(hidden(), mb=1)
    await asyncio.sleep(0.01)
    await ex.backward(hidden(), grad_out(), step=0, mb=1)
    stats = ex.cache_stats()
    assert stats["hits"] == 0 and stats["misses"] == 1 and stats["entries"] == 0 and stats["bytes"] == 0


def test_the_cache_on_its_own_clock() -> None:
    now = [0.0]
    cache = ActivationCache(2, 25, ttl_s=5.0, clock=lambda: now[0])
    x = torch.zeros(2)

    def captured(nbytes: int) -> CapturedForward:
        return CapturedForward(leaf=x, out=x, nbytes=nbytes)

    assert cache.put(1, x, captured(10), step=0) and cache.put(2, x, captured(10), step=0)
    assert not cache.put(3, x, captured(1), step=0)  # full by entries: the new one is skipped
    assert cache.take(None, x, step=0) is None  # names no microbatch: not counted
    now[0] = 4.0
    assert cache.take(1, x, step=0) is not None
    assert cache.put(4, x, captured(10), step=0)
    assert not cache.put(5, x, captured(6), step=0)  # full by bytes (20 + 6 > 25)
    now[0] = 5.5  # entry 2 (created at 0) is older than the TTL; entry 4 (at 4) is not
    assert cache.take(4, x, step=1) is None  # of another step: dropped
    assert cache.take(2, x, step=0) is None  # expired
    assert cache.stats() == CacheStats(entries=0, bytes=0, max_entries=2, max_bytes=25, hits=1, misses=2,
                                       mismatches=0, evictions=2, skipped=2)
    # a backward without inputs: the entry of its id, step and sender only
    assert cache.put(8, x, captured(10), step=0, source="a")
    assert cache.take_held(8, step=0, source="b") is None and len(cache) == 1  # another sender: kept for "a"
    assert cache.take_held(9, step=0, source="a") is None
    held = cache.take_held(8, step=0, source="a")
    assert held is not None and held.inputs is x and len(cache) == 0
    assert cache.put(10, x, captured(10), step=0, source="a")
    assert cache.take_held(10, step=1, source="a") is None and len(cache) == 0  # of another step: dropped
    s = cache.stats()
    assert (s.hits, s.held, s.misses, s.unheld, s.evictions) == (2, 1, 5, 3, 3)
    cache.discard(10)
    assert cache.put(6, x, captured(10), step=0)
    assert cache.take(6, torch.ones(2), step=0) is None  # other inputs under the id
    assert cache.put(7, x, captured(10), step=0)
    cache.clear()
    assert (len(cache), cache.nbytes, cache.stats().mismatches, cache.stats().evictions) == (0, 0, 1, 5)
    assert not ActivationCache(0, 25, 1.0).enabled and not ActivationCache(2, 0, 1.0).enabled


async def test_last_stage_keeps_nothing(executors) -> None:
    ex = executors(SPEC.n_stages - 1)
    await ex.forward(hidden(), mb=1)
    assert ex.cache_stats()["entries"] == 0


async def test_wait_progress_wakes_on_samples_and_steps(executors) -> None:
    ex = executors(1)
    assert not await ex.wait_progress(0.0, step=1)
    waiting_samples = asyncio.create_task(ex.wait_progress(30.0, samples=B))
    waiting_step = asyncio.create_task(ex.wait_progress(30.0, step=1))
    await asyncio.sleep(0)
    await ex.backward(hidden(), grad_out(), step=0)
    assert await waiting_samples
    assert not waiting_step.done()
    await step(ex)
    assert await waiting_step


async def test_the_data_plane_carries_the_microbatch_id() -> None:
    x, y = torch.randint(0, TINY.vocab_size, (B, T)), torch.randint(0, TINY.vocab_size, (B, T))
    async with running_daemon(0) as d0, running_daemon(1) as d1, DataPlaneClient() as c:
        forward = await c.forward(d0.data_addr, 0, x, mb=2**64 - 1)
        assert forward.kept  # the peer says it keeps the inputs: the backward may omit them
        g = (await c.backward(d1.data_addr, 1, forward.outputs, targets=y)).grad_inputs
        await c.backward(d0.data_addr, 0, x, grad_outputs=g, step=0, mb=2**64 - 1)
        assert d0.executor.cache_stats()["hits"] == 1
        assert d0.status()["activation_cache"]["hits"] == 1
        # without inputs: from the kept forward; a peer that holds none answers 409 InputsNotCached, typed
        assert (await c.forward(d0.data_addr, 0, x, mb=5)).kept
        await c.backward(d0.data_addr, 0, None, grad_outputs=g, step=0, mb=5)
        assert d0.status()["activation_cache"]["held"] == 1 and d0.executor.grad_samples == 2 * B
        for mb in (5, 6):  # spent by its backward; never run here
            with pytest.raises(InputsNotCached) as missed:
                await c.backward(d0.data_addr, 0, None, grad_outputs=g, step=0, mb=mb)
            assert missed.value.status == 409 and isinstance(missed.value, PeerError)
        assert d0.executor.grad_samples == 2 * B  # refused, not counted
        # bad ones are 4xx: no microbatch named (422), the last stage's fused backward without inputs (422)
        async with aiohttp.ClientSession() as s:
            for meta, tensors in (({"stage": 0, "step": 0}, {"grad_outputs": g}),
                                  ({"stage": 1, "mb": 5}, {"targets": y})):
                addr = d0.data_addr if meta["stage"] == 0 else d1.data_addr
                async with s.post(f"http://{addr}/v1/backward", data=encode_frame("backward", meta, tensors),
                                  headers={"Content-Type": CONTENT_TYPE}) as r:
                    assert r.status == 422, await r.text()
                    assert (await r.json())["error"] == "RequestError"
        for bad in (-1, "x", True, 1.5):
            with pytest.raises(PeerError) as err:
                await c.forward(d0.data_addr, 0, x, mb=bad)  # type: ignore[arg-type]
            assert err.value.status == 422 and err.value.error == "RequestError"
        # the progress long-poll: answered at the wait's end when the step is not reached
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{d0.data_addr}/v1/progress?wait_step=1&wait_s=0.05") as r:
                assert r.status == 200 and (await r.json())["step"] == 0
            async with s.get(f"http://{d0.data_addr}/v1/progress?wait_step=0&wait_s=5") as r:
                assert r.status == 200 and (await r.json())["step"] == 0
            for query in ("wait_step=x", "wait_step=1&wait_s=-1", "wait_step=1&wait_s=3600"):
                async with s.get(f"http://{d0.data_addr}/v1/progress?{query}") as r:
                    assert r.status == 422


def test_the_router_prefers_the_forwards_peer_while_usable() -> None:
    now = [0.0]
    router = StageRouter(0, clock=lambda: now[0])
    router.update_peers(listed({"a": "A", "b": "B"}))
    assert router.choose_preferred("b") == ("b", "B")
    assert router.choose_preferred("b", exclude={"b"}) == ("a", "A")  # it failed this call: elsewhere
    router.report_failure("b")
    assert router.choose_preferred("b") == ("a", "A")  # banned
    assert router.choose_preferred("gone") is not None and router.choose_preferred(None) is not None


async def test_a_rounds_hooks_run_before_queued_backwards(executors) -> None:
    # the worker runs a round's hooks ahead of queued microbatches (swarmd.pipeline.stage.worker): a
    # contribution taken while five backwards wait holds at most the one already running
    ex = executors(1, training=TrainingSpec(delay_updates=True))
    queued = [asyncio.create_task(ex.backward(hidden(i), grad_out(i), step=0)) for i in range(5)]
    await asyncio.sleep(0)  # every backward is submitted to the worker
    taken = await ex.take_contribution()
    assert taken.samples <= B
    await asyncio.gather(*queued)  # delayed updates: they join the next update, nothing is lost
    assert taken.samples + ex.grad_samples == 5 * B
