"""Parameters sharded by FSDP2 (``fully_shard``, DTensor). LowRankQHAdam steps each rank's shard and ends where
the unsharded optimizer, given the same averaged gradients, ends (gloo, 2 processes); LoRDO with 2 workers,
each sharded over its 2 ranks, ends where the same 2 workers with the whole model on each rank end (4)."""

import pytest
import torch
from torch import nn

from lordo.optim import LowRankQHAdam, fsdp_placement

from harness import gloo_group, run_gloo


class TwoSides(nn.Module):
    """Right- and left-side matrices, one of odd height (uneven shards: FSDP2 splits rows unevenly, columns
    evenly only), and biases (full-rank)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.up = nn.Linear(12, 20)  # weight 20×12: right side, split by rows (10 + 10)
        self.down = nn.Linear(20, 6)  # weight 6×20: left side, split by columns (10 + 10)
        self.out = nn.Linear(6, 7)  # weight 7×6: right side, split by rows (4 + 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.down(torch.tanh(self.up(x)))))


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 12, generator=g), torch.randn(5, 7, generator=g)


def optimizer(model: nn.Module, update_proj_gap: int | None = None, **options) -> LowRankQHAdam:
    """Low-rank matrices whose bases are recomputed from the gradient every ``update_proj_gap`` steps."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    return LowRankQHAdam([{"params": matrices, "rank": 3, "update_proj_gap": update_proj_gap},
                          {"params": vectors, "rank": None}], lr=2e-2, weight_decay=0.1, omega=0.9, **options)


OPTIONS = {
    "subspace, G + E": dict(basis_method="subspace", update_proj_gap=3),
    "svd, G, keep": dict(basis_method="svd", update_proj_gap=2, qh_source="grad", error_feedback_after_qh="keep"),
    "no error feedback": dict(error_feedback=False, update_proj_gap=4),
}


