"""A trainer's configuration: one frozen object that the CLI builds and every part of the trainer reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmd.errors import ConfigError
from swarmd.swarm_key import SwarmKey
from swarmd.train.timing import Timing
from swarmd.train.window import START

__all__ = ["TrainerConfig"]


@dataclass(frozen=True)
class TrainerConfig:
    """Everything a trainer is told; ``swarmd train``'s flags map onto it one to one."""

    api: str  # control-plane URL of any daemon of the swarm, e.g. http://127.0.0.1:8080
    steps: int = 100  # optimizer steps the swarm should take from now
    data: str | None = None  # text file or folder; None: the Python standard library's sources
    # --tokenizer FILE (a Hugging Face tokenizers JSON); None: byte-level, or a prepared --data DIR's own
    tokenizer: str | None = None
    text_field: str = "text"  # the field of a .jsonl record that holds its text (--text-field)
    batch_size: int | None = None  # samples per step (sync mode); None: the swarm's target_batch_size
    microbatch_size: int = 8
    codec: str = "8bit"  # activations and their gradients between stages
    seed: int = 0
    # microbatches in flight at once; None (``--window auto``): sized from what the trainer measures of its stages'
    # compute and round trips, and resized as they move (swarmd.train.window)
    window: int | None = None
    taper: bool = True  # sync mode: taper the step's ends (swarmd.pipeline.partition.tapered_sizes)
    max_taper_depth: int = 2  # ... at most this finely (1: halves only; 2: quarters, when measured to pay)
    sync: bool = False
    val_every: int = 10  # steps between validation losses (0: only at the end)
    val_batches: int = 4
    request_timeout_s: float = 60.0
    stage_wait_timeout_s: float = 120.0  # give up when a stage has had no usable peer this long
    refresh_s: float = 2.0  # how often the stage map is re-read from /swarm
    heartbeat_s: float = 10.0  # how often the registration is renewed (daemons forget it after 30 s)
    max_corpus_bytes: int = 8 * 2**20
    name: str = "trainer"
    max_seconds: float | None = None  # stop after the step that ends past this (chaos runs)
    api_token: str | None = None  # the daemon's control-plane token, when it has one
    swarm_key: SwarmKey | None = None  # a private swarm's key: signs every data-plane request
    reserve: bool = True  # pace through the first stage's sample reservations (False: each trainer on its own)
    lease_s: float = 5.0  # sample reservations expire this long after the last renewal (a dead trainer's)
    data_shards: int = 16  # the training split is cut in this many shards; an async trainer draws from one at a time
    shard: int | None = None  # which one; None: the rank the daemon handed out at registration
    verify_fraction: float = 0.02  # spot checks: this share of microbatches runs paired (swarmd.train.spot_checks)
    p2p: bool = False  # forwards go peer to peer, stage to stage (issue #31; swarmd.train.stage_calls)
    timing: Timing = field(default_factory=Timing)  # every timeout, grace and pause of its loops

    def __post_init__(self) -> None:
        for name in ("steps", "microbatch_size", "val_batches", "max_corpus_bytes", "data_shards"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.window is not None and self.window < 1:
            raise ConfigError("--window must be at least 1 (or auto)")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError("--batch-size must be at least 1")
        if self.val_every < 0:
            raise ConfigError("--val-every must not be negative")
        if self.shard is not None and self.shard < 0:
            raise ConfigError("--shard must not be negative")
        if not 0.5 <= self.lease_s <= 300:
            raise ConfigError("--lease-s must lie in [0.5, 300] seconds")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ConfigError("--verify-fraction must lie in [0, 1]")
        if self.max_taper_depth not in (0, 1, 2):
            raise ConfigError("max_taper_depth must be 0, 1 or 2")

    @property
    def start_window(self) -> int:
        """The window before anything is measured: the fixed ``window``, or ``swarmd.train.window.START``."""
        return self.window if self.window is not None else START
