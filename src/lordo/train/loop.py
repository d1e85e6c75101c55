"""The training loop: sample → forward → backward → ``DistributedOptimizer.step`` → log → evaluate.

:class:`Trainer` holds one run: its models (one per worker this process hosts), the distributed optimizer,
the samplers and a :class:`RunState` (what a checkpoint restores besides models and optimizer). Every
process runs the same sequence of collectives: the optimizer's, the agreement on stop and non-finite flags,
the evaluation's average and the checkpoint barriers; only the main process writes files.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from ..comm import make_communicator
from ..comm.mesh import worker_mesh
from ..comm.torch_dist import CommError
from ..config import Config
from ..data import prepare as data_prep
from ..data.sampler import BatchSampler, eval_batches
from ..distributed_optimizer import DistributedOptimizer, reshard
from ..errors import ConfigError, NonFiniteError, WriteError
from ..files import atomic_write, write_json
from ..model import GPT, build_model, format_groups
from ..optim import fsdp_placement
from ..phases import Phases
from .checkpoint import Checkpointer, full_state
from .memory import check_fits
from .metrics import MetricsWriter, Progress
from .persist import CheckpointMethods
from .runtime import (
    PRECISIONS,
    RunState,
    SignalFlag,
    evaluate,
    locked_output,
    muon_precision_note,
    output_folder,
    resolve_device,
    resolve_precision,
)
from .schedule import lr_factor
from .summary import RunFacts, summarize


def train(cfg: Config, out_dir: str | Path | None, log: Callable[[str], None] = print, stream: TextIO | None = None) -> dict:
    """Run one training job described by ``cfg``; the main process writes config.json, metrics.jsonl and
    summary.json to ``out_dir`` (None: ``runs/<preset>-<strategy>-<time>``, named by the main process) and
    returns the summary (other processes return it too, without files). The main process holds a lock on
    the folder for the run. ``train.threads`` holds for the run; the caller's thread count is restored after it,
    however the run ends."""
    with _thread_count(cfg.train.threads):
        return _train(cfg, out_dir, log, stream)


@contextlib.contextmanager
def _thread_count(threads: int):
    """torch's intra-op thread count at ``threads`` inside (0: left as it is), the caller's back after."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(cfg: Config, out_dir: str | Path | None, log: Callable[[str], None], stream: TextIO | None) -> dict:
    t, d = cfg.train, cfg.dist
    if not t.threads and d.backend == "torchft" and "OMP_NUM_THREADS" not in os.environ and (os.cpu_count() or 1) > 1:
        # a torchft worker is started on its own: nothing divides the cores among the workers of one machine
        log(f"note: this torchft worker uses all {os.cpu_count()} cores (torch's default); with several workers on "
            "one machine give each its share, --set train.threads=CORES/WORKERS: two workers on 2 cores trained "
            "4.6x faster with one thread each (docs/multi-node.md)")
    device = resolve_device(t.device)
    comm = make_communicator(d.backend, d.workers, d.timeout_s, device.type, d.ranks_per_worker, d.shard)
    note = muon_precision_note(cfg, device)
    if note and comm.is_main:
        log(note)
    clean = False
    try:
        out = output_folder(cfg, out_dir, comm)
        with locked_output(out, comm):
            summary = Trainer(cfg, out, comm, device, log, stream if stream is not None else sys.stderr).run()
        clean = True
        return summary
    finally:
        comm.close(clean)


DIAGNOSTICS = ("basis_overlap", "residual_energy", "error_feedback_norm")  # averaged into summary.json


