"""Hypothesis against the data plane of a real daemon, over real HTTP on 127.0.0.1 (issue #6).

Each test starts one in-process daemon (``running_daemon``'s configuration, on port 0) on an
event loop in a background thread, so that hypothesis can drive a plain synchronous HTTP client
(``httpx.Client``, keep-alive) from the test's thread: one daemon per test, hundreds of examples
against it. Every answer must be below 500, and every 4xx a JSON ``{"error", "message"}`` body.

After the fuzzing, each test checks that nothing a refused request carried reached the stage: the
daemon still answers a valid forward with the same result as before, its parameters digest is
unchanged, and the gradients it accumulated are exactly those of the backwards it answered 200
(none, for most runs), all finite. Float tensors holding NaN or Inf must never get a 200.

The daemons train with a target batch size no fuzzed backward can reach, so that the few
well-formed backwards the fuzzer produces accumulate gradients but never trigger an optimizer
step (which would legitimately change the parameters and the forward's result).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import httpx
import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.daemon import Daemon
from swarmd.errors import WireError
from swarmd.net import hadamard
from swarmd.net.codecs import CODECS, EIGHT_BIT_BLOCKSIZES, FOUR_BIT_BLOCKSIZES
from swarmd.net.wire import ALLOWED_DTYPES, CONTENT_TYPE, decode_frame, encode_frame
from swarmd.pipeline.spec import TrainingSpec
from tests.conftest import TINY, daemon_config

T = TypeVar("T")

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
NEVER_STEPS = TrainingSpec(target_batch_size=2**24)  # no fuzzed backward reaches it: no optimizer step
B, S = 2, 8  # the batch and sequence of the reference requests


# --- a daemon on a background event loop --------------------------------------------------------


class DaemonThread:
    """A :class:`Daemon` started and stopped on its own event loop in a daemon thread."""

    def __init__(self, daemon: Daemon, loop: asyncio.AbstractEventLoop) -> None:
        self.daemon = daemon
        self.loop = loop

    def call(self, coro: Awaitable[T], timeout: float = 60.0) -> T:
        """Run ``coro`` on the daemon's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    @property
    def data_url(self) -> str:
        return f"http://{self.daemon.data_addr}"

    @property
    def api_url(self) -> str:
        return f"http://{self.daemon.status()['api_addr']}"

    def digest(self) -> str:
        return self.call(self.daemon.executor.params_digest())

    def grads(self) -> list[torch.Tensor | None]:
        async def read() -> list[torch.Tensor | None]:  # on the loop: no request runs meanwhile
            return [None if p.grad is None else p.grad.clone() for p in self.daemon.executor.module.parameters()]

        return self.call(read())


@contextlib.contextmanager
def daemon_thread(stage: int = 0, *, training: TrainingSpec = NEVER_STEPS, **net: Any) -> Iterator[DaemonThread]:
    """``running_daemon``'s configuration (127.0.0.1, port 0, no rebalancing), with ``training``."""
    config = daemon_config(stage, TINY, **net)
    config = replace(config, pipeline=replace(config.pipeline, training=training))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzzed-daemon", daemon=True)
    thread.start()
    daemon = Daemon(config)
    handle = DaemonThread(daemon, loop)
    try:
        handle.call(daemon.start())
        yield handle
    finally:
        try:
            handle.call(daemon.shutdown())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            loop.close()


# --- checking every answer ----------------------------------------------------------------------


class Prober:
    """Sends requests and checks the invariants every answer must hold; counts statuses."""

    def __init__(self, base_url: str) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=30.0)
        self.statuses: Counter[int] = Counter()
        self.accepted_samples = 0  # samples of the backwards answered 200

    def close(self) -> None:
        self.client.close()

    def send(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        content_type: str | None = CONTENT_TYPE,
        params: list[tuple[str, str]] | None = None,
    ) -> httpx.Response:
        headers = {} if content_type is None else {"Content-Type": content_type}
        r = self.client.request(method, path, content=body, headers=headers, params=params or None)
        self.statuses[r.status_code] += 1
        where = f"{method} {path} ({len(body)}-byte body, {content_type!r}) -> {r.status_code}: {r.text[:300]!r}"
        assert r.status_code < 500, where
        if r.status_code >= 400 and method != "HEAD":
            payload = json.loads(r.content)  # raises (fails the example) if the error is not JSON
            assert isinstance(payload, dict), where
            assert isinstance(payload.get("error"), str) and payload["error"], where
            assert isinstance(payload.get("message"), str) and payload["message"], where
        return r

    def post_frame(self, path: str, body: bytes, content_type: str = CONTENT_TYPE) -> httpx.Response:
        r = self.send("POST", path, body, content_type)
        if content_type.split(";")[0].strip() == CONTENT_TYPE:
            nonfinite = _non_finite_inputs(body, COMPUTED[path])
            assert not (r.status_code == 200 and nonfinite), f"{path}: NaN/Inf in {nonfinite} answered 200"
        if r.status_code == 200 and path == "/v1/backward":
            self.accepted_samples += decode_frame(r.content).meta["samples"]
        return r


