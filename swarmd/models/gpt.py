"""The GPT architecture (``arch: "gpt"``): nanoGPT's pre-norm decoder.

``x + attn(ln(x))`` then ``x + mlp(ln(x))``, LayerNorm with biases, learned position
embeddings, a GELU MLP, biases on every linear layer but the head. Stage 0 owns the token and
position embeddings (``wte``, ``wpe``); the last stage owns ``ln_f`` and ``lm_head``. These
names are the parameters' names in checkpoints and exports, so they stay as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarmd.models.base import INIT_STD, Constant, Normal, StageModule, embedding
from swarmd.pipeline.spec import ModelSpec

__all__ = ["Block", "CausalSelfAttention", "GPTStage", "MLP"]


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


class GPTStage(StageModule):
    """A stage of the GPT architecture."""

    arch = "gpt"

    def build_first(self, device: torch.device) -> None:
        self.wte = embedding(self.spec.vocab_size, self.spec.d_model, device)
        self.wpe = embedding(self.spec.seq_len, self.spec.d_model, device)

    def build_block(self, device: torch.device) -> nn.Module:
        return Block(self.spec, device)

    def build_last(self, device: torch.device) -> None:
        self.ln_f = nn.LayerNorm(self.spec.d_model, device=device)
        self.lm_head = nn.Linear(self.spec.d_model, self.spec.vocab_size, bias=False, device=device)

    def embed(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        out: Tensor = self.wte(tokens) + self.wpe(positions)
        return out

    def logits(self, x: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.ln_f(x))
        return out

    def init_rule(self, module_name: str, param_name: str, module: nn.Module) -> Normal | Constant:
        """GPT-2 init: N(0, 0.02) for weights and embeddings, N(0, 0.02 / sqrt(2 * n_layers))
        for the projections that write into the residual stream (``c_proj``), zeros for
        biases, ones and zeros for LayerNorm. ``n_layers`` counts block applications, so a
        shared block is scaled as if it were that many separate ones."""
        if isinstance(module, nn.LayerNorm):
            return Constant(1.0 if param_name == "weight" else 0.0)
        if param_name == "bias":
            return Constant(0.0)
        if module_name.endswith("c_proj"):
            return Normal(INIT_STD / math.sqrt(2 * self.spec.n_layers))
        return Normal(INIT_STD)