def unsharded(options: dict, world: int, steps: int) -> list[torch.Tensor]:
    """One process, the whole model: each step's gradient is the mean over the ranks' batches, as FSDP's is."""
    model = TwoSides()
    opt = optimizer(model, **options)
    for step in range(steps):
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in (data(r, step) for r in range(world))) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def sharded_worker(options: dict, steps: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with gloo_group():
        rank = dist.get_rank()
        model = TwoSides()
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), shard_placement_fn=fsdp_placement)
        opt = optimizer(model, **options)
        for step in range(steps):
            x, y = data(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        whole = [p.full_tensor().detach().clone() for p in model.parameters()]
        local = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
        return whole, local, opt.state_bytes()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_sharded_step_equals_the_unsharded_optimizer(name):
    options, steps = OPTIONS[name], 7
    results = run_gloo(sharded_worker, 2, options, steps)
    assert all(status == "ok" for status, _ in results.values()), results
    reference = unsharded(options, 2, steps)
    start = [p.detach() for p in TwoSides().parameters()]
    for rank in (0, 1):
        whole, local, _ = results[rank][1]
        for got, want, before in zip(whole, reference, start, strict=True):
            assert not torch.equal(want, before)  # the step moved every tensor
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert results[0][1][1]["up.weight"] == (10, 12) and results[0][1][1]["down.weight"] == (6, 10)
    assert results[0][1][1]["out.weight"] == (4, 6) and results[1][1][1]["out.weight"] == (3, 6)
    # the state a rank holds is its shards': rank 0 has up 10×12 (moments 10×3), down 6×10 (3×10), out 4×6
    # (4×3); the bases are whole (12×3, 6×3, 6×3); biases 10, 3 and 4
    state = results[0][1][2]
    assert state["lowrank_moments"] == 2 * (10 * 3 + 3 * 10 + 4 * 3) * 4
    assert state["bases"] == (12 * 3 + 6 * 3 + 6 * 3) * 4
    assert state["full_rank_moments"] == 2 * (10 + 3 + 4) * 4
    assert state["error_feedback"] == (0 if name == "no error feedback" else (10 * 12 + 6 * 10 + 4 * 6) * 4
                                       + (10 * 3 + 3 * 10 + 4 * 3) * 4 * (options.get("qh_source") != "grad"))


class Wide(nn.Module):
    """Shards large enough to be held in 8 bits (each rank's at least 4,096 entries, low-rank moments 1,024): a
    right-side matrix split by rows, a left-side one split by columns, a full-rank head split by rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.up, self.down, self.head = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 160)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.down(torch.tanh(self.up(x)))))


def wide_data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(32, 64, generator=g), torch.randn(32, 160, generator=g)  # gradients of rank 64 > r: one basis


def wide_optimizer(model: nn.Module, **options) -> LowRankQHAdam:
    low = [model.up.weight, model.down.weight]
    full = [p for p in model.parameters() if all(p is not q for q in low)]
    return LowRankQHAdam([{"params": low, "rank": 16}, {"params": full, "rank": None}], lr=2e-2, omega=0.9,
                         basis_method="subspace", **options)


LEAN_OPTIMIZER = dict(error_feedback_dtype="int8", moments_dtype="int8", lowrank_moments_dtype="int8")


def lean_sharded_worker(steps: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with gloo_group():
        model = Wide()
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), shard_placement_fn=fsdp_placement)
        opt = wide_optimizer(model, **LEAN_OPTIMIZER)
        out = []
        for step in range(steps):
            x, y = wide_data(dist.get_rank(), step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step in (0, steps - 1):
                out.append([p.full_tensor().detach().clone() for p in model.parameters()])
        codes = {name: sorted(k for k in opt.state[p] if k.endswith(".codes")) for name, p in model.named_parameters()}
        return out, codes


def test_the_lean_state_on_sharded_parameters_stays_within_its_rounding_of_float32():
    """Each rank holds its shards' error feedback and moments in 8 bits (blocks of its own shard, its own stochastic
    rounding): the first step, from zero state, equals float32's; six steps later every tensor is within 5 % of
    its movement of the unsharded float32 optimizer's (the rounding's order here: 1-2 %)."""
    steps = 6
    results = run_gloo(lean_sharded_worker, 2, steps)
    assert all(status == "ok" for status, _ in results.values()), results
    model, opt, reference = Wide(), None, []
    opt = wide_optimizer(model)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        sum(nn.functional.mse_loss(model(x), y) for x, y in (wide_data(r, step) for r in range(2))).div(2).backward()
        opt.step()
        opt.zero_grad()
        if step in (0, steps - 1):
            reference.append([p.detach().clone() for p in model.parameters()])
    (first, last), codes = results[0][1]
    for got, want in zip(first, reference[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want, before in zip(last, reference[1], start, strict=True):
        assert float((got - want).norm() / (want - before).norm()) < 0.05
    moments = ["exp_avg.codes", "exp_avg_sq.codes"]
    assert codes["up.weight"] == codes["down.weight"] == sorted([*moments, "error_feedback.codes"])
    assert codes["head.weight"] == moments and codes["head.bias"] == []  # 80 entries a rank: float32


def wrong_placement_worker():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with gloo_group():
        model = TwoSides()
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))  # Shard(0) for every matrix
        try:
            optimizer(model)
        except ValueError as exc:
            return str(exc)
        return "no error"


def test_a_left_side_matrix_split_by_rows_is_refused_with_the_fix():
    results = run_gloo(wrong_placement_worker, 2)
    message = results[0][1]
    assert results[0][0] == "ok", results
    assert "low-rank 6×20 matrix is split along dimension 0" in message
    assert "shard_placement_fn=lordo.optim.fsdp_placement" in message


def test_without_torch_distributed_imported_nothing_is_sharded():
    from lordo.optim.sharded import is_sharded, local

    t = torch.ones(2, 3)
    assert not is_sharded(t) and local(t) is t


def lordo_worker(name: str, ranks_per_worker: int, shard: bool, steps: int, options: dict):
    """Worker w (ranks w·R … w·R + R − 1) trains on its 4 sequences of each step, split between its ranks;
    ``shard``: the model sharded over them with FSDP2, else whole on each."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import lordo

    from harness import batch, tiny_model

    with gloo_group():
        rank, r = dist.get_rank(), ranks_per_worker
        mesh = lordo.worker_mesh(r) if shard else None
        model, spare = tiny_model(), tiny_model()
        if shard:
            fully_shard(model, mesh=mesh, shard_placement_fn=fsdp_placement)
            fully_shard(spare, mesh=mesh, shard_placement_fn=fsdp_placement)
        opt = lordo.distributed(model, name, lr=1e-2, sync_every=3, backend="gloo", timeout_s=60, ranks_per_worker=r,
                                **options)
        worker, member, part = rank // r, rank % r, 4 // r
        try:
            for step in range(steps):
                x, y = batch(worker, step, size=4)
                model(x[member * part:(member + 1) * part], y[member * part:(member + 1) * part])[1].backward()
                opt.step()
            with torch.no_grad():  # evaluations (FSDP2 keeps the root's parameters gathered after them)
                model(x, y), spare(x, y)
            opt.average_into(spare)  # between synchronisations: the workers' mean
            mean = [(p.full_tensor() if shard else p).detach().clone() for p in spare.parameters()]
            stats = opt.finish()
            whole = [(p.full_tensor() if shard else p).detach().clone() for p in model.parameters()]
            counters = [t for state in opt.strategy.workers[0].optimizer.state.values() for t in state.values()
                        if isinstance(t, torch.Tensor) and t.ndim == 0]  # step counts: every rank holds its own
            return whole, opt.ledger.table(), stats, opt.memory_report(), mean, sum(t.element_size() for t in counters)
        finally:
            opt.close()


