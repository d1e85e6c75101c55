"""Low-rank moments held in 8 bits (``lowrank_moments_dtype = "int8"``): the step, the rotation into a new basis and
the average over the workers against float32 / float64 references, checkpoints, simulator = gloo, bad settings."""

import io

import pytest
import torch
from test_memory import build
from test_memory import train as _train

from lordo.errors import ConfigError
from lordo.optim import LowRankQHAdam, compact
from lordo.optim.lowrank import rotate_moments
from lordo.optim.state import moment_shape
from lordo.optim.subspace import side_of

from harness import assert_simulator_equals_gloo, strategy_config, tiny_model

INT8 = ['strategy.lowrank_moments_dtype="int8"', "strategy.rank=16"]


def _largest_gap(fmt) -> float:
    book = compact.code_book(fmt, torch.device("cpu")).double()
    return float((book[1:] - book[:-1]).max())


# rounding bounds from the code books, in units of a block's largest magnitude: u is rounded to the nearest code
# (within half the largest gap), v's root stochastically to one of the two codes around it (within one gap)
HALF_STEP, ROOT_STEP = _largest_gap(compact.INT8) / 2, _largest_gap(compact.UINT8)


def _toy(int8: bool, seed: int = 0):
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(96, 64) * 0.02)  # moments 96 x 16 = 1,536 entries: held compact
    small = torch.nn.Parameter(torch.randn(40, 24) * 0.02)  # moments 40 x 16 = 640: too small, float32
    options = {"lowrank_moments_dtype": "int8"} if int8 else {}
    return [w, small], LowRankQHAdam([{"params": [w, small], "rank": 16}], lr=1e-2, **options)


def _steps(params, opt, start: int, n: int) -> None:
    for t in range(start, start + n):
        g = torch.Generator().manual_seed(t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _moments(opt, p):
    """(u, v) of ``p`` as float32, decoded where held compact."""
    state, shape = opt.state[p], moment_shape(p, 16)
    return tuple(compact.load(state, k, f, shape).clone() for k, f in (("exp_avg", compact.INT8), ("exp_avg_sq", compact.UINT8)))


def _within_rounding(got: torch.Tensor, ref: torch.Tensor, root: bool = False) -> None:
    if root:
        got, ref = got.clamp(min=0).sqrt(), ref.clamp(min=0).sqrt()
    bound = (ROOT_STEP if root else HALF_STEP) * float(ref.abs().max()) * 1.001
    assert float((got.double() - ref.double()).abs().max()) <= bound


def test_the_moments_are_held_in_8_bits_where_large_enough_and_the_step_stays_close_to_float32():
    ref_params, ref = _toy(False)
    params, lean = _toy(True)
    _steps(ref_params, ref, 0, 1)
    _steps(params, lean, 0, 1)
    w, small = params
    assert set(lean.state[w]) >= {"exp_avg.codes", "exp_avg.scale", "exp_avg_sq.codes", "exp_avg_sq.scale"}
    assert "exp_avg" in lean.state[small] and lean.state[small]["exp_avg"].dtype == torch.float32
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)  # zero moments: the first step computed in float32 is the same; only storage rounds
    u_ref, v_ref = ref.state[ref_params[0]]["exp_avg"], ref.state[ref_params[0]]["exp_avg_sq"]
    u, v = _moments(lean, w)
    _within_rounding(u, u_ref)
    _within_rounding(v, v_ref, root=True)
    _steps(ref_params, ref, 1, 19)
    _steps(params, lean, 1, 19)
    for a, b in zip(ref_params, params):  # 20 steps of random gradients at lr 1e-2: the rounding stays small
        assert float((a - b).detach().norm() / a.detach().norm()) < 0.05
    measured = lean.state_bytes()["lowrank_moments"]
    assert measured == 2 * compact.nbytes(compact.INT8, 96 * 16) + 2 * 4 * 40 * 16  # w compact, small float32


def test_a_new_basis_rotates_the_decoded_moments_as_float64_would_rounded_once():
    params, opt = _toy(True)
    _steps(params, opt, 0, 5)
    w = params[0]
    u, v = (m.double() for m in _moments(opt, w))
    old = opt.state[w]["basis"].double()
    new = torch.linalg.qr(torch.randn(64, 16, dtype=torch.float64))[0]
    rotate_moments(u, v, old, new, side_of(w.shape), int(opt.state[w]["step"]), 0.9, 0.999)  # the float64 reference
    opt.set_basis(w, new.float())
    got_u, got_v = _moments(opt, w)
    assert "exp_avg.codes" in opt.state[w]  # held compact again
    _within_rounding(got_u, u)
    _within_rounding(got_v, v, root=True)


def _build(overrides=(), workers: int = 2):
    return build("lordo", workers, ["strategy.sync_every=4", *INT8, *overrides], model=lambda: tiny_model(d_model=64))