COMPUTED = {"/v1/forward": ("inputs",), "/v1/backward": ("inputs", "grad_outputs"), "/v1/average": ("grads",),
            "/v1/report": (), "/v1/recheck": ()}


def _non_finite_inputs(body: bytes, names: tuple[str, ...]) -> list[str]:
    """Which of the tensors ``names`` (those the endpoint computes with; it ignores others) of
    ``body`` hold NaN or Inf, as the daemon decodes them."""
    try:
        frame = decode_frame(body)
    except WireError:
        return []
    return [
        name
        for name, t in frame.tensors.items()
        if name in names and t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


# --- strategies -----------------------------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**64 - 1)
SCALARS = st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=12) | st.binary(max_size=24)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
# msgpack the frame decoder must refuse: non-string keys, extension types, anything at the top
PACKABLE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-5, 5), st.binary(max_size=3)), inner, max_size=4),
    max_leaves=12,
)
CONTENT_TYPES = st.sampled_from(
    [
        CONTENT_TYPE,
        f"{CONTENT_TYPE}; charset=utf-8",
        "application/json",
        "text/plain",
        "",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
    ]
) | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip)  # as h11 sends it
QUERY = st.lists(
    st.tuples(st.text(max_size=8), st.text(max_size=16)), max_size=3
)
SPECIAL_FLOATS = st.sampled_from([math.nan, -math.nan, math.inf, -math.inf, 3.0e38, -3.0e38, 1e30, 65504.0, 1e5, -0.0])
DTYPE_NAMES = st.sampled_from(list(ALLOWED_DTYPES)) | st.sampled_from(["float64", "int8", "complex64", "Float32", ""])
CODEC_NAMES = st.sampled_from(sorted(CODECS)) | st.sampled_from(["zip", "8BIT", "", "4bit"])


Hints = dict[str, tuple[str, list[Any]]]  # tensor name -> (dtype, shape with "B"/"S" placeholders)


def _resolve(shape: list[Any], b: int, s: int) -> list[int]:
    return [b if d == "B" else s if d == "S" else d for d in shape]


@st.composite
def shapes(draw: st.DrawFn, hint: list[int]) -> Any:
    """Mostly a shape near ``hint`` (the endpoint's expected one); sometimes anything."""
    choice = draw(st.integers(0, 9))
    if choice <= 5:
        shape = list(hint)
        for i in draw(st.lists(st.integers(0, len(hint) - 1), max_size=2)):
            shape[i] = draw(st.integers(0, 9))
        return shape
    if choice <= 7:
        return draw(st.lists(st.integers(-3, 5) | st.sampled_from([2**27, 2**31, 2**63 - 1, -(2**63)]), max_size=8))
    return draw(VALUES)


def _numel(shape: Any) -> int | None:
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d <= 4096 for d in shape) or len(shape) > 6:
        return None
    n = math.prod(shape)
    return n if n <= 8192 else None


