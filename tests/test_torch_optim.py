"""DistributedOptimizer as a torch.optim.Optimizer: schedulers, per-group settings, GradScaler, closures,
Hugging Face Trainer and Lightning. References are torch's own AdamW (``ddp`` on one worker with no clipping
is AdamW exactly) and the uninterrupted run."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import lordo


def tiny_lm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(40, 12), nn.Linear(12, 12, bias=False), nn.GELU(), nn.Linear(12, 40, bias=False))


def loss_of(model: nn.Module, step: int, rank: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 40, (6, 7), generator=g)
    return nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


SCHEDULERS = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: (s + 1) / 4 if s < 4 else 0.5 ** (s - 3)),
    "MultiplicativeLR": lambda o: torch.optim.lr_scheduler.MultiplicativeLR(o, lambda s: 0.8),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.3),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 5], gamma=0.2),
    "ConstantLR": lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.25, total_iters=4),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=6),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7),
    "PolynomialLR": lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=1e-3, max_lr=2e-2, step_size_up=3),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=10),  # cycles betas too
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.2, total_iters=3), torch.optim.lr_scheduler.ExponentialLR(o, 0.8)],
        milestones=[3]),
}


@pytest.mark.parametrize("family", list(SCHEDULERS) + ["ReduceLROnPlateau"])
def test_every_torch_scheduler_family_sets_the_lr_the_step_uses(family):
    ours_model, ref_model = tiny_lm(), tiny_lm()
    opt = lordo.distributed(ours_model, "ddp", lr=1e-2, grad_clip=0.0, weight_decay=0.1, backend="sim")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    if family == "ReduceLROnPlateau":
        scheds = [torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0) for o in (opt, ref)]
    else:
        scheds = [SCHEDULERS[family](o) for o in (opt, ref)]
    lrs = []
    for step in range(10):
        for model, o, sched in zip((ours_model, ref_model), (opt, ref), scheds):
            loss = loss_of(model, step)
            loss.backward()
            o.step()
            o.zero_grad()
            sched.step(1.0) if family == "ReduceLROnPlateau" else sched.step()  # a flat metric: lr halves
        lrs.append(opt.param_groups[0]["lr"])
        for a, b in zip(ours_model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), f"{family}: step {step}"
    assert len(set(lrs)) >= 2  # the schedule did change the learning rate


def test_per_group_learning_rate_and_weight_decay_are_the_groups_own():
    ours_model, ref_model = tiny_lm(), tiny_lm()
    opt = lordo.distributed(ours_model, "ddp", lr=1e-2, grad_clip=0.0, backend="sim")
    assert [g["name"] for g in opt.param_groups] == ["block_matrix", "embedding"]
    opt.param_groups[0].update(lr=3e-2, weight_decay=0.0)
    opt.param_groups[1].update(lr=2e-3, weight_decay=0.5)
    by_id = dict(zip(map(id, ours_model.parameters()), ref_model.parameters()))
    ref = torch.optim.AdamW([{"params": [by_id[id(p)] for p in opt.param_groups[0]["params"]], "lr": 3e-2, "weight_decay": 0.0},
                             {"params": [by_id[id(p)] for p in opt.param_groups[1]["params"]], "lr": 2e-3, "weight_decay": 0.5}],
                            fused=True)
    for step in range(5):
        for model, o in ((ours_model, opt), (ref_model, ref)):
            loss_of(model, step).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_grad_scaler_steps_like_torch_adamw_and_all_workers_skip_an_inf_together():
    ours_model, ref_model = tiny_lm(), tiny_lm()
    opt = lordo.distributed(ours_model, "ddp", lr=1e-2, grad_clip=0.0, backend="sim")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12) for _ in range(2)]
    for step in range(4):
        for model, o, scaler in zip((ours_model, ref_model), (opt, ref), scalers):
            scaler.scale(loss_of(model, step)).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)

    models = [tiny_lm(), tiny_lm()]
    opt = lordo.distributed(models, "lordo", rank=4, sync_every=2, backend="sim")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for rank, m in enumerate(models):
        scaler.scale(loss_of(m, 0, rank)).backward()
    before = [[p.detach().clone() for p in m.parameters()] for m in models]
    next(models[1].parameters()).grad[0, 0] = float("inf")  # one worker overflowed
    scaler.step(opt)
    scaler.update()
    assert opt.last_stats == {"amp_skipped": 1.0} and opt.steps_done == 0 and scaler.get_scale() == 2.0**11
    for m, saved in zip(models, before):
        assert all(torch.equal(p, s) and p.grad is None for p, s in zip(m.parameters(), saved))


def test_step_takes_a_closure_and_returns_its_loss():
    model = tiny_lm()
    opt = lordo.distributed(model, "lordo", rank=4, sync_every=2, backend="sim")

    def closure():
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert isinstance(first, torch.Tensor) and opt.steps_done == 1
    for _ in range(5):
        last = opt.step(closure)
    assert last.item() < first.item()


def test_a_distributed_optimizer_state_dict_loads_with_weights_only(tmp_path):
    model = tiny_lm()
    opt = lordo.distributed(model, "lordo", rank=4, sync_every=3, backend="sim")
    for step in range(4):
        loss_of(model, step).backward()
        opt.step()
    opt.param_groups[0]["lr"] = 1.5e-3
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    model2 = tiny_lm()
    model2.load_state_dict(model.state_dict())
    opt2 = lordo.distributed(model2, "lordo", rank=4, sync_every=3, backend="sim")
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert opt2.param_groups[0]["lr"] == 1.5e-3 and opt2.steps_done == 4
    for step in range(4, 7):
        for m, o in ((model, opt), (model2, opt2)):
            loss_of(m, step).backward()
            o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_parameters_cannot_be_added_later():
    opt = lordo.distributed(tiny_lm(), "lordo", rank=4, backend="sim")
    with pytest.raises(lordo.ConfigError, match="cannot be added later"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})


def test_an_unused_parameter_gets_a_zero_gradient_with_a_warning():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head, self.unused = nn.Embedding(40, 12), nn.Linear(12, 40, bias=False), nn.Linear(12, 12)

        def forward(self, tokens):
            return self.head(self.emb(tokens))

    model = WithUnused()
    opt = lordo.distributed(model, "ddp", backend="sim")
    tokens = torch.randint(0, 40, (2, 5))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    with pytest.warns(RuntimeWarning, match=r"without a gradient \(unused in forward\?\): unused.weight, unused.bias"):
        opt.step()
    with pytest.raises(RuntimeError, match="call loss.backward"):
        opt.step()  # nothing has a gradient now


def test_batchnorm_statistics_are_averaged_at_each_synchronisation():
    models = [nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opt = lordo.distributed(models, "local-adam", sync_every=2, backend="sim")
    for step in range(2):
        for rank, m in enumerate(models):
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(8, 4, generator=g) * (rank + 1)  # the workers see different statistics
            m(x).pow(2).mean().backward()
        if step == 0:
            stats = [m[1].running_var.clone() for m in models]
        opt.step()
    assert not torch.allclose(stats[0], stats[1])
    assert torch.equal(models[0][1].running_mean, models[1][1].running_mean)
    assert torch.equal(models[0][1].running_var, models[1][1].running_var)
    assert opt.ledger.table()["all_reduce:buffers"]["calls"] == 1


@pytest.mark.parametrize("strategy", ["local-adam", "lordo"])
def test_the_anchor_in_host_memory_trains_the_same_and_leaves_the_device(strategy):
    runs = {}
    for offload in (False, True):
        models = [tiny_lm(), tiny_lm()]
        opt = lordo.distributed(models, strategy, rank=4, sync_every=2, backend="sim", offload_anchor=offload)
        for step in range(5):
            for rank, m in enumerate(models):
                loss_of(m, step, rank).backward()
            opt.step()
        opt.finish()
        runs[offload] = ([p.detach().clone() for p in models[0].parameters()], opt.memory_report())
    for a, b in zip(runs[False][0], runs[True][0]):
        assert torch.equal(a, b)
    on_device, off_device = runs[False][1], runs[True][1]
    assert "anchor (host)" in off_device and "anchor" not in off_device
    assert off_device["device_total"] == on_device["device_total"] - on_device["anchor"]
    assert off_device["total"] == on_device["total"]


def _two_workers_mid_round(tmp_path):
    """Two simulated workers, 4 steps at K = 3: the state is saved one step after a synchronisation."""
    models = [tiny_lm(), tiny_lm()]
    opt = lordo.distributed(models, "lordo", rank=4, sync_every=3, backend="sim")
    for step in range(4):
        for rank, m in enumerate(models):
            loss_of(m, 10 * step + rank).backward()
        opt.step()
    assert not opt.in_sync
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    return models, opt


def test_a_mid_round_resume_in_torchs_usual_order_is_refused_not_corrupted(tmp_path):
    """Loading the models, then building the optimizer (which copies worker 0's weights to every worker), then
    loading its state would continue worker 1 from worker 0's weights: refused, naming the order that works."""
    models, _ = _two_workers_mid_round(tmp_path)
    again = [tiny_lm(), tiny_lm()]
    for m, saved in zip(again, models):
        m.load_state_dict(saved.state_dict())
    opt2 = lordo.distributed(again, "lordo", rank=4, sync_every=3, backend="sim")
    with pytest.raises(lordo.ConfigError, match=r"hosted worker\(s\) \[1\] are worker 0's.*Build the optimizer first, "
                                                r"then load each model's state"):
        opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))


