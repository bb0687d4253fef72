"""The pure parts of a chunked all-reduce round: who coordinates, who owns which part, what the
owners report, and the one commit-or-abort decision (``swarmd.pipeline.averaging.allreduce.averager`` runs it).

Nothing here touches the network, the clock or the stage: every function is a function of its
arguments, so every peer computes the same plan from the same view, and the tests pin the rules.

- :func:`choose_coordinator`: the smallest peer id among the candidates, directly reachable ones
  first (a relayed peer coordinates only a stage of relayed peers), as the single leader is chosen
  (``swarmd.pipeline.averaging.averager``).
- :func:`part_bounds`: the flat gradient vector cut into one contiguous part per owner, equal
  sizes by default, or in proportion to ``weights`` (the owners' measured bandwidth).
- :class:`RoundPlan`: the round the coordinator starts (its members and their addresses, the
  part owners, the bounds), sent to every member; validated when read from the wire.
- :class:`Ready`: an owner's "part ready" (the digest of its encoded part mean, the samples of
  every member it reduced), and :func:`decide`: commit only when every part is ready, every
  owner reduced the same members with the same sample counts, nobody was refused, and the
  samples reach the target.
- :class:`Decision`: what the coordinator signs (:func:`decision_message`); a member applies
  the round's mean only with a ``commit`` decision whose digests match every part it fetched.
- :func:`quorum`: whether a round's members are enough of the stage as listed for the round to
  start and commit (at least half of every listed peer, and a strict majority of those the
  coordinator does not exclude): two disjoint rounds at one step cannot both have it
  (``swarmd.pipeline.averaging.allreduce.averager`` has the argument).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import msgpack
import torch

from swarmd.dht.identity import peer_id_of, verify
from swarmd.net.addresses import is_relayed
from swarmd.pipeline.averaging.trust.hostile_contributions import PartTerms
from swarmd.pipeline.averaging.trust.refusals import Refusal
from swarmd.pipeline.averaging.trust.round_checks import whole_norms, whole_outliers

_PART_DOMAIN = b"swarmd-allreduce-part/1\x00"
_READY_DOMAIN = b"swarmd-allreduce-ready/1\x00"
_DECISION_DOMAIN = b"swarmd-allreduce-decision/1\x00"
MAX_MEMBERS = 1024  # a plan names at most this many peers (remote input: bounded)
MAX_ID_LEN = 128


def choose_coordinator(addrs: Mapping[str, str], suspects: Iterable[str] = ()) -> str | None:
    """The coordinator of the round among ``addrs`` (peer id -> data address): the smallest peer id,
    directly reachable peers first; peers in ``suspects`` (they failed this peer lately) are
    skipped unless nobody else is left. None for no candidate."""
    if not addrs:
        return None
    skip = set(suspects)
    pool = [pid for pid in addrs if pid not in skip] or list(addrs)
    return min(pool, key=lambda pid: (is_relayed(addrs[pid]), pid))


def part_owners(members: Mapping[str, str]) -> tuple[str, ...]:
    """Who owns a part: the directly reachable members (a relayed one adds a hop to every part it
    owns, and its relay's death would abort the round), or all of them when none is; sorted."""
    direct = sorted(pid for pid, addr in members.items() if not is_relayed(addr))
    return tuple(direct) if direct else tuple(sorted(members))


def part_bounds(numel: int, owners: int, weights: Sequence[float] | None = None) -> tuple[tuple[int, int], ...]:
    """``owners`` contiguous ``[lo, hi)`` slices covering ``range(numel)``: equal sizes (the first
    ``numel % owners`` one longer), or in proportion to ``weights`` (positive, one per owner)."""
    if owners < 1:
        raise ValueError("a round has at least one part owner")
    if numel < 0:
        raise ValueError("numel must be >= 0")
    if weights is None:
        base, extra = divmod(numel, owners)
        sizes = [base + (1 if i < extra else 0) for i in range(owners)]
    else:
        if len(weights) != owners or not all(math.isfinite(w) and w > 0 for w in weights):
            raise ValueError("weights: one positive finite number per owner")
        total = float(sum(weights))
        cuts = [round(numel * sum(weights[: i + 1]) / total) for i in range(owners)]
        cuts[-1] = numel
        sizes = [cuts[0]] + [cuts[i] - cuts[i - 1] for i in range(1, owners)]
    bounds, lo = [], 0
    for size in sizes:
        bounds.append((lo, lo + size))
        lo += size
    return tuple(bounds)


@dataclass(frozen=True)
class RoundPlan:
    """One round, as its coordinator started it."""

    round_id: str  # unique per round: "<step>-<coordinator prefix>-<nonce>"
    stage: int
    step: int
    coordinator: str
    members: tuple[tuple[str, str], ...]  # (peer id, data address), sorted by peer id
    owners: tuple[str, ...]  # owner of part j
    bounds: tuple[tuple[int, int], ...]  # part j is grads[lo:hi]
    timeout_s: float  # owners wait this long for parts, the coordinator for readies
    # owners wait this long for every member's part, then reduce those that came (the missing are dropped
    # from the round: ``decide``); None: ``timeout_s`` (the stage's patience, ``patience``)
    patience_s: float | None = None
    # members whose gradients every owner leaves out of its part's mean (their samples count): they owe the
    # coordinator the opening of their last contribution to it (``openings``); the commit names them as struck
    struck: tuple[str, ...] = ()

    @property
    def wait_s(self) -> float:
        """How long an owner waits for every member's part before it reduces those that came."""
        return self.timeout_s if self.patience_s is None else min(self.patience_s, self.timeout_s)

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(pid for pid, _ in self.members)

    def addr(self, peer_id: str) -> str:
        for pid, addr in self.members:
            if pid == peer_id:
                return addr
        raise KeyError(peer_id)

    def parts_of(self, peer_id: str) -> tuple[int, ...]:
        return tuple(j for j, o in enumerate(self.owners) if o == peer_id)

    def to_wire(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "stage": self.stage, "step": self.step, "coordinator": self.coordinator,
                "members": [list(m) for m in self.members], "owners": list(self.owners),
                "bounds": [list(b) for b in self.bounds], "timeout_s": self.timeout_s,
                **({"patience_s": self.patience_s} if self.patience_s is not None else {}),
                **({"struck": list(self.struck)} if self.struck else {})}

    @classmethod
    def from_wire(cls, value: Any, *, numel: int | None = None) -> RoundPlan:
        """Validate a plan read from the wire (``ValueError`` naming what is wrong)."""
        if not isinstance(value, dict):
            raise ValueError("a round plan is a map")
        rid, stage, step, coord = value.get("round_id"), value.get("stage"), value.get("step"), value.get("coordinator")
        members, owners, bounds, timeout = (value.get("members"), value.get("owners"), value.get("bounds"),
                                            value.get("timeout_s"))
        if not (_short_str(rid) and _nat(stage) and _nat(step) and _short_str(coord)):
            raise ValueError("a round plan needs round_id, stage, step and coordinator")
        if not (isinstance(members, list) and 0 < len(members) <= MAX_MEMBERS
                and all(isinstance(m, list) and len(m) == 2 and _short_str(m[0]) and isinstance(m[1], str)
                        and len(m[1]) <= 512 for m in members)):
            raise ValueError("a round plan's members are [peer_id, address] pairs")
        ids = [m[0] for m in members]
        if ids != sorted(set(ids)) or coord not in ids:
            raise ValueError("a round plan's members are sorted, distinct and include the coordinator")
        if not (isinstance(owners, list) and isinstance(bounds, list) and 0 < len(owners) == len(bounds)
                and all(o in ids for o in owners)):
            raise ValueError("a round plan names one member as owner of each part")
        lo = 0
        for b in bounds:
            if not (isinstance(b, list) and len(b) == 2 and b[0] == lo and _nat(b[1]) and b[1] >= lo):
                raise ValueError("a round plan's parts are contiguous [lo, hi) slices from 0")
            lo = b[1]
        if numel is not None and lo != numel:
            raise ValueError(f"a round plan's parts cover {lo} values, not the stage's {numel}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ValueError("a round plan's timeout_s is a number of seconds in (0, 3600]")
        patience = value.get("patience_s")
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, (int, float))
                                     or not 0 < patience <= timeout):
            raise ValueError("a round plan's patience_s is a number of seconds in (0, timeout_s]")
        struck = value.get("struck", [])
        if not (isinstance(struck, list) and all(isinstance(p, str) for p in struck)
                and struck == sorted(set(struck)) and set(struck) <= set(ids) - {coord}):
            raise ValueError("a round plan's struck members are distinct members but the coordinator, sorted")
        return cls(round_id=rid, stage=stage, step=step, coordinator=coord,
                   members=tuple((m[0], m[1]) for m in members), owners=tuple(owners),
                   bounds=tuple((b[0], b[1]) for b in bounds), timeout_s=float(timeout),
                   patience_s=float(patience) if patience is not None else None, struck=tuple(struck))


