"""Hugging Face's ``Trainer`` with LoRDO, one worker per process (``pip install 'lordo[hf]'``)::

    trainer = lordo.hf.LoRDOTrainer(model=model, args=args, train_dataset=data, lordo_options={"rank": 16})
    trainer.train()                               # python script.py, or torchrun --nproc-per-node 4 script.py

Under ``torchrun`` the plain ``Trainer`` hands the model to Accelerate, which wraps it in
``DistributedDataParallel``: every gradient all-reduced at every step, the traffic LoRDO exists to avoid. This
subclass keeps the model unwrapped, so each process is one LoRDO worker training on its own shard of the data
(the Trainer's distributed sampler), and LoRDO synchronises every ``sync_every`` steps. It also:

- builds the optimizer (``lordo.distributed(model, "lordo", ...)``) from the TrainingArguments' learning rate,
  betas, epsilon and weight decay, unless ``optimizers=(opt, scheduler)`` gives one;
- turns the Trainer's own gradient clipping off: LoRDO clips inside its step (``grad_clip``, 0.5 by default), and
  clipping twice changes the step; ``max_grad_norm`` left at its default is not applied, with one warning;
- saves and loads each worker's optimizer state in the Trainer's checkpoints (``optimizer-rank{R}.pt``): the
  workers' error feedback and moments differ, and a resume gives each its own back. Checkpoints are taken at
  synchronisations (``save_steps`` a multiple of ``sync_every``), where every worker holds the same model. Each
  file is written whole or not at all, and ``resume_from_checkpoint=True`` takes the newest checkpoint that every
  worker finished saving (a worker killed while saving leaves the one before);
- synchronises once more when training ends: every worker holds the same model, the one the Trainer saves;
- destroys the process group when the script exits, if the script has not (lordo's communicator sees to it): a gloo
  group left to the interpreter's teardown can abort the process (``terminate called without an active exception``)
  after training went well.
"""

from __future__ import annotations

import io
import os
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ConfigError
from .files import atomic_write

try:
    import transformers
except ImportError as exc:  # pragma: no cover - the hf extra is missing
    raise ImportError("lordo.hf needs transformers and accelerate: pip install 'lordo[hf]'") from exc


