"""The averaging codec of a swarm founded with ``grad_codec = "auto"``: chosen per link, from its measured speed.

Over a LAN a stage's gradients cross in milliseconds uncompressed, and any lossy codec would only cost
CPU and a little accuracy; over an internet link of 100 Mbit/s and 100 ms they are most of a step
(issue 28: a ``small`` stage's 6.7 MB took 1.4 s a step at 100 ms / 100 Mbit/s). So ``auto`` sends each
transfer with the least lossy codec of :data:`LADDER` (``none``, then ``8bit``, then ``5level``) whose
bytes cross the link, at its measured throughput (``swarmd.net.links``: the timings of earlier rounds'
bodies, no probes), within :data:`BUDGET_S`; when none does, the smallest. A link not measured yet gets
``none``: the first round over it is its measurement. A loopback address always gets ``none``: stage-mates
on one machine (tests, a demo) share memory bandwidth, and a body read slowly there means a busy CPU, not
a slow link.

Every frame names its codec, so a receiver needs no agreement: a contributor chooses for its link to the
round's leader (or to a part's owner), and the leader (an owner) answers everyone with the *most
compressed* codec any of them sent (:func:`answer_codec`): one slow contributor is not answered with
more bytes than it chose to send, and the answer is still encoded once, so the peers stay bit-identical.
Error feedback is on under ``auto`` (``swarmd.pipeline.error_feedback``); a round sent uncompressed
leaves no residual.

A founder who pins a codec (``--grad-codec 8bit``, ``none``, ...) gets exactly that on every link.
"""

from __future__ import annotations

__all__ = ["AUTO", "BUDGET_S", "LADDER", "answer_codec", "choose", "resolve", "wire_bytes"]

AUTO = "auto"

#: The codecs ``auto`` picks from, least lossy first, with their bits a value on the wire (``8bit``:
#: one byte and a float32 absmax per 4096 values; ``5level``: 24 codes in 7 bytes and a bfloat16 scale
#: per 64 values, ``swarmd.net.codecs``).
LADDER: tuple[tuple[str, float], ...] = (("none", 32.0), ("8bit", 8.0 + 32 / 4096), ("5level", 56 / 24 + 16 / 64))

#: A transfer of one round should take at most this long on its link. 0.1 s: a tenth of a step of a
#: second, the pipeline's step on ``small`` here; a 100 Mbit/s link carries 1.25 MB in it (a ``small``
#: stage's gradients in ``5level``, not in ``8bit``), a 1 Gbit/s link 12.5 MB (them uncompressed).
BUDGET_S = 0.1

_RANK = {name: i for i, (name, _) in enumerate(LADDER)}


def wire_bytes(codec: str, numel: int) -> float:
    """About how many bytes ``numel`` gradient values take on the wire with ``codec`` (one of :data:`LADDER`)."""
    bits = dict(LADDER)[codec]
    return numel * bits / 8


def choose(numel: int, bytes_per_s: float | None, budget_s: float = BUDGET_S) -> str:
    """The least lossy codec of :data:`LADDER` that moves ``numel`` values within ``budget_s`` at
    ``bytes_per_s``; the most compressed when none does; ``none`` when the link was never measured."""
    if bytes_per_s is None:
        return "none"
    for codec, _ in LADDER:
        if wire_bytes(codec, numel) <= budget_s * bytes_per_s:
            return codec
    return LADDER[-1][0]


def resolve(grad_codec: str, numel: int, bytes_per_s: float | None, *, loopback: bool = False) -> str:
    """The codec a transfer of ``numel`` values uses: the swarm's ``grad_codec`` when the founder
    pinned one, else (``auto``) :func:`choose` from the link's measured throughput; ``none`` over
    ``loopback`` (peers on one machine: the link is memory, and a stalled CPU is no slow link)."""
    if grad_codec != AUTO:
        return grad_codec
    return "none" if loopback else choose(numel, bytes_per_s)


def answer_codec(grad_codec: str, sent: list[str]) -> str:
    """The codec of a round's answer (or a part's mean), encoded once for every member: the swarm's
    pinned ``grad_codec``, or under ``auto`` the most compressed of the codecs its members ``sent``
    their contributions with (``none`` when they sent nothing compressed, or nothing at all). A codec
    outside :data:`LADDER` counts as ``none``: a frame's codec is the sender's choice, not a command."""
    if grad_codec != AUTO:
        return grad_codec
    rank = max((_RANK.get(c, 0) for c in sent), default=0)
    return LADDER[rank][0]