def plan_round(*, stage: int, step: int, coordinator: str, members: Mapping[str, str], numel: int, nonce: str,
               timeout_s: float, weights: Mapping[str, float] | None = None,
               patience_s: float | None = None, struck: Iterable[str] = ()) -> RoundPlan:
    """The plan of a round of ``members`` (peer id -> address; the coordinator among them); ``struck``: the
    members whose gradients the owners leave out of the mean (they owe an opening)."""
    owners = part_owners(members)
    w = [weights.get(o, 1.0) for o in owners] if weights else None
    return RoundPlan(round_id=f"{step}-{coordinator[:16]}-{nonce}", stage=stage, step=step, coordinator=coordinator,
                     members=tuple(sorted(members.items())), owners=owners,
                     bounds=part_bounds(numel, len(owners), w), timeout_s=timeout_s,
                     patience_s=None if patience_s is None else min(max(patience_s, 1e-3), timeout_s),
                     struck=tuple(sorted(set(struck) & set(members) - {coordinator})))


def reduce_part(parts: Mapping[str, tuple[int, torch.Tensor | None]], size: int) -> tuple[torch.Tensor, int]:
    """The mean of one part over its contributions (peer id -> (samples, float32 slice or None)):
    summed in float64 in peer-id order (the same sum whatever the arrival order, and no overflow
    of finite float32 inputs), divided by the total samples, as float32; and that total."""
    total = sum(s for s, _ in parts.values())
    summed = torch.zeros(size, dtype=torch.float64)
    for pid in sorted(parts):
        grads = parts[pid][1]
        if grads is not None:
            summed += grads
    if total <= 0:
        return summed.to(torch.float32), 0
    return (summed / total).to(torch.float32), total


