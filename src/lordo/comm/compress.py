"""Compressed payloads for the synchronisations: int8 with one scale per row, and bfloat16.

int8: each row r of a tensor (a 1-D tensor is one row) is sent as q = round(x / s_r) in [−127, 127] with
s_r = max|x_r| / 127, so every element's error is at most s_r / 2. Integers from different workers
have different scales and cannot be summed on the wire, so int8 payloads are all-gathered and every worker
dequantises and averages them itself, in rank order (identical on every worker).

Log-int8, for non-negative tensors with a wide dynamic range (Adam's second moments, where a small entry
rounded to zero would make its step explode): each row is sent as its log range [lo, hi] (two float32)
and codes c = round(254·(ln x − lo)/(hi − lo)) − 127 in [−127, 127]; −128 encodes an exact zero. Every
positive element comes back within a factor exp((hi − lo)/508) of itself.
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
    return _rows(q).float().mul_(scale[:, None]).reshape(q.shape)  # in place on the float copy


ZERO_CODE = -128


@torch.no_grad()
def quantize_log_int8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 with t's number of elements, (rows, 2) float32 [lo, hi] of ln x per row) for t ≥ 0."""
    rows = _rows(t.float())
    positive = rows > 0
    logs = torch.where(positive, rows.clamp(min=_TINY).log(), torch.zeros((), device=rows.device))
    hi = torch.where(positive, logs, torch.full((), -torch.inf, device=rows.device)).amax(dim=1)
    lo = torch.where(positive, logs, torch.full((), torch.inf, device=rows.device)).amin(dim=1)
    empty = ~torch.isfinite(hi)  # a row of zeros
    hi, lo = torch.where(empty, 0.0, hi), torch.where(empty, 0.0, lo)
    width = (hi - lo).clamp(min=1e-12)
    codes = ((logs - lo[:, None]) / width[:, None] * 254).round_().sub_(127).clamp_(-127, 127)
    codes = torch.where(positive, codes, torch.full((), float(ZERO_CODE), device=rows.device)).to(torch.int8)
    return codes.reshape(t.shape), torch.stack([lo, hi], dim=1)


@torch.no_grad()
def dequantize_log_int8_rows(codes: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """float32 tensor of the codes' shape: exp(lo + (c + 127)/254·(hi − lo)), 0 where c = −128."""
    c = _rows(codes)
    lo, hi = bounds[:, 0:1], bounds[:, 1:2]
    x = torch.exp(lo + (c.float() + 127) / 254 * (hi - lo))
    return torch.where(c == ZERO_CODE, torch.zeros((), device=x.device), x).reshape(codes.shape)
