"""The training loop: sample → forward → backward → ``strategy.step`` → log → evaluate."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from ..comm import make_communicator
from ..config import Config
from ..errors import ConfigError
from ..data import prepare as data_prep
from ..data.sampler import BatchSampler, eval_batches
from ..model import GPT, GPTConfig, format_groups, group_parameters
from ..strategies import build_strategy
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


def _noop(_: str) -> None:
    pass


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
    # identical seeds give identical replicas; the broadcast makes it so on mixed machines too
    comm.broadcast([[p.data for p in m.parameters()] for m in models], tag="init")
    groups = [group_parameters(m) for m in models]
    log(
        f"model: {cfg.model.preset}, {models[0].num_params():,} parameters, vocab {data.vocab_size}, device {device}; "
        f"strategy {cfg.strategy.name}, {comm.world_size} worker(s) on {type(comm).__name__}"
    )
    log(format_groups(groups[0]))
    strategy = build_strategy(cfg, models, groups, comm)
    forwards = [torch.compile(m) if t.compile else m for m in models]
    samplers = [BatchSampler(data.train, cfg.model.seq_len, t.batch_size, t.seed, r, comm.world_size) for r in comm.local_ranks]
    val = eval_batches(data.val, cfg.model.seq_len, t.batch_size, t.eval_batches)
    tokens_per_step = comm.world_size * t.batch_size * cfg.model.seq_len  # over all workers

    if main:
        resolved = cfg.to_dict()
        resolved["derived"] = {
            "vocab_size": data.vocab_size,
            "params": models[0].num_params(),
            "data": str(data.root),
            "world_size": comm.world_size,
            "communicator": type(comm).__name__,
        }
        _write_json(out / "config.json", resolved)
        metrics = open(out / "metrics.jsonl", "w")
    else:
        metrics = open(os.devnull, "w")

    progress = Progress(t.steps, stream, every=max(t.log_every, t.steps // 20))
    val_loss = evaluate(models[0], val, device) if main else float("nan")
    metrics.write(json.dumps({"step": 0, "tokens": 0, "val_loss": val_loss, "val_ppl": math.exp(val_loss), "comm_bytes": comm.ledger.total_bytes}) + "\n")
    train_s = 0.0
    wall0 = time.perf_counter()
    loss_sum, loss_n = 0.0, 0
    diagnostics: dict[str, list[float]] = {}
    try:
        for step in range(1, t.steps + 1):
            t0 = time.perf_counter()
            lr = cfg.optim.lr * lr_factor(step - 1, t.steps, cfg.schedule)
            losses = []
            for forward, sampler in zip(forwards, samplers):
                x, y = sampler.next()
                _, loss = forward(x.to(device), y.to(device))
                loss.backward()
                losses.append(loss.item())
            stats = strategy.step(lr)
            if step == t.steps:
                stats.update(strategy.finish())
            train_s += time.perf_counter() - t0
            loss_value = sum(losses) / len(losses)  # mean over the workers this process hosts
            loss_sum, loss_n = loss_sum + loss_value, loss_n + 1

            for key in ("basis_overlap", "residual_energy"):
                if key in stats:
                    diagnostics.setdefault(key, []).append(stats[key])
            row: dict[str, Any] = {}
            if step % t.log_every == 0 or step == t.steps or "synced" in stats or "basis_overlap" in stats:
                row = {"step": step, "tokens": step * tokens_per_step, "train_loss": loss_sum / loss_n, "lr": lr}
                row.update(stats)
                loss_sum, loss_n = 0.0, 0
            evaluated = main and (step % t.eval_every == 0 or step == t.steps)
            if evaluated:
                # worker 0's model; it equals the global model at synchronisation steps and at the end
                val_loss = evaluate(models[0], val, device)
                row.update({"step": step, "tokens": step * tokens_per_step, "val_loss": val_loss, "val_ppl": math.exp(val_loss)})
            if row:
                row["comm_bytes"] = comm.ledger.total_bytes
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            if main:
                tps = step * tokens_per_step / train_s
                text = f"loss {loss_value:.3f}  lr {lr:.2e}  {tps:,.0f} tok/s"
                progress.update(step, text + (f"  val_ppl {math.exp(val_loss):.1f}" if evaluated else ""), force=evaluated)
    finally:
        metrics.close()

    steps_done = t.steps
    ledger = comm.ledger
    ddp_bytes = steps_done * strategy.step_payload_bytes() + ledger.entries["broadcast:init"].bytes
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
        "optimizer_state_bytes": strategy.state_bytes(),
        "comm_bytes_total": ledger.total_bytes,
        "comm_bytes_per_step": ledger.total_bytes / steps_done,
        "comm_calls": ledger.total_calls,
        "comm_by_collective": ledger.table(),
        "ddp_comm_bytes": ddp_bytes,
        "comm_ratio_to_ddp": ledger.total_bytes / ddp_bytes,
        "compute_s_per_worker": compute_s,
        "measured_comm_s": ledger.comm_s,
        "modeled_wall_s": {
            f"{bw:g}gbit": compute_s + ledger.modeled_comm_s(bw * 1e9, cfg.comm.latency_s) for bw in cfg.comm.bandwidths_gbit
        },
        "latency_s": cfg.comm.latency_s,
        "out_dir": str(out),
    }
    for key, values in diagnostics.items():
        summary[f"{key}_mean"] = sum(values) / len(values)
    if main:
        torch.save(models[0].state_dict(), out / "model.pt")
        _write_json(out / "summary.json", summary)
    return summary