def part_digest(mean: torch.Tensor, used: Sequence[Sequence[Any]]) -> str:
    """What an owner reports and the decision carries for part ``j``: sha256 over the decoded part
    mean's bytes and the contributions it lists, so equal digests mean bit-identical decoded means
    (the round checks' ``used`` lists included)."""
    t = mean.detach().to(torch.float32).contiguous().cpu()
    h = hashlib.sha256(t.numpy().data)
    h.update(msgpack.packb([list(u) for u in used], use_bin_type=True))
    return h.hexdigest()


def claim_digest(part_digests: Sequence[str]) -> str:
    """What a member's signed claim of its whole contribution names as its digest
    (``accusations.contribution_message``): sha256 over its parts' digests as their owners decoded them,
    in part order; the coordinator recomputes it from the parts' ``used`` lists."""
    return hashlib.sha256(msgpack.packb(list(part_digests), use_bin_type=True)).hexdigest()


def part_message(stage: int, round_id: str, part: int, samples: int, digest: str, peer_id: str, owner: str) -> bytes:
    """What a member signs when it sends part ``part`` of its gradients to its owner."""
    return _PART_DOMAIN + msgpack.packb([stage, round_id, part, samples, digest, peer_id, owner], use_bin_type=True)


def part_signer(meta: Mapping[str, Any], digest: str, stage: int, round_id: str, part: int, owner: str) -> str | None:
    """The member that signed an ``ar_part`` frame's ``meta`` (its ``peer_id``, ``pk``, ``sig``, ``samples``) for
    part ``part`` of ``round_id`` to ``owner``, over ``digest`` (the slice's ``tensor_digest`` as decoded); None
    when the frame is not signed so (remote input: any meta)."""
    pid, pk, sig, samples = meta.get("peer_id"), meta.get("pk"), meta.get("sig"), meta.get("samples")
    if not (isinstance(pid, str) and type(pk) is bytes and type(sig) is bytes and type(samples) is int):
        return None
    if peer_id_of(pk) != pid:
        return None
    return pid if verify(pk, part_message(stage, round_id, part, samples, digest, pid, owner), sig) else None


