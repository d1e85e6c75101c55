"""Muon as the inner optimizer of ddp and local-adam (``optim.inner = "muon"``): ``MuonAdamW`` against torch's own
Muon and AdamW stepped side by side, through lordo.distributed, and the settings it refuses."""

import io

import pytest
import torch
from torch import nn

import lordo
from lordo.config import build_config
from lordo.errors import ConfigError
from lordo.model.params import group_by_module
from lordo.optim import MuonAdamW


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32),
                         nn.GELU(), nn.Linear(32, 50))


def loss_of(model, step):
    tokens = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(step))
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def split(model):
    """(Muon's matrices, AdamW's with decay, AdamW's without) by lordo's module rules."""
    groups = group_by_module(model)
    muon = [p for g in groups if g.rule.matrix for p in g.params if p.ndim == 2]
    decay = [p for g in groups if g.rule.weight_decay for p in g.params if all(p is not q for q in muon)]
    rest = [p for g in groups if not g.rule.weight_decay for p in g.params if all(p is not q for q in muon)]
    return muon, decay, rest


def torch_pair(model, lr=1e-2, wd=0.1):
    muon, decay, rest = split(model)
    return (torch.optim.Muon(muon, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=lr, weight_decay=wd,
                              fused=True))


def hybrid(model, lr=1e-2):
    muon, decay, rest = split(model)
    return MuonAdamW([{"params": muon, "muon": True}, {"params": decay, "muon": False},
                      {"params": rest, "muon": False, "weight_decay": 0.0}], lr=lr, weight_decay=0.1)


def test_muon_adamw_is_torchs_muon_and_adamw_stepped_side_by_side_with_a_schedule():
    ours, ref = make(), make()
    opt, (muon, adamw) = hybrid(ours), torch_pair(ref)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    ref_schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (muon, adamw)]
    for step in range(5):
        loss_of(ours, step).backward()
        loss_of(ref, step).backward()
        opt.step()
        opt.zero_grad()
        for o, s in zip((muon, adamw), ref_schedules):
            o.step()
            o.zero_grad()
            s.step()
        schedule.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(1e-2 / 6)  # the schedule reached the inner optimizer
    assert set(opt.state[list(ours.parameters())[1]]) == {"momentum_buffer"}


def test_muon_adamw_resumes_bit_for_bit_from_a_weights_only_state():
    model, twin = make(), make()
    opt = hybrid(model)
    for step in range(3):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin.load_state_dict(model.state_dict())
    opt2 = hybrid(twin, lr=0.5)  # the state's learning rate wins, as in torch
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(3, 6):
        for m, o in ((model, opt), (twin, opt2)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_one_worker_ddp_with_muon_is_torchs_muon_and_adamw():
    ours, ref = make(), make()
    opt = lordo.distributed(ours, "ddp", lr=1e-2, weight_decay=0.1, grad_clip=0.0, inner="muon")
    muon, adamw = torch_pair(ref)
    for step in range(4):
        loss_of(ours, step).backward()
        loss_of(ref, step).backward()
        opt.step()
        for o in (muon, adamw):
            o.step()
            o.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("overrides, message", [
    (['strategy.name="lordo"'], r"optim.inner = \"muon\" is the inner optimizer of ddp, local-adam, diloco; strategy 'lordo'"),
    (['strategy.name="local-adam"', 'strategy.average_moments="all"'], r"Muon's matrices do not have"),
    (['strategy.name="ddp"', 'optim.muon_adjust_lr="rms"'], r"optim.muon_adjust_lr must be one of"),
])
def test_muon_settings_that_cannot_work_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(overrides=['optim.inner="muon"', *overrides])


def test_muon_with_bfloat16_weights_is_refused_with_the_fix():
    model = make().to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"bfloat16/float16 weights.*bf16-mixed"):
        lordo.distributed(model, "ddp", inner="muon")


def test_the_memory_report_counts_one_buffer_per_muon_matrix_and_two_moments_for_the_rest():
    model = make()
    opt = lordo.distributed(model, "ddp", inner="muon")
    muon, decay, rest = split(model)
    assert opt.strategy.state_bytes() == {"muon_momentum": 4 * sum(p.numel() for p in muon),
                                          "full_rank_moments": 8 * sum(p.numel() for p in decay + rest)}
