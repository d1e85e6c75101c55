"""Muon as the inner optimizer of ddp and local-adam (``optim.inner = "muon"``): ``MuonAdamW`` against torch's own
Muon and AdamW stepped side by side, through lordo.distributed, and the settings it refuses."""

import copy
import io
import re

import pytest
import torch
from torch import nn

import lordo
from lordo.config import build_config
from lordo.errors import ConfigError
from lordo.model.params import group_by_module
from lordo.optim import LowRankQHAdam, MuonAdamW
from lordo.optim.muon import LowRankMuon


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


def _resume_from_a_weights_only_state(build, build_twin=None):
    """Three steps, the state saved and loaded (weights_only) into a twin, three more steps of both: (the original
    optimizer, the original model, the twin)."""
    model, twin = make(), make()
    opt = build(model)
    for step in range(3):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin.load_state_dict(model.state_dict())
    opt2 = (build_twin or build)(twin)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(3, 6):
        for m, o in ((model, opt), (twin, opt2)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad()
    return opt, model, twin


def test_muon_adamw_resumes_bit_for_bit_from_a_weights_only_state():
    # the twin built at another rate: the state's learning rate wins, as in torch
    _, model, twin = _resume_from_a_weights_only_state(hybrid, lambda m: hybrid(m, lr=0.5))
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
    (['strategy.name="lordo"', "optim.compile_step=true"], r"LoRDO's Muon form, LowRankMuon\) runs per matrix"),
    (['strategy.name="lordo"', 'strategy.lowrank_term="momentum"'], r"leave optim.compile_step = false and strategy.lowrank_term"),
    (['strategy.name="local-adam"', 'strategy.average_moments="all"'], r"Muon's matrices do not have"),
    (['strategy.name="ddp"', 'optim.muon_adjust_lr="rms"'], r"optim.muon_adjust_lr must be one of"),
    (['strategy.name="local-adam"', "dist.shard=true", "dist.ranks_per_worker=2", 'dist.backend="gloo"'],
     r"dist.shard = true does not take optim.inner = \"muon\".*use optim.inner = \"auto\""),
    (['strategy.name="lordo"', "dist.shard=true", "dist.ranks_per_worker=2", 'dist.backend="gloo"'],
     r"dist.shard = true does not take optim.inner = \"muon\""),
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


# --------------------------------------------------------------------------------------------------------------
# LoRDO in Muon's form: LowRankMuon


def _ns64(x, steps=5, coefficients=(3.4445, -4.775, 2.0315)):
    """Newton–Schulz written out in float64: X ← aX + b(XXᵀ)X + c(XXᵀ)²X on the wide orientation, from X/‖X‖."""
    a, b, c = coefficients
    tall = x.shape[0] > x.shape[1]
    y = (x.T if tall else x) / x.norm()
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + b * gram @ y + c * gram @ gram @ y
    return y.T if tall else y


class _MuonSpec:
    """The update of LowRankMuon's module doc in float64, term by term (right side: P q×r, proj = A·P)."""

    def __init__(self, w, basis, *, lr, mu, omega, wd, after_qh, rank, qh_scale="own", whole=False, split=False):
        self.split = split
        self.whole = whole
        self.W, self.P = w.detach().double().clone(), basis.double()
        self.right = w.shape[0] >= w.shape[1]
        self.E, self.M = torch.zeros_like(self.W), None
        self.lr, self.mu, self.omega, self.wd, self.after_qh, self.rank = lr, mu, omega, wd, after_qh, rank
        self.qh_scale = qh_scale

    def proj(self, a):
        return a @ self.P if self.right else self.P.T @ a

    def back(self, g):
        return g @ self.P.T if self.right else self.P @ g

    def set_basis(self, new):
        new = new.double()
        c = new.T @ self.P
        if self.M is not None:
            self.M = self.M @ c.T if self.right else c @ self.M
        self.P = new

    def step(self, G):
        A = G + self.E
        g = self.proj(A)
        self.E = A - self.back(g)
        self.M = (1 - self.mu) * g if self.M is None else self.mu * self.M + (1 - self.mu) * g
        N = (1 - self.mu) * g + self.mu * self.M
        p, q = self.W.shape
        if self.whole or self.split:  # Newton-Schulz on a p×q step, at Muon's own rate
            # whole: the two terms at unit norm; split: the momentum inside the basis and E read as the momentum
            # outside it, (1 − ω)·(c + ω·E), c = G − back(g)
            X = (self.back(N) + (1 - self.omega) * (G - self.back(g) + self.omega * self.E) if self.split else
                 self.omega * self.back(N) / N.norm() + (1 - self.omega) * A / A.norm())
            self.W = self.W * (1 - self.lr * self.wd) - self.lr * 0.2 * max(p, q) ** 0.5 * _ns64(X)
            if self.after_qh == "remove":
                self.E = self.omega * self.E
            return
        Orth = _ns64(N)
        s = 0.2 * max(p, q) ** 0.5 * (min(p, q) / self.rank) ** 0.5
        rho = s * Orth.norm() / (p * q) ** 0.5
        # "own": A's RMS over its p·q entries; "momentum": the RMS of the back-projected momentum, p×q too
        sigma = (A if self.qh_scale == "own" else self.back(N)).pow(2).mean().sqrt()
        self.W = self.W * (1 - self.lr * self.wd) - self.lr * (self.omega * s * self.back(Orth) + (1 - self.omega) * rho * A / sigma)
        if self.after_qh == "remove":
            self.E = self.omega * self.E


@pytest.mark.parametrize("form, qh_scale, after_qh", [
    ("lowrank", "own", "keep"), ("lowrank", "own", "remove"), ("lowrank", "momentum", "keep"),
    ("lowrank", "momentum", "remove"), ("whole", "own", "keep"), ("whole", "own", "remove"), ("split", "own", "remove")])
@pytest.mark.parametrize("shape", [(12, 7), (5, 11)])
def test_the_muon_forms_equal_their_formulas_in_float64(shape, form, qh_scale, after_qh):
    """Six steps at ω = 0.9 with error feedback (G + E in the QH term, deferred from the second step on) and weight
    decay; the basis changes before step 4 (M rotated into it, E settled), both sides; each orthogonalise setting
    against its formula (the module doc's) in float64 (μ = 0.8 for split: the two halves of its momentum differ)."""
    torch.manual_seed(5)
    r = 3
    w = nn.Parameter(torch.randn(shape))
    q = torch.linalg.qr(torch.randn(min(shape), r, dtype=torch.float64))[0].float()
    mu = 0.8 if form == "split" else 0.9
    opt = LowRankMuon([{"params": [w], "rank": r}], lr=0.02, momentum=mu, omega=0.9, weight_decay=0.1,
                      error_feedback_after_qh=after_qh, ns_dtype=torch.float64, qh_scale=qh_scale, orthogonalise=form)
    opt.set_basis(w, q)
    spec = _MuonSpec(w, q, lr=0.02, mu=mu, omega=0.9, wd=0.1, after_qh=after_qh, rank=r, qh_scale=qh_scale,
                     whole=form == "whole", split=form == "split")
    for t in range(1, 7):
        if t == 4:
            q2 = torch.linalg.qr(torch.randn(min(shape), r, dtype=torch.float64))[0].float()
            opt.set_basis(w, q2)
            spec.set_basis(q2)
        G = torch.randn(shape, dtype=torch.float64)
        w.grad = G.float()
        opt.step()
        spec.step(G)
        torch.testing.assert_close(w.detach().double(), spec.W, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.error_feedback(w).double(), spec.E, rtol=1e-5, atol=1e-6)
    assert set(opt.state[w]) >= {"exp_avg", "basis", "error_feedback"} and "exp_avg_sq" not in opt.state[w]
    assert opt.state[w]["exp_avg"].shape == ((shape[0], r) if shape[0] >= shape[1] else (r, shape[1]))


def test_the_whole_step_moves_directions_outside_the_basis_as_far_as_inside():
    """The point of the setting: with ω = 0.98 the raw term is 2 % of the mix, yet after Newton-Schulz every
    direction of the update has about the same size, so the part outside span(P) (q − r of q directions) is
    sqrt((q − r)/r) times the part inside; the r-dimensional form moves it through the scaled raw term only."""
    torch.manual_seed(16)
    shape, r = (48, 32), 4
    ratios = {}
    for form in ("lowrank", "whole"):
        w = nn.Parameter(torch.randn(shape))
        q = torch.linalg.qr(torch.randn(shape[1], r))[0]
        opt = LowRankMuon([{"params": [w], "rank": r}], lr=0.01, omega=0.98, weight_decay=0.0, ns_dtype=torch.float32,
                          orthogonalise=form)
        opt.set_basis(w, q)
        before = w.detach().clone()
        w.grad = torch.randn(shape)
        opt.step()
        step = w.detach() - before
        inside = step @ q @ q.T
        ratios[form] = float((step - inside).norm() / inside.norm())
    even = ((shape[1] - r) / r) ** 0.5
    assert 0.8 * even < ratios["whole"] < 1.25 * even and ratios["lowrank"] < 0.5 * even, ratios


def step_side_by_side(ours, opt, ref, reference, steps, rtol, atol):
    """``steps`` random gradients given to both optimizers; their parameters compared after each step."""
    for _ in range(steps):
        g = torch.randn(ours.shape)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        reference.step()
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("orthogonalise", ["lowrank", "whole", "split"])
@pytest.mark.parametrize("shape", [(24, 16), (16, 24)])
@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_at_full_rank_omega_one_and_the_identity_basis_it_is_torchs_muon(shape, adjust, orthogonalise):
    torch.manual_seed(6)
    ours, ref = nn.Parameter(torch.randn(shape)), None
    ref = nn.Parameter(ours.detach().clone())
    opt = LowRankMuon([{"params": [ours], "rank": min(shape)}], lr=0.02, omega=1.0, weight_decay=0.1, adjust_lr_fn=adjust,
                      orthogonalise=orthogonalise)
    opt.set_basis(ours, torch.eye(min(shape)))
    muon = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    step_side_by_side(ours, opt, ref, muon, 5, rtol=1e-6, atol=1e-7)
    assert float(opt.error_feedback(ours).abs().max()) == 0  # a basis of the whole space drops nothing


def test_the_muon_form_resumes_bit_for_bit_and_holds_one_low_rank_moment():
    torch.manual_seed(7)

    def build(m, kind=LowRankMuon):
        mats = [p for p in m.parameters() if p.ndim == 2 and p.shape[0] != 50 and p.shape[1] != 16]
        rest = [p for p in m.parameters() if all(p is not q for q in mats)]
        return kind([{"params": mats, "rank": 4}, {"params": rest, "rank": None}], lr=1e-2, omega=0.9)

    opt, model, twin = _resume_from_a_weights_only_state(build)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    adam = build(make(), LowRankQHAdam)  # the same groups with Adam's two low-rank moments
    assert opt.state_bytes()["lowrank_moments"] * 2 == adam.state_bytes()["lowrank_moments"]


def test_the_muon_form_refuses_what_it_does_not_do():
    w = nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"batched=True: LowRankMuon runs per matrix"):
        LowRankMuon([{"params": [w], "rank": 2}], batched=True)
    with pytest.raises(ValueError, match=r"adjust_lr_fn must be one of"):
        LowRankMuon([{"params": [w], "rank": 2}], adjust_lr_fn="rms")