@dataclass(frozen=True)
class Ready:
    """An owner's report that part ``part`` is reduced (or could not be)."""

    round_id: str
    part: int
    owner: str
    digest: str  # bytes_digest of the encoded part mean; "" when not reduced
    samples: tuple[tuple[str, int], ...]  # (member, samples) it reduced, sorted
    missing: tuple[str, ...] = ()  # members whose part had not arrived when the owner reduced (or gave up)
    refused: tuple[tuple[str, str], ...] = ()  # (member, why): non-finite, outlier, unsigned...
    # each other member's slice scored against the owner's own (``hostile_contributions.part_terms``): the
    # coordinator adds them up over the parts into the leader's scores, to strike and convict
    scores: tuple[tuple[str, PartTerms], ...] = ()
    # (member, per-sample norm of its slice) for each member with samples: the coordinator adds them up over
    # the parts into the whole contributions' norms, for the outlier rule (``decide``)
    norms: tuple[tuple[str, float], ...] = ()
    # the members the plan named struck, which the owner left out of its part's mean (``RoundPlan.struck``):
    # signed, so an audit recomputes the part as the owner said it reduced it (``audit``)
    struck: tuple[str, ...] = ()

    def message(self, stage: int) -> bytes:
        return _READY_DOMAIN + msgpack.packb([stage, *self.to_wire()], use_bin_type=True)

    def to_wire(self) -> list[Any]:
        out = [self.round_id, self.part, self.owner, self.digest, [list(s) for s in self.samples],
               list(self.missing), [list(r) for r in self.refused]]
        if self.scores or self.norms or self.struck:
            out.append([[pid, t.to_wire()] for pid, t in self.scores])
        if self.norms or self.struck:
            out.append([list(n) for n in self.norms])
        if self.struck:
            out.append(list(self.struck))
        return out

    @classmethod
    def from_wire(cls, value: Any) -> Ready:
        if not (isinstance(value, list) and len(value) in (7, 8, 9, 10)):
            raise ValueError("a part-ready report is [round_id, part, owner, digest, samples, missing, refused"
                             "[, scores[, norms[, struck]]]]")
        rid, part, owner, digest, samples, missing, refused = value[:7]
        raw_scores = value[7] if len(value) >= 8 else []
        if not (isinstance(raw_scores, list) and len(raw_scores) <= MAX_MEMBERS
                and all(isinstance(t, list) and len(t) == 2 and _short_str(t[0]) for t in raw_scores)):
            raise ValueError("a part-ready report's scores are [peer_id, terms] pairs")
        scores = tuple((t[0], PartTerms.from_wire(t[1])) for t in raw_scores)
        raw_norms = value[8] if len(value) >= 9 else []
        struck = value[9] if len(value) == 10 else []
        if not (isinstance(struck, list) and len(struck) <= MAX_MEMBERS and all(_short_str(s) for s in struck)):
            raise ValueError("a part-ready report's struck members are peer ids")
        if not (isinstance(raw_norms, list) and len(raw_norms) <= MAX_MEMBERS
                and all(isinstance(n, list) and len(n) == 2 and _short_str(n[0]) and isinstance(n[1], float)
                        and math.isfinite(n[1]) and n[1] >= 0 for n in raw_norms)
                and len({n[0] for n in raw_norms}) == len(raw_norms)):
            raise ValueError("a part-ready report's norms are [peer_id, finite non-negative float] pairs, "
                             "one per member")
        if not (_short_str(rid) and _nat(part) and _short_str(owner) and isinstance(digest, str)
                and len(digest) in (0, 64)):
            raise ValueError("a part-ready report names its round, part, owner and a 64-hex digest")
        if not (isinstance(samples, list) and len(samples) <= MAX_MEMBERS
                and all(isinstance(s, list) and len(s) == 2 and _short_str(s[0]) and _nat(s[1]) for s in samples)):
            raise ValueError("a part-ready report's samples are [peer_id, samples] pairs")
        if not (isinstance(missing, list) and len(missing) <= MAX_MEMBERS and all(_short_str(m) for m in missing)):
            raise ValueError("a part-ready report's missing members are peer ids")
        if not (isinstance(refused, list) and len(refused) <= MAX_MEMBERS
                and all(isinstance(r, list) and len(r) == 2 and _short_str(r[0]) and isinstance(r[1], str)
                        and len(r[1]) <= 512 for r in refused)):
            raise ValueError("a part-ready report's refusals are [peer_id, why] pairs")
        return cls(rid, part, owner, digest, tuple((s[0], s[1]) for s in samples), tuple(missing),
                   tuple((r[0], r[1]) for r in refused), scores, tuple((n[0], n[1]) for n in raw_norms),
                   tuple(struck))


