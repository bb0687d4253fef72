"""GPT-style pipeline stages: the unit of work a SWARM peer serves.

SWARM (Ryabinin et al., 2023, section 3.1) splits a model into stages and lets any peer
serving stage ``k`` process any microbatch for that stage. That only works if every peer's
copy of a stage is *interchangeable*, so this module guarantees two things:

- **Deterministic initial parameters.** Each parameter is drawn from its own
  ``torch.Generator`` seeded by SHA-256 of ``(spec.digest, stage, parameter name)``, so a
  stage's initial weights are a pure function of ``(spec, stage)``: independent of
  construction order, the global RNG, the thread or the device. Peers joining at different
  times start from the same point, and :func:`params_digest` lets them check it.
- **A deterministic forward pass.** The data plane's backward is stateless: a peer
  recomputes the forward from the saved inputs (activation recomputation, section 3.1)
  rather than keeping activations for minutes. Dropout would make that recomputation differ
  from the original forward, so these stages have none; at the data sizes volunteers train
  on, its regularisation is not worth the bookkeeping of shipping RNG state.

The architecture is nanoGPT's pre-norm decoder: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.
Stage 0 also owns token and position embeddings; the last stage owns the final LayerNorm,
an untied LM head and the loss (untied, because tying would make the first and last stages
share a parameter that lives on two different swarms).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarmd.errors import ConfigError, RequestError
from swarmd.pipeline.spec import ModelSpec

__all__ = [
    "Block",
    "CausalSelfAttention",
    "FullModel",
    "MLP",
    "StageModule",
    "build_stage",
    "params_digest",
]

_INIT_STD = 0.02
_PARAMS_DIGEST_VERSION = b"swarmd.params/1\n"


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through PyTorch's fused SDPA kernel."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.n_heads = spec.n_heads
        self.c_attn = nn.Linear(spec.d_model, 3 * spec.d_model, device=device)
        self.c_proj = nn.Linear(spec.d_model, spec.d_model, device=device)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        shape = (batch, seq, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """Position-wise feed-forward network with a GELU."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.c_fc = nn.Linear(spec.d_model, spec.d_ff, device=device)
        self.c_proj = nn.Linear(spec.d_ff, spec.d_model, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.d_model, device=device)
        self.attn = CausalSelfAttention(spec, device)
        self.ln_2 = nn.LayerNorm(spec.d_model, device=device)
        self.mlp = MLP(spec, device)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class StageModule(nn.Module):
    """Blocks ``spec.stage_range(stage)`` of the model, plus embeddings or head at the ends.

    Input: int64 token ids ``[B, T]`` on the first stage, float hidden states
    ``[B, T, d_model]`` elsewhere (cast to the stage's dtype). Output: hidden states, or on
    the last stage logits ``[B, T, vocab]``, or the mean cross-entropy when ``targets`` is
    given. Inputs that do not fit raise :class:`~swarmd.errors.RequestError`, because they
    usually come from a remote peer; token ids are range-checked since an out-of-range id
    would trip a CUDA device assert that poisons the whole process.
    """

    def __init__(
        self,
        spec: ModelSpec,
        stage: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        spec.stage_range(stage)  # validates the stage index with a ConfigError
        if not dtype.is_floating_point:
            raise ConfigError(f"a stage's parameters must be floating point, not {dtype}")
        self.spec = spec
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == spec.n_stages - 1
        # Built on the meta device: no memory, and the default initialisers never touch the
        # global RNG. The real values come from reset_parameters().
        meta = torch.device("meta")
        if self.is_first:
            self.wte = nn.Embedding(spec.vocab_size, spec.d_model, device=meta)
            self.wpe = nn.Embedding(spec.seq_len, spec.d_model, device=meta)
        n_blocks = 1 if spec.share_layers else spec.layers_per_stage
        self.blocks = nn.ModuleList(Block(spec, meta) for _ in range(n_blocks))
        if self.is_last:
            self.ln_f = nn.LayerNorm(spec.d_model, device=meta)
            self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False, device=meta)
        self.to_empty(device=device)
        self.to(dtype=dtype)
        self.reset_parameters()

    @property
    def expects_tokens(self) -> bool:
        """Whether :meth:`forward` takes token ids (first stage) rather than hidden states."""
        return self.is_first

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype hidden-state inputs are cast to (float32 unless built otherwise)."""
        return next(self.parameters()).dtype

    def reset_parameters(self) -> None:
        """Set every parameter to its deterministic initial value (see the module docstring).

        GPT-2 init: N(0, 0.02) for weights and embeddings, N(0, 0.02 / sqrt(2 * n_layers))
        for the projections that write into the residual stream (``c_proj``), zeros for
        biases, ones and zeros for LayerNorm. ``n_layers`` counts block applications, so a
        shared block is scaled as if it were ``layers_per_stage`` separate ones.
        """
        residual_std = _INIT_STD / math.sqrt(2 * self.spec.n_layers)
        with torch.no_grad():
            for module_name, module in self.named_modules():
                for param_name, param in module.named_parameters(recurse=False):
                    if isinstance(module, nn.LayerNorm):
                        param.fill_(1.0 if param_name == "weight" else 0.0)
                    elif param_name == "bias":
                        param.zero_()
                    else:
                        std = residual_std if module_name.endswith("c_proj") else _INIT_STD
                        full_name = f"{module_name}.{param_name}" if module_name else param_name
                        param.copy_(self._normal(full_name, param.shape, std))

    def _normal(self, name: str, shape: torch.Size, std: float) -> Tensor:
        """N(0, std) drawn on the CPU in float32 from a generator private to this parameter."""
        key = f"{self.spec.digest}\0{self.stage}\0{name}".encode()
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
        elif not inputs.is_floating_point() or inputs.dim() != 3 or inputs.shape[2] != spec.d_model:
            raise RequestError(
                f"stage {self.stage} expects float hidden states [batch, seq, {spec.d_model}], "
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
        if self.is_first:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
            x = self.wte(inputs) + self.wpe(positions)
        else:
            x = inputs.to(self.param_dtype)
        for i in range(self.spec.layers_per_stage):
            x = self.blocks[0 if self.spec.share_layers else i](x)
        if not self.is_last:
            return x
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _check_token_range(ids: Tensor, vocab_size: int, what: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise RequestError(f"{what} must lie in [0, {vocab_size}), got values outside it")


def build_stage(
    spec: ModelSpec,
    stage: int,
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype = torch.float32,
) -> StageModule:
    """Build stage ``stage`` of ``spec`` with its deterministic initial parameters."""
    return StageModule(spec, stage, device=device, dtype=dtype)


def params_digest(module: nn.Module) -> str:
    """SHA-256 hex over (name, dtype, shape, raw bytes) of every parameter, in name order.

    Equal digests mean bit-identical parameters, which is how peers of one stage check that
    they start from (or, after averaging, agree on) the same weights without shipping them.
    """
    return tensors_digest(module.named_parameters())


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """:func:`params_digest` of named tensors (e.g. a downloaded state, checked before adopting it)."""
    h = hashlib.sha256(_PARAMS_DIGEST_VERSION)
    for name, param in sorted(named, key=lambda item: item[0]):
        data = param.detach().contiguous().cpu().reshape(-1)
        header = f"{name}\0{str(data.dtype).removeprefix('torch.')}\0"
        header += f"{','.join(map(str, param.shape))}\0{data.numel() * data.element_size()}\0"
        h.update(header.encode())
        h.update(data.view(torch.uint8).numpy().data)
    return h.hexdigest()


class FullModel(nn.Module):
    """All stages chained in one process: the single-machine reference for tests and training."""

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device | str = "cpu",
        *,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.stages = nn.ModuleList(
            build_stage(spec, k, device, dtype=dtype) for k in range(spec.n_stages)
        )

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        x = tokens
        for stage in self.stages[:-1]:
            x = stage(x)
        return self.stages[-1](x, targets)
