"""The training run's checkpoints: when one is due, saving it (collectively), resuming from the newest intact one,
joining a torchft run, and what a stopped or failed worker is told to restart from. A mixin of
:class:`~lordo.train.loop.Trainer`, whose models, samplers, optimizer and run state it saves."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..comm.torch_dist import CommError
from ..errors import ConfigError, NonFiniteError, Stopped
from .checkpoint import load_local_state, local_state
from .resume_settings import config_differences
from .runtime import RunState

if TYPE_CHECKING:
    from .checkpoint import Checkpointer


class CheckpointMethods:
    """Checkpoints of :class:`~lordo.train.loop.Trainer` (see the module doc)."""

    if TYPE_CHECKING:  # what the Trainer provides
        cfg: Any
        comm: Any
        optimizer: Any
        phases: Any
        models: list
        samplers: list
        data: Any
        checkpoints: Checkpointer
        config_dict: dict
        state: RunState
        scaler: Any
        window: torch.Tensor
        sharded: bool
        out: Path
        log: Callable[[str], None]

    def join(self) -> None:
        """Under torchft: start with the other workers, or recover from them and continue at their step."""
        try:
            step = self.optimizer.join()
        except CommError as exc:
            raise CommError(f"{exc}. {self._restart_hint()}") from None
        if step != self.state.step:  # the others were ahead (else: a fresh start, or all resumed together)
            self.log(f"recovered from a peer: continuing at step {step}")
            self.state.step = step
            for sampler in self.samplers:
                sampler.position = step  # the batches depend on the step alone

    def _checkpoint_if_due(self, step: int, stop_requested: bool, signum: int | None) -> None:
        t = self.cfg.train
        if self.comm.fault_tolerant:  # a worker recovers from its peers; from its files when all stopped at once
            if self._ft_checkpoint_due(step):
                self.save_checkpoint(step)
            if stop_requested and step < t.steps:
                raise Stopped(f"stopped after step {step}; the other workers go on. Start this worker again (the same "
                              "command) and it recovers from them", 128 + (signum or signal.SIGTERM))
            return
        if not ((t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.steps or stop_requested):
            return
        saved = self.save_checkpoint(step)
        if stop_requested and step < t.steps:
            name = signal.Signals(signum).name if signum else "a signal on another worker"
            raise Stopped(f"stopped by {name} after step {step}; checkpoint saved to {saved}. "
                          f"Continue with: lordo train --resume {self.out}", 128 + (signum or signal.SIGTERM))

    def _ft_checkpoint_due(self, step: int) -> bool:
        """Under torchft every worker saves at the same steps, each right after a committed synchronisation
        (the workers then hold the same model): the first sync step at or after each multiple of
        train.checkpoint_every, and the last step; a function of the step alone, so a worker recovered from its
        peers saves where they do. A whole run restarted then resumes from one step on every worker."""
        t, k = self.cfg.train, self.cfg.strategy.sync_every
        if not self.optimizer.in_sync:
            return False
        every = t.checkpoint_every
        return step == t.steps or (every > 0 and step % k == 0 and step // every > (step - k) // every)

    def save_checkpoint(self, step: int) -> Path:
        """Collective: every process writes its workers' files; the main one the shared state. A model that is
        not finite on any worker is never saved: it would replace a good checkpoint."""
        finite = all(bool(torch.isfinite(p).all()) for m in self.models for p in m.parameters())
        (diverged,) = self.comm.agree([not finite])
        if diverged:
            raise NonFiniteError(f"the model is not finite at step {step}; no checkpoint was saved over the last good "
                                 f"one: {self._last_good()}")
        state = self.optimizer.state_dict()
        window = float(self.window)  # the open loss window travels as it is, in each process's own file: folded
        # into loss_sum, a stop inside a window would add a rounding the uninterrupted run does not have
        shared = {"strategy": state["shared"], "ledger": state["ledger"], "rng": torch.get_rng_state(),
                  **self.state.to_checkpoint()}
        if self.scaler is not None:
            shared["grad_scaler"] = self.scaler.state_dict()
        workers = [{"model": local_state(m), "sampler": smp.state_dict(), "strategy": ws}
                   for m, smp, ws in zip(self.models, self.samplers, state["workers"])]
        workers[0]["loss_window"] = window
        if self.sharded:  # a rank's anchor, outer momentum and ledger are its shards' own: in its own file
            workers[0].update(strategy_shared=state["shared"], ledger=state["ledger"])
        return self.checkpoints.save(step, self.config_dict, shared, workers, data=self.data_fingerprint())

    def data_fingerprint(self) -> dict[str, str]:
        """What identifies the corpus a run trains on (a resume must read the same tokens)."""
        m = self.data.manifest
        return {"train_sha256": m["splits"]["train"]["sha256"], "tokenizer_sha256": m.get("tokenizer", {}).get("sha256", "")}

    def resume(self) -> None:
        meta, shared, workers, folder = self.checkpoints.load_latest(self._check_compatible)
        for model, sampler, w in zip(self.models, self.samplers, workers, strict=True):
            load_local_state(model, w["model"])
            sampler.load_state_dict(w["sampler"])
        self.phases.start(self.optimizer, int(meta["step"]))  # the K of the checkpoint's phase, before its state loads
        mine = workers[0] if "strategy_shared" in workers[0] else {"strategy_shared": shared["strategy"], "ledger": shared["ledger"]}
        self.optimizer.load_state_dict(
            {"shared": mine["strategy_shared"], "workers": [w["strategy"] for w in workers], "ledger": mine["ledger"]})
        torch.set_rng_state(shared["rng"])
        if self.scaler is not None and "grad_scaler" in shared:
            self.scaler.load_state_dict(shared["grad_scaler"])
        self.state = RunState.from_checkpoint(meta, shared)
        self.window.fill_(float(workers[0].get("loss_window", 0.0)))
        self.log(f"resuming from {folder} at step {self.state.step}")

    def _check_compatible(self, meta: dict) -> None:
        problems = config_differences(meta["config"], self.config_dict)
        if meta["world_size"] != self.comm.world_size:
            problems.append(f"workers: {meta['world_size']} in the checkpoint, {self.comm.world_size} now")
        if meta.get("data", self.data_fingerprint()) != self.data_fingerprint():
            problems.append(f"the corpus: {self.data.root} holds other tokens than the checkpoint's run read")
        if int(meta["step"]) > self.cfg.train.steps:
            problems.append(f"train.steps: the checkpoint is at step {meta['step']}, past train.steps = {self.cfg.train.steps}")
        if problems:
            raise ConfigError(
                f"{self.out} holds a checkpoint of a different run (step {meta['step']}); it differs in:\n  "
                + "\n  ".join(problems)
                + "\nuse another --out, or the checkpoint's settings (lordo train --resume DIR reads them)"
            )

    def _restart_hint(self) -> str:
        """What a restart of this worker starts from: its newest intact checkpoint, or step 0 when it has none."""
        latest = self.checkpoints.latest_intact_name()
        if latest is None:
            return "This worker has no checkpoint yet: started again, it begins at step 0"
        return f"Started again, this worker resumes from its checkpoint {latest}"

    def _last_good(self) -> str:
        return self.checkpoints.latest_intact_name() or "none (no intact checkpoint was saved yet)"