@dataclass(frozen=True)
class Decision:
    """The coordinator's one decision on a round: ``commit`` (apply the mean whose parts have these
    digests) or ``abort`` (everybody keeps its gradients)."""

    round_id: str
    stage: int
    step: int
    status: Literal["commit", "abort"]
    samples: int  # the mean's total samples (0 on abort)
    digests: tuple[str, ...]  # per part, on commit
    coordinator: str
    reason: str = ""  # why it aborted
    refused: tuple[tuple[str, str], ...] = ()  # members an owner refused (the next rounds go without them)
    # members whose parts an owner did not have within the plan's patience (silent): on a commit, every
    # owner missed them and the mean holds the others only; on an abort, some owner missed them
    dropped: tuple[str, ...] = ()
    # on a commit: the members whose contributions the owners' summed scores strike (far from or against the
    # owners' own slices; ``hostile_contributions.combine_terms``), and those the coordinator convicted by them
    struck: tuple[str, ...] = ()
    convicted: tuple[tuple[str, str], ...] = ()

    def message(self) -> bytes:
        fields: list[Any] = [self.round_id, self.stage, self.step, self.status, self.samples, list(self.digests),
                             self.coordinator]
        if self.dropped or self.struck or self.convicted:
            # (signed: a relayed copy cannot make a member think its samples were left out)
            fields.append(list(self.dropped))
        if self.struck or self.convicted:  # (signed: nobody but the coordinator names a peer convicted)
            fields += [list(self.struck), [list(c) for c in self.convicted]]
        return _DECISION_DOMAIN + msgpack.packb(fields, use_bin_type=True)

    def to_wire(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "stage": self.stage, "step": self.step, "status": self.status,
                "samples": self.samples, "digests": list(self.digests), "coordinator": self.coordinator,
                "reason": self.reason, "refused": [list(r) for r in self.refused], "dropped": list(self.dropped),
                "struck": list(self.struck), "convicted": [list(c) for c in self.convicted]}

    @classmethod
    def from_wire(cls, value: Any) -> Decision:
        if not isinstance(value, dict):
            raise ValueError("a decision is a map")
        rid, stage, step, status = value.get("round_id"), value.get("stage"), value.get("step"), value.get("status")
        samples, digests, coord = value.get("samples"), value.get("digests"), value.get("coordinator")
        reason, refused, dropped = value.get("reason", ""), value.get("refused", []), value.get("dropped", [])
        if not (_short_str(rid) and _nat(stage) and _nat(step) and status in ("commit", "abort") and _nat(samples)
                and _short_str(coord) and isinstance(reason, str) and len(reason) <= 512):
            raise ValueError("a decision names its round, stage, step, status, samples and coordinator")
        if not (isinstance(digests, list) and len(digests) <= MAX_MEMBERS
                and all(isinstance(d, str) and len(d) == 64 for d in digests)):
            raise ValueError("a decision's digests are 64-hex strings, one per part")
        if not (isinstance(refused, list) and len(refused) <= MAX_MEMBERS
                and all(isinstance(r, list) and len(r) == 2 and _short_str(r[0]) and isinstance(r[1], str)
                        for r in refused)):
            raise ValueError("a decision's refusals are [peer_id, why] pairs")
        if not (isinstance(dropped, list) and len(dropped) <= MAX_MEMBERS and all(_short_str(d) for d in dropped)):
            raise ValueError("a decision's dropped members are peer ids")
        struck, convicted = value.get("struck", []), value.get("convicted", [])
        if not (isinstance(struck, list) and len(struck) <= MAX_MEMBERS and all(_short_str(d) for d in struck)):
            raise ValueError("a decision's struck members are peer ids")
        if not (isinstance(convicted, list) and len(convicted) <= MAX_MEMBERS
                and all(isinstance(c, list) and len(c) == 2 and _short_str(c[0]) and isinstance(c[1], str)
                        and len(c[1]) <= 512 for c in convicted)):
            raise ValueError("a decision's convictions are [peer_id, why] pairs")
        return cls(rid, stage, step, "commit" if status == "commit" else "abort", samples, tuple(digests), coord,
                   reason, tuple((r[0], r[1][:512]) for r in refused), tuple(dropped), tuple(struck),
                   tuple((c[0], c[1]) for c in convicted))