def _sharded_refusals():
    """In a gloo process of its own (a process group left in pytest's process would hang a later fork):
    each Muon optimizer given a DTensor matrix, the error it raises; and MuonAdamW given a plain one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from harness import gloo_group

    with gloo_group():
        mesh = init_device_mesh("cpu", (1,))
        w = nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        b = nn.Parameter(torch.zeros(4))
        errors = []
        for build in (lambda: MuonAdamW([{"params": [w], "muon": True}, {"params": [b], "muon": False}]),
                      lambda: LowRankMuon([{"params": [w], "rank": 2}])):
            try:
                build()
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        MuonAdamW([{"params": [nn.Parameter(torch.randn(8, 4))], "muon": True}, {"params": [b], "muon": False}])
        return errors


def test_both_muon_optimizers_refuse_matrices_sharded_by_fsdp2():
    from harness import run_gloo

    status, errors = run_gloo(_sharded_refusals, 1)[0]
    assert status == "ok", errors
    adamw, lowrank = errors
    assert re.search(r"MuonAdamW does not take Muon matrices sharded by FSDP2.*optim.inner = \"auto\"", adamw or "")
    assert re.search(r"LowRankMuon does not take parameters sharded by FSDP2", lowrank or "")


def test_lordo_with_the_muon_form_trains_workers_that_agree_after_each_synchronisation():
    replicas = [make(), make()]
    opt = lordo.distributed(replicas, "lordo", inner="muon", rank=4, sync_every=3, backend="sim")
    assert all(type(w.optimizer).__name__ == "LowRankMuon" for w in opt.strategy.workers)
    losses = []
    for step in range(6):
        for w, m in enumerate(replicas):
            loss = loss_of(m, 10 * w + step)
            loss.backward()
            losses.append(loss.item())
        opt.step()
    for a, b in zip(*(m.parameters() for m in replicas)):
        assert torch.equal(a, b)  # step 6 synchronised them
    assert opt.last_stats.get("synced") == 1.0 and all(map(lambda x: x == x, losses))
    state = opt.strategy.state_bytes()
    low = [p for p, _ in opt.strategy.workers[0].optimizer.lowrank_params()]
    assert state["lowrank_moments"] == sum(4 * 4 * max(p.shape) for p in low)  # one fp32 p×r moment per matrix


def _muon_run(strategy, backend):
    """Two workers of ``strategy`` with optim.inner = muon, six steps (two synchronisations), final weights."""
    import os

    hosted = [0, 1] if backend == "sim" else [int(os.environ["RANK"])]
    models = [make() for _ in hosted]
    options = dict(rank=4) if strategy == "lordo" else {}
    opt = lordo.distributed(models if backend == "sim" else models[0], strategy, inner="muon", sync_every=3,
                            backend=backend, **options)
    for step in range(6):
        for w, m in zip(hosted, models):
            loss_of(m, 10 * w + step).backward()
        opt.step()
    opt.finish()
    return [{k: v.clone() for k, v in m.state_dict().items()} for m in models]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lordo"])  # local-adam's MuonAdamW communicates nothing of its own
def test_muon_runs_the_same_on_gloo_processes_as_on_the_simulator(strategy):
    from harness import one_thread, run_gloo

    with one_thread():  # as the gloo processes run: GEMMs' last bits depend on the thread count
        expected = _muon_run(strategy, "sim")
    results = run_gloo(_muon_run, 2, strategy, "gloo")
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok", value
        for k, v in expected[rank].items():
            torch.testing.assert_close(value[0][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_a_copy_of_the_muon_form_steps_as_the_original():
    import copy

    w = nn.Parameter(torch.randn(8, 5))
    opt = LowRankMuon([{"params": [w], "rank": 2}], lr=0.01, omega=0.9)
    w.grad = torch.randn(8, 5)
    opt.step()
    twin = copy.deepcopy({"w": w, "opt": opt})
    for m in (w, twin["w"]):
        m.grad = torch.ones(8, 5)
    opt.step()
    twin["opt"].step()
    assert torch.equal(w, twin["w"])


def _muon64(w, grads, *, lr, mu, wd, adjust):
    """torch's Muon written out in float64 (Nesterov): B ← μB + (1−μ)G, N = (1−μ)G + μB, W ← W(1 − ηλ) − η·k·NS(N)."""
    w, buf = w.double().clone(), torch.zeros(w.shape, dtype=torch.float64)
    p, q = w.shape
    k = 0.2 * max(p, q) ** 0.5 if adjust == "match_rms_adamw" else max(1.0, p / q) ** 0.5
    for g in grads:
        buf = mu * buf + (1 - mu) * g.double()
        w = w * (1 - lr * wd) - lr * k * _ns64((1 - mu) * g.double() + mu * buf)
    return w


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)])
@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_muon_with_its_iteration_in_float32_is_the_float64_step_and_in_bfloat16_torchs(shape, adjust):
    from lordo.optim.hybrid import PrecisionMuon, muon_step

    torch.manual_seed(7)
    start = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(4)]
    ours32, ours16, ref = (nn.Parameter(start.clone()) for _ in range(3))
    opt32 = PrecisionMuon([ours32], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust, ns_dtype=torch.float32)
    muon = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    state16: dict = {ours16: {}}
    for g in grads:
        ours32.grad, ours16.grad, ref.grad = g.clone(), g.clone(), g.clone()
        opt32.step()
        muon.step()
        with torch.no_grad():  # the step's own loop in bfloat16: torch's step, operation for operation
            muon_step([ours16], [ours16.grad], state16, muon.param_groups[0], torch.bfloat16)
    assert torch.equal(ours16, ref)
    expected = _muon64(start, grads, lr=0.02, mu=0.95, wd=0.1, adjust=adjust)
    torch.testing.assert_close(ours32.double(), expected, rtol=0, atol=1e-5)
    assert (ref.double() - expected).abs().max() > 1e-4  # bfloat16's rounding is visible at this tolerance
    assert set(opt32.state[ours32]) == {"momentum_buffer"}  # torch's state: checkpoints interchange
    assert copy.deepcopy(opt32).ns_dtype == torch.float32  # a copy steps as the original


