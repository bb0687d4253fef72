"""Layer sharing: one block's parameters applied several times in a stage (ALBERT-style).

SWARM trains its largest model this way (the paper's 1B shared-parameter, ~13B-effective
Transformer on 400 preemptible T4s, claim C4): a stage applies the same block ``n`` times, so its
compute is that of ``n`` layers while its parameters, and with them the gradients its peers
average every step and the state a newcomer downloads, are those of one. Against the square-cube
law this is the cheap side: averaging traffic shrinks ``n``-fold, activations at the stage's
boundary do not change.

``ModelSpec.share_layers`` turns it on for every stage (it is in the spec's digest, so peers of a
shared and an unshared model never mix). :class:`~swarmd.models.base.StageModule` builds
:func:`blocks_built` blocks and applies block :func:`block_applied` at each of its layers.
Sharing is within a stage only: a parameter shared across stages would live on two swarms, whose
averaging rounds know nothing of each other.
"""

from __future__ import annotations

__all__ = ["block_applied", "blocks_built"]


def blocks_built(n_applied: int, *, shared: bool) -> int:
    """How many blocks a stage that applies ``n_applied`` layers holds parameters for."""
    return 1 if shared else n_applied


def block_applied(layer: int, *, shared: bool) -> int:
    """Which of the stage's blocks computes its ``layer``-th layer (0-based)."""
    return 0 if shared else layer
