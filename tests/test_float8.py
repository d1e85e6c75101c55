"""The e4m3 moment storage (optim/float8.py; ``moments_dtype`` and ``lowrank_moments_dtype`` ``"fp8"``): √v rounded
stochastically by arithmetic against a float64 reference built from the format's definition, its draws, the same
codes encoded in parts, compiled or eagerly, and the optimizers holding their moments so."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_fp8 import e4m3_values

from lordo.config import build_config
from lordo.optim import LowRankQHAdam, compact, float8
from lordo.optim.hybrid import MuonAdamW

from harness import random_steps, resumes_bit_identically


def test_the_draws_are_uniform_on_a_2_to_the_minus_20_grid_and_a_function_of_seed_and_index():
    u = float8.uniform(1 << 20, seed=7, device=torch.device("cpu"))
    assert u.dtype == torch.float32 and float(u.min()) >= 0 and float(u.max()) < 1
    assert torch.equal(u * 2**20, (u * 2**20).floor())
    assert abs(float(u.double().mean()) - 0.5) < 3 * (1 / 12) ** 0.5 / 2**10  # 3 sigma of the mean of 2^20 draws
    assert abs(float(u.double().var()) - 1 / 12) < 1e-3
    counts = torch.histc(u, bins=16, min=0, max=1)
    assert float((counts - 2**16).abs().max()) < 5 * 2**8  # each sixteenth within 5 sigma
    assert torch.equal(float8.uniform(1000, seed=7, device=torch.device("cpu"), offset=5000), u[5000:6000])
    assert not torch.equal(float8.uniform(1000, seed=8, device=torch.device("cpu")), u[:1000])


def _root_ratios(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded √x / scale, exact √x / scale), float64, of ``x`` stored in ufp8 with ``seed``."""
    codes, scale = compact.encode(x, compact.UFP8, seed=seed)
    got = compact.decode(codes, scale, compact.UFP8, x.shape).double().sqrt().view(-1, 256)
    step = (x.double().sqrt().view(-1, 256).amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-300)  # an all-zero block: 0
    return got / step, x.double().sqrt().view(-1, 256) / step


