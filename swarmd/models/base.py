"""The pipeline stage every architecture shares: the unit of work a SWARM peer serves.

SWARM (Ryabinin et al., 2023, section 3.1) splits a model into stages and lets any peer
serving stage ``k`` process any microbatch for that stage. That only works if every peer's
copy of a stage is *interchangeable*, so :class:`StageModule` guarantees, whatever the
architecture:

- **Deterministic initial parameters.** Each parameter is drawn from its own
  ``torch.Generator`` seeded by SHA-256 of ``(spec.digest, stage, parameter name)``, so a
  stage's initial weights are a pure function of ``(spec, stage)``: independent of
  construction order, the global RNG, the thread or the device. Peers joining at different
  times start from the same point, and ``params_digest`` lets them check it. An architecture
  only says *which* distribution each parameter gets (:meth:`StageModule.init_rule`).
- **A deterministic forward pass.** The data plane's backward is stateless: a peer
  recomputes the forward from the saved inputs (activation recomputation, section 3.1)
  rather than keeping activations for minutes. Dropout would make that recomputation differ
  from the original forward, so stages have none.

A stage is ``blocks`` in order (``spec.stage_range(stage)``; with ``share_layers`` one block
applied that many times: :mod:`swarmd.models.layer_sharing`), with the embedding in front on
stage 0 and the final norm, an untied LM head and the loss behind on the last stage (untied,
because tying would make the first and last stages share a parameter that lives on two different
swarms). A subclass builds those pieces (:meth:`build_first`, :meth:`build_block`,
:meth:`build_last`) and runs them (:meth:`embed`, :meth:`logits`); everything else lives here once.

With ``spec.boundary_dim`` set, every architecture gets the paper's compression-aware boundary
(Appendix I, the bottleneck variant): a stage that is not the last ends with ``boundary_out``
(``d_model -> boundary_dim``) and one that is not the first begins with ``boundary_in`` (back to
``d_model``), so what crosses the network is ``boundary_dim`` wide both ways (activations
forward, their gradients backward), and it compresses further with any codec.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarmd.errors import ConfigError, RequestError
from swarmd.models.layer_sharing import block_applied, blocks_built
from swarmd.pipeline.spec import ModelSpec

__all__ = ["Constant", "Normal", "StageModule", "embedding"]

INIT_STD = 0.02


class Normal(float):
    """Init rule: N(0, std) from the parameter's own generator."""


class Constant(float):
    """Init rule: every element set to this value."""