def decide(plan: RoundPlan, readies: Mapping[int, Ready], target: int) -> Decision:
    """The coordinator's decision from the owners' reports: commit only if every part is ready
    with a digest, every owner reduced the same members (all of them but those *every* owner
    missed at the plan's patience: dropped, silent) with the same sample counts, nobody was
    refused, and the samples reach ``target``; abort otherwise (everybody keeps its gradients).
    An abort names in ``dropped`` the members some owner missed (the coordinator's silent ones).
    Whether the members left are still a quorum of the stage is the coordinator's to check."""
    missed = tuple(sorted({m for ready in readies.values() for m in ready.missing}))

    def abort(reason: str, refused: tuple[tuple[str, str], ...] = ()) -> Decision:
        return Decision(plan.round_id, plan.stage, plan.step, "abort", 0, (), plan.coordinator, reason, refused,
                        missed)

    refused = tuple(sorted({r for ready in readies.values() for r in ready.refused}))
    if refused:
        return abort(f"{len(refused)} contribution(s) refused by a part owner", refused)
    missing = [j for j in range(len(plan.owners)) if j not in readies]
    if missing:
        return abort(f"part(s) {missing[:8]} not reported ready in time")
    dropped = set(missed)
    members = set(plan.member_ids) - dropped
    if not members:
        return abort("no member's parts arrived")
    counts: dict[str, int] | None = None
    for j in range(len(plan.owners)):
        ready = readies[j]
        if ready.owner != plan.owners[j] or ready.round_id != plan.round_id:
            return abort(f"part {j} reported by another owner or round")
        if not ready.digest:
            return abort(f"part {j} could not be reduced")
        if set(ready.struck) != set(plan.struck):  # (what an audit recomputes the part by: ``audit``)
            return abort(f"part {j} was reduced striking other members than the plan's")
        if set(ready.missing) != dropped:
            return abort(f"part {j} misses {len(ready.missing)} member(s), other owners {len(dropped)}")
        got = dict(ready.samples)
        if set(got) != members:
            return abort(f"part {j} was reduced over other members than the plan's")
        if counts is None:
            counts = got
        elif got != counts:
            return abort(f"part {j} counts other samples than part 0 (a member sent differing counts)")
    why = _outliers(plan, readies, counts or {})
    if why is not None:
        return abort(*why)
    total = sum((counts or {}).values())
    if total < target:
        return abort(f"the round holds {total} samples, below the target {target}")
    digests = tuple(readies[j].digest for j in range(len(plan.owners)))
    return Decision(plan.round_id, plan.stage, plan.step, "commit", total, digests, plan.coordinator,
                    dropped=missed)