def test_muon_ns_dtype_reaches_both_muon_optimizers_and_is_checked():
    from lordo.optim.hybrid import PrecisionMuon

    for strategy in ("ddp", "lordo"):
        opt = lordo.distributed(make(), strategy, inner="muon", muon_ns_dtype="float32", rank=4)
        inner = opt.strategy.workers[0].optimizer
        muon = inner.muon if strategy == "ddp" else inner
        assert isinstance(muon, PrecisionMuon if strategy == "ddp" else LowRankMuon)
        assert (muon.ns_dtype if strategy == "ddp" else muon.muon.dtype) == torch.float32
    with pytest.raises(ConfigError, match="muon_ns_dtype must be one of.*bfloat16.*float32"):
        build_config(overrides=['optim.muon_ns_dtype="float16"'])
    with pytest.raises(ValueError, match="ns_dtype must be one of"):
        PrecisionMuon([nn.Parameter(torch.randn(4, 4))], ns_dtype=torch.float16)


@pytest.mark.parametrize("flags, overrides, device, noted", [
    ("fpu sse avx2 fma", [], "cpu", True),                                   # AVX2 only: bfloat16 GEMMs are slow
    ("fpu avx2 avx512f avx512_bf16", [], "cpu", False),                      # bfloat16 dot products
    ("fpu avx2 amx_bf16 amx_tile", [], "cpu", False),
    ("fpu sse avx2 fma", ['optim.muon_ns_dtype="float32"'], "cpu", False),   # already float32
    ("fpu sse avx2 fma", [], "cuda", False),                                 # not the CPU's iteration
    ("", [], "cpu", False),                                                  # flags unknown: nothing said
])
def test_a_note_suggests_float32_newton_schulz_on_a_cpu_without_bfloat16_matrix_instructions(flags, overrides, device,
                                                                                             noted):
    from lordo.train.runtime import muon_precision_note

    cfg = build_config(overrides=['optim.inner="muon"', *overrides])
    cpuinfo = f"processor\t: 0\nflags\t\t: {flags}\n" if flags else "processor\t: 0\n"
    note = muon_precision_note(cfg, torch.device(device), cpuinfo)
    assert (note is not None) == noted
    if noted:
        assert 'optim.muon_ns_dtype="float32"' in note
    assert muon_precision_note(build_config(), torch.device("cpu"), cpuinfo) is None  # Adam: nothing to say


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)])
@pytest.mark.parametrize("rank", [3, 16])
def test_the_split_form_is_torchs_muon_at_any_rank_while_the_basis_stays_and_omega_is_mu(shape, rank):
    """orthogonalise = "split": the momentum inside the basis is M (μ), the one outside it (1 − ω)/ω·E (ω). With
    ω = μ the two halves are one Muon momentum, so with the basis fixed the step is torch's Muon at any rank, the
    weight decay included: nothing is lost by keeping the momentum low-rank plus E."""
    from lordo.optim.hybrid import PrecisionMuon

    torch.manual_seed(17)
    ours = nn.Parameter(torch.randn(shape))
    ref = nn.Parameter(ours.detach().clone())
    opt = LowRankMuon([{"params": [ours], "rank": rank}], lr=0.02, momentum=0.9, omega=0.9, weight_decay=0.1,
                      ns_dtype=torch.float32, orthogonalise="split")
    opt.set_basis(ours, torch.linalg.qr(torch.randn(min(shape), min(rank, min(shape))))[0])
    muon = PrecisionMuon([ref], lr=0.02, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32,
                         adjust_lr_fn="match_rms_adamw")
    step_side_by_side(ours, opt, ref, muon, 6, rtol=2e-5, atol=2e-6)


