"""The averaging codec of a swarm founded with ``grad_codec = "auto"``: chosen per link, from its measured speed.

Over a LAN a stage's gradients cross in milliseconds uncompressed, and any lossy codec would only cost
CPU and a little accuracy; over an internet link of 100 Mbit/s and 100 ms they are most of a step
(issue 28: a ``small`` stage's 6.7 MB took 1.4 s a step at 100 ms / 100 Mbit/s). So ``auto`` sends each
transfer with the codec of :data:`LADDER` (``none``, ``8bit``, ``5level``) that makes the round's
gradients arrive soonest: their bytes there and back at the link's measured throughput
(``swarmd.net.links``: the timings of earlier rounds' bodies, no probes), plus the CPU the codec costs
on the round's critical path (:data:`CPU_S_PER_VALUE`: encoded and decoded on both sides). A codec within
:data:`LOSSLESS_SLACK` of the fastest that loses less wins: a little time for exactness. A link not
measured yet gets ``none``: the first round over it is its measurement. A loopback address always
gets ``none``: stage-mates on one machine (tests, a demo) share memory bandwidth, and a body read
slowly there means a busy CPU, not a slow link.

Why the CPU counts: ``5level`` (Hadamard-rotated blocks) costs about 110 ms to encode and 65 ms to
decode a ``small`` stage's 1.68M values on one core here, ``8bit`` 21 ms and 5 ms; a round encodes
and decodes about three times on its critical path, so at 100 Mbit/s ``5level``'s smaller frames
(0.54 MB against 8bit's 1.68 MB each way) save 0.18 s of wire and cost 0.5 s of CPU. It pays below
about 30 Mbit/s on this CPU, sooner on a faster one.

Every frame names its codec, so a receiver needs no agreement: a contributor chooses for its link to the
round's leader (or to a part's owner), and the leader (an owner) answers everyone with the *most
compressed* codec any of them sent (:func:`answer_codec`): one slow contributor is not answered with
more bytes than it chose to send, and the answer is still encoded once, so the peers stay bit-identical.
Error feedback is on under ``auto`` (``swarmd.pipeline.averaging.error_feedback``); a round sent uncompressed
leaves no residual. A contributor can claim any codec (the leader answers in it); it costs the round
precision, never agreement.

A founder who pins a codec (``--grad-codec 8bit``, ``none``, ...) gets exactly that on every link.
"""

from __future__ import annotations

__all__ = ["AUTO", "CPU_S_PER_VALUE", "CROSSINGS", "LADDER", "LOSSLESS_SLACK", "answer_codec", "choose", "resolve",
           "round_s", "wire_bytes"]

AUTO = "auto"

#: The codecs ``auto`` picks from, least lossy first, with their bits a value on the wire (``8bit``:
#: one byte and a float32 absmax per 4096 values; ``5level``: 24 codes in 7 bytes and a bfloat16 scale
#: per 64 values, ``swarmd.net.codecs``).
LADDER: tuple[tuple[str, float], ...] = (("none", 32.0), ("8bit", 8.0 + 32 / 4096), ("5level", 56 / 24 + 16 / 64))

#: CPU seconds a value costs a round's critical path with each codec, beyond ``none``'s copies: about
#: three encodes and three decodes (the contributor's frame and its decoded copy, the leader's decode,
#: the mean's encode and both sides' decode of it), timed on one core of this 2-core machine
#: (``small``, 1.68M values: 5level 108 + 66 ms, 8bit 21 + 5 ms a pass).
CPU_S_PER_VALUE: dict[str, float] = {"none": 0.0, "8bit": 50e-9, "5level": 350e-9}
#: Each round's gradients cross the link twice: the contribution there, the mean back.
CROSSINGS = 2
#: A less lossy codec is chosen while it is at most this much slower than the fastest.
LOSSLESS_SLACK = 0.1

_RANK = {name: i for i, (name, _) in enumerate(LADDER)}


def wire_bytes(codec: str, numel: int) -> float:
    """About how many bytes ``numel`` gradient values take on the wire with ``codec`` (one of :data:`LADDER`)."""
    bits = dict(LADDER)[codec]
    return numel * bits / 8


def round_s(codec: str, numel: int, bytes_per_s: float) -> float:
    """About how long ``numel`` values take a round with ``codec`` over a link of ``bytes_per_s``: the
    wire both ways plus the codec's CPU (see the module docstring)."""
    return CROSSINGS * wire_bytes(codec, numel) / bytes_per_s + CPU_S_PER_VALUE[codec] * numel


def choose(numel: int, bytes_per_s: float | None) -> str:
    """The codec of :data:`LADDER` that moves ``numel`` values through a round soonest at ``bytes_per_s``
    (the less lossy one while within :data:`LOSSLESS_SLACK` of the soonest); ``none`` when the link was
    never measured."""
    if bytes_per_s is None or not bytes_per_s > 0:
        return "none"
    times = {codec: round_s(codec, numel, bytes_per_s) for codec, _ in LADDER}
    fastest = min(times.values())
    return next(codec for codec, _ in LADDER if times[codec] <= fastest * (1 + LOSSLESS_SLACK))


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
