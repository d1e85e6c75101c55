"""Compressed synchronisations (bf16, int8 per row) with error feedback, and the bf16 error-feedback buffer."""

import pytest
import torch

from lordo.comm import SimCommunicator
from lordo.comm.codec import Int8Rows, average
from lordo.comm.compress import (
    dequantize_int8_rows,
    dequantize_log_int8_rows,
    int8_payload_bytes,
    log_int8_payload_bytes,
    quantize_int8_rows,
    quantize_log_int8_rows,
)
from lordo.errors import ConfigError
from lordo.model import group_parameters
from lordo.optim import LowRankQHAdam
from lordo.strategies import build_strategy

from harness import batch, gloo_strategy_worker, one_thread, run_gloo, run_strategy, strategy_config, tiny_model


def test_int8_rows_error_is_at_most_half_a_step_and_zero_rows_stay_zero():
    torch.manual_seed(0)
    x = torch.randn(7, 13) * torch.logspace(-3, 2, 7)[:, None]  # rows of very different magnitudes
    x[3] = 0
    q, scale = quantize_int8_rows(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == (7,)
    expected_scale = x.abs().amax(dim=1) / 127  # by hand: the largest element of a row maps to ±127
    torch.testing.assert_close(scale, expected_scale)
    err = (dequantize_int8_rows(q, scale) - x).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6) + 1e-30).all())
    assert bool((q[3] == 0).all())
    assert int(q.abs().amax(dim=1)[torch.arange(7) != 3].min()) == 127
    v = torch.tensor([0.5, -1.0, 0.25])  # a vector is one row
    q, scale = quantize_int8_rows(v)
    assert q.tolist() == [64, -127, 32] and scale.tolist() == pytest.approx([1 / 127])
    assert int8_payload_bytes(torch.zeros(7, 13)) == 7 * 13 + 4 * 7


def two_workers(compress, feedback=True, steps=8, name="lordo"):
    comm = SimCommunicator(2)
    cfg = strategy_config(name, ["strategy.sync_every=4", "strategy.rank=4", f'strategy.compress="{compress}"',
                                 f"strategy.compress_feedback={str(feedback).lower()}"])
    return run_strategy(comm, cfg, steps)