def test_the_split_form_refuses_error_feedback_settings_it_cannot_read_as_a_momentum():
    w = nn.Parameter(torch.randn(8, 6))
    for options in ({"error_feedback": False}, {"qh_source": "grad"}, {"error_feedback_after_qh": "keep"}):
        with pytest.raises(ValueError, match="orthogonalise='split' keeps the momentum's part outside the basis"):
            LowRankMuon([{"params": [w], "rank": 2}], orthogonalise="split", **options)


def test_the_split_form_is_the_default_and_a_setting_it_cannot_read_is_refused_by_name():
    muon = ['strategy.name="lordo"', 'optim.inner="muon"']
    assert build_config(overrides=muon).optim.muon_orthogonalise == "split"
    assert LowRankMuon([nn.Parameter(torch.randn(8, 6))]).muon.orthogonalise == "split"
    for setting in ('strategy.error_feedback=false', 'strategy.qh_source="grad"', 'strategy.error_feedback_after_qh="keep"'):
        with pytest.raises(ConfigError, match='optim.muon_orthogonalise = "split".*use optim.muon_orthogonalise = "lowrank"'):
            build_config(overrides=[*muon, setting])
        lowrank = build_config(overrides=[*muon, setting, 'optim.muon_orthogonalise="lowrank"'])
        assert lowrank.optim.muon_orthogonalise == "lowrank"  # the r-dimensional form reads any of them
