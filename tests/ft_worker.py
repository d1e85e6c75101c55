"""One worker of the torchft tests (tests/test_ft.py), started as its own process: a small regression
model trained by lordo over a TorchFTCommunicator. Its settings come as one JSON argument; it writes
``started-<replica>-<incarnation>`` once its Manager is up, ``held-<replica>`` when it waits at ``wait_at``, and
``result-<replica>.json`` at the end."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import lordo
from lordo.comm.ft import TorchFTCommunicator

TEACHER = torch.Generator().manual_seed(123)
TARGET = torch.randn(16, 8, generator=TEACHER) / 4


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)  # the worker's own data, the same on a restart
    x = torch.randn(32, 16, generator=g)
    return x, torch.tanh(x @ TARGET)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    replica, out = cfg["replica"], Path(cfg["out"])
    torch.manual_seed(0)  # every replica starts from the same weights
    width = cfg.get("width", 32)  # 256: large enough that --lean holds the first layer's state in 8 bits
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 8))
    comm = TorchFTCommunicator(cfg["workers"], replica, lighthouse=cfg["lighthouse"], min_workers=cfg["min_workers"],
                               timeout_s=10, quorum_timeout_s=120)
    opt = lordo.distributed(model, cfg["strategy"], backend=comm, lr=cfg.get("lr", 1e-2), rank=4, sync_every=cfg["sync_every"],
                            **cfg.get("options", {}))
    if cfg.get("die_in_round_at"):  # killed inside a round: after the first collective of the one at that step
        reduce = comm._all_reduce_mean

        def dying(per_worker):
            reduce(per_worker)
            if opt.steps_done == cfg["die_in_round_at"]:
                os.kill(os.getpid(), signal.SIGKILL)

        comm._all_reduce_mean = dying
    (out / f"started-{replica}-{cfg['incarnation']}").write_text(str(os.getpid()))
    for name in cfg.get("join_after", []):  # join at a known round: once the others are held at wait_at
        deadline = time.monotonic() + 120
        while not (out / name).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    start = opt.join()
    after_16 = None
    for step in range(start + 1, cfg["steps"] + 1):
        if step == cfg.get("die_at"):
            os.kill(os.getpid(), signal.SIGKILL)  # between two synchronisations, without a word
        if step == cfg.get("wait_at"):  # hold the survivors until the restarted worker is up
            (out / f"held-{replica}").write_text(str(step))
            deadline = time.monotonic() + 120
            while not (out / cfg["wait_for"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        x, y = batch(replica, step)
        loss = nn.functional.mse_loss(model(x), y)
        if not torch.isfinite(loss):
            raise SystemExit(f"non-finite loss at step {step}")
        loss.backward()
        opt.step()
        if step == 16:  # the model every worker holds after the round of step 16
            after_16 = [p.detach().tolist() for p in model.parameters()]
    opt.finish()
    with torch.no_grad():
        x, y = batch(99, 0)
        val = float(nn.functional.mse_loss(model(x), y))
    inner = opt.strategy.optimizer(0) if hasattr(opt.strategy, "optimizer") else None
    bases = [inner.state[p]["basis"].tolist() for p, _ in inner.lowrank_params()] if inner is not None else []
    held = sorted({key for state in inner.state.values() for key in state if key.endswith(".codes")}) if inner else []
    moments = [inner.moment_copy(p, "exp_avg").tolist() for p, _ in inner.lowrank_params()] if inner is not None else []
    result = {"start": start, "after_16": after_16, "val_loss": val, "params": [p.detach().tolist() for p in model.parameters()],
              "bases": bases, "rounds": comm.rounds, "held_compact": held, "lowrank_exp_avg": moments}
    (out / f"result-{replica}.json").write_text(json.dumps(result))
    opt.close()
    comm.close()


if __name__ == "__main__":
    main()
