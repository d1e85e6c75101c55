"""Text from a trained model: autoregressive sampling, greedy or with a temperature and top-k, seeded."""

from __future__ import annotations

import torch

from ..errors import LordoError
from .gpt import GPT


class SampleError(LordoError):
    """A prompt the model or its tokenizer cannot take."""


@torch.no_grad()
def generate(model: GPT, prompt: list[int], new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, stop: int | None = None) -> list[int]:
    """``new_tokens`` token ids after ``prompt`` (its ids), each from the model's distribution over the last
    ``seq_len`` tokens: the most likely (``temperature`` 0), or drawn at ``temperature`` from the ``top_k`` most
    likely (0: all) with a generator seeded by ``seed`` (the same seed, the same text). Stops early at ``stop``."""
    if not prompt:
        raise SampleError("the prompt is empty: give at least one token of text")
    if temperature < 0 or top_k < 0 or new_tokens < 0:
        raise SampleError(f"temperature, top_k and the number of tokens must be >= 0, got {temperature}, {top_k}, {new_tokens}")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: list[int] = []
    for _ in range(new_tokens):
        logits, _ = model(ids[:, -model.cfg.seq_len:])
        last = logits[0, -1].float().cpu()
        if temperature == 0:
            token = int(last.argmax())
        else:
            last = last / temperature
            if top_k:
                kth = torch.topk(last, min(top_k, last.numel())).values[-1]
                last = last.masked_fill(last < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(last, dim=-1), 1, generator=gen))
        out.append(token)
        if stop is not None and token == stop:
            break
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return out
