"""The activation cache: a forward's autograd graph, kept a while for its backward.

SWARM's backward is *stateless* (paper, section 3.2): the backward request carries the stage
inputs again and the peer recomputes the forward, so any peer of the stage can serve it. This
cache is an optimisation on top, never needed for correctness. A forward that names its
microbatch (``mb``, a random 64-bit id the trainer picks) keeps its graph, so the backward of
the same microbatch arriving at the *same* peer at the *same* step skips the recomputed
forward. The graph is used only if the backward names the same ``mb``, the stage is still at
the step the forward ran at (any change of the parameters, an update or an adopted snapshot,
empties the cache: the graph saved the old values), and its inputs are equal to the forward's
(``torch.equal``); otherwise the backward recomputes. Both paths run the same kernels on the
same values, so they give bit-identical gradients.

Inputs kept, not resent. An entry also holds the forward's (decoded, prepared) inputs, so the
backward of a forward this peer *kept* (its reply said ``kept``) may omit them: that is what
takes SWARM's stage boundary from 3 tensors per microbatch back to the paper's 2 (issue #30).
Such a backward is served from the entry (:meth:`ActivationCache.take_held`) only when it names
the same ``mb``, comes from the address the forward came from (so a member that saw an id cannot
spend another trainer's entry), and the stage is still at the forward's step; otherwise it is
refused (``InputsNotCached``, counted in ``unheld``) before anything is computed or counted, and
its sender resends it with the inputs. The inputs count in the entry's bytes.

Bounds. The cache is bounded by entries and by the bytes of the saved activations (parameters
not counted: they are shared with the module); entries expire after ``ttl_s`` and all go at
every step. When a forward's graph does not fit, it is the new one that is not kept (counted
as ``skipped``), not the oldest that is evicted: backwards come back in about the order of
their forwards, so the oldest entry is the next one needed, and evicting it would turn one
miss into a miss for every microbatch in flight.

Threads. An :class:`ActivationCache` is a plain, unsynchronised object owned by the stage's
worker thread (``swarmd.pipeline.stage.executor``); readers elsewhere see its counters only through
the frozen :class:`CacheStats` the worker publishes.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarmd.pipeline.model import StageModule

__all__ = ["ActivationCache", "CacheStats", "CachedForward", "CapturedForward", "capture_forward"]


@dataclass(frozen=True)
class CacheStats:
    """The cache's size and counters at one moment (``/status`` → ``activation_cache``)."""

    entries: int
    bytes: int  # saved activations held now
    max_entries: int
    max_bytes: int
    hits: int = 0  # backwards that reused their forward's graph
    misses: int = 0  # backwards naming an mb with no usable entry here: recomputed
    mismatches: int = 0  # of the misses: an entry for the mb, but other inputs
    evictions: int = 0  # entries dropped unused (expiry, step change, a retried forward)
    skipped: int = 0  # forwards whose graph was not kept: the cache was full
    held: int = 0  # of the hits: backwards that came without their inputs (the entry's were used)
    unheld: int = 0  # backwards without inputs and no usable entry here: refused, resent with inputs

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class CapturedForward:
    """A forward run with its graph kept, and what keeping that graph costs."""

    leaf: torch.Tensor  # the graph's input leaf (requires grad), or the token ids on the first stage
    out: torch.Tensor  # the stage outputs, with their graph
    nbytes: int  # saved activations and the output, parameters not counted


@dataclass(frozen=True)
class CachedForward:
    """A captured forward stored under its microbatch id, until its backward."""

    inputs: torch.Tensor  # the prepared inputs the forward ran on (for the equality check)
    leaf: torch.Tensor | None  # None: the graph was dropped at an update, the inputs kept (delayed updates)
    out: torch.Tensor | None
    step: int  # the optimizer step the parameters were at
    nbytes: int
    created: float  # on the cache's clock
    source: str = ""  # where the forward came from (the sender's IP): a backward without inputs must too


def capture_forward(module: StageModule, x: torch.Tensor, *, shared: frozenset[int]) -> CapturedForward:
    """Run ``module`` on ``x`` keeping the autograd graph, and measure what the graph saves.

    ``shared`` holds the storage pointers of the module's parameters: autograd saves them too,
    but they live on with the module whatever the cache does, so they are not counted.
    """
    leaf = x if module.is_first else x.detach().requires_grad_(True)
    seen: set[int] = set()
    nbytes = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal nbytes
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr not in shared:
            seen.add(ptr)
            nbytes += t.untyped_storage().nbytes()
        # detached: the same storage and version counter (in-place changes are still caught),
        # but no grad_fn. Keeping ``t`` itself would, for a saved *output*, make a reference
        # cycle node -> saved tensor -> node that only a backward breaks: an entry dropped
        # unused (evicted, or its step passed) would leak its whole graph.
        return t.detach()

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        out = module(leaf)
    for kept in (out, x):  # the output, and the inputs a backward without them is served from
        ptr = kept.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            nbytes += kept.untyped_storage().nbytes()
    return CapturedForward(leaf=leaf, out=out, nbytes=nbytes)