def _outliers(plan: RoundPlan, readies: Mapping[int, Ready],
              counts: Mapping[str, int]) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """The outlier rule on the whole contributions (``round_checks.outliers``, the single leader's), from
    the owners' per-part norms: an abort's reason and refusals, or None. A part's slice of an honest
    gradient can lie much further from its stage-mates' than the whole does (a spike in one layer, or an
    error-feedback residual capped against the whole gradient's norm, concentrated in one part: 65x a
    part's median seen in an honest run), so the owners do not judge their part alone. The coordinator's
    own contribution is never refused (it computed it), as a leader's or an owner's own. Ready reports
    without norms (an older build's owners, which judged their part themselves) skip the rule; norms
    that do not name exactly the members with samples abort."""
    holding = {pid for pid, n in counts.items() if n > 0}
    if not any(readies[j].norms for j in range(len(plan.owners))):
        return None
    per_part: list[dict[str, tuple[float, int]]] = []
    for j in range(len(plan.owners)):
        norms = dict(readies[j].norms)
        if set(norms) != holding:
            return f"part {j} reports the norms of other members than those holding samples", ()
        per_part.append({pid: (norm, counts[pid]) for pid, norm in norms.items()})
    whole = whole_norms(per_part)
    if whole is None:  # (every part named the same members with the same counts: not reached)
        return "the parts' norms do not add up to whole contributions", ()
    bad = whole_outliers(whole, plan.coordinator)
    if not bad:
        return None
    refused = tuple(sorted((pid, str(Refusal("outlier", why))) for pid, why in bad.items()))
    return f"{len(refused)} contribution(s) refused by the coordinator", refused


def quorum(members: Iterable[str], listed: Iterable[str], excluded: Iterable[str] = ()) -> str | None:
    """Why a round of ``members`` may not start or commit, given the stage's peers as the
    coordinator lists them (``listed``: every serving record of the stage, proven or not, this
    coordinator included or not) and the peers it ``excluded``; None when it may.

    A round needs ``2 |members| >= |listed|`` (at least half of every listed peer, excluded ones
    too) and ``2 |members| > |listed - excluded|`` (a strict majority of the peers it counts).
    Members are counted as listed whatever the listing says (they reported, so they serve)."""
    m = set(members)
    everyone = set(listed) | m
    counted = everyone - (set(excluded) - m)
    if 2 * len(m) < len(everyone):
        return f"{len(m)} member(s) are less than half of the {len(everyone)} peers listed"
    if 2 * len(m) <= len(counted):
        return f"{len(m)} member(s) are no majority of the {len(counted)} peers listed and not excluded"
    return None


def _short_str(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_LEN


def _nat(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
