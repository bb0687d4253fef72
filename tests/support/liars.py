"""Test-only fault hooks: peers that lie (issue #17, item 4).

Executors, in three ways (:func:`make_liar`): ``scale``: a forward's outputs multiplied by
``factor``; ``noise``: a forward's outputs plus Gaussian noise of ``noise`` times their standard
deviation; ``grad``: a backward's input gradients negated and tripled. Parameter gradients stay
honest.

Averagers (:func:`poison_contributions`, :func:`lie_as_leader`): a contributor that sends
poisoned gradients (``scaled`` by 5000, ``noisy``, or ``nan``) while its executor keeps the true
ones, and a leader that answers with ten times the mean (``scaled``) or leaves the others'
contributions out of its list (``dropped``). tests/adversarial/test_averaging_checks.py and
tests/adversarial/test_liars_sync.py use them on in-process peers; its ``LIAR_HOOK`` tells the same lies in
child-process daemons.

Two ways in: :func:`make_liar` patches one in-process executor (what the tests use: cheap), and
:data:`SITECUSTOMIZE` is a ``sitecustomize`` module for a child-process daemon (put its folder on
``PYTHONPATH`` and set ``SWARMD_TEST_LIE=scale|noise|grad``, optionally ``SWARMD_TEST_LIE_STAGE``),
as tests/integration/test_averaging_faults.py does for its hooks.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import Any

import torch

from swarmd.pipeline.averaging.allreduce.averager import AllReduceAverager
from swarmd.pipeline.averaging.allreduce.messages import ArAck
from swarmd.pipeline.averaging.averager import RoundResult, StageAverager
from swarmd.pipeline.stage.executor import StageExecutor

__all__ = ["AWARE_HONEST_ANSWERS", "LIES", "SITECUSTOMIZE", "Told", "lie_about_a_microbatch", "lie_as_leader",
           "lie_as_owner", "make_liar", "poison_contributions", "withhold_inputs"]

LIES = ("scale", "noise", "grad", "sometimes", "gradnoise", "stale", "ahead", "far", "aware", "awareflip")
#: How many answers the check-aware liar (``aware``) gives honestly first: a peer's first answers
#: to each trainer are always checked, so it waits them out.
AWARE_HONEST_ANSWERS = 12


@dataclasses.dataclass
class Told:
    """How many answers a liar of :func:`make_liar` has told wrong so far (``scripts/bench_verify.py``:
    how soon after its first lie it is excluded)."""

    lies: int = 0


def make_liar(executor: StageExecutor, lie: str, *, factor: float = 1.5, noise: float = 0.5, seed: int = 0) -> Told:
    """Make ``executor`` (this instance only) lie the way ``lie`` names (issue #29's table):

    * ``scale``: a forward's outputs times ``factor``; ``sometimes``: times 1.05, one forward in three;
    * ``noise``: a forward's outputs plus Gaussian noise of ``noise`` times their standard deviation;
    * ``grad``: a backward's input gradients negated and tripled; ``gradnoise``: plus 20 % noise;
    * ``stale``: lazy, forwards with its start-up weights (never updated) and the current step;
    * ``ahead`` / ``far``: every answer tagged one step ahead / 1000 steps ahead of the truth;
    * ``aware``: honest whenever a request looks like a check (flagged ``verify``, a backward of a
      microbatch whose forward it never ran, or one of its first ``AWARE_HONEST_ANSWERS`` answers),
      and otherwise tripled, negated input gradients and validation losses times 0.9; ``awareflip``: the
      same, its gradients only negated (their size kept: no size rule sees it, only the pairs).

    Parameter gradients stay honest (what it accumulates is the averaging's business). Returns the
    count of its lies, kept up to date."""
    if lie not in LIES:
        raise ValueError(f"unknown lie {lie!r}; one of {LIES}")
    generator = torch.Generator().manual_seed(seed)
    honest_forward, honest_backward = executor._forward_sync, executor._backward_sync
    calls = [0]
    seen: set[int] = set()  # microbatch ids it ran a forward for (the check-aware liar's memory)
    frozen = copy.deepcopy(executor.module) if lie == "stale" else None
    told = Told()

    def lied(result: Any) -> Any:
        told.lies += 1
        return result

    def forward(inputs: torch.Tensor, targets: torch.Tensor | None, mb: int | None, *args: Any) -> Any:
        result = honest_forward(inputs, targets, mb, *args)
        calls[0] += 1
        out = result.outputs
        if lie in ("ahead", "far"):
            return lied(dataclasses.replace(result, step=result.step + (1 if lie == "ahead" else 1000)))
        if lie in ("aware", "awareflip"):
            if mb is not None:
                seen.add(mb)
            if targets is not None and calls[0] > AWARE_HONEST_ANSWERS:
                return lied(dataclasses.replace(result, outputs=out * 0.9))  # a validation loss
            return result
        if targets is not None:  # a loss (validation): left alone, only activations lie
            return result
        if lie == "stale" and frozen is not None:
            x, _ = executor.passes.prepare(inputs, None, targets_required=False)
            with torch.no_grad():
                out = frozen(x, None).detach().to("cpu", out.dtype)
        elif lie == "scale":
            out = out * factor
        elif lie == "sometimes":
            out = out * 1.05 if calls[0] % 3 == 0 else out
        elif lie == "noise":
            out = out + noise * out.std() * torch.randn(out.shape, generator=generator, dtype=out.dtype)
        return dataclasses.replace(result, outputs=out) if out is result.outputs else lied(
            dataclasses.replace(result, outputs=out))

    def backward(inputs: torch.Tensor, grad_outputs: torch.Tensor | None, targets: torch.Tensor | None,
                 step: int | None, mb: int | None, *args: Any, **kwargs: Any) -> Any:
        result = honest_backward(inputs, grad_outputs, targets, step, mb, *args, **kwargs)
        calls[0] += 1
        if lie in ("ahead", "far"):
            return lied(dataclasses.replace(result, step=result.step + (1 if lie == "ahead" else 1000)))
        if result.grad_inputs is None:
            return result
        if lie in ("aware", "awareflip"):
            verify = args[1] if len(args) > 1 else kwargs.get("verify", False)
            looks_checked = (verify or calls[0] <= AWARE_HONEST_ANSWERS
                             or (grad_outputs is not None and mb not in seen))
            seen.discard(mb if mb is not None else -1)
            if looks_checked:
                return result
            return lied(dataclasses.replace(result, grad_inputs=(-3.0 if lie == "aware" else -1.0)
                                            * result.grad_inputs))
        if lie == "gradnoise":
            g = result.grad_inputs
            noisy = g + 0.2 * g.std() * torch.randn(g.shape, generator=generator, dtype=g.dtype)
            return lied(dataclasses.replace(result, grad_inputs=noisy))
        return lied(dataclasses.replace(result, grad_inputs=-3.0 * result.grad_inputs))

    if lie in ("grad", "gradnoise"):
        executor._backward_sync = backward  # type: ignore[method-assign]
    elif lie in ("ahead", "far", "aware", "awareflip"):
        executor._backward_sync = backward  # type: ignore[method-assign]
        executor._forward_sync = forward  # type: ignore[method-assign]
    else:
        executor._forward_sync = forward  # type: ignore[method-assign]
    return told


def poison_contributions(averager: StageAverager, how: str, *, own_part_only: bool = False,
                         open_true: bool = False, others_only: bool = False) -> None:
    """Make ``averager`` send poisoned contributions (``scaled``, ``noisy``, ``nan``; ``minus20`` or
    ``flipped``: its true gradient times -20 or -1, issue 29's table); its executor
    keeps the true gradients, so a refused contribution is restored intact. ``own_part_only`` (a member of
    the chunked all-reduce): poison only its slice of the parts it owns, the other owners get the truth
    (scored by nobody but itself, its lie was its part's mean: issue 29). ``open_true`` (a last-stage member
    of the chunked all-reduce): its openings sketch its true contribution as the one it sent, so they are
    consistent (no owner holds all of what it sent to check that sketch against: ``allreduce.sent_parts``).
    ``others_only`` (the same): poison only the slices it sends to owners other than its round's coordinator
    and itself (the coordinator checks the part it owns itself, and the others by a draw)."""
    if how not in ("scaled", "noisy", "nan", "minus20", "flipped"):
        raise ValueError(f"unknown poison {how!r}")

    def poisoned(own: Any) -> Any:
        if own.grads is not None:
            g = torch.Generator().manual_seed(own.step)
            if how == "scaled":
                grads = own.grads * 5000
            elif how in ("minus20", "flipped"):  # issue 29's table: inside the 64x band, the wrong way
                grads = own.grads * (-20.0 if how == "minus20" else -1.0)
            elif how == "noisy":
                grads = own.grads + torch.randn(own.grads.shape, generator=g) * (
                    float(own.grads.norm()) / own.grads.numel() ** 0.5 * 2000)
            else:
                grads = own.grads.clone()
                grads[::97] = float("nan")
            own = dataclasses.replace(own, grads=grads)
        return own

    if open_true:
        if not isinstance(averager, AllReduceAverager):
            raise ValueError("open_true is a lie of the chunked all-reduce's members")
        from swarmd.pipeline.averaging.allreduce import member as ar_member

        opened = ar_member.open_contribution
        liar_id = averager.peer_id

        def open_true_contribution(identity: Any, **kw: Any) -> bytes:
            if kw.get("peer_id") == liar_id and kw["own"].grads is not None:
                kw["decoded"] = kw["own"].grads
            return opened(identity, **kw)

        ar_member.open_contribution = open_true_contribution  # type: ignore[assignment]
    if isinstance(averager, AllReduceAverager):  # a member: every part it sends, and its slice of the part it
        original_parts = averager._to_send  # owns (it reduces that part honestly: ``lie_as_owner`` does not)
        def to_send(own: Any, plan: Any) -> Any:
            sent = original_parts(own, plan)
            if others_only and sent.grads is not None:
                lying, grads = poisoned(sent), sent.grads.clone()
                for j, owner in enumerate(plan.owners):
                    if owner not in (plan.coordinator, averager.peer_id):
                        lo, hi = plan.bounds[j]
                        grads[lo:hi] = lying.grads[lo:hi]
                return dataclasses.replace(sent, grads=grads)
            if not own_part_only or sent.grads is None:
                return poisoned(sent)
            lying, grads = poisoned(sent), sent.grads.clone()
            for j in plan.parts_of(averager.peer_id):
                lo, hi = plan.bounds[j]
                grads[lo:hi] = lying.grads[lo:hi]
            return dataclasses.replace(sent, grads=grads)

        averager._to_send = to_send  # type: ignore[method-assign]
        return
    original = averager._post

    async def _post(addr: str, own: Any, leader: str) -> Any:
        return await original(addr, poisoned(own), leader)

    averager._post = _post  # type: ignore[method-assign]


def lie_as_owner(averager: AllReduceAverager, factor: float = -1.0, hide: str = "") -> None:
    """Make ``averager`` publish the mean of every part it owns times ``factor`` (-1: a sign flip, which the
    members' box checks pass: ``round_checks.check_answer``), its ready report signed over that lie; its
    slices and everything else honest. What the audits of part owners catch (``allreduce.audit``). ``hide``:
    what it does when an auditor asks for its evidence: ``""`` shows it, ``refuse`` refuses, ``hang`` never
    answers, ``moved`` says it serves another stage now (``auditor``: held to account as unaccountable)."""
    if hide not in ("", "refuse", "hang", "moved"):
        raise ValueError(f"unknown way to hide {hide!r}")
    original = averager._register
    if hide:
        async def on_slices(q: Any) -> bytes:
            if hide == "hang":
                await asyncio.sleep(3600)
            return ArAck(False, "another stage: this peer serves stage 1 now" if hide == "moved"
                         else "not showing that").encode()

        averager.auditor.on_slices = on_slices  # type: ignore[method-assign]

    def register(plan: Any) -> None:
        original(plan)
        for j in plan.parts_of(averager.peer_id):
            owner = averager.owners[(plan.round_id, j)]
            honest_rule = owner._rule

            def lying_rule(parts: Any, honest_rule: Any = honest_rule) -> Any:
                mean, red = honest_rule(parts)
                return mean * factor, red

            owner._rule = lying_rule  # type: ignore[method-assign]

    averager._register = register  # type: ignore[method-assign]


def withhold_openings(averager: StageAverager) -> None:
    """Make ``averager`` never open its contributions (``swarmd.pipeline.averaging.trust.openings``): the liar
    that dodges the sum check by never showing its sums."""

    def _opened(leader: str, opened: Any) -> None:
        return None

    averager._opened = _opened  # type: ignore[method-assign]


def lie_about_a_microbatch(averager: StageAverager, where: str = "part") -> list[int]:
    """Make ``averager``'s contributions hold one microbatch's gradient sign-flipped, consistently: the
    contribution is ``c - 2 g_1`` and its part for that microbatch ``-g_1``, so its opening's parts sum to its
    contribution (no sum check sees it) and it ships that microbatch's true inputs. Only a recomputation of
    that microbatch (``swarmd.pipeline.averaging.trust.recomputation``) tells. ``where="extra"``: the whole contribution
    flipped (``c - 2 t``, ``t`` the microbatches' sum) and the lie opened as a part no microbatch explains
    (``-2 t``), every part true: only the bound on that part tells. ``where="unlisted"``: the contribution
    true, but that microbatch opened as a part no microbatch explains (so no recomputation could draw it):
    only the check that an opening lists every shipped microbatch tells. Returns the microbatch ids it lied
    about, kept up to date; a contribution put back after a failed round is put back true."""
    if where not in ("part", "extra", "unlisted"):
        raise ValueError(f"unknown place for the lie {where!r}")
    executor = averager.executor
    take, restore = executor.take_contribution, executor.restore_contribution
    lied: list[int] = []
    originals: dict[int, Any] = {}

    async def take_lying() -> Any:
        own = await take()
        index = next((i for i, (mb, _) in enumerate(own.parts) if mb is not None), None)
        if own.grads is None or index is None:
            return own
        mb, part = own.parts[index]
        if where == "unlisted":
            lie = dataclasses.replace(own, parts=(*own.parts[:index], (None, part), *own.parts[index + 1:]))
            originals[id(lie)] = own
            lied.append(mb)
            return lie
        if where == "extra":
            part = torch.stack([t for m, t in own.parts if m is not None]).sum(0)
            parts = (*own.parts, (None, -2 * part))
        else:
            parts = (*own.parts[:index], (mb, -part), *own.parts[index + 1:])
        lie = dataclasses.replace(own, grads=own.grads - 2 * part, parts=parts)
        originals[id(lie)] = own
        while len(originals) > 4:  # those of applied rounds are never put back
            originals.pop(next(iter(originals)))
        lied.append(mb)
        return lie

    async def restore_true(contribution: Any) -> None:
        await restore(originals.pop(id(contribution), contribution))

    executor.take_contribution = take_lying  # type: ignore[method-assign]
    executor.restore_contribution = restore_true  # type: ignore[method-assign]
    return lied


def withhold_inputs(averager: StageAverager) -> None:
    """Make ``averager`` send its contributions without their microbatches' inputs (``AverageRequest.inputs``):
    the liar that dodges the recomputation (``swarmd.pipeline.averaging.trust.recomputation``) by never showing them."""
    executor = averager.executor
    take = executor.take_contribution

    async def take_bare() -> Any:
        return dataclasses.replace(await take(), inputs=())

    executor.take_contribution = take_bare  # type: ignore[method-assign]


def lie_as_leader(averager: StageAverager, how: str) -> None:
    """Make ``averager``, leading a round, answer with ten times the mean (``scaled``) or list only its
    own contribution (``dropped``); it applies its lie itself (it forks its stage)."""
    if how not in ("scaled", "dropped"):
        raise ValueError(f"unknown lie {how!r}")
    original = averager._reduce

    def _reduce(rnd: Any) -> RoundResult:
        result = original(rnd)
        if result.status != "ok" or result.reply is None or result.mean_grads is None or result.used is None:
            return result
        mean, used = result.mean_grads, result.used
        if how == "scaled":
            mean = mean * 10
        else:
            used = tuple(u for u in used if u.peer_id == averager.peer_id)
        lie = dataclasses.replace(result, mean_grads=mean, used=used)
        return dataclasses.replace(lie, reply=lie.to_reply(averager.executor.stage).encode("none"))

    averager._reduce = _reduce  # type: ignore[method-assign]


SITECUSTOMIZE = '''
import os

_LIE = os.environ.get("SWARMD_TEST_LIE")
if _LIE:
    from swarmd.pipeline.stage import executor as _executor
    from tests.support.liars import make_liar

    _init = _executor.StageExecutor.__init__
    _stage = os.environ.get("SWARMD_TEST_LIE_STAGE")

    def _lying_init(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        if _stage is None or int(_stage) == self.stage:
            make_liar(self, _LIE)

    _executor.StageExecutor.__init__ = _lying_init
'''