class ActivationCache:
    """Captured forwards by microbatch id, bounded by entries, bytes and age (see the module docstring)."""

    def __init__(
        self, max_entries: int, max_bytes: int, ttl_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max(0, max_entries)
        self.max_bytes = max(0, max_bytes)
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[int, CachedForward] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.mismatches = 0
        self.evictions = 0
        self.skipped = 0
        self.held = 0
        self.unheld = 0

    @property
    def enabled(self) -> bool:
        """Whether forwards should capture their graph at all (a zero bound turns the cache off)."""
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> CacheStats:
        return CacheStats(
            entries=len(self._entries), bytes=self.nbytes, max_entries=self.max_entries, max_bytes=self.max_bytes,
            hits=self.hits, misses=self.misses, mismatches=self.mismatches, evictions=self.evictions,
            skipped=self.skipped, held=self.held, unheld=self.unheld,
        )

    def discard(self, mb: int) -> None:
        """Drop the entry of ``mb`` unused (a retried forward replaces the earlier one)."""
        self._pop(mb, evicted=True)

    def put(self, mb: int, inputs: torch.Tensor, captured: CapturedForward, step: int, source: str = "") -> bool:
        """Keep ``captured`` for the backward of ``mb`` if it fits; False: skipped (the cache is full).

        Expired entries go first. A skipped graph is freed when the caller drops ``captured.out``,
        and its backward recomputes.
        """
        now = self._clock()
        self._expire(now)
        if len(self._entries) >= self.max_entries or self.nbytes + captured.nbytes > self.max_bytes:
            self.skipped += 1
            return False
        self._entries[mb] = CachedForward(
            inputs=inputs, leaf=captured.leaf, out=captured.out, step=step, nbytes=captured.nbytes, created=now,
            source=source,
        )
        self.nbytes += captured.nbytes
        return True

    def take(self, mb: int | None, inputs: torch.Tensor, step: int) -> CachedForward | None:
        """The usable entry for a backward of ``mb`` at ``step`` on ``inputs``, removed; None: recompute.

        A backward that names no microbatch is not counted. One that names one is a hit only if
        the entry exists, is of this step and ran on equal inputs; an entry that fails the check
        is dropped (counted as an eviction, and as a mismatch when only the inputs differ).
        """
        if mb is None:
            return None
        self._expire(self._clock())
        entry = self._pop(mb, evicted=False)
        if entry is None or entry.step != step or entry.out is None:
            self.misses += 1
            if entry is not None:
                self.evictions += 1
            return None
        same = entry.inputs.dtype == inputs.dtype and entry.inputs.shape == inputs.shape
        if not (same and torch.equal(entry.inputs, inputs)):
            self.misses += 1
            self.mismatches += 1
            self.evictions += 1
            return None
        self.hits += 1
        return entry

    def take_held(self, mb: int, step: int, source: str = "") -> CachedForward | None:
        """The entry of ``mb`` for a backward at ``step`` from ``source`` that omitted its inputs,
        removed; None: the sender must resend them (counted in ``unheld``). An entry whose graph
        was dropped (:meth:`clear` with ``keep_inputs``) has ``out`` None: recompute from its inputs.

        An entry of another step is dropped (its graph is stale); one kept for another source
        stays (a stranger naming the id neither uses nor spends it).
        """
        self._expire(self._clock())
        entry = self._entries.get(mb)
        if entry is not None and entry.source != source:
            entry = None
        elif entry is not None:
            self._pop(mb, evicted=entry.step != step)
            if entry.step != step:
                entry = None
        if entry is None:
            self.misses += 1
            self.unheld += 1
            return None
        self.hits += 1
        self.held += 1
        return entry

    def clear(self, *, keep_inputs: bool = False) -> None:
        """The parameters changed: every saved graph is stale.

        ``keep_inputs`` (delayed updates: a backward one step old still counts, into the next
        update): keep each entry's inputs, drop its graph, so that backward recomputes from them
        instead of asking its sender to resend them across the network. Entries already without
        a graph (two updates old: their backwards are refused as stale) go.
        """
        if not keep_inputs:
            self.evictions += len(self._entries)
            self._entries.clear()
            self.nbytes = 0
            return
        for mb, entry in list(self._entries.items()):
            if entry.out is None:
                self._pop(mb, evicted=True)
            else:
                nbytes = _inputs_bytes(entry.inputs)
                self.nbytes += nbytes - entry.nbytes
                self._entries[mb] = dataclasses.replace(entry, leaf=None, out=None, nbytes=nbytes)

    def _pop(self, mb: int, *, evicted: bool) -> CachedForward | None:
        entry = self._entries.pop(mb, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            if evicted:
                self.evictions += 1
        return entry

    def _expire(self, now: float) -> None:
        while self._entries:
            mb, entry = next(iter(self._entries.items()))
            if now - entry.created <= self.ttl_s:
                break
            self._pop(mb, evicted=True)


def _inputs_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