def test_a_mid_round_resume_built_first_then_loaded_continues_bit_for_bit(tmp_path):
    models, opt = _two_workers_mid_round(tmp_path)
    again = [tiny_lm(), tiny_lm()]
    opt2 = lordo.distributed(again, "lordo", rank=4, sync_every=3, backend="sim")
    for m, saved in zip(again, models):
        m.load_state_dict(saved.state_dict())
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for step in range(4, 8):
        for ms, o in ((models, opt), (again, opt2)):
            for rank, m in enumerate(ms):
                loss_of(m, 10 * step + rank).backward()
            o.step()
    for ms in (models, again):
        assert not torch.equal(next(ms[0].parameters()), next(ms[1].parameters()))  # mid-round again at step 8
    for a, b in zip([p for m in models for p in m.parameters()], [p for m in again for p in m.parameters()]):
        assert torch.equal(a, b)


def test_the_with_block_finishes_and_a_forgotten_finish_is_reported_at_exit():
    models = [tiny_lm(), tiny_lm()]
    with lordo.distributed(models, "lordo", rank=4, sync_every=3, backend="sim") as opt:
        for step in range(4):  # one step past the sync of step 3
            for rank, m in enumerate(models):
                loss_of(m, step, rank).backward()
            opt.step()
        assert not opt.in_sync
    assert opt.in_sync and all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    script = textwrap.dedent("""
        import torch, lordo
        from test_torch_optim import tiny_lm, loss_of
        models = [tiny_lm(), tiny_lm()]
        opt = lordo.distributed(models, "local-adam", sync_every=3, backend="sim")
        for step in range(STEPS):
            for rank, m in enumerate(models):
                loss_of(m, step, rank).backward()
            opt.step()
        FINISH
    """)
    for steps, finish, warned in ((4, "", True), (4, "opt.finish()", False), (3, "", False)):
        code = script.replace("STEPS", str(steps)).replace("FINISH", finish)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).parent)
        assert done.returncode == 0, done.stderr
        said = "ended 1 step(s) after its last synchronisation without opt.finish()" in done.stderr
        assert said == warned, (steps, finish, done.stderr)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.0), r"lr must be a number > 0, or None for the strategy's default, got 0.0"),
    (dict(betas=(0.9,)), r"betas must be a pair \(beta1, beta2\)"),
    (dict(betas=(0.9, 0.99), beta1=0.8), r"give betas=\(beta1, beta2\) or beta1=/beta2=, not both"),
])
def test_torch_style_arguments_are_taken_or_refused_by_name(kwargs, message):
    with pytest.raises(lordo.ConfigError, match=message):
        lordo.distributed(tiny_lm(), "lordo", rank=4, backend="sim", **kwargs)
    opt = lordo.distributed(tiny_lm(), "lordo", rank=4, backend="sim", betas=(0.8, 0.95))
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and opt.param_groups[0]["lr"] == 3e-3


