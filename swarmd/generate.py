"""Sampling text from an exported model on one machine (``swarmd generate``, and the demo's last lines).

The models are byte-level (vocab 256): a prompt is its UTF-8 bytes, and every sampled token is
one byte, decoded at the end (a byte sequence cut mid-character shows as U+FFFD). Each new byte
is drawn from the last position's logits over at most ``seq_len`` bytes of context, divided by
``temperature`` and cut to the ``top_k`` likeliest; ``temperature`` 0 is greedy. A seeded
``torch.Generator`` makes a sample reproducible.
"""

from __future__ import annotations

import torch

from swarmd.pipeline.model import FullModel

__all__ = ["generate", "sample_text"]


@torch.no_grad()
def generate(model: FullModel, prompt: bytes, tokens: int, *, temperature: float = 0.8, top_k: int | None = 40,
             seed: int = 0) -> bytes:
    """``prompt`` followed by ``tokens`` sampled bytes."""
    if tokens < 0:
        raise ValueError(f"tokens must not be negative, got {tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must not be negative, got {temperature}")
    spec = model.spec
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt or b"\n")
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
    return bytes(ids if prompt else ids[1:])


def sample_text(model: FullModel, prompt: str, tokens: int, *, temperature: float = 0.8, top_k: int | None = 40,
                seed: int = 0) -> str:
    """:func:`generate` on text: the prompt's UTF-8 bytes in, the decoded sample out."""
    sample = generate(model, prompt.encode(), tokens, temperature=temperature, top_k=top_k, seed=seed)
    return sample.decode("utf-8", errors="replace")
