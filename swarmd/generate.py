"""Sampling text from an exported model on one machine (``swarmd generate``, and the demo's last lines).

A prompt is encoded with the model's tokenizer (``swarmd.train.tokenizer``: its UTF-8 bytes for
the byte-level default, a BPE file's ids otherwise; its digest must be the model spec's) and the
sample decoded with it at the end (a byte sequence cut mid-character shows as U+FFFD). Each new
token is drawn from the last position's logits over at most ``seq_len`` tokens of context,
divided by ``temperature`` and cut to the ``top_k`` likeliest; ``temperature`` 0 is greedy. A
seeded ``torch.Generator`` makes a sample reproducible. An empty prompt starts from the
tokenizer's document separator (a line break, or ``<|endoftext|>``), which is not returned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarmd.pipeline.model import FullModel
from swarmd.train.tokenizer import BYTE_LEVEL, Tokenizer, check_matches

__all__ = ["generate", "generate_ids", "sample_text"]


@torch.no_grad()
def generate_ids(model: FullModel, prompt: Sequence[int], tokens: int, *, temperature: float = 0.8,
                 top_k: int | None = 40, seed: int = 0) -> list[int]:
    """``prompt`` (token ids, at least one) followed by ``tokens`` sampled ids."""
    if tokens < 0:
        raise ValueError(f"tokens must not be negative, got {tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must not be negative, got {temperature}")
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    spec = model.spec
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = [int(i) for i in prompt]
    model.eval()
    for _ in range(tokens):
        context = torch.tensor([ids[-spec.seq_len:]], dtype=torch.long, device=device)
        logits = model(context)[0, -1].float().cpu()
        if temperature == 0:
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k is not None and 0 < top_k < logits.numel():
            cutoff = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < cutoff, float("-inf"))
        ids.append(int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)))
    return ids


def generate(model: FullModel, prompt: bytes, tokens: int, *, temperature: float = 0.8, top_k: int | None = 40,
             seed: int = 0) -> bytes:
    """A byte-level model's sample: ``prompt`` followed by ``tokens`` sampled bytes."""
    ids = generate_ids(model, list(prompt or b"\n"), tokens, temperature=temperature, top_k=top_k, seed=seed)
    return bytes(ids if prompt else ids[1:])


def sample_text(model: FullModel, prompt: str, tokens: int, *, temperature: float = 0.8, top_k: int | None = 40,
                seed: int = 0, tokenizer: Tokenizer | None = None) -> str:
    """:func:`generate_ids` on text: the prompt encoded, the sample decoded, with ``tokenizer``
    (byte-level when None), which must be the model's (ConfigError otherwise)."""
    tok = tokenizer or BYTE_LEVEL
    check_matches(tok.digest, model.spec, tok.source)
    start = tok.encode(prompt) if prompt else list(tok.separator)
    ids = generate_ids(model, start, tokens, temperature=temperature, top_k=top_k, seed=seed)
    return tok.decode(ids if prompt else ids[len(start):])