def test_a_model_wrapped_in_ddp_is_refused():
    wrapped = nn.DataParallel(tiny_lm())
    with pytest.raises(lordo.ConfigError, match=r"wrapped in DistributedDataParallel .* pass the module itself"):
        lordo.distributed(wrapped, "lordo", rank=4, backend="sim")


def test_opt_state_shows_each_parameters_inner_state():
    """Tools that read opt.state[p] (as for any torch.optim optimizer) see the moments, bases and error feedback."""
    models = [tiny_lm(), tiny_lm()]
    opt = lordo.distributed(models, "lordo", rank=4, sync_every=3, backend="sim")
    for rank, m in enumerate(models):
        loss_of(m, 0, rank).backward()
    opt.step()
    matrix = models[1][1].weight
    assert {"exp_avg", "exp_avg_sq", "basis"} <= set(opt.state[matrix])
    assert opt.state[matrix] is opt.strategy.optimizer(1).state[matrix]
    assert len(opt.state) == 2 * len(list(models[0].parameters()))
    with pytest.raises(KeyError):
        opt.state[nn.Parameter(torch.zeros(2))]


def test_a_basis_that_no_one_refreshes_is_reported_once(monkeypatch):
    """GaLore refreshes every 200 steps; update_proj_gap = None (the default) never does unless a strategy or the
    caller changes the bases: after FIXED_BASIS_WARNING_STEPS steps without a change it says so, once."""
    import warnings

    from lordo.optim import bases as module

    monkeypatch.setattr(module, "FIXED_BASIS_WARNING_STEPS", 5)

    def train(models: list[nn.Module], opt, steps: int, refresh_at: int | None = None) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, steps + 1):
                for m in models:
                    m(torch.randn(4, 8)).square().mean().backward()
                if step == refresh_at:
                    opt.refresh_basis(models[0].weight, models[0].weight.grad)
                opt.step()
                opt.zero_grad()
        return [str(w.message) for w in caught if "no basis has changed" in str(w.message)]

    def alone(**kwargs) -> tuple[list[nn.Module], lordo.LowRankQHAdam]:
        layer = nn.Linear(8, 8)
        return [layer], lordo.LowRankQHAdam(layer.parameters(), rank=2, lr=1e-2, **kwargs)

    (message,) = train(*alone(), 12)
    assert "in 5 steps" in message and "update_proj_gap=200" in message
    assert train(*alone(update_proj_gap=3), 12) == []
    assert train(*alone(), 12, refresh_at=2) == []
    # a strategy changes the bases at each synchronisation: nothing to say
    models = [nn.Linear(8, 8) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    with lordo.distributed(models, "lordo", backend="sim", rank=2, sync_every=4, lr=1e-2) as opt:
        assert train(models, opt, 12) == []
