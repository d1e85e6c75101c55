"""A small Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP, tied embeddings, causal SDPA attention."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ..config import Config


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 128
    ffn_hidden: int = 0  # 0: 8/3 * d_model rounded up to a multiple of 64 (Llama's rule)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_params(self) -> int:
        """The parameters of ``GPT(self)``, counted without building it: the tied embedding, per block four
        attention matrices, three MLP matrices and two norms, and the final norm."""
        d = self.d_model
        per_block = 4 * d * d + 3 * d * self.hidden + 2 * d
        return self.vocab_size * d + self.n_layers * per_block + d


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Norms, rotations and the loss run in fp32 under bf16/fp16; float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _at_least_fp32(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim // 2) for rotating (even, odd) pairs."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, time, head_dim); rotates each consecutive pair of channels by its angle."""
    t = x.shape[-2]
    xf = _at_least_fp32(x)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[:t], sin[:t]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model; the output head shares the token-embedding matrix."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.ndim == 2:
                # residual-stream outputs are scaled down with depth (GPT-2 rule)
                scale = 1 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o.weight", "down.weight")) else 1
                nn.init.normal_(p, mean=0.0, std=std * scale)
            else:
                nn.init.ones_(p)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx: (batch, time) token ids, time <= seq_len. Returns (logits, mean cross-entropy or None)."""
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds model.seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = F.linear(self.norm(x), self.tok_emb.weight)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(_at_least_fp32(logits).view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(cfg: Config, vocab_size: int) -> GPT:
    """The GPT of a run's config (its ``model`` section), initialised from ``train.seed``."""
    m = cfg.model
    gpt_cfg = GPTConfig(vocab_size=vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                        seq_len=m.seq_len, ffn_hidden=m.ffn_hidden, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
                        init_std=m.init_std)
    torch.manual_seed(cfg.train.seed)
    return GPT(gpt_cfg)
