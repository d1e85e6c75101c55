"""``ddp``: AdamW on the (averaged) full gradient every step."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import OptimConfig
from ..model.params import ParamGroup
from .base import Strategy, tensor_bytes


def make_adamw(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.AdamW:
    param_groups = [
        {"params": g.params, "weight_decay": cfg.weight_decay if g.rule.weight_decay else 0.0, "name": g.rule.group}
        for g in groups
    ]
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm in place (0 = no clipping); returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, model: nn.Module, groups: list[ParamGroup], cfg: OptimConfig) -> None:
        super().__init__(model, groups)
        self.cfg = cfg
        self.params = [p for g in groups for p in g.params]
        self.optimizer = make_adamw(groups, cfg)

    def step(self, lr: float) -> dict[str, float]:
        grad_norm = clip_gradients(self.params, self.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm}

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def state_bytes(self) -> dict[str, int]:
        moments = [t for s in self.optimizer.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
        # before the first step AdamW has no state yet: report what it will hold (2 fp32 copies)
        if not moments:
            return {"full_rank_moments": 2 * tensor_bytes(self.params)}
        return {"full_rank_moments": tensor_bytes(moments)}