STRATEGIES = {"lordo": {"rank": 2}, "lordo-local": {"rank": 2},
              "local-adam": {"average_moments": "all"}}  # torch's AdamW on DTensors, its moments averaged


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_workers_sharded_over_their_ranks_equal_workers_whose_ranks_hold_the_whole_model(name):
    steps = 7  # synchronisations after steps 3 and 6 and a final one after 7
    options = STRATEGIES[name]
    whole = run_gloo(lordo_worker, 4, name, 2, False, steps, options)  # the same split of each batch, whole models
    sharded = run_gloo(lordo_worker, 4, name, 2, True, steps, options)
    assert all(status == "ok" for status, _ in [*whole.values(), *sharded.values()]), (whole, sharded)
    reference = whole[0][1][0]
    for rank in range(4):
        params, _, final, _, mean, _ = sharded[rank][1]
        for got, want in zip(params, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(mean, whole[0][1][4], strict=True):  # average_into after an evaluation
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        stats = whole[rank][1][2]  # its worker's (error feedback is each worker's own)
        for key in ("pseudo_grad_norm", "basis_overlap", "residual_energy", "error_feedback_norm"):
            if key in stats:  # over the whole matrices, not a shard
                assert final[key] == pytest.approx(stats[key], rel=1e-4), key
    for w in (0, 1):  # a worker's ranks each send their shards: together what one whole worker sends
        mine, other = sharded[2 * w][1][1], sharded[2 * w + 1][1][1]
        for tag, entry in whole[2 * w][1][1].items():  # its leader's ledger
            assert mine[tag]["calls"] == entry["calls"] == other[tag]["calls"], tag
            assert mine[tag]["bytes"] + other[tag]["bytes"] == entry["bytes"], tag
    # and hold between them one whole worker's state, but for the bases and the step counts, which each rank
    # holds whole
    memory, halves = whole[0][1][3], [sharded[rank][1][3] for rank in (0, 1)]
    counters = whole[0][1][5]
    assert counters > 0 and counters == sharded[0][1][5] == sharded[1][1][5]
    extra = {key: halves[0][key] + halves[1][key] - memory[key] for key in memory.keys() - {"bases", "total",
                                                                                          "device_total"}}
    assert extra.pop("adamw") == 0 and sum(extra.values()) == counters, extra
    assert all(more >= 0 for more in extra.values()), extra
    assert halves[0].get("bases") == halves[1].get("bases") == memory.get("bases")


def refusals_worker():
    from torch.distributed.fsdp import fully_shard

    import lordo

    from harness import tiny_model

    with gloo_group():
        model = tiny_model()
        fully_shard(model, mesh=lordo.worker_mesh(2), shard_placement_fn=fsdp_placement)
        partly = tiny_model()
        fully_shard(partly.blocks[0], mesh=lordo.worker_mesh(2), shard_placement_fn=fsdp_placement)  # not the root
        messages = []
        for m, strategy, ranks_per_worker in ((model, "ddp", 2), (model, "lordo", 1), (partly, "lordo", 2)):
            try:
                lordo.distributed(m, strategy, backend="gloo", ranks_per_worker=ranks_per_worker, timeout_s=60)
                messages.append("no error")
            except lordo.ConfigError as exc:
                messages.append(str(exc))
        return messages


def test_what_a_sharded_model_cannot_do_is_refused_by_name():
    results = run_gloo(refusals_worker, 2)
    assert results[0][0] == "ok", results
    ddp, one_rank, partly = results[0][1]
    assert "strategy 'ddp' averages gradients between workers every step" in ddp and "lordo-local" in ddp
    assert "sharded over ranks [0, 1], but this process's worker is ranks [0]" in one_rank
    assert "lordo.worker_mesh(ranks_per_worker)" in one_rank
    assert "the model is sharded in part: tok_emb.weight" in partly and "apply fully_shard to the root module" in partly


def resumed_worker(steps: int, stop_at: int | None, options: dict, d_model: int):
    """2 workers of 2 ranks, sharded; ``stop_at``: save every rank's state there, rebuild the model and the
    optimizer from scratch, load it, go on. Returns the final model and the state keys of worker 0's optimizer."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import lordo

    from harness import batch, tiny_model

    def build():
        model = tiny_model(d_model=d_model)
        fully_shard(model, mesh=lordo.worker_mesh(2), shard_placement_fn=fsdp_placement)
        return model, lordo.distributed(model, "lordo", lr=1e-2, sync_every=3, backend="gloo", timeout_s=60,
                                        ranks_per_worker=2, **({"rank": 2} | options))

    with gloo_group():
        rank = dist.get_rank()
        model, opt = build()
        try:
            for step in range(steps):
                if step == stop_at:
                    saved_model = {k: v.to_local().clone() for k, v in model.state_dict().items()}
                    saved = opt.state_dict()
                    opt.close()
                    model, opt = build()
                    for k, v in model.state_dict().items():
                        v.to_local().copy_(saved_model[k])
                    opt.load_state_dict(saved)
                x, y = batch(rank // 2, step, size=4)
                model(x[rank % 2 * 2:rank % 2 * 2 + 2], y[rank % 2 * 2:rank % 2 * 2 + 2])[1].backward()
                opt.step()
            opt.finish()
            keys = {key for state in opt.strategy.workers[0].optimizer.state.values() for key in state}
            return [p.full_tensor().detach().clone() for p in model.parameters()], keys
        finally:
            opt.close()


# the lean state in 8 bits (anchor, error feedback, full-rank and low-rank moments), on a model wide enough that each
# rank's shards are held compact: the embedding and head's moments (31 × 160 rows), the MLP's E and low-rank moments
LEAN = {"memory": "lean", "lowrank_moments_dtype": "int8", "rank": 16}
RESUMED = {"float32": ({}, 16), "lean": (LEAN, 160)}


@pytest.mark.parametrize("name", list(RESUMED))
def test_a_sharded_run_resumes_exactly_from_each_ranks_state(name):
    options, d_model = RESUMED[name]
    straight = run_gloo(resumed_worker, 4, 7, None, options, d_model)
    resumed = run_gloo(resumed_worker, 4, 7, 4, options, d_model)  # between syncs: local models differ from the anchor
    assert all(status == "ok" for status, _ in [*straight.values(), *resumed.values()]), (straight, resumed)
    for rank in range(4):
        for a, b in zip(resumed[rank][1][0], straight[rank][1][0], strict=True):
            assert torch.equal(a, b)
    held = {key for key in straight[0][1][1] if key.endswith(".codes")}
    assert held == ({"exp_avg.codes", "exp_avg_sq.codes", "error_feedback.codes"} if options else set())