def embedding(num: int, dim: int, device: torch.device) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight is allocated, not initialised, on ``device``.

    ``nn.Embedding(..., device="meta")`` runs its own ``normal_`` init on the meta tensor, which
    in torch 2.x goes through ``torch._refs`` and costs ~3 s the first time in a process (every
    daemon start paid it); the values are set by ``reset_parameters`` anyway.
    """
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim, device=device), device=device)


class StageModule(nn.Module):
    """Blocks ``spec.stage_range(stage)`` of the model, plus embeddings or head at the ends.

    Input: int64 token ids ``[B, T]`` on the first stage, float hidden states
    ``[B, T, spec.boundary_width]`` elsewhere (cast to the stage's dtype). Output: hidden states
    (``boundary_width`` wide: ``d_model``, or ``boundary_dim`` through the bottleneck), or on
    the last stage logits ``[B, T, vocab]``, or the mean cross-entropy when ``targets`` is
    given. Inputs that do not fit raise :class:`~swarmd.errors.RequestError`, because they
    usually come from a remote peer; token ids are range-checked since an out-of-range id
    would trip a CUDA device assert that poisons the whole process.

    Subclasses set :attr:`arch` and implement the ``build_*`` pieces, :meth:`embed`,
    :meth:`logits` and :meth:`init_rule`; the constructor signature is the stage builder's
    that the registry calls: ``cls(spec, stage, device=..., dtype=...)``.
    """

    arch: ClassVar[str] = ""
    blocks: nn.ModuleList
    boundary_in: nn.Linear | None
    boundary_out: nn.Linear | None

    def __init__(
        self,
        spec: ModelSpec,
        stage: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        layers = spec.stage_range(stage)  # validates the stage index with a ConfigError
        if not dtype.is_floating_point:
            raise ConfigError(f"a stage's parameters must be floating point, not {dtype}")
        if self.arch and spec.arch != self.arch:
            raise ConfigError(f"{type(self).__name__} builds arch {self.arch!r}, not the spec's {spec.arch!r}")
        self.spec = spec
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == spec.n_stages - 1
        self.n_applied = len(layers)  # block applications on this stage
        # Built on the meta device: no memory, and the default initialisers never touch the
        # global RNG. The real values come from reset_parameters().
        meta = torch.device("meta")
        if self.is_first:
            self.build_first(meta)
        n_blocks = blocks_built(self.n_applied, shared=spec.share_layers)
        self.blocks = nn.ModuleList(self.build_block(meta) for _ in range(n_blocks))
        if self.is_last:
            self.build_last(meta)
        # the bottleneck at stage boundaries (spec.boundary_dim; the paper's Appendix I)
        self.boundary_in = None
        self.boundary_out = None
        if spec.boundary_dim and not self.is_first:
            self.boundary_in = nn.Linear(spec.boundary_dim, spec.d_model, device=meta)
        if spec.boundary_dim and not self.is_last:
            self.boundary_out = nn.Linear(spec.d_model, spec.boundary_dim, device=meta)
        self.to_empty(device=device)
        self.to(dtype=dtype)
        self.reset_parameters()

    # ---- what an architecture provides ----------------------------------------------------------

    def build_first(self, device: torch.device) -> None:
        """Create stage 0's embedding modules as attributes (on ``device``, the meta device)."""
        raise NotImplementedError

    def build_block(self, device: torch.device) -> nn.Module:
        """One transformer block: ``[B, T, d_model] -> [B, T, d_model]``."""
        raise NotImplementedError

    def build_last(self, device: torch.device) -> None:
        """Create the last stage's final norm and LM head as attributes."""
        raise NotImplementedError

    def embed(self, tokens: Tensor) -> Tensor:
        """Token ids ``[B, T]`` to hidden states (stage 0)."""
        raise NotImplementedError

    def logits(self, x: Tensor) -> Tensor:
        """Hidden states to logits ``[B, T, vocab]`` (the last stage)."""
        raise NotImplementedError

    def init_rule(self, module_name: str, param_name: str, module: nn.Module) -> Normal | Constant:
        """How parameter ``module_name.param_name`` starts: :class:`Normal` or :class:`Constant`."""
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------

    @property
    def expects_tokens(self) -> bool:
        """Whether :meth:`forward` takes token ids (first stage) rather than hidden states."""
        return self.is_first

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype hidden-state inputs are cast to (float32 unless built otherwise)."""
        return next(self.parameters()).dtype

    def reset_parameters(self) -> None:
        """Set every parameter to its deterministic initial value (see the module docstring)."""
        with torch.no_grad():
            for module_name, module in self.named_modules():
                for param_name, param in module.named_parameters(recurse=False):
                    if module_name in ("boundary_in", "boundary_out"):
                        param.copy_(self._boundary_init(module_name, param_name, param.shape))
                        continue
                    rule = self.init_rule(module_name, param_name, module)
                    if isinstance(rule, Constant):
                        param.fill_(float(rule))
                    else:
                        full_name = f"{module_name}.{param_name}" if module_name else param_name
                        param.copy_(self._normal(full_name, param.shape, float(rule)))

    def _boundary_init(self, module_name: str, param_name: str, shape: torch.Size) -> Tensor:
        """The bottleneck's initial values: zero biases; ``boundary_out`` (``d_model -> k``) drawn
        N(0, 1/d_model), so its rows are nearly orthonormal; and ``boundary_in`` of the next stage
        its transpose (drawn from the previous stage's generator of ``boundary_out.weight``), so
        that at initialisation the boundary passes a k-dimensional projection of the hidden
        state through unchanged rather than a random mix of it."""
        if param_name == "bias":
            return torch.zeros(shape)
        d_model, k = self.spec.d_model, self.spec.boundary_dim
        if module_name == "boundary_out":
            return self._normal("boundary_out.weight", torch.Size((k, d_model)), d_model**-0.5)
        return self._normal("boundary_out.weight", torch.Size((k, d_model)), d_model**-0.5, self.stage - 1).t()

    def _normal(self, name: str, shape: torch.Size, std: float, stage: int | None = None) -> Tensor:
        """N(0, std) drawn on the CPU in float32 from a generator private to this parameter
        (of ``stage``, this one by default)."""
        stage = self.stage if stage is None else stage
        key = f"{self.spec.digest}\0{stage}\0{name}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") & (2**63 - 1)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        return torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std)

    def check_inputs(self, inputs: Tensor, targets: Tensor | None = None) -> None:
        """Raise :class:`RequestError` with a sentence if the inputs do not fit this stage."""
        spec = self.spec
        if self.is_first:
            if inputs.dtype != torch.int64 or inputs.dim() != 2:
                raise RequestError(
                    f"stage {self.stage} expects int64 token ids [batch, seq], "
                    f"got {inputs.dtype} {list(inputs.shape)}"
                )
            _check_token_range(inputs, spec.vocab_size, "token ids")
        elif not inputs.is_floating_point() or inputs.dim() != 3 or inputs.shape[2] != spec.boundary_width:
            raise RequestError(
                f"stage {self.stage} expects float hidden states [batch, seq, {spec.boundary_width}], "
                f"got {inputs.dtype} {list(inputs.shape)}"
            )
        batch, seq = inputs.shape[:2]
        if batch == 0 or not 0 < seq <= spec.seq_len:
            raise RequestError(
                f"stage {self.stage} expects 1 <= seq <= {spec.seq_len} and a non-empty batch, "
                f"got shape {list(inputs.shape)}"
            )
        if targets is None:
            return
        if not self.is_last:
            raise RequestError(f"stage {self.stage} is not the last stage and takes no targets")
        if targets.dtype != torch.int64 or tuple(targets.shape) != (batch, seq):
            raise RequestError(
                f"targets must be int64 [{batch}, {seq}], got {targets.dtype} "
                f"{list(targets.shape)}"
            )
        _check_token_range(targets, spec.vocab_size, "targets")

    def forward(self, inputs: Tensor, targets: Tensor | None = None) -> Tensor:
        # No validation here: this is the hot path of trusted callers. Remote input is checked
        # once, at the boundary (StageExecutor calls check_inputs).
        x = self.embed(inputs) if self.is_first else inputs.to(self.param_dtype)
        if self.boundary_in is not None:
            x = self.boundary_in(x)
        shared = self.spec.share_layers
        for i in range(self.n_applied):
            x = self.blocks[block_applied(i, shared=shared)](x)
        if not self.is_last:
            return x if self.boundary_out is None else self.boundary_out(x)
        logits = self.logits(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _check_token_range(ids: Tensor, vocab_size: int, what: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise RequestError(f"{what} must lie in [0, {vocab_size}), got values outside it")