def test_each_root_lands_on_one_of_its_two_e4m3_neighbours():
    """√x over the block's scale is rounded down or up to an e4m3 value, never further (subnormals included); the
    block's largest element is exact."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(32, 256, generator=gen) * torch.pow(10.0, -8 * torch.rand(32, 256, generator=gen))
    x[5] = 0.0
    got, y = _root_ratios(x.reshape(-1), seed=3)
    book = e4m3_values()
    below = book[(torch.searchsorted(book, y, right=True) - 1).clamp(min=0)]
    above = book[torch.searchsorted(book, y).clamp(max=len(book) - 1)]
    slack = 2.0**-20 * y + 1e-300  # y formed in float32, the decoded square in float32
    assert ((got >= below - slack) & (got <= above + slack)).all()
    assert (got - y).abs().max() > 0  # not all exact: the test can fail
    assert got[5].abs().max() == 0 and torch.allclose(got.amax(dim=1)[y.amax(dim=1) > 0], torch.tensor(448.0, dtype=torch.float64))


def test_the_rounding_is_unbiased_at_every_magnitude():
    """The mean over 400 seeds of the decoded √x is √x within the draws' standard error (half an e4m3 step per
    draw at most), from the top binade down into the subnormals; the nearest rounding would miss by up to the
    step's half where stochastic rounding's mean does not."""
    y_values = torch.tensor([447.0, 300.3, 100.7, 10.37, 1.011, 0.1003, 0.0101, 0.0031, 0.00107])  # √x / scale
    x = torch.zeros(256)
    x[0] = 448.0**2
    x[1:1 + len(y_values)] = y_values.square()
    x = x.repeat(64)  # 64 blocks: 64 draws of each value per seed
    means = torch.stack([_root_ratios(x, seed)[0] for seed in range(400)]).mean(dim=(0, 1))
    book = e4m3_values()
    for k, y in enumerate(y_values.double(), start=1):
        i = torch.searchsorted(book, y)
        step = float(book[i] - book[i - 1])
        error = abs(float(means[k]) - float(y))
        assert error < 4 * (step / 2) / (400 * 64) ** 0.5, (float(y), error, step)
        assert step > 0


def test_a_large_tensor_encoded_in_parts_has_the_codes_of_one_encoded_whole():
    x = torch.randn(3 * compact.CODEC_CHUNK + 1000, generator=torch.Generator().manual_seed(1))
    for fmt in (compact.FP8, compact.UFP8):
        parts = compact.encode(x, fmt, seed=11)
        whole = float8.encode(x, 11, fmt.root, fmt.stochastic)
        assert torch.equal(parts[0].view(torch.uint8), whole[0].view(torch.uint8)) and torch.equal(parts[1], whole[1])


@pytest.fixture
def compiled_codec():
    float8._kernel.cache_clear()
    float8._failed.clear()
    float8.use_compiled(True)
    yield
    float8.use_compiled(False)
    float8._kernel.cache_clear()
    float8._failed.clear()


@pytest.mark.slow
def test_the_compiled_codec_writes_the_eager_codes(compiled_codec):
    """torch.compile'd encode and decode (one dynamic compile each) against the eager functions, bit for bit, at two
    sizes (one not a multiple of the block) and both formats."""
    try:  # a machine that compiles nothing (no C++ compiler) is not this test's subject
        torch.compile(lambda t: t * 2 + 1)(torch.ones(8))
    except Exception as exc:
        pytest.skip(f"torch.compile does not work here: {type(exc).__name__}")
    gen = torch.Generator().manual_seed(2)
    for n in (256 * 40, 256 * 97 + 13):
        x = torch.randn(n, generator=gen) * torch.pow(10.0, -4 * torch.rand(n, generator=gen))
        for fmt in (compact.FP8, compact.UFP8):
            codes, scale = compact.encode(x, fmt, seed=5)
            eager_codes, eager_scale = float8._encode(x, *float8._keys(5, 0, x.device), torch.tensor(448.0), fmt.root,
                                                      fmt.stochastic)
            assert torch.equal(codes.view(torch.uint8), eager_codes.view(torch.uint8)) and torch.equal(scale, eager_scale)
            assert torch.equal(compact.decode(codes, scale, fmt, x.shape), float8._decode(codes, scale, n, fmt.root))
    assert not float8._failed


def test_a_codec_that_cannot_be_compiled_warns_once_and_writes_the_same_codes(compiled_codec, monkeypatch):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    x = torch.rand(4096)
    with pytest.warns(RuntimeWarning, match="could not be compiled.*no C\\+\\+ compiler"):
        codes, scale = compact.encode(x, compact.UFP8, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = compact.encode(x, compact.UFP8, seed=1)
    eager = float8._encode(x, *float8._keys(1, 0, x.device), torch.tensor(448.0), True, True)
    assert torch.equal(codes.view(torch.uint8), eager[0].view(torch.uint8)) and torch.equal(again[1], eager[1])


def _toy(moments, seed: int = 0):
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(256, 64) * 0.02)  # r = 32: 8,192 low-rank moment entries
    emb = torch.nn.Parameter(torch.randn(128, 64) * 0.02)  # full-rank, 8,192 entries
    opt = LowRankQHAdam([{"params": [w], "rank": 32}, {"params": [emb], "rank": None}], lr=1e-2,
                        moments_dtype=moments, lowrank_moments_dtype=moments)
    return [w, emb], opt


def test_fp8_moments_step_close_to_float32_and_are_held_as_e4m3_codes():
    ref_params, ref = _toy(None)
    params, opt = _toy("fp8")
    random_steps(ref_params, ref, 0, 20)
    random_steps(params, opt, 0, 20)
    for key in ("exp_avg", "exp_avg_sq"):
        for p in params:
            assert opt.state[p][key + compact.CODES].dtype == torch.float8_e4m3fn and key not in opt.state[p]
    start, _ = _toy(None)
    for a, b, w0 in zip(ref_params, params, start):
        drift = float((a - b).norm() / (a - w0).norm())  # against the twenty steps' own size
        # each m rounded to within 2⁻⁴ of itself, each √v within 2⁻³ (stochastically, unbiased): the update's error
        # stays below the larger of the two (int8 moments: 1.7 % on this toy; e4m3: 5.3 %)
        assert 0 < drift < 2.0**-3, drift


def test_fp8_moments_resume_bit_identically_and_load_into_int8_and_back():
    def codes_kept(saved):
        assert saved["opt"]["state"][1]["exp_avg_sq" + compact.CODES].dtype == torch.float8_e4m3fn

    resumes_bit_identically(lambda seed: _toy("fp8", seed=seed), random_steps, saved_check=codes_kept)
    params, opt = _toy("fp8")
    random_steps(params, opt, 0, 3)
    moments = {k: opt.state[params[1]][k + compact.CODES] for k in ("exp_avg", "exp_avg_sq")}
    v = compact.load(opt.state[params[1]], "exp_avg_sq", compact.UFP8, params[1].shape)
    for wanted, dtype in (("int8", torch.uint8), (None, None)):
        new_params, new = _toy(wanted, seed=1)
        for p, q in zip(new_params, params):
            p.data.copy_(q.data)
        new.load_state_dict(opt.state_dict())
        state = new.state[new_params[1]]
        if dtype is None:
            assert torch.equal(state["exp_avg_sq"], v)  # expanded exactly
        else:
            assert state["exp_avg_sq" + compact.CODES].dtype == dtype
        random_steps(new_params, new, 3, 2)
        assert all(bool(torch.isfinite(p).all()) for p in new_params)
    assert moments["exp_avg"].dtype == torch.float8_e4m3fn


def test_muloco_s_state_can_be_fp8_and_steps_close_to_float32():
    def build(moments_dtype):
        torch.manual_seed(0)
        emb, lin = torch.nn.Parameter(torch.randn(128, 64)), torch.nn.Parameter(torch.randn(128, 64) * 0.1)
        opt = MuonAdamW([{"params": [lin], "muon": True}, {"params": [emb], "muon": False}], lr=1e-2,
                        ns_dtype=torch.float32, moments_dtype=moments_dtype)
        return [emb, lin], opt

    (ref_params, ref), (params, opt) = build("float32"), build("fp8")
    random_steps(ref_params, ref, 0, 10)
    random_steps(params, opt, 0, 10)
    assert opt.state[params[1]]["momentum_buffer" + compact.CODES].dtype == torch.float8_e4m3fn
    assert opt.state[params[0]]["exp_avg_sq" + compact.CODES].dtype == torch.float8_e4m3fn
    start, _ = build("float32")
    for a, b, w0 in zip(ref_params, params, start):
        assert 0 < float((a - b).norm() / (a - w0).norm()) < 2.0**-3


def test_fp8_moments_and_the_compiled_codec_are_settings():
    cfg = build_config(overrides=['strategy.moments_dtype="fp8"', 'strategy.lowrank_moments_dtype="fp8"',
                                  "optim.compile_codec=true"])
    assert (cfg.strategy.moments_dtype, cfg.strategy.lowrank_moments_dtype, cfg.optim.compile_codec) == ("fp8", "fp8", True)
    # where no state is fp8 it compiles nothing (a sweep sets it in its base for every point, its float32 reference too)
    assert build_config(overrides=["optim.compile_codec=true"]).optim.compile_codec
    with pytest.raises(ValueError, match="'int8' or 'fp8'"):
        LowRankQHAdam([torch.nn.Parameter(torch.randn(8, 8))], rank=2, moments_dtype="fp4")
