"""``lordo bench basis``: basis refresh, exact SVD against warm-started subspace iteration, on the pseudo-gradients
of a short real run."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from ..config import build_config
from .timing import print_table, summarize, time_interleaved


def capture_pseudo_gradients(preset: str, steps: int, rank: int, data_dir: str, workers: int = 4,
                             batch_size: int = 4) -> list[dict[str, torch.Tensor]]:
    """Train ``lordo`` on the simulator for ``steps`` steps (K = steps // 2, so two synchronisations) and
    return, for each synchronisation, every low-rank matrix's averaged pseudo-gradient and its basis before."""
    from ..comm import SimCommunicator
    from ..data import prepare
    from ..data.sampler import BatchSampler
    from ..distributed_optimizer import DistributedOptimizer
    from ..model import build_model
    from ..strategies import LoRDOStrategy

    cfg = build_config(overrides=[f'model.preset="{preset}"', 'strategy.name="lordo"', f"strategy.rank={rank}",
                                  f"strategy.sync_every={max(1, steps // 2)}", f"dist.workers={workers}",
                                  f"train.batch_size={batch_size}"])
    data = prepare.ensure(data_dir, cfg.data.vocab_size, cfg.data.val_fraction, log=lambda _: None)
    models = [build_model(cfg, data.vocab_size) for _ in range(workers)]
    opt = DistributedOptimizer(models, cfg, SimCommunicator(workers))
    strategy = opt.strategy
    assert isinstance(strategy, LoRDOStrategy)
    captured: list[dict[str, torch.Tensor]] = []

    def capture(delta):
        bases = [strategy.optimizer(0).state[p]["basis"].clone() for p in strategy.lowrank(0)]  # before the change
        captured.append({"deltas": [delta[i].detach().clone() for i in strategy.lowrank_index], "bases": bases})

    strategy.round_observers.append(capture)
    samplers = [BatchSampler(data.train, cfg.model.seq_len, batch_size, 0, r, workers) for r in range(workers)]
    for _ in range(steps):
        for model, sampler in zip(models, samplers):
            x, y = sampler.next()
            model(x, y)[1].backward()
        opt.step(lr=3e-3)
    return captured


def _must(basis: torch.Tensor | None) -> torch.Tensor:
    if basis is None:
        raise RuntimeError("a basis computation failed")
    return basis


def basis_benchmark(preset: str, rank: int, steps: int, rounds: int, data_dir: str, iters: int = 1,
                    device: torch.device | None = None) -> dict[str, Any]:
    """Exact SVD vs warm-started subspace iteration on the pseudo-gradients of a short run (captured on the
    CPU), timed on ``device``."""
    from ..optim import captured_energy, subspace_iteration_basis, svd_basis

    device = device or torch.device("cpu")
    print(f"training {preset} with lordo for {steps} steps on 4 simulated workers to capture pseudo-gradients ...")
    syncs = capture_pseudo_gradients(preset, steps, rank, data_dir)
    sync = syncs[-1]  # the second synchronisation: the previous basis is a real warm start
    deltas, previous = [d.to(device) for d in sync["deltas"]], [b.to(device) for b in sync["bases"]]
    def exact() -> None:
        for d in deltas:
            svd_basis(d, rank)

    def warm() -> None:
        for d, b in zip(deltas, previous):
            subspace_iteration_basis(d, rank, b, iters=iters)

    fns = {"exact SVD": exact, f"subspace iteration ({iters} it, warm)": warm}
    times = time_interleaved(fns, rounds=rounds, warmup=1, device=device)
    rows = summarize(times, "exact SVD")
    exact_bases = [_must(svd_basis(d, rank)) for d in deltas]
    approx = [_must(subspace_iteration_basis(d, rank, b, iters=iters)) for d, b in zip(deltas, previous)]
    e_exact = [captured_energy(d, b) for d, b in zip(deltas, exact_bases)]
    e_approx = [captured_energy(d, b) for d, b in zip(deltas, approx)]
    e_old = [captured_energy(d, b) for d, b in zip(deltas, previous)]
    ratio = [a / e if e > 0 else 1.0 for a, e in zip(e_approx, e_exact)]
    rows[0]["energy_vs_exact"] = 1.0
    rows[1]["energy_vs_exact"] = statistics.mean(ratio)
    rows[1]["energy_vs_exact_min"] = min(ratio)
    rows[0]["speedup"] = 1.0
    rows[1]["speedup"] = rows[0]["median_ms"] / rows[1]["median_ms"]
    shapes = sorted({tuple(d.shape) for d in deltas})
    print_table(f"basis refresh of {len(deltas)} matrices {shapes} at r = {rank} ({preset}, the pseudo-gradients of "
                f"the second synchronisation), {device}, {rounds} rounds",
                rows, [("name", "method", "s"), ("median_ms", "median ms (all matrices)", ".2f"), ("p25_ms", "p25", ".2f"),
                       ("p75_ms", "p75", ".2f"), ("speedup", "speed-up", ".1f"),
                       ("energy_vs_exact", "captured energy / exact (mean)", ".4f"),
                       ("energy_vs_exact_min", "min", ".4f")])
    print(f"captured energy of the exact top-{rank}: mean {statistics.mean(e_exact):.4f}; of the previous basis "
          f"(no refresh): mean {statistics.mean(e_old):.4f}")
    return {"preset": preset, "rank": rank, "device": str(device), "shapes": shapes, "rows": rows, "energy_exact": e_exact,
            "energy_subspace": e_approx, "energy_previous": e_old}
