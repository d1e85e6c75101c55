"""Text from a trained model: autoregressive sampling, greedy or with a temperature and top-k, seeded."""

from __future__ import annotations

import math

import torch

from ..errors import LordoError
from .gpt import GPT

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


class SampleError(LordoError):
    """A prompt or a sampling setting the model or its tokenizer cannot take."""


@torch.no_grad()
def generate(model: GPT, prompt: list[int], new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, stop: int | None = None) -> list[int]:
    """``new_tokens`` token ids after ``prompt`` (its ids), each from the model's distribution over the last
    ``seq_len`` tokens: the most likely (``temperature`` 0), or drawn at ``temperature`` from the ``top_k`` most
    likely (0: all) with a generator seeded by ``seed`` (the same seed, the same text). Stops early at ``stop``."""
    if not prompt:
        raise SampleError("the prompt is empty: give at least one token of text")
    if not math.isfinite(temperature) or temperature < 0:
        raise SampleError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k < 0 or new_tokens < 0:
        raise SampleError(f"top_k and the number of tokens must be >= 0, got {top_k}, {new_tokens}")
    if top_k and temperature == 0:
        raise SampleError(f"top_k ({top_k}) chooses among the most likely tokens when sampling; temperature 0 takes the "
                          "most likely one: give a temperature > 0, or leave top_k at 0")
    if not SEED_MIN <= seed <= SEED_MAX:
        raise SampleError(f"seed must be an integer from {SEED_MIN} to {SEED_MAX} (torch's generator), got {seed}")
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
            last = (last - last.max()) / temperature  # <= 0: a tiny temperature gives -inf, never inf - inf
            if top_k:
                kth = torch.topk(last, min(top_k, last.numel())).values[-1]
                last = last.masked_fill(last < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(last, dim=-1), 1, generator=gen))
        out.append(token)
        if stop is not None and token == stop:
            break
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return out
