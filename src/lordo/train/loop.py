"""The training loop: sample → forward → backward → ``DistributedOptimizer.step`` → log → evaluate."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from ..api import DistributedOptimizer
from ..comm import make_communicator
from ..config import Config
from ..data import prepare as data_prep
from ..data.sampler import BatchSampler, eval_batches
from ..errors import ConfigError, NonFiniteError, Stopped
from ..model import GPT, GPTConfig, format_groups
from .checkpoint import Checkpointer, config_differences
from .schedule import lr_factor


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(name)


def build_model(cfg: Config, vocab_size: int) -> GPT:
    m = cfg.model
    gpt_cfg = GPTConfig(
        vocab_size=vocab_size,
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        seq_len=m.seq_len,
        ffn_hidden=m.ffn_hidden,
        rope_theta=m.rope_theta,
        norm_eps=m.norm_eps,
        init_std=m.init_std,
    )
    torch.manual_seed(cfg.train.seed)
    return GPT(gpt_cfg)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device) -> float:
    """Mean cross-entropy over the fixed validation batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        _, loss = model(x.to(device), y.to(device))
        total += float(loss)
    model.train(was_training)
    return total / len(batches)


class Progress:
    """A self-updating line on a terminal; plain periodic lines otherwise (logs, CI, pipes)."""

    def __init__(self, total: int, stream: TextIO, every: int) -> None:
        self.total, self.stream, self.every = total, stream, every
        self.tty = stream.isatty()

    def update(self, step: int, text: str, force: bool = False) -> None:
        line = f"step {step:>{len(str(self.total))}}/{self.total}  {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if step == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif force or step % self.every == 0 or step == self.total:
            print(line, file=self.stream, flush=True)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _tensorboard(out: Path, start: int):
    """A TensorBoard writer into OUT/tensorboard; on resume, events after the checkpoint's step are dropped."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ModuleNotFoundError:
        raise ConfigError("train.log = tensorboard needs the tensorboard package: pip install 'lordo[tb]'") from None
    return SummaryWriter(str(out / "tensorboard"), purge_step=start + 1 if start else None)


def _noop(_: str) -> None:
    pass


def _model_to_score(optimizer: DistributedOptimizer, model: torch.nn.Module, spare: torch.nn.Module | None):
    """The model an evaluation scores and its label for metrics.jsonl: ``synced`` (every worker holds it),
    ``average`` (the workers' mean, loaded into ``spare``; a collective on every process) or ``worker0``."""
    if optimizer.in_sync:
        return model, "synced"
    if spare is None:
        return model, "worker0"
    optimizer.average_into(spare)
    return spare, "average"


def train(cfg: Config, out_dir: str | Path, log: Callable[[str], None] = print, stream: TextIO | None = None) -> dict:
    """Run one training job described by ``cfg``; the main process writes config.json, metrics.jsonl and
    summary.json to ``out_dir`` and returns the summary (other processes return it too, without files)."""
    t, d = cfg.train, cfg.dist
    if t.threads:
        torch.set_num_threads(t.threads)
    device = resolve_device(t.device)
    comm = make_communicator(d.backend, d.workers, d.timeout_s, device.type)
    try:
        return _train(cfg, Path(out_dir), comm, device, log, stream if stream is not None else sys.stderr)
    finally:
        comm.close()


class _SignalFlag:
    """Remembers SIGTERM/SIGINT so that the loop can finish the step, save a checkpoint and exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C does not wait for the checkpoint
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _rewrite_metrics(path: Path, upto: int) -> None:
    """Keep the rows of steps <= ``upto`` (those written after the checkpoint are redone on resume)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= upto:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a row cut short by the crash, and everything after it
    path.write_text("".join(k + "\n" for k in kept))


def _train(cfg: Config, out: Path, comm, device: torch.device, log, stream) -> dict:
    t, d = cfg.train, cfg.dist
    if comm.world_size != d.workers and d.workers != 1:
        raise ConfigError(
            f"dist.workers is {d.workers} but the launcher started {comm.world_size} processes; "
            "set dist.workers to the launcher's world size (or leave it at 1 under torchrun)"
        )
    main = comm.is_main
    log = log if main else _noop
    if main:
        out.mkdir(parents=True, exist_ok=True)

    # one process per machine prepares the corpus if needed; the others wait, then open the same files
    if comm.is_node_main:
        data = data_prep.ensure(cfg.data.dir, cfg.data.vocab_size, cfg.data.val_fraction, log=log)
    comm.barrier()
    if not comm.is_node_main:
        data = data_prep.load(data_prep.prepared_dir(cfg.data.dir, cfg.data.vocab_size, cfg.data.val_fraction))

    models = [build_model(cfg, data.vocab_size).to(device) for _ in comm.local_ranks]
    # identical seeds give identical replicas; the optimizer broadcasts worker 0's parameters anyway
    optimizer = DistributedOptimizer(models, cfg, comm)
    log(
        f"model: {cfg.model.preset}, {models[0].num_params():,} parameters, vocab {data.vocab_size}, device {device}; "
        f"strategy {cfg.strategy.name}, {comm.world_size} worker(s) on {type(comm).__name__}"
    )
    log(format_groups(optimizer.groups[0]))
    forwards = [torch.compile(m) if t.compile else m for m in models]
    # between synchronisations the workers' models differ: evaluate their average in a spare replica
    spare = copy.deepcopy(models[0]) if t.eval_model == "average" and comm.world_size > 1 else None
    samplers = [BatchSampler(data.train, cfg.model.seq_len, t.batch_size, t.seed, r, comm.world_size) for r in comm.local_ranks]
    val = eval_batches(data.val, cfg.model.seq_len, t.batch_size, t.eval_batches)
    tokens_per_step = comm.world_size * t.batch_size * cfg.model.seq_len  # over all workers

    config_dict = cfg.to_dict()
    checkpoints = Checkpointer(out, comm, t.keep_checkpoints)
    start, train_s, skipped = 0, 0.0, 0
    resumed_window = (0.0, 0)
    diagnostics: dict[str, list[float]] = {}
    val_loss = float("nan")
    def check_compatible(meta: dict) -> None:
        problems = config_differences(meta["config"], config_dict)
        if meta["world_size"] != comm.world_size:
            problems.append(f"workers: {meta['world_size']} in the checkpoint, {comm.world_size} now")
        if problems:
            raise ConfigError(
                f"{out} holds a checkpoint of a different run (step {meta['step']}); it differs in:\n  "
                + "\n  ".join(problems)
                + "\nuse another --out, or the checkpoint's settings (lordo train --resume DIR reads them)"
            )

    if checkpoints.has_checkpoint():
        meta, shared, workers = checkpoints.load_latest(check_compatible)
        for model, sampler, w in zip(models, samplers, workers, strict=True):
            model.load_state_dict(w["model"])
            sampler.load_state_dict(w["sampler"])
        optimizer.load_state_dict(
            {"shared": shared["strategy"], "workers": [w["strategy"] for w in workers], "ledger": shared["ledger"]}
        )
        torch.set_rng_state(shared["rng"])
        start, train_s, skipped = int(meta["step"]), float(shared["train_s"]), int(shared["skipped"])
        diagnostics = {k: list(v) for k, v in shared["diagnostics"].items()}
        val_loss = float(shared["val_loss"])
        resumed_window = (float(shared["loss_window"][0]), int(shared["loss_window"][1]))
        log(f"resuming from {checkpoints.latest_step_name()} at step {start}")

    def save_checkpoint(step: int) -> Path:
        state = optimizer.state_dict()
        shared_state = {
            "strategy": state["shared"],
            "ledger": state["ledger"],
            "rng": torch.get_rng_state(),
            "train_s": train_s,
            "skipped": skipped,
            "diagnostics": diagnostics,
            "val_loss": val_loss,
            "loss_window": [loss_sum, loss_n],  # the train_loss of the next metrics row averages over it
        }
        workers_state = [
            {"model": m.state_dict(), "sampler": smp.state_dict(), "strategy": ws}
            for m, smp, ws in zip(models, samplers, state["workers"])
        ]
        return checkpoints.save(step, config_dict, shared_state, workers_state)

    def last_good() -> str:
        return checkpoints.latest_step_name() or "none (no checkpoint was saved yet)"

    if main:
        resolved = dict(config_dict)
        resolved["derived"] = {
            "vocab_size": data.vocab_size,
            "params": models[0].num_params(),
            "data": str(data.root),
            "world_size": comm.world_size,
            "communicator": type(comm).__name__,
        }
        _write_json(out / "config.json", resolved)
        if start:
            _rewrite_metrics(out / "metrics.jsonl", start)
        metrics = open(out / "metrics.jsonl", "a" if start else "w")
    else:
        metrics = open(os.devnull, "w")
    board = _tensorboard(out, start) if main and t.log == "tensorboard" else None

    progress = Progress(t.steps, stream, every=max(t.log_every, t.steps // 20))
    if start == 0:
        val_loss = evaluate(models[0], val, device) if main else float("nan")
        metrics.write(json.dumps({"step": 0, "tokens": 0, "val_loss": val_loss, "val_ppl": math.exp(val_loss),
                                  "eval_model": "synced", "comm_bytes": 0}) + "\n")
        if board is not None:
            board.add_scalar("val_loss", val_loss, 0)
            board.add_scalar("val_ppl", math.exp(val_loss), 0)
    wall0, train_s_at_start = time.perf_counter(), train_s
    loss_sum, loss_n = resumed_window
    try:
        with _SignalFlag() as stop:
            for step in range(start + 1, t.steps + 1):
                t0 = time.perf_counter()
                lr = cfg.optim.lr * lr_factor(step - 1, t.steps, cfg.schedule)
                losses = []
                for forward, sampler in zip(forwards, samplers):
                    x, y = sampler.next()
                    _, loss = forward(x.to(device), y.to(device))
                    losses.append(loss.item())
                    if math.isfinite(losses[-1]):
                        loss.backward()
                nonfinite, stop_requested = comm.agree([not all(map(math.isfinite, losses)), stop.signum is not None])
                if nonfinite and t.on_nonfinite == "stop":
                    raise NonFiniteError(
                        f"the loss is not finite at step {step} (worker losses {losses}); last good checkpoint: "
                        f"{last_good()}. Lower optim.lr, or set train.on_nonfinite=skip to skip such steps"
                    )
                if nonfinite:  # skip the step on every worker, keep the data position moving
                    for m in models:
                        m.zero_grad(set_to_none=True)
                    skipped += 1
                    stats: dict[str, float] = {"skipped_nonfinite": 1.0}
                    log(f"step {step}: non-finite loss, step skipped on every worker ({skipped} so far)")
                else:
                    try:
                        stats = optimizer.step(lr)
                        if step == t.steps:
                            stats.update(optimizer.finish())
                    except NonFiniteError as exc:
                        raise NonFiniteError(f"{exc}; last good checkpoint: {last_good()}") from None
                train_s += time.perf_counter() - t0
                finite = [v for v in losses if math.isfinite(v)]
                loss_value = sum(finite) / len(finite) if finite else float("nan")  # mean over hosted workers
                if finite:
                    loss_sum, loss_n = loss_sum + loss_value, loss_n + 1

                for key in ("basis_overlap", "residual_energy", "error_feedback_norm"):
                    if key in stats:
                        diagnostics.setdefault(key, []).append(stats[key])
                row: dict[str, Any] = {}
                if step % t.log_every == 0 or step == t.steps or "synced" in stats or "basis_overlap" in stats:
                    row = {"step": step, "tokens": step * tokens_per_step, "lr": lr}
                    row["train_loss"] = loss_sum / loss_n if loss_n else float("nan")
                    row.update(stats)
                    loss_sum, loss_n = 0.0, 0
                evaluated = step % t.eval_every == 0 or step == t.steps
                if evaluated:
                    scored, which = _model_to_score(optimizer, models[0], spare)
                    if main:
                        val_loss = evaluate(scored, val, device)
                        row.update({"step": step, "tokens": step * tokens_per_step, "val_loss": val_loss,
                                    "val_ppl": math.exp(val_loss), "eval_model": which})
                evaluated = evaluated and main
                if row:
                    row["comm_bytes"] = comm.ledger.total_bytes
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                    if board is not None:
                        for key, value in row.items():
                            if key not in ("step", "synced") and isinstance(value, (int, float)) and math.isfinite(value):
                                board.add_scalar(key, value, step)
                if main:
                    tps = (step - start) * tokens_per_step / max(train_s - train_s_at_start, 1e-9)
                    text = f"loss {loss_value:.3f}  lr {lr:.2e}  {tps:,.0f} tok/s"
                    progress.update(step, text + (f"  val_ppl {math.exp(val_loss):.1f}" if evaluated else ""), force=evaluated)
                periodic = t.checkpoint_every and step % t.checkpoint_every == 0
                if periodic or step == t.steps or stop_requested:
                    metrics.flush()
                    saved = save_checkpoint(step)
                if stop_requested and step < t.steps:
                    name = signal.Signals(stop.signum).name if stop.signum else "a signal on another worker"
                    raise Stopped(
                        f"stopped by {name} after step {step}; checkpoint saved to {saved}. "
                        f"Continue with: lordo train --resume {out}",
                        128 + (stop.signum or signal.SIGTERM),
                    )
            if start >= t.steps and main:  # resumed a finished run: evaluate the final model again
                val_loss = evaluate(models[0], val, device)
    finally:
        metrics.close()
        if board is not None:
            board.close()

    steps_done = t.steps
    ledger = comm.ledger
    # what ddp would send over the same steps (plus the same initial broadcast); nothing with one worker
    init = ledger.entries.get("broadcast:init")
    ddp_bytes = steps_done * optimizer.strategy.step_payload_bytes() + (init.bytes if init else 0) if comm.world_size > 1 else 0
    compute_s = max(0.0, train_s - ledger.comm_s) / len(comm.local_ranks)  # per worker
    summary = {
        "strategy": cfg.strategy.name,
        "model": cfg.model.preset,
        "params": models[0].num_params(),
        "workers": comm.world_size,
        "communicator": type(comm).__name__,
        "sync_every": cfg.strategy.sync_every if cfg.strategy.name != "ddp" else 1,
        "steps": steps_done,
        "tokens": steps_done * tokens_per_step,
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "unigram_val_ppl": data.manifest["unigram_baseline"]["val_ppl"],
        "wall_s": time.perf_counter() - wall0,
        "train_s": train_s,
        "tokens_per_s": steps_done * tokens_per_step / train_s,
        "optimizer_state_bytes": optimizer.strategy.state_bytes(),
        "comm_bytes_total": ledger.total_bytes,
        "comm_bytes_per_step": ledger.total_bytes / steps_done,
        "comm_calls": ledger.total_calls,
        "comm_by_collective": ledger.table(),
        "ddp_comm_bytes": ddp_bytes,
        "comm_ratio_to_ddp": ledger.total_bytes / ddp_bytes if ddp_bytes else None,
        "compute_s_per_worker": compute_s,
        "measured_comm_s": ledger.comm_s,
        "modeled_wall_s": {
            f"{bw:g}gbit": compute_s + ledger.modeled_comm_s(bw * 1e9, cfg.comm.latency_s) for bw in cfg.comm.bandwidths_gbit
        },
        "latency_s": cfg.comm.latency_s,
        "skipped_steps": skipped,
        "resumed_from_step": start,
        "out_dir": str(out),
    }
    for key, values in diagnostics.items():
        summary[f"{key}_mean"] = sum(values) / len(values)
        summary[f"{key}_last"] = values[-1]
    if main:
        torch.save(models[0].state_dict(), out / "model.pt")
        _write_json(out / "summary.json", summary)
    return summary
