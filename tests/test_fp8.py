"""The ``fp8`` storage of error feedback (optim/compact.py): e4m3 codes per block of 256 against a float64 reference
built from the format's definition, the optimizer's state held in it, and a saved state moving between formats."""

from __future__ import annotations

import pytest
import torch

from lordo.config import build_config
from lordo.errors import ConfigError
from lordo.optim import LowRankQHAdam, compact

from harness import random_steps, resumes_bit_identically


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value from its definition (1 sign, 4 exponent bits with bias 7, 3 mantissa bits;
    exponent 0 is subnormal; S.1111.111 is NaN), float64, sorted."""
    values = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            magnitude = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            values += [magnitude, -magnitude]
    return torch.tensor(sorted(set(values)), dtype=torch.float64)


def nearest(book: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The distance from each y to its nearest book value."""
    i = torch.searchsorted(book, y).clamp(1, len(book) - 1)
    return torch.minimum((book[i] - y).abs(), (book[i - 1] - y).abs())


def test_the_reference_has_e4m3s_448_and_its_smallest_subnormal():
    book = e4m3_values()
    assert len(book) == 253 and float(book.max()) == 448.0 and float(book[book > 0].min()) == 2.0**-9


def test_each_element_is_the_e4m3_value_nearest_to_it_over_its_block_s_scale():
    """x / (absmax / 448) rounded to the nearest e4m3 value, times the same scale: checked against the float64
    reference rounding (one float32 ulp of slack for the quotient formed in float32), over blocks whose magnitudes
    span every binade of the format, subnormals included, and an all-zero block."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.pow(10.0, -6 * torch.rand(64, 256, generator=gen))
    x[:, 0] = torch.where(torch.rand(64, generator=gen) < 0.5, -1.0, 1.0) * torch.rand(64, generator=gen) * 3
    x[7] = 0.0
    codes, scale = compact.encode(x.reshape(-1), compact.FP8)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    got = compact.decode(codes, scale, compact.FP8, x.shape).double()
    absmax = x.abs().amax(dim=1).double()
    step = (absmax / 448.0)[:, None]
    y = x.double() / step.clamp(min=1e-300)
    slack = 2.0**-23 * y.abs() + 1e-300
    assert ((got / step.clamp(min=1e-300) - y).abs() <= nearest(e4m3_values(), y) + slack).all()
    assert got[7].abs().max() == 0
    largest = x.abs().argmax(dim=1)
    assert torch.allclose(got.gather(1, largest[:, None]), x.double().gather(1, largest[:, None]), rtol=1e-6, atol=0)
    # the lookup decode reads each code as torch's own conversion does
    assert torch.equal(got.float(), (codes.float().view(64, 256) * scale[:, None]))


def test_the_error_is_a_sixteenth_of_each_element_above_the_subnormals_and_half_a_subnormal_step_below():
    x = torch.randn(256 * 40, generator=torch.Generator().manual_seed(1)) ** 5
    got = compact.decode(*compact.encode(x, compact.FP8), compact.FP8, x.shape)
    absmax = x.abs().view(-1, 256).amax(dim=1).repeat_interleave(256)
    normal = x.abs() >= absmax / 448 * 2.0**-6
    err = (got - x).abs()
    assert (err[normal] <= 2.0**-4 * x.abs()[normal] * (1 + 1e-6)).all()
    assert (err[~normal] <= (absmax / 448 * 2.0**-10)[~normal] * (1 + 1e-6)).all()
    assert normal.any() and (~normal).any()


def _toy(ef, seed: int = 0):
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(96, 64) * 0.02)
    b = torch.nn.Parameter(torch.randn(64) * 0.02)
    opt = LowRankQHAdam([{"params": [w], "rank": 4}, {"params": [b], "rank": None}], lr=1e-2, error_feedback_dtype=ef)
    return [w, b], opt


def test_an_fp8_error_feedback_steps_as_float32_first_and_stays_close():
    ref_params, ref = _toy(None)
    params, opt = _toy("fp8")
    random_steps(ref_params, ref, 0, 1)
    random_steps(params, opt, 0, 1)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))  # E was zero: only its storage rounds
    assert opt.state[params[0]]["error_feedback" + compact.CODES].dtype == torch.float8_e4m3fn
    random_steps(ref_params, ref, 1, 19)
    random_steps(params, opt, 1, 19)
    assert float((ref_params[0] - params[0]).norm() / ref_params[0].norm()) < 0.05
    e, e32 = opt.error_feedback(params[0]), ref.error_feedback(ref_params[0])
    assert float((e - e32).norm() / e32.norm()) < 0.15  # twenty steps of E rounded to e4m3, each within 2⁻⁴


def test_an_fp8_state_is_saved_as_float8_codes_and_resumes_bit_identically():
    def codes_kept(saved):
        assert saved["opt"]["state"][0]["error_feedback" + compact.CODES].dtype == torch.float8_e4m3fn

    resumes_bit_identically(lambda seed: _toy("fp8", seed=seed), random_steps, saved_check=codes_kept)


@pytest.mark.parametrize("saved, wanted", [("int8", "fp8"), ("fp8", "int8"), ("int8", "int4"), ("int4", "int8"),
                                           ("fp8", None), (None, "fp8")])
def test_a_state_saved_in_one_storage_of_e_loads_into_another(saved, wanted):
    """A run resumed with another error_feedback_dtype: E carries over, rounded once to the new format (a compact
    state in one format was read as the other before, which failed or corrupted E)."""
    params, opt = _toy(saved)
    random_steps(params, opt, 0, 3)
    e = opt.error_feedback(params[0]).clone()
    new_params, new = _toy(wanted, seed=1)
    for p, q in zip(new_params, params):
        p.data.copy_(q.data)
    new.load_state_dict(opt.state_dict())
    bound = {"int8": 0.0072, "int4": 1 / 14, "fp8": 2.0**-4, None: 0.0}[wanted] * float(e.abs().max())
    assert float((new.error_feedback(new_params[0]) - e).abs().max()) <= bound + 1e-9
    state = new.state[new_params[0]]
    if wanted is None:
        assert state["error_feedback"].dtype == torch.float32
    else:
        codes = state["error_feedback" + compact.CODES]
        assert (codes.dtype == torch.float8_e4m3fn) == (wanted == "fp8")
    random_steps(new_params, new, 3, 2)
    assert all(bool(torch.isfinite(p).all()) for p in new_params)


def test_fp8_is_a_setting_of_the_error_feedback_and_refused_where_int8_is():
    assert build_config(overrides=['strategy.error_feedback_dtype="fp8"']).strategy.error_feedback_dtype == "fp8"
    with pytest.raises(ConfigError, match="steps each matrix alone"):
        build_config(overrides=['strategy.error_feedback_dtype="fp8"', "optim.compile_step=true"])
    with pytest.raises(ValueError, match="'int8', 'int4' or 'fp8'"):
        LowRankQHAdam([torch.nn.Parameter(torch.randn(8, 8))], rank=2, error_feedback_dtype="fp4")
