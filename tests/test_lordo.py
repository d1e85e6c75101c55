"""LoRDO's strategies: stagnation and its cure, simulator = gloo, resume, accounting, bad options."""

import io

import pytest
import torch

from lordo.comm import SimCommunicator
from lordo.errors import ConfigError, NonFiniteError
from lordo.model import group_parameters
from lordo.strategies import build_strategy

from harness import (
    assert_simulator_equals_gloo,
    batch,
    run_gloo,
    run_strategy,
    strategy_config,
    tiny_model,
)

LOWRANK = ["strategy.rank=2", "strategy.sync_every=3"]


def make(name, overrides=(), workers=2):
    cfg = strategy_config(name, [*LOWRANK, *overrides])
    models = [tiny_model() for _ in range(workers)]
    comm = SimCommunicator(workers)
    return models, build_strategy(cfg, models, [group_parameters(m) for m in models], comm), comm


def train_steps(models, strategy, start, stop, lr=1e-2, fixed=False):
    """Steps [start, stop) on fresh random batches, or on one fixed batch per worker (learnable)."""
    stats = []
    for step in range(start, stop):
        for rank, model in enumerate(models):
            model(*batch(rank, 0 if fixed else step))[1].backward()
        stats.append(strategy.step(lr))
    return stats


@pytest.mark.parametrize("name", ["lordo", "lordo-global-noqh", "lordo-local", "lowrank-ddp"])
def test_every_strategy_trains_and_keeps_workers_in_step(name):
    models, strategy, _ = make(name)
    x, y = batch(0, 0)
    before = models[0](x, y)[1].item()
    train_steps(models, strategy, 0, 12, lr=3e-2, fixed=True)
    strategy.finish()
    assert models[0](x, y)[1].item() < before - 0.3
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def block_matrices(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2}


def numerical_rank(m):
    s = torch.linalg.svdvals(m.double())
    return int((s > 1e-6 * s[0]).sum())


def test_global_projection_without_qh_stagnates_and_qh_cures_it():
    """The paper's central observation: with ω = 1 every update lies in span(P), so the pseudo-gradient does,
    so its top-r basis is P again (overlap 1) and after many syncs the change of each matrix still has rank
    ≤ r on the low-rank side. With ω < 1 the full-rank term moves the basis and the change is full-rank."""
    results = {}
    for name in ("lordo-global-noqh", "lordo"):
        models, strategy, _ = make(name, ["optim.weight_decay=0", "strategy.omega=0.9"])
        start = block_matrices(models[0])
        stats = train_steps(models, strategy, 0, 15)
        overlaps = [s["basis_overlap"] for s in stats if "basis_overlap" in s]
        assert len(overlaps) == 5
        end = block_matrices(models[0])
        ranks = [numerical_rank(end[n] - start[n]) for n in start]
        results[name] = (overlaps, ranks, [s["residual_energy"] for s in stats if "residual_energy" in s])
    overlaps, ranks, residual = results["lordo-global-noqh"]
    assert min(overlaps) > 1 - 1e-4
    assert max(ranks) <= 2
    assert max(residual) < 1e-6
    overlaps, ranks, residual = results["lordo"]
    assert max(overlaps) < 0.999 and min(overlaps) < 0.98
    assert min(ranks) > 2
    assert min(residual) > 1e-3


@pytest.mark.parametrize("name, extra", [
    ("lordo", []), ("lowrank-ddp", []),
    # the research code's step: momentum term, E kept and averaged, exact SVD
    ("lordo", ["strategy.lowrank_term=momentum", "strategy.average_error_feedback=true",
               "strategy.error_feedback_after_qh=keep", "strategy.basis_method=svd"]),
    # int4 rounds with both residuals folded into the models: each shard owner folds its re-encoding's loss into
    # its own model, at the shard the collectives gave it
    ("lordo", ['strategy.compress="int4"', 'strategy.compress_residual="model"']),
])
def test_simulator_and_gloo_give_the_same_trajectory(name, extra):
    assert_simulator_equals_gloo(name, [*LOWRANK, *extra])


