"""``ddp``: the full gradient is all-reduced every step (one bucketed collective), then the inner optimizer."""

from __future__ import annotations

from .base import Strategy, inner_state_bytes


class DDPStrategy(Strategy):
    """Synchronous data parallelism: ``DDPStrategy(models, comm, optimizers=[AdamW(...)], grad_clip=0.5)``."""

    name = "ddp"

    def step(self, lr: float | None = None) -> dict[str, float]:
        self.set_lr(lr)
        self.comm.all_reduce_mean(self.grads(), tag="gradient")
        # every worker now holds the same averaged gradient, so clipping and the optimizer agree everywhere
        norms = self.clip_and_step()
        self.average_buffers()
        return {"grad_norm": norms[0]}

    def state_bytes(self) -> dict[str, int]:
        return inner_state_bytes(self.workers[0].optimizer, self.workers[0].params)
