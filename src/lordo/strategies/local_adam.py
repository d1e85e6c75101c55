"""Local-update strategies: K local optimizer steps per worker, then the workers average.

At a synchronisation every worker sends its pseudo-gradient Δ_m = θ_anchor − θ_m; with the mean Δ the
outer step is θ_new = θ_anchor − η_out·Δ (η_out = 1 is plain model averaging; an optional outer SGD
momentum, Nesterov by default, as in DiLoCo), and every worker restarts from θ_new. Optimizer moments can
be averaged too, at every sync or with periods of their own (DES-LOC).

``local-adam`` uses AdamW as the local optimizer; LoRDO's strategies (``lordo.py``) reuse this class.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.compress import dequantize_int8_rows, dequantize_log_int8_rows, quantize_int8_rows, quantize_log_int8_rows
from ..errors import NonFiniteError
from .base import Strategy, make_adamw, tensor_bytes


class LocalUpdateStrategy(Strategy):
    default_average = "none"  # which moments strategy.average_moments = "auto" averages

    def __init__(self, models, groups, cfg, comm) -> None:
        super().__init__(models, groups, cfg, comm)
        s = cfg.strategy
        self.sync_every, self.outer_lr = s.sync_every, s.outer_lr
        self.momentum, self.nesterov = s.outer_momentum, s.outer_nesterov
        self.average = self.default_average if s.average_moments == "auto" else s.average_moments
        self.moment_periods = {"exp_avg": s.sync_exp_avg_every, "exp_avg_sq": s.sync_exp_avg_sq_every}
        self.optimizers = [self.make_optimizer(worker_groups) for worker_groups in groups]
        # the anchor (last synchronised model) and the outer momentum are the same on every worker:
        # one copy per process
        self.anchor = [p.detach().clone() for p in self.params[0]]
        self.outer_momentum = [torch.zeros_like(p) for p in self.anchor] if self.momentum > 0 else []
        self.syncs = 0
        self.synced_at = 0  # the step of the last synchronisation (0: the replicas start equal)
        # compressed synchronisations: each worker keeps what compression lost (error feedback), full size
        self.compress = s.compress
        feedback = self.compress != "none" and s.compress_feedback
        self.compression_error = [[torch.zeros_like(p) for p in params] for params in self.params] if feedback else []

    def make_optimizer(self, worker_groups) -> torch.optim.Optimizer:
        return make_adamw(worker_groups, self.cfg.optim)

    def averaged_params(self, worker: int) -> list[torch.Tensor]:
        """Parameters whose optimizer moments are averaged (``self.average`` = none | lowrank | all)."""
        return self.params[worker] if self.average == "all" else []

    def before_local_step(self) -> dict[str, float]:
        """Hook: runs after backward, before any local optimizer step (gradients are in ``.grad``)."""
        return {}

    def after_average(self, delta: list[torch.Tensor]) -> dict[str, float]:
        """Hook: runs at a sync with the averaged pseudo-gradient ``delta`` (ordered like ``self.params[0]``)."""
        return {}

    def step(self, lr: float) -> dict[str, float]:
        stats = self.before_local_step()
        norms = self.clip_and_step(lr)
        stats["grad_norm"] = norms[0]
        sync_due = self.steps_done % self.sync_every == 0
        self.average_moments(sync_due)
        if sync_due:
            stats.update(self.synchronise())
        return stats

    def average_moments(self, sync_due: bool) -> None:
        if self.average == "none":
            return
        for key, period in self.moment_periods.items():
            if (self.steps_done % period == 0) if period else sync_due:
                moments = [
                    [opt.state[p][key] for p in self.averaged_params(w)] for w, opt in enumerate(self.optimizers)
                ]
                if not moments[0]:
                    continue
                # compressed moments need no error feedback: they are running averages, not sums to deliver
                if self.compress == "none":
                    self.comm.all_reduce_mean(moments, tag=key)
                elif self.compress == "bf16":
                    low = [[m.to(torch.bfloat16) for m in ms] for ms in moments]
                    self.comm.all_reduce_mean(low, tag=f"{key}_bf16")
                    for ms, ls in zip(moments, low):
                        for m, lo in zip(ms, ls):
                            m.copy_(lo)
                else:
                    # int8 rows along the longer axis (low-rank moments are p×r: one scale per r elements would
                    # cost as much as the codes); second moments in the log domain: non-negative, a wide range,
                    # and never rounded to 0 (their step would explode)
                    lines = [[m.T if m.ndim == 2 and m.shape[0] > m.shape[1] else m for m in ms] for ms in moments]
                    encode, decode = ((quantize_log_int8_rows, dequantize_log_int8_rows) if key == "exp_avg_sq"
                                      else (quantize_int8_rows, dequantize_int8_rows))
                    payload = [[x for m in ms for x in encode(m)] for ms in lines]
                    self._gather_mean(lines, payload, f"{key}_int8", decode)

    def finish(self) -> dict[str, float]:
        return self.synchronise() if self.steps_done % self.sync_every else {}

    @torch.no_grad()
    def synchronise(self) -> dict[str, float]:
        # each worker's parameters become its pseudo-gradient in place (they are overwritten below anyway)
        for params in self.params:
            for p, a in zip(params, self.anchor):
                p.sub_(a).neg_()
        pseudo = [[p.data for p in params] for params in self.params]
        self.average_pseudo_gradients(pseudo)
        delta = pseudo[0]
        if not all(bool(torch.isfinite(d).all()) for d in delta):
            raise NonFiniteError(
                f"the averaged pseudo-gradient is not finite at synchronisation {self.syncs + 1} (after optimizer "
                f"step {self.steps_done})"
            )
        stats = {"synced": 1.0, "pseudo_grad_norm": float(torch.nn.utils.get_total_norm(delta))}
        stats.update(self.after_average(delta))
        if self.momentum > 0:
            for buf, d in zip(self.outer_momentum, delta):
                buf.mul_(self.momentum).add_(d)
            direction = (
                [d + self.momentum * b for d, b in zip(delta, self.outer_momentum)] if self.nesterov else self.outer_momentum
            )
        else:
            direction = delta
        for a, d in zip(self.anchor, direction):
            a.sub_(d, alpha=self.outer_lr)
        for params in self.params:
            for p, a in zip(params, self.anchor):
                p.copy_(a)
        self.syncs += 1
        self.synced_at = self.steps_done
        return stats

    @property
    def in_sync(self) -> bool:
        return self.synced_at == self.steps_done

    @torch.no_grad()
    def average_pseudo_gradients(self, pseudo: list[list[torch.Tensor]]) -> None:
        """Replace every worker's pseudo-gradients, in place, by their mean over all workers, sent as
        ``strategy.compress`` says (with error feedback of what compression lost, if enabled)."""
        if self.compress == "none":
            self.comm.all_reduce_mean(pseudo, tag="pseudo_gradient")
            return
        for tensors, errors in zip(pseudo, self.compression_error):
            for t, e in zip(tensors, errors):
                t.add_(e)  # x = Δ + what earlier rounds did not deliver
        if self.compress == "bf16":
            payload = [[t.to(torch.bfloat16) for t in tensors] for tensors in pseudo]
            for tensors, sent, errors in zip(pseudo, payload, self.compression_error):
                for t, c, e in zip(tensors, sent, errors):
                    e.copy_(t).sub_(c)
            self.comm.all_reduce_mean(payload, tag="pseudo_gradient_bf16")
            for tensors, sent in zip(pseudo, payload):
                for t, c in zip(tensors, sent):
                    t.copy_(c)
            return
        payload = []
        for w, tensors in enumerate(pseudo):
            items: list[torch.Tensor] = []
            for i, t in enumerate(tensors):
                q, scale = quantize_int8_rows(t)
                items += [q, scale]
                if self.compression_error:
                    self.compression_error[w][i].copy_(t).sub_(dequantize_int8_rows(q, scale))
            payload.append(items)
        self._gather_mean(pseudo, payload, "pseudo_gradient_int8", dequantize_int8_rows)

    def _gather_mean(self, tensors: list[list[torch.Tensor]], payload: list[list[torch.Tensor]], tag: str,
                     decode) -> None:
        """Replace every worker's ``tensors`` in place by the mean over all workers of their encoded
        ``payload`` (per worker: code, metadata, code, metadata, ...), all-gathered: integers with different
        scales cannot be summed on the wire. Each worker decodes and sums in rank order, so all agree."""
        gathered = self.comm.all_gather(payload, tag=tag)
        means: dict[int, list[torch.Tensor]] = {}  # the simulator hands every hosted worker the same list
        for ts, sources in zip(tensors, gathered):
            if id(sources) not in means:
                mean = []
                for i, t in enumerate(ts):
                    acc = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                    for src in sources:  # rank order: the same sum on every worker
                        acc += decode(src[2 * i], src[2 * i + 1])
                    mean.append(acc.div_(self.comm.world_size))
                means[id(sources)] = mean
            for t, m in zip(ts, means[id(sources)]):
                t.copy_(m)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        for worker, errors in zip(state["workers"], self.compression_error):
            worker["compression_error"] = [e.clone() for e in errors]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for worker, errors in zip(state["workers"], self.compression_error):
            for e, saved in zip(errors, worker["compression_error"], strict=True):
                e.copy_(saved)

    def shared_state(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done,
            "syncs": self.syncs,
            "synced_at": self.synced_at,
            "anchor": [a.clone() for a in self.anchor],
            "outer_momentum": [b.clone() for b in self.outer_momentum],
        }

    def load_shared_state(self, state: dict[str, Any]) -> None:
        self.steps_done, self.syncs = int(state["steps_done"]), int(state["syncs"])
        # older checkpoints lack it: they were taken after the step's synchronisation, if one was due
        self.synced_at = int(state.get("synced_at", self.steps_done - self.steps_done % self.sync_every))
        for a, s in zip(self.anchor, state["anchor"], strict=True):
            a.copy_(s)
        for b, s in zip(self.outer_momentum, state["outer_momentum"], strict=True):
            b.copy_(s)

    def step_payload_bytes(self) -> int:
        return tensor_bytes(self.params[0])

    def optimizer_bytes(self) -> dict[str, int]:
        return {"full_rank_moments": 2 * tensor_bytes(self.params[0])}

    def state_bytes(self) -> dict[str, int]:
        out = self.optimizer_bytes()
        out["anchor"] = tensor_bytes(self.anchor)
        if self.outer_momentum:
            out["outer_momentum"] = tensor_bytes(self.outer_momentum)
        if self.compression_error:
            out["compression_feedback"] = tensor_bytes(self.compression_error[0])
        return out


class LocalAdamStrategy(LocalUpdateStrategy):
    name = "local-adam"