class Trainer(CheckpointMethods):
    """One training run in this process (see the module docstring)."""

    def __init__(self, cfg: Config, out: Path, comm, device: torch.device, log, stream: TextIO) -> None:
        t = cfg.train
        if comm.world_size != cfg.dist.workers and cfg.dist.workers != 1:
            raise ConfigError(
                f"dist.workers is {cfg.dist.workers} but the launcher started {comm.world_size * cfg.dist.ranks_per_worker} "
                f"processes ({cfg.dist.ranks_per_worker} per worker); set dist.workers to the number of processes / "
                "dist.ranks_per_worker (or leave it at 1 under torchrun)"
            )
        self.cfg, self.out, self.comm, self.device, self.stream = cfg, out, comm, device, stream
        self.main = comm.is_main
        self.log = log if self.main else (lambda _: None)
        if self.main:
            out.mkdir(parents=True, exist_ok=True)
        self.data = self._load_data()
        self.precision = resolve_precision(t.precision, device)
        weights = torch.bfloat16 if self.precision == "bf16" else torch.float32
        self.sharded = cfg.dist.shard  # each worker's model sharded over its ranks (FSDP2)
        self.mesh = worker_mesh(cfg.dist.ranks_per_worker) if self.sharded else None
        check_fits(cfg, self.data.vocab_size, len(comm.local_ranks), device)
        self.models = [self._new_model(weights) for _ in comm.local_ranks]
        # identical seeds give identical replicas; the optimizer broadcasts worker 0's parameters anyway
        self.optimizer = DistributedOptimizer(self.models, cfg, comm, check_finish=False)  # the loop finishes
        self.forwards = [torch.compile(m) if t.compile else m for m in self.models]
        # every rank reads its own shard of the data (several per worker when a worker is a group of ranks)
        self.samplers = [BatchSampler(self.data.train, cfg.model.seq_len, t.batch_size, t.seed, shard, shards)
                         for shard, shards in comm.data_shards()]
        self.val = eval_batches(self.data.val, cfg.model.seq_len, t.batch_size, t.eval_batches)
        # between synchronisations the workers' models differ: evaluations score their average, in a spare
        # (not under torchft: a collective outside the synchronisations' rounds; each worker scores its own)
        averaged = t.eval_model == "average" and comm.world_size > 1 and not comm.fault_tolerant
        self.spare = (self._new_model(weights) if self.sharded else copy.deepcopy(self.models[0])) if averaged else None
        self.tokens_per_step = comm.data_shards()[0][1] * t.batch_size * cfg.model.seq_len  # over all ranks
        self.checkpoints = Checkpointer(out, comm, t.keep_checkpoints)
        self.config_dict = cfg.to_dict()
        self.state = RunState(schedule_steps=t.steps)
        self.phases = Phases(cfg.switch, cfg.strategy.sync_every)  # two phases in one run (switch.at_step > 0)
        self.phases.start(self.optimizer, 0)  # the first phase's K; a resume sets its checkpoint's phase
        # fp16 autocast needs loss scaling; the optimizer unscales and skips a step on every worker together
        self.scaler = torch.amp.GradScaler(device.type) if self.precision == "fp16-mixed" else None
        self.window = torch.zeros((), device=device)  # this log window's summed loss, read at the log interval

    def _new_model(self, weights: torch.dtype) -> GPT:
        """A replica on the training device; with dist.shard, each block and the rest sharded over the worker's
        ranks, every matrix along its long side (lordo.optim.fsdp_placement)."""
        model = build_model(self.cfg, self.data.vocab_size).to(device=self.device, dtype=weights)
        if self.mesh is not None:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block, mesh=self.mesh, shard_placement_fn=fsdp_placement)
            fully_shard(model, mesh=self.mesh, shard_placement_fn=fsdp_placement)
        return model

    def _load_data(self):
        # one process per machine prepares the corpus if needed; the others wait, then open the same files
        d = self.cfg.data
        spec = data_prep.CorpusSpec.of(d)
        data = data_prep.ensure(d.dir, d.vocab_size, d.val_fraction, log=self.log, spec=spec) if self.comm.is_node_main else None
        self.comm.barrier()
        return data if data is not None else data_prep.load(data_prep.corpus_dir(d.dir, spec))

    # ------------------------------------------------------------------------------------------------ the run

    def run(self) -> dict:
        m, cfg = self.models[0], self.cfg
        self.log(f"model: {cfg.model.preset}, {m.num_params():,} parameters, vocab {self.data.vocab_size}, device "
                 f"{self.device}; strategy {cfg.strategy.name}, {self.comm.world_size} worker(s) on {type(self.comm).__name__}")
        self.log(format_groups(self.optimizer.groups[0]))
        if self.checkpoints.has_checkpoint():
            self.resume()  # under torchft too: a worker whose peers are ahead then recovers from them instead
        if self.comm.fault_tolerant:
            self.join()
        if self.main:
            self._write_config()
        metrics = MetricsWriter(self.out, self.main, self.state.step, cfg.train.log == "tensorboard")
        wall0, start = time.perf_counter(), self.state.step
        try:
            self._loop(metrics)
        finally:
            metrics.close()
        state = self.state
        facts = RunFacts(params=self.models[0].num_params(), tokens_per_step=self.tokens_per_step,
                         unigram_val_ppl=self.data.manifest["unigram_baseline"]["val_ppl"], val_loss=state.val_loss,
                         train_s=state.train_s, skipped=state.skipped, diagnostics=state.diagnostics,
                         out_dir=str(self.out))
        summary = summarize(self.cfg, self.comm, self.optimizer, facts, time.perf_counter() - wall0, start)
        self._write_final(summary)
        return summary

    def _write_final(self, summary: dict[str, Any]) -> None:
        """summary.json and the final model.pt (by the main process; a sharded model's shards are gathered on every
        rank of its worker first)."""
        weights = full_state(self.models[0])
        if not self.main:
            return
        buffer = io.BytesIO()
        torch.save(weights, buffer)
        try:
            atomic_write(self.out / "model.pt", buffer.getvalue())
            write_json(self.out / "summary.json", summary)
        except WriteError as exc:
            latest = self.checkpoints.latest_intact_name()
            kept = f"; the checkpoint {latest} is intact: free space and rerun with --resume {self.out}" if latest else ""
            raise WriteError(f"{exc}{kept}") from None

    def _loop(self, metrics: MetricsWriter) -> None:
        t, start = self.cfg.train, self.state.step
        progress = Progress(t.steps, self.stream, every=max(t.log_every, t.steps // 20), start=start, enabled=self.main)
        if start == 0:
            metrics.write({"step": 0, "tokens": 0, **self.evaluation(), "comm_bytes": 0, "comm_wire_bytes": 0})
        train_s_at_start = self.state.train_s
        try:
            with SignalFlag() as stop:
                for step in range(start + 1, t.steps + 1):
                    stats, lr, stop_requested = self.train_step(step, stop.signum is not None)
                    row = self.metrics_row(step, lr, stats)
                    evaluated = step % t.eval_every == 0 or step == t.steps
                    if evaluated:  # a collective on every process when the workers' average is scored
                        row.update({"step": step, "tokens": step * self.tokens_per_step, **self.evaluation()})
                    if row:
                        # metrics.TIMING_FIELDS: seconds in training steps so far (loss against wall-clock), of which
                        # the training thread waited for collectives
                        row["train_s"], row["comm_blocked_s"] = self.state.train_s, self.comm.ledger.blocked_s
                        row["comm_bytes"] = self.comm.ledger.total_bytes
                        row["comm_wire_bytes"] = self.comm.ledger.total_wire_bytes
                        metrics.write(row)
                    if self.main:  # every step: Progress prints when a line is due (also 30 s after the last one)
                        tps = (step - start) * self.tokens_per_step / max(self.state.train_s - train_s_at_start, 1e-9)
                        if step == start + 1 or evaluated:
                            self._memory_text = self._state_memory_text()
                        progress.update(step, self._progress_text(row, lr, tps), val_ppl=row.get("val_ppl"), force=evaluated)
                    self._checkpoint_if_due(step, stop_requested, stop.signum)
        finally:
            progress.close()
        if start >= t.steps and (self.main or self.sharded):  # resumed a finished run: evaluate the final model again
            self.state.val_loss = evaluate(self.models[0], self.val, self.device)

    # ----------------------------------------------------------------------------------------------- a step

    def train_step(self, step: int, stop_signalled: bool) -> tuple[dict[str, float], float, bool]:
        """Forward, backward and the optimizer step on every hosted worker; returns (diagnostics, lr, whether
        any process asked to stop)."""
        t0 = time.perf_counter()
        # the schedule keeps the length it was laid out for; steps added on resume run at its final lr
        total = self.state.schedule_steps
        lr = self.cfg.optim.lr * lr_factor(min(step, total) - 1, total, self.cfg.schedule) * self.phases.lr_scale(step)
        switched = self.phases.before_step(self.optimizer, step)
        if switched:
            self.log(switched)
        try:
            losses = torch.stack([self._forward_backward(forward, sampler) for forward, sampler in zip(self.forwards, self.samplers)])
        except Exception as exc:
            if not (self.sharded and _is_link_failure(exc)):
                raise
            # FSDP2 gathers the shards in forward and backward: a rank of this worker that died shows up here
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise CommError(f"step {step}: another rank of this worker stopped answering during the forward/backward "
                            f"(FSDP2's gathers of the shards; {type(exc).__name__}: {first}). {self._restart_hint()}") from None
        # one host read per step for every hosted worker; every process must take the same branch
        nonfinite, stop_requested = self.comm.agree([not bool(torch.isfinite(losses).all()), stop_signalled])
        if nonfinite:
            stats = self._skip(step, losses)
        else:
            try:
                if self.scaler is not None:
                    self.scaler.step(self.optimizer, lr=lr)
                    self.scaler.update()
                else:
                    self.optimizer.step(lr=lr)
                stats = dict(self.optimizer.last_stats)
                if step == self.cfg.train.steps:
                    stats.update(self.optimizer.finish())
            except NonFiniteError as exc:
                raise NonFiniteError(f"{exc}; last good checkpoint: {self._last_good()}") from None
            except CommError as exc:
                raise CommError(f"{exc}. {self._restart_hint()}") from None
            self.window += losses.mean()
            self.state.loss_n += 1
            self.state.skipped_in_a_row = 0
        self.state.train_s += time.perf_counter() - t0
        self.state.step = step
        return stats, lr, stop_requested

    def autocast(self):
        """The forward pass's precision: an autocast context for the mixed precisions, else nothing."""
        dtype = PRECISIONS.get(self.precision)
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def _forward_backward(self, forward, sampler) -> torch.Tensor:
        x, y = sampler.next()
        with self.autocast():
            _, loss = forward(x.to(self.device), y.to(self.device))
        # a non-finite loss gives non-finite gradients: the step is then skipped or stopped
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach().float()

    def _skip(self, step: int, losses: torch.Tensor) -> dict[str, float]:
        bad = self._nonfinite_workers(losses)
        if self.cfg.train.on_nonfinite == "stop":
            own = {r: v for r, v in zip(self.comm.local_ranks, losses.tolist())}
            raise NonFiniteError(
                f"the loss is not finite at step {step} on worker(s) {bad} (losses of the workers in this process: "
                f"{own}); last good checkpoint: {self._last_good()}. Lower optim.lr, or set train.on_nonfinite=skip "
                "to skip such steps"
            )
        for m in self.models:  # skip the step on every worker, keep the data position moving
            m.zero_grad(set_to_none=True)
        self.state.skipped += 1
        self.state.skipped_in_a_row += 1
        if self.state.skipped_in_a_row >= self.cfg.train.max_consecutive_skips:
            raise NonFiniteError(
                f"the loss was not finite for {self.state.skipped_in_a_row} steps in a row (up to step {step}): the model "
                f"has diverged; last good checkpoint: {self._last_good()}. Lower optim.lr"
            )
        self.log(f"step {step}: non-finite loss, step skipped on every worker ({self.state.skipped} so far)")
        return {"skipped_nonfinite": 1.0}

    def _nonfinite_workers(self, losses: torch.Tensor) -> list[int]:
        """The workers whose loss was not finite at this step, everywhere alike (one small collective, only on such a
        step; under torchft, where each worker decides alone, this process's own)."""
        flags = torch.zeros(self.comm.world_size, dtype=torch.float64)
        for rank, value in zip(self.comm.local_ranks, losses.tolist()):
            if not math.isfinite(value):
                flags[rank] = 1.0
        if not self.comm.fault_tolerant and self.comm.world_size > 1:
            hosted = [[flags.clone()] for _ in self.comm.local_ranks]
            self.comm.all_reduce_mean(hosted, tag="nonfinite", accounted=False)
            flags = hosted[0][0]
        return [rank for rank, v in enumerate(flags.tolist()) if v > 0]

    # ------------------------------------------------------------------------------------ metrics, evaluation

    def metrics_row(self, step: int, lr: float, stats: dict[str, float]) -> dict[str, Any]:
        """The row to log at this step (empty between log intervals and syncs); closes the loss window."""
        for key in DIAGNOSTICS:
            if key in stats:
                self.state.diagnostics.setdefault(key, []).append(stats[key])
        t = self.cfg.train
        if not (step % t.log_every == 0 or step == t.steps or "synced" in stats or "basis_overlap" in stats):
            return {}
        s = self.state
        if len(self.comm.local_ranks) < self.comm.world_size and not self.comm.fault_tolerant:
            self.comm.all_reduce_mean([[self.window]], tag="train_loss", accounted=False)  # the mean over workers
        s.loss_sum += float(self.window)  # the only read of the training loss
        row = {"step": step, "tokens": step * self.tokens_per_step, "lr": lr,
               "train_loss": s.loss_sum / s.loss_n if s.loss_n else float("nan"), **stats}
        if self.comm.fault_tolerant and "synced" in stats:
            row["workers"] = self.comm.contributors  # who took part in this synchronisation
        s.loss_sum, s.loss_n = 0.0, 0
        self.window.zero_()
        return row

    def evaluation(self) -> dict[str, Any]:
        """Validation loss of the model every worker holds, or of the workers' average between
        synchronisations (``train.eval_model``); row fields, with ``eval_model`` saying which was scored."""
        if self.optimizer.in_sync:
            model, which = self.models[0], "synced"
        elif self.spare is None:
            model, which = self.models[0], f"worker{self.comm.local_ranks[0]}"
        else:
            self.optimizer.average_into(self.spare)  # a collective: every process, every evaluation
            model, which = self.spare, "average"
        if not (self.main or self.sharded):  # a sharded model's forward is a collective of its worker's ranks
            return {}
        with self.autocast():
            self.state.val_loss = evaluate(model, self.val, self.device)
        reshard(model)  # FSDP2 leaves the root's parameters gathered after a forward without backward
        if not self.main:
            return {}
        return {"val_loss": self.state.val_loss, "val_ppl": math.exp(self.state.val_loss), "eval_model": which}

    def _progress_text(self, row: dict[str, Any], lr: float, tokens_per_s: float) -> str:
        # the training loss of the last metrics row, labelled with its step (between rows it stays); none yet: nothing
        if "train_loss" in row:
            self._last_loss = f"loss {row['train_loss']:.3f} (at step {row['step']})  "
        loss = getattr(self, "_last_loss", "")
        memory = getattr(self, "_memory_text", "")
        return f"{loss}lr {lr:.2e}  {tokens_per_s:,.0f} tok/s{memory}"  # the last val_ppl: Progress keeps it

    def _state_memory_text(self) -> str:
        """The optimizer state one worker holds, measured from its tensors, against AdamW's."""
        report = self.optimizer.memory_report()
        return f"  state {report['total'] / 2**20:,.1f} MiB ({report['total'] / report['adamw']:.2f}x AdamW)"

    # ---------------------------------------------------------------------------------- checkpoints, resume

    def _write_config(self) -> None:
        resolved = dict(self.config_dict)
        resolved["derived"] = {"vocab_size": self.data.vocab_size, "params": self.models[0].num_params(),
                               "data": str(self.data.root), "world_size": self.comm.world_size,
                               "communicator": type(self.comm).__name__}
        write_json(self.out / "config.json", resolved)
        tokenizer = self.data.root / "tokenizer.json"
        if tokenizer.is_file():  # the run folder is self-contained: lordo sample / export read it from there
            atomic_write(self.out / "tokenizer.json", tokenizer.read_bytes())


def _is_link_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure (a peer gone, a broken connection), not a bug or a bad input."""
    dist_error = getattr(torch.distributed, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in (
        "Connection closed", "Connection reset", "Gloo", "gloo", "NCCL", "Socket", "peer", "Broken pipe", "timed out"))


__all__ = ["RunState", "Trainer", "build_model", "evaluate", "resolve_device", "train"]
