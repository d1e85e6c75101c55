"""The training loop: sample → forward → backward → ``strategy.step`` → log → evaluate."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from ..config import Config
from ..data import prepare as data_prep
from ..data.sampler import BatchSampler, eval_batches
from ..model import GPT, GPTConfig, format_groups, group_parameters
from ..strategies import build_strategy
from .schedule import lr_factor


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from ..errors import ConfigError

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


def train(cfg: Config, out_dir: str | Path, log: Callable[[str], None] = print, stream: TextIO | None = None) -> dict:
    """Run one training job described by ``cfg``; writes config.json, metrics.jsonl, summary.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stream = stream if stream is not None else sys.stderr
    t, s = cfg.train, cfg.strategy
    if t.threads:
        torch.set_num_threads(t.threads)
    device = resolve_device(t.device)

    data = data_prep.ensure(cfg.data.dir, cfg.data.vocab_size, cfg.data.val_fraction, log=log)
    model = build_model(cfg, data.vocab_size).to(device)
    groups = group_parameters(model)
    log(f"model: {cfg.model.preset}, {model.num_params():,} parameters, vocab {data.vocab_size}, device {device}")
    log(format_groups(groups))
    strategy = build_strategy(cfg, model, groups)
    forward = torch.compile(model) if t.compile else model

    sampler = BatchSampler(data.train, cfg.model.seq_len, t.batch_size, t.seed)
    val = eval_batches(data.val, cfg.model.seq_len, t.batch_size, t.eval_batches)
    tokens_per_step = t.batch_size * cfg.model.seq_len

    resolved = cfg.to_dict()
    resolved["derived"] = {"vocab_size": data.vocab_size, "params": model.num_params(), "data": str(data.root)}
    _write_json(out / "config.json", resolved)

    progress = Progress(t.steps, stream, every=max(t.log_every, t.steps // 20))
    metrics = open(out / "metrics.jsonl", "w")
    val_loss = evaluate(model, val, device)
    metrics.write(json.dumps({"step": 0, "tokens": 0, "val_loss": val_loss, "val_ppl": math.exp(val_loss)}) + "\n")
    train_s = 0.0
    wall0 = time.perf_counter()
    loss_sum, loss_n = 0.0, 0
    try:
        for step in range(1, t.steps + 1):
            t0 = time.perf_counter()
            lr = cfg.optim.lr * lr_factor(step - 1, t.steps, cfg.schedule)
            x, y = sampler.next()
            _, loss = forward(x.to(device), y.to(device))
            loss.backward()
            stats = strategy.step(lr)
            loss_value = loss.item()
            train_s += time.perf_counter() - t0
            loss_sum, loss_n = loss_sum + loss_value, loss_n + 1

            row: dict[str, Any] = {}
            if step % t.log_every == 0 or step == t.steps:
                row = {"step": step, "tokens": step * tokens_per_step, "train_loss": loss_sum / loss_n, "lr": lr}
                row.update(stats)
                loss_sum, loss_n = 0.0, 0
            evaluated = step % t.eval_every == 0 or step == t.steps
            if evaluated:
                val_loss = evaluate(model, val, device)
                row.update(
                    {"step": step, "tokens": step * tokens_per_step, "val_loss": val_loss, "val_ppl": math.exp(val_loss)}
                )
            if row:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            tps = step * tokens_per_step / train_s
            text = f"loss {loss_value:.3f}  lr {lr:.2e}  {tps:,.0f} tok/s"
            progress.update(step, text + (f"  val_ppl {math.exp(val_loss):.1f}" if evaluated else ""), force=evaluated)
    finally:
        metrics.close()

    steps_done = t.steps
    summary = {
        "strategy": s.name,
        "model": cfg.model.preset,
        "params": model.num_params(),
        "steps": steps_done,
        "tokens": steps_done * tokens_per_step,
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "unigram_val_ppl": data.manifest["unigram_baseline"]["val_ppl"],
        "wall_s": time.perf_counter() - wall0,
        "train_s": train_s,
        "tokens_per_s": steps_done * tokens_per_step / train_s,
        "optimizer_state_bytes": strategy.state_bytes(),
        "out_dir": str(out),
    }
    _write_json(out / "summary.json", summary)
    return summary