def gloo_bases_worker():
    from lordo.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator("gloo", timeout_s=60)
    try:
        cfg = strategy_config("lordo", LOWRANK)
        model = tiny_model()
        strategy = build_strategy(cfg, [model], [group_parameters(model)], comm)
        for step in range(7):
            model(*batch(comm.rank, step))[1].backward()
            strategy.step(1e-2)
        opt = strategy.optimizers[0]
        return [opt.state[p]["basis"].clone() for p, _ in opt.lowrank_params()]
    finally:
        comm.close()


def test_global_bases_are_bitwise_identical_on_every_gloo_worker():
    results = run_gloo(gloo_bases_worker, 2)
    assert all(status == "ok" for status, _ in results.values()), results
    a, b = results[0][1], results[1][1]
    assert len(a) == 7
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["lordo", "lordo-local", "lowrank-ddp"])
def test_resume_from_state_dict_mid_round_equals_uninterrupted(name):
    models, strategy, _ = make(name)
    train_steps(models, strategy, 0, 10)
    strategy.finish()
    reference = [p.detach().clone() for p in models[0].parameters()]

    models, strategy, _ = make(name)
    train_steps(models, strategy, 0, 4)  # stop between syncs (K = 3)
    buf = io.BytesIO()
    torch.save({"models": [m.state_dict() for m in models], "strategy": strategy.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    models, strategy, _ = make(name)
    for m, s in zip(models, saved["models"]):
        m.load_state_dict(s)
    strategy.load_state_dict(saved["strategy"])
    train_steps(models, strategy, 4, 10)
    strategy.finish()
    for a, b in zip(reference, models[0].parameters()):
        assert torch.equal(a, b)


def shapes_of_lowrank(model):
    return [p.shape for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]


def test_ledger_of_lordo_and_lowrank_ddp_by_hand():
    model = tiny_model()
    n_all = sum(p.numel() for p in model.parameters())
    low = shapes_of_lowrank(model)
    n_low = sum(s[0] * s[1] for s in low)
    r = 2
    low_moment = sum(max(s) * r for s in low)  # one moment: p×r (right) or r×q (left), the big side times r
    _, ledger = run_strategy(SimCommunicator(2), strategy_config("lordo", LOWRANK), steps=7)
    assert ledger["all_reduce:initial_basis_gradient"]["bytes"] == 4 * n_low
    assert ledger["all_reduce:pseudo_gradient"] == {"calls": 3, "bytes": 3 * 4 * n_all, "tensors": 3 * 11,
                                                    "wire": 3 * 4 * n_all}  # 2 workers: 2(M-1)/M = 1
    # low-rank moments averaged at the two syncs on the K-grid (the final sync at step 7 does not)
    assert ledger["all_reduce:exp_avg"]["bytes"] == 2 * 4 * low_moment
    assert ledger["all_reduce:exp_avg_sq"]["bytes"] == 2 * 4 * low_moment

    _, ledger = run_strategy(SimCommunicator(2), strategy_config("lowrank-ddp", LOWRANK), steps=7)
    n_full = n_all - n_low
    assert ledger["all_reduce:projected_gradient"]["bytes"] == 7 * 4 * (low_moment + n_full)
    assert ledger["all_reduce:basis_gradient"] == {"calls": 3, "bytes": 3 * 4 * n_low, "tensors": 3 * 7,
                                                   "wire": 3 * 4 * n_low}  # steps 1, 4, 7

    _, ledger = run_strategy(SimCommunicator(2), strategy_config("lordo-local", LOWRANK), steps=7)
    assert set(ledger) == {"all_reduce:pseudo_gradient"}  # local bases, local moments


def test_memory_by_category():
    models, strategy, _ = make("lordo")
    low = shapes_of_lowrank(models[0])
    n_all = sum(p.numel() for p in models[0].parameters())
    n_low = sum(s[0] * s[1] for s in low)
    got = strategy.state_bytes()
    assert got["lowrank_moments"] == 4 * 2 * sum(max(s) * 2 for s in low)
    assert got["full_rank_moments"] == 4 * 2 * (n_all - n_low)
    assert got["bases"] == 4 * sum(min(s) * 2 for s in low)
    assert got["error_feedback"] == 4 * n_low + 4 * sum(max(s) * 2 for s in low)  # E and proj(E), one moment's size
    assert got["anchor"] == 4 * n_all


@pytest.mark.parametrize("override, message", [
    ("strategy.rank=17", r"strategy.rank must be in \[1, 16\] for blocks.0.attn.q.weight \(16, 16\)"),
    ("strategy.rank=0", r"strategy.rank must be > 0, got 0"),
    ("strategy.omega=1.2", r"strategy.omega must be in \[0, 1\] \(or -1: automatic\), got 1.2"),
    ("strategy.sync_every=0", r"strategy.sync_every must be > 0, got 0"),
    ("strategy.lowrank_pattern=nothing_matches", r"matches no 2-D parameter"),
    ("strategy.lowrank_pattern=\"(\"", r"strategy.lowrank_pattern is not a valid regular expression"),
])
def test_bad_options_give_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        make("lordo", [override])


@pytest.mark.parametrize("name", ["local-adam", "lordo"])
def test_a_failed_synchronisation_rolls_every_replica_back_to_the_anchor(name):
    """A non-finite averaged pseudo-gradient raises, and every worker then holds the model of the previous
    synchronisation again (not the averaged pseudo-gradient its parameters held during the sync)."""
    models, strategy, _ = make(name)
    train_steps(models, strategy, 0, 3)  # one sync (K = 3)
    synced = [p.detach().clone() for p in strategy.workers[0].params]
    train_steps(models, strategy, 3, 5)
    with torch.no_grad():
        strategy.workers[1].params[0].view(-1)[0] = float("inf")
    for rank, model in enumerate(models):
        model(*batch(rank, 5))[1].backward()
    with pytest.raises(NonFiniteError, match="reset to the model of the previous synchronisation"):
        strategy.step(1e-2)
    for w in strategy.workers:
        for a, b, c in zip(w.params, synced, strategy.anchor, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("name", ["local-adam", "lordo"])
def test_a_failed_synchronisation_says_when_the_optimizer_state_must_be_reloaded(name):
    """A non-finite gradient reaches the moments (and the error feedback); the model is rolled back, the state is not,
    so every later synchronisation would fail again: the error names the workers whose state must be reloaded."""
    models, strategy, _ = make(name)
    train_steps(models, strategy, 0, 4)
    for rank, model in enumerate(models):
        model(*batch(rank, 4))[1].backward()
    next(iter(strategy.workers[1].params)).grad.view(-1)[0] = float("nan")
    strategy.step(1e-2)  # step 5
    for rank, model in enumerate(models):
        model(*batch(rank, 5))[1].backward()
    with pytest.raises(NonFiniteError, match=r"optimizer state of worker\(s\) (0, )?1 is not finite .* load a state_dict"):
        strategy.step(1e-2)  # step 6: the synchronisation


def test_strategies_take_injected_optimizers_without_a_config():
    """The library without the CLI's schema: torch's AdamW inside, DiLoCo's Nesterov SGD outside, against the
    outer step written out by hand (buffer b ← μ·b + Δ, anchor ← anchor − η·(Δ + μ·b))."""
    from lordo.strategies import LocalUpdateStrategy

    models = [tiny_model() for _ in range(2)]
    strategy = LocalUpdateStrategy(
        models, SimCommunicator(2), optimizers=[torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models],
        sync_every=2, outer_optimizer=lambda anchor: torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True))
    expected = [p.detach().clone() for p in models[0].parameters()]
    buffers = [torch.zeros_like(a) for a in expected]
    deltas = []
    strategy.after_average = lambda delta: deltas.append([d.clone() for d in delta]) or {}  # type: ignore[method-assign]
    for step in range(6):
        for rank, model in enumerate(models):
            model(*batch(rank, step))[1].backward()
        strategy.step(1e-2)
        if strategy.steps_done % 2 == 0:
            for b, d in zip(buffers, deltas[-1]):
                b.mul_(0.9).add_(d)
            expected = [a - 0.7 * (d + 0.9 * b) for a, d, b in zip(expected, deltas[-1], buffers)]
            for model in models:
                for p, a in zip(model.parameters(), expected):
                    torch.testing.assert_close(p.detach(), a, rtol=1e-6, atol=1e-7)
    assert len(deltas) == 3 and all(bool(d[0].abs().sum() > 0) for d in deltas)


def test_keyword_arguments_are_checked():
    from lordo.strategies import LocalUpdateStrategy

    models = [tiny_model()]
    opts = [torch.optim.AdamW(models[0].parameters())]
    with pytest.raises(ConfigError, match="sync_every must be an integer >= 1, got 0"):
        LocalUpdateStrategy(models, SimCommunicator(1), optimizers=opts, sync_every=0)
    with pytest.raises(ConfigError, match="compress must be one of none, bf16, int8, int4, sparse, basis, got 'fp4'"):
        LocalUpdateStrategy(models, SimCommunicator(1), optimizers=opts, sync_every=2, compress="fp4")
    partial = [torch.optim.AdamW(list(models[0].parameters())[1:])]
    with pytest.raises(ConfigError, match="does not hold the trainable parameter.*tok_emb.weight"):
        LocalUpdateStrategy(models, SimCommunicator(1), optimizers=partial, sync_every=2)


def test_a_format_1_outer_momentum_loads_into_the_outer_optimizer():
    """Checkpoints before the outer optimizer held the Nesterov buffers as a list ``outer_momentum``; loaded
    into torch's SGD they continue the run exactly."""
    dilo = ["strategy.outer_lr=0.7", "strategy.outer_momentum=0.9"]
    models, strategy, _ = make("local-adam", dilo)
    train_steps(models, strategy, 0, 10)
    strategy.finish()
    reference = [p.detach().clone() for p in models[0].parameters()]

    models, strategy, _ = make("local-adam", dilo)
    train_steps(models, strategy, 0, 7)  # two syncs (K = 3): the buffers hold something
    state = strategy.state_dict()
    outer = state["shared"].pop("outer_optimizer")
    state["shared"]["outer_momentum"] = [outer["state"][i]["momentum_buffer"] for i in range(len(strategy.anchor))]
    models2, strategy2, _ = make("local-adam", dilo)
    for m, src in zip(models2, models):
        m.load_state_dict(src.state_dict())
    strategy2.load_state_dict(state)
    train_steps(models2, strategy2, 7, 10)
    strategy2.finish()
    for a, b in zip(reference, models2[0].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("qh_source", ["grad", "grad+error"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["lordo", "lordo-local", "lordo-global-noqh", "lowrank-ddp"])
def test_every_low_rank_strategy_runs_in_every_dtype_through_basis_changes(name, dtype, qh_source):
    """Bases are float32; moments, gradients and error feedback are in the parameter's dtype. 8 steps with
    K = 3 make two basis changes (syncs for the local-update strategies, refreshes for lowrank-ddp)."""
    cfg = strategy_config(name, [*LOWRANK, f'strategy.qh_source="{qh_source}"'])
    params, ledger = run_strategy(SimCommunicator(2), cfg, steps=8, dtype=dtype)
    assert all(p.dtype == dtype and bool(torch.isfinite(p).all()) for p in params)
    assert ledger["all_reduce:projected_gradient" if name == "lowrank-ddp" else "all_reduce:pseudo_gradient"]["calls"] >= 3
    reference, _ = run_strategy(SimCommunicator(2), cfg, steps=8, dtype=torch.float32)
    tolerance = {torch.float64: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.05}[dtype]
    for a, b in zip(params, reference):
        torch.testing.assert_close(a.float(), b, rtol=tolerance, atol=tolerance)


def _projector(basis):
    b = basis.double()
    return b @ b.T


@pytest.mark.parametrize("method, fresh", [("auto", True), ("svd", True), ("subspace", False)])
def test_lordo_local_bases_are_each_workers_own_top_r_basis_afresh(method, fresh):
    """The paper's LoRDO-Local (the default, basis_method auto = svd): at a synchronisation each worker's basis
    is the top-r basis of its own gradient of that step, computed afresh (float64 SVD reference); the warm
    variant (subspace) starts from the previous basis and is not."""
    models, strategy, _ = make("lordo-local", [f"strategy.basis_method={method}"])
    train_steps(models, strategy, 0, 2)
    for rank, model in enumerate(models):
        model(*batch(rank, 2))[1].backward()
    name = "blocks.0.mlp.down.weight"
    own = [dict(m.named_parameters())[name].grad.detach().double().clone() for m in models]
    strategy.step(1e-2)  # step 3 of K = 3: a synchronisation
    assert strategy.optimizers[0].param_groups[0]["basis_method"] == ("subspace" if method == "subspace" else "svd")
    deviations = []
    for w, (model, grad) in enumerate(zip(models, own)):
        p = dict(model.named_parameters())[name]
        basis = strategy.optimizer(w).state[p]["basis"]
        u, _, vh = torch.linalg.svd(grad)
        ref = vh[:2].T if p.shape[0] >= p.shape[1] else u[:, :2]
        deviations.append(float((_projector(basis) - ref @ ref.T).abs().max()))
    if fresh:
        assert max(deviations) < 1e-4, deviations
    else:
        assert min(deviations) > 1e-2, deviations
    assert not torch.allclose(_projector(strategy.optimizer(0).state[dict(models[0].named_parameters())[name]]["basis"]),
                              _projector(strategy.optimizer(1).state[dict(models[1].named_parameters())[name]]["basis"]))


def test_basis_method_auto_is_warm_for_the_global_basis():
    _, strategy, _ = make("lordo")
    assert {g["basis_method"] for g in strategy.optimizer(0).param_groups} == {"subspace"}


@pytest.mark.parametrize("name", ["lordo", "lordo-local"])
def test_average_error_feedback_makes_every_workers_e_the_mean_at_a_sync(name):
    """Two runs in lockstep, E averaged or not: up to the sync they are the same run; right after it, the
    averaging run's E is, on every worker, the float64 mean of the other run's per-worker E (the basis change
    keeps E), and the weights agree; the bytes of E are counted once per sync."""
    plain_models, plain, _ = make(name)
    avg_models, averaged, comm = make(name, ["strategy.average_error_feedback=true"])
    for m, n in zip(avg_models, plain_models):
        m.load_state_dict(n.state_dict())
    for strategy, models in ((plain, plain_models), (averaged, avg_models)):
        train_steps(models, strategy, 0, 3)  # K = 3: the third step ends with a sync
    low = [n for n, p in plain_models[0].named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    for n in low:
        per_worker = [plain.optimizer(w).error_feedback(dict(m.named_parameters())[n]).double()
                      for w, m in enumerate(plain_models)]
        mean = sum(per_worker) / len(per_worker)
        assert float((per_worker[0] - per_worker[1]).abs().max()) > 1e-6  # the workers' E differ before
        for w, m in enumerate(avg_models):
            torch.testing.assert_close(averaged.optimizer(w).error_feedback(dict(m.named_parameters())[n]).double(),
                                       mean, rtol=1e-5, atol=1e-7)
    for a, b in zip(avg_models[0].parameters(), plain_models[0].parameters()):
        torch.testing.assert_close(a, b)
    n_low = sum(p.numel() for n, p in plain_models[0].named_parameters() if n in low)
    assert comm.ledger.table()["all_reduce:error_feedback"]["bytes"] == 4 * n_low


@pytest.mark.parametrize("override, message", [
    ("strategy.error_feedback=false", r"average_error_feedback .* needs strategy.error_feedback = true"),
    ("strategy.compress=int8", r"average_error_feedback sends .* use strategy.compress = none or bf16, got 'int8'"),
    ("strategy.sync_delay=1", r"average_error_feedback .* use sync_delay = 0"),
])
def test_average_error_feedback_refuses_what_it_cannot_do(override, message):
    with pytest.raises(ConfigError, match=message):
        make("lordo", ["strategy.average_error_feedback=true", override])


def test_the_research_step_preset_builds_the_research_codes_step():
    """configs/research-step.toml: the momentum low-rank term, G + E in the full-rank term with E kept, an exact
    SVD at every sync, on the inner optimizers that the strategy builds."""
    from pathlib import Path

    from lordo.config import build_config

    cfg = build_config(Path(__file__).parent.parent / "configs" / "research-step.toml", ["strategy.rank=2"])
    models = [tiny_model() for _ in range(2)]
    strategy = build_strategy(cfg, models, [group_parameters(m) for m in models], SimCommunicator(2))
    group = next(g for g in strategy.optimizer(0).param_groups if g["rank"] is not None)
    assert (group["lowrank_term"], group["qh_source"], group["error_feedback_after_qh"], group["basis_method"]) == (
        "momentum", "grad+error", "keep", "svd")
    assert strategy.name == "lordo" and not strategy.average_error_feedback


def _least_squares_toy(clip, rounds=100, seed=0):
    """4 workers minimise ½‖W − W*‖² (W 32×16, zero at the start) with lordo at r = 2, K = 8, lr 3e-2, exact
    bases, no weight decay; returns the relative error ‖W − W*‖/‖W*‖ and ‖E‖ after rounds 50 and 100."""
    import warnings

    import lordo

    torch.manual_seed(seed)
    target = torch.randn(32, 16)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False)) for _ in range(4)]
    for m in models:
        torch.nn.init.zeros_(m[0].weight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = lordo.distributed(models, "lordo", rank=2, sync_every=8, lr=3e-2, backend="sim", grad_clip=clip,
                                weight_decay=0.0, basis_method="svd")
    out = []
    for r in range(rounds):
        for _ in range(8):
            for m in models:
                (0.5 * (m[0].weight - target).pow(2).sum()).backward()
            opt.step()
        if (r + 1) % 50 == 0:
            w = models[0][0].weight
            out.append((float((w.detach() - target).norm() / target.norm()),
                        float(opt.strategy.optimizer(0).error_feedback(w).norm())))
    return out, [str(w.message) for w in caught]


def test_the_least_squares_toy_stays_bounded_only_clipped():
    """The rule's full-rank term is divided by the low-rank moments' mean D: unclipped, the toy's error grows
    between rounds 50 and 100 (0.109 → 0.160 measured) and E with it, and building it warns; clipped at the
    default 0.5 it converges and E vanishes (docs/concepts.md, 'Keep the gradient clipped')."""
    (mid, end), warned = _least_squares_toy(clip=0.0)
    assert end[0] > 1.3 * mid[0] and end[1] > 1.3 * mid[1] > 40
    assert any("optim.grad_clip = 0 with LoRDO's full-rank term" in w for w in warned)
    (_, end), warned = _least_squares_toy(clip=0.5)
    assert end[0] < 0.01 and end[1] < 0.1
    assert not any("grad_clip" in w for w in warned)


def test_diloco_is_local_adam_with_diloco_outer_nesterov_unless_set():
    """``diloco``: local AdamW steps, then an outer Nesterov SGD step with DiLoCo's 0.7 and 0.9 on the averaged
    pseudo-gradient (the trajectory of local-adam given those settings); explicit outer settings win."""
    models, strategy, _ = make("diloco")
    (group,) = strategy.outer.param_groups
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    reference_models, reference, _ = make("local-adam", ["strategy.outer_lr=0.7", "strategy.outer_momentum=0.9"])
    for m, r in zip(models, reference_models):
        r.load_state_dict(m.state_dict())
    train_steps(models, strategy, 0, 7)
    train_steps(reference_models, reference, 0, 7)
    for a, b in zip(models[0].parameters(), reference_models[0].parameters()):
        assert torch.equal(a, b)
    _, explicit, _ = make("diloco", ["strategy.outer_lr=0.5", "strategy.outer_momentum=0.8"])
    assert (explicit.outer.param_groups[0]["lr"], explicit.outer.param_groups[0]["momentum"]) == (0.5, 0.8)