@st.composite
def payload_values(draw: st.DrawFn, numel: int, dtype: torch.dtype, specials: bool = True) -> torch.Tensor:
    """``numel`` values of ``dtype``: random, scaled, with a few special ones at drawn places."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    if dtype.is_floating_point:
        scale = draw(st.sampled_from([1.0, 1.0, 1e-30, 1e4, 1e30])) if specials else 1.0
        values = torch.randn(numel, generator=gen) * scale
        for _ in range(draw(st.integers(0, 2)) if numel and specials else 0):
            values[draw(st.integers(0, numel - 1))] = draw(SPECIAL_FLOATS)
        return values.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).to(torch.bool)
    high, low = TINY.vocab_size, 0
    if specials and not draw(st.integers(0, 3)):
        high, low = draw(st.sampled_from([TINY.vocab_size + 3, 127, 2])), draw(st.sampled_from([0, -2]))
    return torch.randint(low, high, (numel,), generator=gen).to(dtype)


@st.composite
def encoded_entry(
    draw: st.DrawFn, name: str, dtype_name: str, shape: list[int], codec: str, specials: bool = True
) -> dict[str, Any]:
    """A wire tensor entry whose payload fits its dtype, shape and codec; its values may be special,
    and an 8bit or 4bit entry's absmax may hold NaN, Inf, negative or huge values."""
    numel, dtype = math.prod(shape), ALLOWED_DTYPES[dtype_name]
    entry: dict[str, Any] = {"n": name, "d": dtype_name, "s": shape, "c": codec}
    values = draw(payload_values(numel, dtype, specials))
    if codec in ("8bit", "4bit"):
        if codec == "8bit":
            blocksize = draw(st.sampled_from(sorted(EIGHT_BIT_BLOCKSIZES)))
            blocks, nbytes = -(-numel // blocksize), numel
        else:  # 4bit: full blocks, a power-of-two tail, two codes a byte (swarmd.net.codecs)
            blocksize = draw(st.sampled_from(sorted(FOUR_BIT_BLOCKSIZES)))
            tail = hadamard.tail_size(numel, blocksize)
            blocks = numel // blocksize + (1 if tail else 0)
            nbytes = (numel // blocksize * blocksize + tail + 1) // 2
        entry["p"] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().tobytes()
        absmax = torch.rand(blocks) * (draw(st.sampled_from([1.0, 1.0, 1e30, 3e38])) if specials else 1.0)
        for _ in range(draw(st.integers(0, 2)) if blocks and specials else 0):
            absmax[draw(st.integers(0, blocks - 1))] = draw(SPECIAL_FLOATS | st.just(-1.0))
        entry["a"] = absmax.numpy().tobytes()
        entry["b"] = blocksize
    elif codec in ("fp16", "bf16") and dtype.is_floating_point:
        wire = torch.float16 if codec == "fp16" else torch.bfloat16
        entry["p"] = values.to(wire).view(torch.uint8).numpy().tobytes()
    else:
        entry["p"] = values.view(torch.uint8).numpy().tobytes() if numel else b""
    return entry


@st.composite
def tensor_entries(draw: st.DrawFn, hints: Hints, b: int, s: int) -> Any:
    """A wire tensor entry for one of ``hints``' names (or another), with drawn defects."""
    if draw(st.integers(0, 19)) == 0:
        return draw(VALUES)  # not even a map
    name = draw(st.sampled_from(list(hints)) | st.text(max_size=8))
    hint_dtype, hint_shape = hints.get(name, ("float32", ["B", "S", TINY.d_model]))
    dtype_name = hint_dtype if draw(st.integers(0, 3)) else draw(DTYPE_NAMES)
    shape = draw(shapes(_resolve(hint_shape, b, s)))
    codec = draw(st.sampled_from(["none", "none", "fp16", "bf16", "8bit", "4bit"]) | CODEC_NAMES)
    numel = _numel(shape)
    if numel is not None and dtype_name in ALLOWED_DTYPES and codec in CODECS and draw(st.integers(0, 4)):
        entry = draw(encoded_entry(name, dtype_name, shape, codec))
    else:
        entry = {"n": name, "d": dtype_name, "s": shape, "c": codec, "p": draw(st.binary(max_size=256))}
    if draw(st.integers(0, 4)) == 0:  # a defect: a field dropped, changed, or an 8bit field added
        key = draw(st.sampled_from(["n", "d", "s", "c", "p", "a", "b"]))
        how = draw(st.integers(0, 2))
        if how == 0:
            entry.pop(key, None)
        elif how == 1:
            entry[key] = draw(VALUES)
        elif key == "p" and isinstance(entry.get("p"), bytes) and entry["p"]:  # a few bytes short
            entry["p"] = entry["p"][: draw(st.integers(0, len(entry["p"]) - 1))]
        else:
            entry[key] = draw(st.binary(max_size=64) | st.sampled_from(sorted(EIGHT_BIT_BLOCKSIZES)) | INT64)
    return entry


META_VALID: dict[str, Callable[[int], Any]] = {
    "stage": lambda stage: stage,
    "model": lambda stage: TINY.digest,
    "codec": lambda stage: "none",
    "step": lambda stage: 0,
    "peer_id": lambda stage: "fuzzer",
    "samples": lambda stage: 1,
}


@st.composite
def metas(draw: st.DrawFn, stage: int, keys: list[str]) -> dict[str, Any]:
    """The endpoint's meta with each key valid, absent or replaced by any value; extra keys too."""
    meta: dict[str, Any] = {}
    for key in keys:
        how = draw(st.integers(0, 5))
        if how <= 2:
            meta[key] = META_VALID[key](stage)
        elif how == 3:
            meta[key] = draw(st.sampled_from(sorted(CODECS))) if key == "codec" else draw(INT64)
        elif how == 4:
            meta[key] = draw(VALUES)
    meta.update(draw(st.dictionaries(st.text(max_size=6), VALUES, max_size=2)))
    return meta


@st.composite
def frames(draw: st.DrawFn, kind: str, stage: int, meta_keys: list[str], hints: Hints) -> bytes:
    """A frame for one endpoint, defective in one respect (drawn) or in several.

    ``meta``: well-formed tensors, any meta; ``values``: valid meta, well-formed tensors of the
    right shapes holding NaN, Inf, huge or out-of-range values (and 8bit absmax ones);
    ``tensors``: valid meta, defective tensor entries; ``anything``: all of it, and the frame's
    top-level fields too.
    """
    mode = draw(st.sampled_from(["meta", "values", "tensors", "anything"]))
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    if mode in ("meta", "anything"):
        meta = draw(metas(stage, meta_keys))
    else:
        meta = {"stage": stage, **({"codec": draw(st.sampled_from(sorted(CODECS)))} if draw(st.booleans()) else {})}
    if mode in ("meta", "values"):
        tensors = []
        for name, (dtype_name, shape) in hints.items():
            if draw(st.integers(0, 4)):
                floating = ALLOWED_DTYPES[dtype_name].is_floating_point
                codec = draw(st.sampled_from(sorted(CODECS))) if floating else "none"
                tensors.append(draw(encoded_entry(name, dtype_name, _resolve(shape, b, s), codec, mode == "values")))
    else:
        tensors = draw(st.lists(tensor_entries(hints, b, s), max_size=4))
    top: dict[str, Any] = {"v": 1, "kind": kind, "meta": meta, "tensors": tensors}
    if mode == "anything" and draw(st.booleans()):
        key = draw(st.sampled_from(["v", "kind", "meta", "tensors"]))
        if draw(st.booleans()):
            del top[key]
        else:
            top[key] = draw(VALUES | st.sampled_from(["forward", "backward", "average", ""]))
    body = msgpack.packb(top, use_bin_type=True)
    if mode == "anything":
        cut = draw(st.integers(0, 9))
        if cut == 0:
            body = body[: draw(st.integers(0, max(len(body) - 1, 0)))]
        elif cut == 1:
            body += draw(st.binary(min_size=1, max_size=8))
    return body


def raw_bodies() -> st.SearchStrategy[bytes]:
    """Bytes that are not a frame: random, random msgpack, or structures with frame-like keys."""
    frame_like = st.fixed_dictionaries(
        {},
        optional={"v": VALUES, "kind": VALUES, "meta": VALUES, "tensors": VALUES},
    )
    return st.one_of(
        st.binary(max_size=2048),
        PACKABLE.map(lambda v: msgpack.packb(v, use_bin_type=True)),
        frame_like.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    )


# --- the reference request and the state checks ---------------------------------------------------


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def hidden(seed: int) -> torch.Tensor:
    return torch.randn(B, S, TINY.d_model, generator=torch.Generator().manual_seed(seed))


def reference_forward(p: Prober, stage: int) -> torch.Tensor:
    inputs = tokens(7) if stage == 0 else hidden(7)
    r = p.send("POST", "/v1/forward", encode_frame("forward", {"stage": stage}, {"inputs": inputs}))
    assert r.status_code == 200, r.text
    return decode_frame(r.content).tensors["outputs"]


@contextlib.contextmanager
def state_must_survive(d: DaemonThread, stage: int) -> Iterator[Prober]:
    """Yield a prober; afterwards check that the stage's state holds only what was accepted."""
    p = Prober(d.data_url)
    try:
        before_outputs = reference_forward(p, stage)
        before_digest = d.digest()
        yield p
        assert d.digest() == before_digest, "the parameters changed"
        assert torch.equal(reference_forward(p, stage), before_outputs), "a valid forward changed its result"
        ex = d.daemon.executor
        assert ex.step == 0
        assert ex.grad_samples == p.accepted_samples, (ex.grad_samples, p.accepted_samples)
        grads = d.grads()
        if p.accepted_samples == 0:
            assert all(g is None for g in grads), "a refused backward left gradients behind"
        assert all(g is None or bool(torch.isfinite(g).all()) for g in grads), "NaN/Inf reached the gradients"
        info = p.send("GET", "/v1/info")
        assert info.status_code == 200 and info.json()["step"] == 0
        assert httpx.get(f"{d.api_url}/healthz", timeout=10).json() == {"ok": True, "state": "serving"}
    finally:
        p.close()


# --- the tests ------------------------------------------------------------------------------------

FIRST_HINTS: Hints = {"inputs": ("int64", ["B", "S"]), "grad_outputs": ("float32", ["B", "S", TINY.d_model])}
LAST_HINTS: Hints = {"inputs": ("float32", ["B", "S", TINY.d_model]), "targets": ("int64", ["B", "S"])}
COMPUTE_META = ["stage", "model", "codec", "step"]


def _fuzz_compute_endpoints(stage: int, hints: Hints) -> Counter[int]:
    with daemon_thread(stage) as d, state_must_survive(d, stage) as p:

        @FUZZ
        @given(
            path=st.sampled_from(["/v1/forward", "/v1/backward"]),
            body=st.data(),
            content_type=st.sampled_from([CONTENT_TYPE] * 4) | CONTENT_TYPES,
        )
        def fuzz(path: str, body: st.DataObject, content_type: str) -> None:
            kind = path.rsplit("/", 1)[1]
            if body.draw(st.integers(0, 4)):
                data = body.draw(frames(kind, stage, COMPUTE_META, hints), label="frame")
            else:
                data = body.draw(raw_bodies(), label="raw body")
            p.post_frame(path, data, content_type)

        fuzz()
        return p.statuses


def test_first_stage_forward_and_backward_refuse_hostile_frames() -> None:
    statuses = _fuzz_compute_endpoints(0, FIRST_HINTS)
    # the fuzzing reached past the decoder: content errors and wrong stages were answered too
    assert statuses[400] and statuses[422], statuses


def test_last_stage_forward_and_backward_refuse_hostile_frames_and_non_finite_values() -> None:
    statuses = _fuzz_compute_endpoints(1, LAST_HINTS)
    assert statuses[400] and statuses[422], statuses


def test_average_refuses_hostile_contributions() -> None:
    """``POST /v1/average`` on a daemon that takes part in averaging rounds (``runtime.averager`` set).

    A well-formed contribution for the daemon's current step opens a round, and one with as many
    samples as the target batch would take an optimizer step (the protocol trusts stage-mates);
    so a contribution with a full-size finite gradient is sent for a later step, which is
    answered ``aborted`` without touching the stage.
    """
    with daemon_thread(1) as d, state_must_survive(d, 1) as p:
        assert d.daemon.runtime is not None and d.daemon.runtime.averager is not None
        numel = d.daemon.executor.grad_numel

        @st.composite
        def grads_entries(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
            """A 'grads' entry and whether it is a full-size finite float32 gradient."""
            how = draw(st.integers(0, 3))
            values = torch.randn(numel, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
            if how == 0:  # full size with NaN/Inf in it, in float32 or through a codec
                for _ in range(draw(st.integers(1, 3))):
                    special = SPECIAL_FLOATS.filter(lambda v: not math.isfinite(v))
                    values[draw(st.integers(0, numel - 1))] = draw(special)
            elif how == 1:  # the wrong size or dtype
                values = values[: draw(st.integers(0, numel - 1) | st.just(numel + 1))] if draw(st.booleans()) else \
                    torch.zeros(numel + 1)
                if draw(st.booleans()):
                    values = values.to(draw(st.sampled_from([torch.float16, torch.bfloat16, torch.int64])))
            codec = draw(st.sampled_from(sorted(CODECS)))
            entry = encode_frame("x", {}, {"grads": values}, codec=codec)
            tensor = msgpack.unpackb(entry, raw=False)["tensors"][0]
            return tensor, how >= 2 and bool(torch.isfinite(decode_frame(entry).tensors["grads"]).all())

        @FUZZ
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            what = data.draw(st.integers(0, 9))
            if what == 0:
                p.post_frame("/v1/average", data.draw(raw_bodies()), data.draw(CONTENT_TYPES))
                return
            if what <= 4:  # meta of any shape, small (wrong-size) or defective tensors
                keys = ["stage", "step", "peer_id", "samples", "model", "codec"]
                p.post_frame("/v1/average", data.draw(frames("average", 1, keys, {"grads": ("float32", ["S"])})))
                return
            meta = data.draw(metas(1, ["stage", "step", "peer_id", "samples", "model"]))
            tensors = []
            full_finite = False
            if data.draw(st.integers(0, 3)):
                entry, full_finite = data.draw(grads_entries())
                tensors.append(entry)
            if full_finite and type(meta.get("step")) is int and meta["step"] == d.daemon.executor.step:
                meta["step"] += 1 + data.draw(st.integers(0, 5))  # never a contribution to the current round
            body = msgpack.packb({"v": 1, "kind": "average", "meta": meta, "tensors": tensors}, use_bin_type=True)
            r = p.post_frame("/v1/average", body)
            if r.status_code == 200:
                reply = decode_frame(r.content)
                assert reply.meta["status"] == "aborted", reply.meta

        fuzz()
        assert p.statuses[422] and p.statuses[200], p.statuses
        assert d.daemon.averager is not None and d.daemon.averager.rounds_ok == 0


def test_report_refuses_hostile_reports() -> None:
    """``POST /v1/report`` (swarmd.pipeline.reports): raw bodies, frames with any meta, and validly
    signed reports with one field mutated (the signature then fails) are all a 4xx; only intact
    signed reports are counted (200), and no fuzzed report makes the daemon exclude anyone
    without two of them."""
    from swarmd.dht.identity import Identity
    from swarmd.pipeline.averaging.trust.accusations import Claim, Evidence, answers_of, contribution_message
    from swarmd.pipeline.reports import MisbehaviourReport

    accused = "ab" * 20
    with daemon_thread(0) as d, state_must_survive(d, 0) as p:

        def signed(at: float) -> tuple[bytes, bytes]:
            return MisbehaviourReport.signed(Identity.generate(), accused=accused, stage=0, step=0, kind="forward",
                                             mb=1, request_digest="00" * 32,
                                             answers={accused: "11" * 32, "cd" * 20: "22" * 32}, at=at).encode()

        @settings(FUZZ, max_examples=60)  # each signs a report: keep the default run short
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            what = data.draw(st.integers(0, 3))
            if what == 0:
                p.post_frame("/v1/report", data.draw(raw_bodies()), data.draw(CONTENT_TYPES))
                return
            if what == 1:
                meta = {"body": data.draw(st.binary(max_size=300) | st.integers(-(2**63), 2**64 - 1) | st.none()),
                        "sig": data.draw(st.binary(max_size=80) | st.text(max_size=5))}
                p.post_frame("/v1/report", encode_frame("report", meta, {}, "none"))
                return
            body, sig = signed(time.time())
            raw = bytearray(body)
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
            r = p.post_frame("/v1/report", encode_frame("report", {"body": bytes(raw), "sig": sig}, {}, "none"))
            assert r.status_code == 422, r.text

        fuzz()
        assert p.statuses[422], p.statuses
        assert d.daemon.reports.excluded() == frozenset()
        r = p.post_frame("/v1/report", encode_frame("report", dict(zip(("body", "sig"), signed(time.time()),
                                                                        strict=True)), {}, "none"))
        assert r.status_code == 200 and decode_frame(r.content).meta["reason"] == "counted"
        # an averaging report (a leader's conviction, swarmd.pipeline.averaging.trust.accusations) whose claim the accuser
        # signed itself, not the accused: refused, so a lone accuser cannot show made-up contributions
        accuser, liar = Identity.generate(), Identity.generate()

        def averaging(signer: Identity) -> bytes:
            message = contribution_message(0, 5, 8, "33" * 32, liar.peer_id, accuser.peer_id, 20.0)
            ev = Evidence(accuser.peer_id, liar.public_key_bytes, (Claim(5, 8, "33" * 32, 20.0, signer.sign(message)),))
            body, sig = MisbehaviourReport.signed(accuser, accused=liar.peer_id, stage=0, step=5, kind="averaging",
                                                  mb=1, request_digest="00" * 32, at=time.time(),
                                                  answers=answers_of(ev, liar.peer_id, accuser.peer_id),
                                                  evidence=ev.encode()).encode()
            return encode_frame("report", {"body": body, "sig": sig}, {}, "none")

        r = p.post_frame("/v1/report", averaging(accuser))
        assert r.status_code == 422 and "not signed by the accused" in r.text, r.text
        r = p.post_frame("/v1/report", averaging(liar))  # the liar's own signature: counted (one reporter)
        assert r.status_code == 200 and decode_frame(r.content).meta["reason"] == "counted"
        assert d.daemon.reports.excluded() == frozenset()


# The methods aiohttp's HTTP parser (llhttp) knows; it answers any other with its own plain-text
# 400 and closes the connection, before the application (and so our JSON errors) is reached.
PARSER_METHODS = frozenset(
    "DELETE GET HEAD POST PUT CONNECT OPTIONS TRACE COPY LOCK MKCOL MOVE PROPFIND PROPPATCH SEARCH UNLOCK "
    "BIND REBIND UNBIND ACL REPORT MKACTIVITY CHECKOUT MERGE NOTIFY SUBSCRIBE UNSUBSCRIBE PATCH PURGE "
    "MKCALENDAR LINK UNLINK".split()
)


def test_get_endpoints_and_unknown_methods_and_paths() -> None:
    """Every endpoint with any method, query string, body and content type; unknown paths too."""
    paths = ["/v1/forward", "/v1/backward", "/v1/average", "/v1/info", "/v1/progress", "/v1/state", "/v1/proof",
             "/v1/report", "/v1/recheck"]
    methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]) | st.sampled_from(
        sorted(PARSER_METHODS - {"CONNECT"})  # CONNECT takes host:port, not a path
    ) | st.text(st.characters(min_codepoint=ord("A"), max_codepoint=ord("Z")), min_size=1, max_size=8)
    with daemon_thread(0) as d, state_must_survive(d, 0) as p:

        @FUZZ
        @given(
            method=methods,
            path=st.sampled_from(paths) | st.sampled_from(paths).map(lambda s: s + "/") | st.text(
                st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="?#%"), max_size=20
            ).map(lambda s: "/" + s),
            params=QUERY,
            body=st.binary(max_size=64),
            content_type=CONTENT_TYPES | st.none(),
        )
        def fuzz(method: str, path: str, params: list[tuple[str, str]], body: bytes, content_type: str | None) -> None:
            if method not in PARSER_METHODS:  # refused by aiohttp's HTTP parser, before any of our code
                r = p.client.request(method, path, content=body)
                assert r.status_code == 400, (method, r.status_code)
                return
            r = p.send(method, path, body, content_type, params)
            if method == "GET" and path in ("/v1/info", "/v1/progress"):
                assert r.status_code == 200 and r.json()["stage"] == 0
            if method == "GET" and path == "/v1/proof":  # a proof for a well-formed nonce, else a 422
                nonce = dict(params).get("nonce", "")
                well_formed = 32 <= len(nonce) <= 128 and all(c in "0123456789abcdef" for c in nonce)
                assert r.status_code == (200 if well_formed else 422), (params, r.status_code)

        fuzz()
        assert p.statuses[404] and p.statuses[405] and p.statuses[200], p.statuses


def test_an_unhashable_reply_codec_is_a_422_not_a_500() -> None:
    """Found by the fuzzer: ``meta.codec`` as a list or map made ``codec in CODECS`` raise (500)."""
    with daemon_thread(0) as d:
        p = Prober(d.data_url)
        try:
            for codec in ([], {}, ["8bit"], {"a": 1}):
                for path in ("/v1/forward", "/v1/backward", "/v1/average"):
                    body = encode_frame(path.rsplit("/", 1)[1], {"stage": 0, "codec": codec}, {"inputs": tokens(1)})
                    r = p.send("POST", path, body)
                    assert r.status_code == 422 and "codec" in r.json()["message"], (codec, path, r.text)
        finally:
            p.close()


def test_finite_grad_outputs_that_overflow_are_refused_and_leave_gradients_untouched() -> None:
    """Found by the fuzzer: ``grad_outputs`` of 3e38 (finite, so past the NaN/Inf check) gave
    parameter gradients of Inf, accumulated into the stage and poisoning its next update."""
    with daemon_thread(0) as d, state_must_survive(d, 0) as p:
        huge = torch.full((B, S, TINY.d_model), 3e38)
        body = encode_frame("backward", {"stage": 0}, {"inputs": tokens(3), "grad_outputs": huge})
        r = p.post_frame("/v1/backward", body)
        assert r.status_code == 422 and "overflow" in r.json()["message"], r.text
        # a sane backward is still accumulated, and an overflowing one on top of it changes nothing
        fine = encode_frame("backward", {"stage": 0}, {"inputs": tokens(3), "grad_outputs": hidden(3)})
        assert p.post_frame("/v1/backward", fine).status_code == 200
        before = d.grads()
        assert p.post_frame("/v1/backward", body).status_code == 422
        assert all(torch.equal(a, b) for a, b in zip(before, d.grads(), strict=True) if a is not None)
        assert d.daemon.executor.grad_samples == B


def test_head_of_the_state_stream_is_refused_not_streamed() -> None:
    """Found by the fuzzer: ``HEAD /v1/state`` wrote the whole state stream after the HEAD answer,
    which the client then read as the start of its next response on the keep-alive connection."""
    with daemon_thread(0) as d:
        p = Prober(d.data_url)
        try:
            assert p.send("HEAD", "/v1/state", content_type=None).status_code == 405
            info = p.send("GET", "/v1/info")  # the same keep-alive connection is still in sync
            assert info.status_code == 200 and info.json()["stage"] == 0
            assert p.send("GET", "/v1/state", content_type=None).status_code == 200
        finally:
            p.close()


def test_recheck_refuses_hostile_evidence() -> None:
    """``POST /v1/recheck`` (a conviction by recomputation: swarmd.pipeline.averaging.trust.recomputation):
    raw bodies, frames with any meta, and a validly signed conviction with one byte of its report or of the
    accused's opening changed, or one bit of its inputs, are all a 4xx; only the intact one is taken up
    (200), and it excludes nobody (this peer holds no parameters it could recompute it at, so it counts for
    nothing)."""
    from swarmd.dht.identity import Identity
    from swarmd.net.messages import RecheckRequest
    from swarmd.pipeline.averaging.trust.accusations import answers_of
    from swarmd.pipeline.averaging.trust.contribution_proofs import K, Opening
    from swarmd.pipeline.averaging.trust.recomputation import inputs_digest
    from swarmd.pipeline.reports import MisbehaviourReport

    last = TINY.n_stages - 1
    accused, accuser = Identity.generate(), Identity.generate()
    x, y = torch.randn(2, 8, TINY.boundary_width), torch.randint(0, TINY.vocab_size, (2, 8))
    rows = torch.randn(4, K, dtype=torch.float64)
    opening = Opening.signed(accused, stage=last, step=3, peer_id=accused.peer_id, leader=accuser.peer_id,
                             digest="cd" * 32, codec="none", mbs=[6], parts=rows[:1], extra=rows[2], sent=rows[3],
                             ins=[inputs_digest(6, x, y)], at=["e3" * 32, "fp32"], lead="f4" * 32)
    body, sig = MisbehaviourReport.signed(accuser, accused=accused.peer_id, stage=last, step=3, kind="averaging", mb=1,
                                          request_digest="00" * 32, at=time.time(),
                                          answers=answers_of(opening.evidence, accused.peer_id, accuser.peer_id),
                                          evidence=opening.evidence.encode()).encode()
    raw = opening.encode()
    with daemon_thread(last) as d, state_must_survive(d, last) as p:

        @settings(FUZZ, max_examples=60)
        @given(data=st.data())
        def fuzz(data: st.DataObject) -> None:
            what = data.draw(st.integers(0, 4))
            if what == 0:
                p.post_frame("/v1/recheck", data.draw(raw_bodies()), data.draw(CONTENT_TYPES))
                return
            if what == 1:
                meta = {k: data.draw(SCALARS) for k in data.draw(st.sets(st.sampled_from(["body", "sig", "opening"])))}
                p.post_frame("/v1/recheck", encode_frame("recheck", meta, {"in_x": x.view(torch.int32), "in_y": y,
                                                                            "in_idx": torch.tensor([[6, *x.shape]])},
                                                         "none"))
                return
            parts = [bytearray(body), bytearray(raw)]
            if what < 4:
                field = parts[what - 2]
                field[data.draw(st.integers(0, len(field) - 1))] ^= data.draw(st.integers(1, 255))
                bumped = x
            else:
                bumped = x.clone()
                bumped.view(torch.int32).view(-1)[data.draw(st.integers(0, x.numel() - 1))] ^= 1 << data.draw(
                    st.integers(0, 22))  # one mantissa bit: still finite
            r = p.post_frame("/v1/recheck", RecheckRequest(bytes(parts[0]), sig, bytes(parts[1]), 6, bumped,
                                                           y).encode())
            assert r.status_code == 422, r.text

        fuzz()
        assert p.statuses[422], p.statuses
        assert d.daemon.reports.excluded() == frozenset()
        r = p.post_frame("/v1/recheck", RecheckRequest(body, sig, raw, 6, x, y).encode())
        assert d.daemon.reports.status()["received"] == 0
        # taken up to be recomputed, and counted in the ledger only if it holds (it cannot: no such parameters)
        assert r.status_code == 200 and decode_frame(r.content).meta["reason"] == "checking", r.text
        assert d.daemon.reports.excluded() == frozenset()