def test_log_int8_rows_keep_every_positive_element_within_the_promised_factor():
    torch.manual_seed(1)
    x = torch.rand(6, 50).pow(6) * torch.logspace(-14, -4, 6)[:, None]  # Adam-like second moments, wide ranges
    x[0, 7] = 0.0  # an exact zero stays zero
    x[5] = 0.0  # so does a row of zeros
    x[4] = 3e-9  # a constant row comes back exactly (up to exp/log rounding)
    codes, bounds = quantize_log_int8_rows(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and bounds.shape == (6, 2)
    y = dequantize_log_int8_rows(codes, bounds)
    positive = x > 0
    logs = x.clamp(min=1e-45).log()
    # by hand: per row lo = min ln x, hi = max ln x over the positive elements; the factor is exp((hi − lo)/508)
    lo = torch.where(positive, logs, torch.inf).amin(dim=1)
    hi = torch.where(positive, logs, -torch.inf).amax(dim=1)
    for r in range(5):
        torch.testing.assert_close(bounds[r], torch.stack([lo[r], hi[r]]))
        factor = float(torch.exp((hi[r] - lo[r]) / 508)) * (1 + 1e-5)
        ratio = y[r][positive[r]] / x[r][positive[r]]
        assert float(ratio.max()) <= factor and float(ratio.min()) >= 1 / factor
    assert float(y[0, 7]) == 0.0 and bool((y[5] == 0).all()) and int(codes[0, 7]) == -128
    torch.testing.assert_close(y[4], x[4], rtol=1e-5, atol=0)
    assert bool((y >= 0).all())
    assert log_int8_payload_bytes(torch.zeros(6, 50)) == 6 * 50 + 8 * 6


def test_error_feedback_delivers_everything_over_rounds():
    """Per worker: what was sent (decoded) over the rounds plus what is still held back equals the sum of the
    tensors it had to send. ``comm.codec.average`` driven directly on a tiny model's shapes, 5 rounds. (int8
    payloads are summed in float32 after decoding; bf16 ones are summed in bf16 on the wire, which rounds
    the sum itself, so this identity is int8's.)"""
    codec = Int8Rows()
    comm = SimCommunicator(2)
    torch.manual_seed(5)
    shapes = [p.shape for p in tiny_model().parameters()]
    residuals = [[torch.zeros(s) for s in shapes] for _ in range(2)]
    inputs = [[[torch.randn(s) for s in shapes] for _ in range(2)] for _ in range(5)]
    sent_sum = [[torch.zeros(s) for s in shapes] for _ in range(2)]
    mean_sum = [torch.zeros(s) for s in shapes]
    for round_inputs in inputs:
        pseudo = [[t.clone() for t in w] for w in round_inputs]
        before = [[e.clone() for e in w] for w in residuals]
        average(comm, pseudo, "pseudo_gradient", codec, residuals)
        for w in range(2):
            for i in range(len(shapes)):
                sent_sum[w][i] += round_inputs[w][i] + before[w][i] - residuals[w][i]
        for i in range(len(shapes)):
            mean_sum[i] += pseudo[0][i]
            torch.testing.assert_close(pseudo[1][i], pseudo[0][i], rtol=0, atol=0)  # both workers agree exactly
    for i in range(len(shapes)):
        total_in = sum(inputs[k][w][i] for k in range(5) for w in range(2)) / 2
        held_back = (residuals[0][i] + residuals[1][i]) / 2
        # everything averaged so far plus what is held back is the exact mean of all inputs
        torch.testing.assert_close(mean_sum[i] + held_back, total_in, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mean_sum[i], (sent_sum[0][i] + sent_sum[1][i]) / 2, rtol=1e-5, atol=1e-5)
    assert {k.split(":")[1] for k in comm.ledger.entries} == {f"pseudo_gradient_{codec.name}"}


@pytest.mark.parametrize("compress", ["bf16", "int8"])
def test_compressed_lordo_stays_close_to_uncompressed_and_counts_its_bytes(compress):
    params, ledger = two_workers(compress)
    reference, ref_ledger = two_workers("none")
    for a, b in zip(params, reference):
        torch.testing.assert_close(a, b, rtol=0.05, atol=2e-3)
    n = sum(p.numel() for p in tiny_model().parameters())
    if compress == "int8":
        per_round = sum(int8_payload_bytes(p) for p in tiny_model().parameters())
        assert ledger["all_gather:pseudo_gradient_int8"] == {"calls": 2, "bytes": 2 * per_round, "tensors": 2 * 2 * len(params)}
    else:
        assert ledger["all_reduce:pseudo_gradient_bf16"]["bytes"] == 2 * 2 * n
    assert ref_ledger["all_reduce:pseudo_gradient"]["bytes"] == 2 * 4 * n
    moments = ref_ledger["all_reduce:exp_avg"]["bytes"]  # fp32, one sync = 4 bytes per element
    if compress == "int8":  # int8 moments: 1 byte per element plus 4 (exp_avg) or 8 (exp_avg_sq) per row
        assert moments == ref_ledger["all_reduce:exp_avg_sq"]["bytes"]
        assert ledger["all_gather:exp_avg_int8"]["bytes"] < moments / 4 * 1.5
        assert ledger["all_gather:exp_avg_sq_int8"]["bytes"] > ledger["all_gather:exp_avg_int8"]["bytes"]
    else:
        assert ledger["all_reduce:exp_avg_bf16"]["bytes"] * 2 == moments


def test_compression_on_gloo_matches_the_simulator():
    with one_thread():  # bit for bit: int8 rounding would amplify a last-bit difference into a quantum
        sim, sim_ledger = two_workers("int8", steps=8)
    results = run_gloo(gloo_strategy_worker, 2, "lordo",
                       ["strategy.sync_every=4", "strategy.rank=4", 'strategy.compress="int8"'], 8)
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok", value
        params, ledger = value
        for a, b in zip(params, sim):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert ledger == sim_ledger


def test_compression_state_survives_a_state_dict_round_trip():
    comm = SimCommunicator(2)
    cfg = strategy_config("lordo", ["strategy.sync_every=4", "strategy.rank=4", 'strategy.compress="int8"'])
    models = [tiny_model(), tiny_model()]
    strategy = build_strategy(cfg, models, [group_parameters(m) for m in models], comm)
    for step in range(5):
        for rank, m in enumerate(models):
            m(*batch(rank, step))[1].backward()
        strategy.step(1e-2)
    state = strategy.state_dict()
    assert any(bool(e.abs().sum() > 0) for e in state["workers"][1]["compression_error"])
    models2 = [tiny_model(), tiny_model()]
    other = build_strategy(cfg, models2, [group_parameters(m) for m in models2], SimCommunicator(2))
    other.load_state_dict(state)
    for a, b in zip(other.workers[1].residuals, strategy.workers[1].residuals, strict=True):
        assert torch.equal(a, b)
    assert strategy.state_bytes()["compression_feedback"] == 4 * sum(p.numel() for p in models[0].parameters())


def test_compress_needs_a_local_update_strategy():
    with pytest.raises(ConfigError, match="strategy.compress applies to the synchronisations of local-adam"):
        strategy_config("ddp", ['strategy.compress="int8"'])
    with pytest.raises(ConfigError, match=r"strategy.compress must be one of 'none', 'bf16', 'int8', got 'fp8'"):
        strategy_config("lordo", ['strategy.compress="fp8"'])


def test_bf16_error_feedback_buffer_halves_the_state_and_tracks_the_fp32_one():
    torch.manual_seed(2)
    w32, w16 = (torch.nn.Parameter(torch.randn(24, 10)) for _ in range(2))
    with torch.no_grad():
        w16.copy_(w32)
    opt32 = LowRankQHAdam([{"params": [w32], "rank": 3}], lr=1e-2, omega=0.9)
    opt16 = LowRankQHAdam([{"params": [w16], "rank": 3}], lr=1e-2, omega=0.9, error_feedback_dtype=torch.bfloat16)
    for _ in range(4):
        g = torch.randn(24, 10)
        w32.grad, w16.grad = g.clone(), g.clone()
        opt32.step()
        opt16.step()
    e16, e32 = opt16.error_feedback(w16), opt32.error_feedback(w32)
    assert e16.dtype == torch.bfloat16
    torch.testing.assert_close(e16.float(), e32, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w16, w32, rtol=1e-3, atol=1e-4)
    assert opt16.state_bytes()["error_feedback"] * 2 == opt32.state_bytes()["error_feedback"] == 24 * 10 * 4
