"""Where the default `lordo` step's CPU time goes: `torch.profiler` over ten `LowRankQHAdam` steps on a preset's
parameters (as `lordo bench step` builds them: fixed random gradients, r = min(p, q)/8), a table of aten ops by
self time. The shares are what docs/performance.md quotes; run it with nothing else on the machine:

    python benchmarks/profile_step.py [--preset small] [--steps 10]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from lordo.bench.step import _model_params
from lordo.config import build_config
from lordo.model import group_parameters
from lordo.strategies import make_lowrank_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    model, groups = _model_params(args.preset, torch.device("cpu"))
    rank = min(min(p.shape) for g in groups if g.rule.matrix for p in g.params) // 8
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    cfg = build_config(overrides=[f'model.preset="{args.preset}"', f"strategy.rank={rank}", 'strategy.name="lordo"'])
    opt = make_lowrank_optimizer(group_parameters(model), cfg.strategy, cfg.optim, omega=cfg.strategy.omega)
    for _ in range(5):
        opt.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            opt.step()
    print(f"{args.preset}, r = {rank}, {args.steps} default steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
