"""``ddp``: the full gradient is all-reduced every step (one bucketed collective), then AdamW."""

from __future__ import annotations

from .base import Strategy, make_adamw, tensor_bytes


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, models, groups, cfg, comm) -> None:
        super().__init__(models, groups, cfg, comm)
        self.optimizers = [make_adamw(worker_groups, cfg.optim) for worker_groups in groups]

    def step(self, lr: float) -> dict[str, float]:
        self.comm.all_reduce_mean(self.grads(), tag="gradient")
        # every worker now holds the same averaged gradient, so clipping and AdamW agree everywhere
        norms = self.clip_and_step(lr)
        return {"grad_norm": norms[0]}

    def step_payload_bytes(self) -> int:
        return tensor_bytes(self.params[0])

    def state_bytes(self) -> dict[str, int]:
        # AdamW allocates its moments lazily: report what it holds after the first step (2 fp32 copies)
        return {"full_rank_moments": 2 * tensor_bytes(self.params[0])}