def test_a_synchronisation_averages_the_decoded_moments_and_every_worker_holds_the_same_codes():
    strategy, models = _build(workers=3)
    _train(strategy, models, 3)  # before the first synchronisation (step 4)
    compacted = [p for p in strategy.averaged_params(0) if "exp_avg.codes" in strategy.workers[0].optimizer.state[p]]
    assert compacted, "the wider model's low-rank moments should be held compact"
    before = [[_moments(w.optimizer, p) for p in strategy.averaged_params(i)] for i, w in enumerate(strategy.workers)]
    strategy.average_moments(True)
    for j, p0 in enumerate(strategy.averaged_params(0)):
        for k, root in ((0, False), (1, True)):
            mean = sum(before[i][j][k].double() for i in range(3)) / 3  # float64 reference
            for i, w in enumerate(strategy.workers):
                _within_rounding(_moments(w.optimizer, strategy.averaged_params(i)[j])[k], mean, root)
        key = "exp_avg.codes"
        if key in strategy.workers[0].optimizer.state[p0]:  # same mean, same seed: the same codes on every worker
            codes = [w.optimizer.state[strategy.averaged_params(i)[j]][key] for i, w in enumerate(strategy.workers)]
            assert all(torch.equal(codes[0], c) for c in codes[1:])


def test_a_checkpoint_holds_the_codes_and_a_resumed_run_is_bit_identical():
    straight, models = _build()
    _train(straight, models, 7)
    expected = [p.detach().clone() for p in models[0].parameters()]
    first, models = _build()
    _train(first, models, 5)
    buf = io.BytesIO()
    torch.save({"models": [m.state_dict() for m in models], "strategy": first.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert any("exp_avg.codes" in s for s in saved["strategy"]["workers"][0]["optimizer"]["state"].values())
    second, models = _build()
    for m, s in zip(models, saved["models"]):
        m.load_state_dict(s)
    second.load_state_dict(saved["strategy"])
    _train(second, models, 2, start=5)
    for a, b in zip(expected, models[0].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("delay", [0, 2])
def test_the_simulator_and_gloo_give_the_same_trajectory_with_8_bit_moments(delay):
    assert_simulator_equals_gloo("lordo", ["strategy.sync_every=3", f"strategy.sync_delay={delay}", *INT8], d_model=64)


@pytest.mark.parametrize(("name", "extra", "message"), [
    ("local-adam", [], "applies to LoRDO's inner optimizer"),
    ("lordo", ['optim.inner="muon"'], "Muon"),
    ("lordo", ["optim.compile_step=true"], "compile_step"),
])
def test_bad_settings_are_refused_by_name(name, extra, message):
    with pytest.raises(ConfigError, match=message):
        strategy_config(name, ['strategy.lowrank_moments_dtype="int8"', *extra])


def test_the_optimizer_refuses_other_storages_and_the_muon_form():
    w = torch.nn.Parameter(torch.randn(96, 64))
    with pytest.raises(ValueError, match="lowrank_moments_dtype must be"):
        LowRankQHAdam([w], rank=16, lowrank_moments_dtype="int4")
    from lordo.optim import LowRankMuon

    with pytest.raises(ValueError, match="LowRankMuon keeps its momentum in float32"):
        LowRankMuon([{"params": [w], "rank": 16}], lowrank_moments_dtype="int8")


def test_a_float32_state_loads_into_8_bit_moments_and_back():
    params, plain = _toy(False)
    _steps(params, plain, 0, 4)
    u, v = (m.clone() for m in _moments(plain, params[0]))
    params8, opt8 = _toy(True)
    opt8.load_state_dict(plain.state_dict())
    assert "exp_avg.codes" in opt8.state[params8[0]]  # held as this optimizer's storage asks
    got_u, got_v = _moments(opt8, params8[0])
    _within_rounding(got_u, u)
    _within_rounding(got_v, v, root=True)
    params32, opt32 = _toy(False)
    opt32.load_state_dict(opt8.state_dict())
    assert opt32.state[params32[0]]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt32.state[params32[0]]["exp_avg"], got_u)  # the codes decoded, nothing more lost


def test_a_delayed_round_merges_the_decoded_moments_as_the_float_rule_says():
    """A round in flight holds float32 copies of the moments it sent; landing it after τ = 1 local step sets each
    worker's moments to u(s+τ) + β^τ·(ū(s) − u(s)) (strategies/delayed.py), computed here in float64 from the
    decoded moments and the round's copies, within one rounding (the outer step, which would rotate the moments into
    new bases, is left out)."""
    strategy, models = _build(["strategy.sync_delay=2"])
    _train(strategy, models, 4)  # step 4: the round starts
    r = strategy.in_flight
    assert r is not None and set(r.moments) == {"exp_avg", "exp_avg_sq"}
    _train(strategy, models, 1, start=4)  # one local step behind it
    r.wait()
    held = [[_moments(w.optimizer, p) for p in strategy.averaged_params(i)] for i, w in enumerate(strategy.workers)]
    strategy.apply_round = lambda delta, own=None: {}  # the merge of the moments alone
    strategy.land()
    compacted = 0
    for k, (key, beta) in enumerate((("exp_avg", 0.9), ("exp_avg_sq", 0.999))):
        sent, means = r.moments[key]
        for i, w in enumerate(strategy.workers):
            for j, p in enumerate(strategy.averaged_params(i)):
                expected = held[i][j][k].double() + beta * (means[i][j].double() - sent[i][j].double())
                _within_rounding(_moments(w.optimizer, p)[k], expected, root=k == 1)
                compacted += f"{key}.codes" in w.optimizer.state[p]
    assert compacted