class _Unwrapped(nn.Module):
    """The model as the Trainer's training loop calls it: not wrapped in DDP (gradients stay each worker's own)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class LoRDOTrainer(transformers.Trainer):
    """``transformers.Trainer`` training with LoRDO, one worker per process (see the module doc). ``lordo_options``:
    :func:`lordo.distributed`'s options (``strategy`` among them, default ``"lordo"``), used when the optimizer is
    built here."""

    def __init__(self, *args: Any, lordo_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.lordo_options = dict(lordo_options or {})
        super().__init__(*args, **kwargs)
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            warnings.warn(f"TrainingArguments.max_grad_norm = {self.args.max_grad_norm} is not applied: LoRDO clips the "
                          "gradients inside its step (grad_clip, 0.5 by default: lordo_options={'grad_clip': ...}); "
                          "clipping them twice would change the step", UserWarning, stacklevel=2)
            self.args.max_grad_norm = 0.0
        sync_every = self.lordo_options.get("sync_every", 32)
        if self.args.save_strategy == "steps" and self.args.save_steps and int(self.args.save_steps) % sync_every:
            raise ConfigError(f"TrainingArguments.save_steps ({self.args.save_steps}) must be a multiple of sync_every "
                              f"({sync_every}): a checkpoint between synchronisations would save worker 0's own model "
                              "for every worker")

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            import lordo

            options = dict(self.lordo_options)
            strategy = options.pop("strategy", "lordo")
            a = self.args
            defaults = {"beta1": a.adam_beta1, "beta2": a.adam_beta2, "eps": a.adam_epsilon, "weight_decay": a.weight_decay}
            self.optimizer = lordo.distributed(self._model(), strategy, lr=a.learning_rate, **{**defaults, **options})
        return self.optimizer

    def _model(self) -> nn.Module:
        if self.model is None:
            raise ConfigError("LoRDOTrainer needs model= (a model_init is not supported)")
        return self.model

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return _Unwrapped(self._model()) if training else self._model()

    @property
    def lordo_optimizer(self):
        """lordo's :class:`~lordo.DistributedOptimizer` behind ``trainer.optimizer`` (which Accelerate wraps), for
        its reports: ``trainer.lordo_optimizer.comm_report()``, ``.memory_report()``."""
        from .distributed_optimizer import DistributedOptimizer

        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate wraps it
        if not isinstance(opt, DistributedOptimizer):
            raise ConfigError(f"LoRDOTrainer trains with lordo's optimizer; optimizers= gave {type(opt).__name__}")
        return opt

    def _lordo(self):
        return self.lordo_optimizer

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self._lordo()
        os.makedirs(output_dir, exist_ok=True)  # every worker writes its own file, the main process's folder or not yet
        _save(opt.state_dict(), Path(output_dir) / _optimizer_file(self.args.process_index))
        if self.args.should_save and self.lr_scheduler is not None:
            _save(self.lr_scheduler.state_dict(), Path(output_dir) / "scheduler.pt")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        rank, world = self.args.process_index, self.args.world_size
        path = Path(checkpoint) / _optimizer_file(rank)
        if not _readable(path):
            saved = sorted(int(m.group(1)) for f in Path(checkpoint).glob("optimizer-rank*.pt")
                           if (m := re.fullmatch(r"optimizer-rank(\d+)\.pt", f.name)))
            why = (f"it was saved by {len(saved)} processes, this run has {world}"
                   if saved and saved == list(range(len(saved))) and len(saved) != world
                   else "its save was cut short (a worker stopped while writing it): resume from the checkpoint before "
                        "it, or with resume_from_checkpoint=True, which takes the newest complete one")
            raise ConfigError(f"{checkpoint} holds no complete optimizer state of worker {rank} ({path}): {why}")
        self._lordo().load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))
        schedule = os.path.join(checkpoint, "scheduler.pt")
        if os.path.isfile(schedule) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(schedule, weights_only=True))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:  # the Trainer's own pick is the newest folder, complete or not
            resume_from_checkpoint = last_complete_checkpoint(str(self.args.output_dir), self.args.world_size)
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        self._lordo().finish()  # every worker now holds the same model
        return result


def _optimizer_file(rank: int) -> str:
    return f"optimizer-rank{rank}.pt"


def _save(obj: Any, path: Path) -> None:
    """``torch.save`` written whole or not at all: a worker killed while saving leaves no file that looks complete."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write(path, buffer.getvalue())


def _readable(path: Path) -> bool:
    """Whether ``path`` is a whole ``torch.save`` file (a zip archive whose central directory, written last, is there)."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (OSError, zipfile.BadZipFile):
        return False


def last_complete_checkpoint(output_dir: str, world_size: int) -> str:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that holds the Trainer's state and every worker's whole
    optimizer file: a worker killed while the others saved leaves a folder that looks complete to the Trainer's own
    pick. Names each one it passes over; raises :class:`ConfigError` when none is complete."""
    found = sorted(((int(m.group(1)), f) for f in Path(output_dir).glob("checkpoint-*")
                    if f.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", f.name))), reverse=True)
    for _, folder in found:
        missing = [name for name in ["trainer_state.json", *map(_optimizer_file, range(world_size))]
                   if not (_readable(folder / name) if name.endswith(".pt") else (folder / name).is_file())]
        if not missing:
            return str(folder)
        warnings.warn(f"{folder} is not resumed from: {', '.join(missing)} missing or cut short (its save was "
                      "interrupted); taking the checkpoint before it", UserWarning, stacklevel=3)
    raise ConfigError(f"resume_from_checkpoint=True: no complete checkpoint in {output_dir} "
                      f"({len(found)} checkpoint folders, none with every worker's optimizer state)")
