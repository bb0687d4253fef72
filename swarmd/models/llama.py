"""The Llama architecture (``arch: "llama"``): RMSNorm, rotary positions, SwiGLU, no biases.

The decoder of Touvron et al. (2023): ``x + attention(rms_norm(x))`` then
``x + feed_forward(rms_norm(x))``, where attention applies rotary position embeddings (Su et
al., RoFormer) to queries and keys, so there is no position embedding table and positions
enter every block; ``n_kv_heads`` below ``n_heads`` gives grouped-query attention (Ainslie et
al., 2023: each key/value head serves ``n_heads / n_kv_heads`` query heads, which shrinks the
key/value projections); the feed-forward is SwiGLU, ``w2(silu(w1 x) * w3 x)`` with
``d_ff`` hidden units. No linear layer has a bias. Names follow Meta's reference code
(``tok_embeddings``, ``attention.wq``, ``feed_forward.w1``, ``norm``, ``output``), with the
blocks under ``blocks`` as in every stage.

The rotary tables are computed from the positions on each forward (cheap next to the matrix
products) rather than kept as buffers: a stage's state is its parameters, so nothing else has
to travel in checkpoints and state downloads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarmd.models.base import INIT_STD, Constant, Normal, StageModule, embedding
from swarmd.pipeline.spec import ModelSpec

__all__ = ["LlamaBlock", "LlamaStage", "RMSNorm", "rotary_tables"]

ROPE_THETA = 10_000.0
RMS_EPS = 1e-5


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 whatever the input's dtype."""

    def __init__(self, width: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, device=device))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return normed.to(x.dtype) * self.weight.to(x.dtype)


def rotary_tables(seq: int, head_dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, ``[seq, head_dim]`` float32 (the half-split layout)."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and optional grouped-query attention."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.kv_heads, spec.head_dim
        kv_width = self.n_kv_heads * self.head_dim
        self.wq = nn.Linear(spec.d_model, spec.d_model, bias=False, device=device)
        self.wk = nn.Linear(spec.d_model, kv_width, bias=False, device=device)
        self.wv = nn.Linear(spec.d_model, kv_width, bias=False, device=device)
        self.wo = nn.Linear(spec.d_model, spec.d_model, bias=False, device=device)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(seq, self.head_dim, x.device)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.wo(y.transpose(1, 2).reshape(batch, seq, width))
        return out


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.w1 = nn.Linear(spec.d_model, spec.d_ff, bias=False, device=device)
        self.w2 = nn.Linear(spec.d_ff, spec.d_model, bias=False, device=device)
        self.w3 = nn.Linear(spec.d_model, spec.d_ff, bias=False, device=device)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class LlamaBlock(nn.Module):
    """One pre-norm Llama block."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.d_model, device)
        self.attention = Attention(spec, device)
        self.ffn_norm = RMSNorm(spec.d_model, device)
        self.feed_forward = FeedForward(spec, device)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        out: Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class LlamaStage(StageModule):
    """A stage of the Llama architecture."""

    arch = "llama"

    def build_first(self, device: torch.device) -> None:
        self.tok_embeddings = embedding(self.spec.vocab_size, self.spec.d_model, device)

    def build_block(self, device: torch.device) -> nn.Module:
        return LlamaBlock(self.spec, device)

    def build_last(self, device: torch.device) -> None:
        self.norm = RMSNorm(self.spec.d_model, device)
        self.output = nn.Linear(self.spec.d_model, self.spec.vocab_size, bias=False, device=device)

    def embed(self, tokens: Tensor) -> Tensor:
        out: Tensor = self.tok_embeddings(tokens)
        return out

    def logits(self, x: Tensor) -> Tensor:
        out: Tensor = self.output(self.norm(x))
        return out

    def init_rule(self, module_name: str, param_name: str, module: nn.Module) -> Normal | Constant:
        """N(0, 0.02) for weights and embeddings, N(0, 0.02 / sqrt(2 * n_layers)) for the two
        projections that write into the residual stream (``wo``, ``w2``), ones for RMSNorm."""
        if isinstance(module, RMSNorm):
            return Constant(1.0)
        if module_name.endswith(("attention.wo", "feed_forward.w2")):
            return Normal(INIT_STD / math.sqrt(2 * self.spec.n_layers))
        return Normal(INIT_STD)
