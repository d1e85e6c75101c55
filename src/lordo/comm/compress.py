"""Compressed payloads for the synchronisations: int8 with one scale per row, and bfloat16.

int8: each row r of a tensor (a 1-D tensor is one row) is sent as q = round(x / s_r) in [−127, 127] with
s_r = max|x_r| / 127, so every element's error is at most s_r / 2. Integers from different workers
have different scales and cannot be summed on the wire, so int8 payloads are all-gathered and every worker
dequantises and averages them itself, in rank order (identical on every worker).
"""

from __future__ import annotations

import torch

_TINY = torch.finfo(torch.float32).tiny


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.ndim >= 2 else t.reshape(1, -1)


@torch.no_grad()
def quantize_int8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 with t's number of elements, one float32 scale per row)."""
    rows = _rows(t.float())
    scale = rows.abs().amax(dim=1) / 127
    q = (rows / scale.clamp(min=_TINY)[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.reshape(t.shape), scale


@torch.no_grad()
def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 tensor of q's shape: q · s_row."""
    return (_rows(q).float() * scale[:, None]).reshape(q.shape)


def int8_payload_bytes(t: torch.Tensor) -> int:
    """Bytes one tensor costs as an int8 payload: one byte per element plus a float32 scale per row."""
    return t.numel() + 4 * _rows(t).shape[0]
