"""Two phases in one run (the ``switch`` section, ``DistributedOptimizer.switch``): the authors' warm-up phase and
their resume with new hyperparameters. References: torch's AdamW, rebuilt for the second phase (``ddp`` on one
worker is AdamW exactly); the authors' two launches done by hand (the state saved at the switch, loaded into an
optimizer built with the second phase's settings, its moments zeroed); the uninterrupted run."""

import copy
import json

import pytest
import torch
from test_torch_optim import loss_of, tiny_lm

import lordo
from lordo.config import build_config
from lordo.errors import ConfigError

from test_checkpoint import assert_same_model, cfg_for, quiet_train, rewind, untimed_metrics


@pytest.mark.parametrize("reset", [True, False])
def test_ddp_switched_steps_as_torch_adamw_with_the_second_phase_settings(reset):
    """Reset: a fresh AdamW with the new betas (what the authors' resume builds); no reset: the same AdamW with its
    betas changed in place. The learning rate halves at the switch in both."""
    ours_model, ref_model = tiny_lm(), tiny_lm()
    opt = lordo.distributed(ours_model, "ddp", lr=1e-2, grad_clip=0.0, backend="sim")
    by_id = dict(zip(map(id, ours_model.parameters()), ref_model.parameters()))

    def adamw(betas, lr):
        return torch.optim.AdamW([{"params": [by_id[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
                                  for g in opt.param_groups], lr=lr, betas=betas, fused=True)

    ref = adamw((0.9, 0.999), 1e-2)
    for step in range(8):
        lr = 1e-2 if step < 4 else 5e-3
        if step == 4:
            opt.switch(betas=(0.95, 0.98), reset=reset)
            if reset:
                ref = adamw((0.95, 0.98), lr)
            for g in ref.param_groups:
                g.update(betas=(0.95, 0.98), lr=lr)
        loss_of(ours_model, step).backward()
        opt.step(lr=lr)
        loss_of(ref_model, step).backward()
        ref.step()
        ref.zero_grad()
        for a, b in zip(ours_model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), f"step {step}"
    assert all(s["step"] == 4 for s in opt.state.values()) is reset  # the step counter restarted with the moments


def _lordo(models, **settings):
    return lordo.distributed(models, "lordo", lr=1e-2, backend="sim", rank=4, sync_every=4, **settings)


def _steps(models, opt, start, n, lr):
    for step in range(start, start + n):
        for rank, m in enumerate(models):
            loss_of(m, step, rank).backward()
        opt.step(lr=lr)


@pytest.mark.parametrize("lean", [False, True], ids=["float32", "lean"])
def test_lordo_switched_equals_the_authors_two_launches(lean):
    """Phase one at omega = 1 (the global low-rank optimizer alone), then omega 0.98, betas (0.999, 0.999), moments
    reset, lr halved: equal to a run saved at the switch and resumed by an optimizer built with those settings, its
    saved moments zeroed by hand. ``lean``: the moments held in 8 bits (compact zeros after the reset)."""
    storage = {"memory": "lean"} if lean else {}
    models = [tiny_lm(), tiny_lm()]
    opt = _lordo(models, omega=1.0, **storage)
    _steps(models, opt, 0, 8, 1e-2)  # two synchronisations: in sync after step 8
    saved_weights = [copy.deepcopy(m.state_dict()) for m in models]
    saved = copy.deepcopy(opt.state_dict())
    error_feedback = [opt.strategy.workers[0].optimizer.error_feedback(p) for p in models[0][1:2].parameters()]
    opt.switch(omega=0.98, betas=(0.999, 0.999), reset=True)
    inner = opt.strategy.workers[0].optimizer
    for p, e in zip(models[0][1:2].parameters(), error_feedback):
        assert torch.equal(inner.error_feedback(p), e)  # the error feedback stays
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(inner.moment_copy(p, key), torch.zeros_like(inner.moment_copy(p, key)))
    _steps(models, opt, 8, 7, 5e-3)
    switched = [p.detach().clone() for p in models[0].parameters()]

    if lean:  # the moments decode to exact zeros (checked above): the next step is a fresh optimizer's
        return
    # the authors' second launch: new settings, the checkpoint's weights and state, both moments reset
    for worker in saved["workers"]:
        for state in worker["optimizer"]["state"].values():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                state[key] = torch.zeros_like(state[key])
        for group in worker["optimizer"]["param_groups"]:
            group["betas"] = (0.999, 0.999)
            group["omega"] = 0.98
    saved.pop("param_groups")
    models = [tiny_lm(5), tiny_lm(5)]
    for m, w in zip(models, saved_weights):
        m.load_state_dict(w)
    second = _lordo(models, omega=0.98, beta1=0.999, beta2=0.999)
    second.load_state_dict(saved)
    _steps(models, second, 8, 7, 5e-3)
    for a, b in zip(switched, models[0].parameters()):
        assert torch.equal(a, b)


def test_a_switch_between_synchronisations_is_refused():
    models = [tiny_lm(), tiny_lm()]
    opt = _lordo(models)
    _steps(models, opt, 0, 3, 1e-2)
    with pytest.raises(ConfigError, match="right after a synchronisation"):
        opt.switch(omega=0.9)
    local = lordo.distributed(tiny_lm(), "local-adam", lr=1e-2, backend="sim")
    with pytest.raises(ConfigError, match="lordo and lordo-local"):
        local.switch(omega=0.9)
    muon = lordo.distributed(tiny_lm(), "lordo", lr=1e-2, backend="sim", rank=4, inner="muon")
    before = [dict(g) for g in muon.param_groups]
    with pytest.raises(ConfigError, match="no Adam moments"):
        muon.switch(betas=(0.5, 0.5), reset=True)
    assert [dict(g) for g in muon.param_groups] == before  # checked before anything changed
    for bad, match in ((dict(omega=1.5), r"omega=...\) must be in \[0, 1\]"), (dict(betas=0.9), "a pair"),
                       (dict(betas=(0.9, 1.0)), r"betas=...\) must be in \[0, 1\)"),
                       (dict(sync_every=0), r"sync_every=...\) must be an integer >= 1")):
        with pytest.raises(ConfigError, match=match):
            muon.switch(**bad)


SWITCHED = ["switch.at_step=8", "switch.sync_every_before=1", "switch.omega=0.9", "switch.beta1=0.95",
            "switch.beta2=0.99", "switch.reset_moments=true", "switch.lr_scale=0.5", "train.keep_checkpoints=3"]


def test_lordo_train_switches_after_step_w_and_resumes_exactly_on_either_side(data_dir, tmp_path):
    """Phase one synchronises every step; the switch after step 8; checkpoints at 5 (before it) and 10 (after it,
    between synchronisations): each resume ends as the uninterrupted run."""
    cfg = cfg_for(data_dir, "lordo", extra=SWITCHED)  # checkpoints at 5, 10 and 14
    full = tmp_path / "full"
    quiet_train(cfg, full)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
    unswitched = cfg_for(data_dir, "lordo")
    quiet_train(unswitched, tmp_path / "one-phase")
    lr_one = {json.loads(line)["step"]: json.loads(line).get("lr") for line in
              (tmp_path / "one-phase" / "metrics.jsonl").read_text().splitlines()}
    assert lr[6] == pytest.approx(lr_one[6]) and lr[12] == pytest.approx(0.5 * lr_one[12])  # lr halves after 8
    synced = sorted(r["step"] for r in rows if r.get("synced"))
    assert synced == [*range(1, 9), 12, 14]  # K = 1 up to the switch, then K = 4 (and the last step's finish)
    for keep in (5, 10):
        resumed = tmp_path / f"resumed-{keep}"
        rewind(full, resumed, keep_step=keep)
        assert quiet_train(cfg, resumed)["resumed_from_step"] == keep
        assert_same_model(full, resumed)
        assert untimed_metrics(full) == untimed_metrics(resumed)


@pytest.mark.parametrize("overrides, match", [
    (["switch.omega=0.9"], r"switch.omega is set but switch.at_step = 0"),
    (["switch.at_step=600"], r"switch.at_step \(600\) must be smaller than train.steps"),
    (["switch.at_step=40"], r"multiple of strategy.sync_every \(32\)"),
    (["switch.at_step=64", "switch.sync_every_before=5"], r"multiple of switch.sync_every_before \(5\)"),
    (["switch.at_step=64", 'strategy.name="ddp"', "switch.sync_every_before=1"], r"'ddp' communicates every step"),
    (["switch.at_step=64", 'strategy.name="local-adam"', "switch.omega=0.9"], r"lordo and lordo-local"),
    (["switch.at_step=64", 'optim.inner="muon"', "switch.reset_moments=true"], r"Muon's momentum"),
    (["switch.at_step=64", "strategy.sync_delay=2"], r"not built with strategy.sync_delay"),
    (["switch.at_step=64", "switch.beta2=1.0"], r"switch.beta2 must be in \[0, 1\) \(or -1: unchanged\)"),
    (["switch.at_step=64", "switch.lr_scale=0"], r"switch.lr_scale must be > 0"),
])
def test_bad_switch_settings_are_refused_naming_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=overrides)
