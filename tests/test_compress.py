"""Compressed synchronisations (bf16; int8 and int4 by a quantised reduce-scatter and all-gather) with error
feedback, and the bf16 error-feedback buffer."""

import math
import random

import pytest
import torch

from lordo.comm import SimCommunicator
from lordo.comm.codec import BlockCodec, add_shard, average, padded_numel, shard_numel
from lordo.comm.compress import (
    dequantize_int8_rows,
    dequantize_log_int8_rows,
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


@pytest.mark.parametrize("codec", [BlockCodec(bits=8, block=16), BlockCodec(bits=4, block=16)], ids=["int8", "int4"])
def test_block_codec_round_trip_error_is_at_most_half_a_step(codec):
    torch.manual_seed(1)
    x = torch.randn(64) * torch.logspace(-3, 1, 4).repeat_interleave(16)  # blocks of very different scales
    buf = codec.encode(x)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes(64) == 64 * codec.bits // 8 + 4 * 4
    y = codec.decode(buf, 64)
    levels = 127 if codec.bits == 8 else 7
    half_step = (x.reshape(4, 16).abs().amax(dim=1) / levels / 2).repeat_interleave(16)
    assert bool(((y - x).abs() <= half_step * (1 + 1e-5) + 1e-12).all())
    assert torch.equal(codec.decode(codec.encode(torch.zeros(32)), 32), torch.zeros(32))


def unpad(flat, shapes, block):
    """The elements of a block-aligned flat vector (comm.codec's layout) that belong to tensors."""
    parts, offset = [], 0
    for s in shapes:
        parts.append(flat[offset:offset + math.prod(s)])
        offset += math.ceil(math.prod(s) / block) * block
    return torch.cat(parts)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bits", [8, 4])
def test_sharded_error_feedback_delivers_everything_over_rounds(bits, world):
    """Quantised reduce-scatter + all-gather with error feedback of both encodings: over the rounds, what was
    delivered plus what the workers (first encoding) and the shard owners (second) still hold is the exact
    mean of everything sent. ``comm.codec.average`` driven directly on a tiny model's shapes, 5 rounds."""
    codec = BlockCodec(bits=bits, block=32)
    comm = SimCommunicator(world)
    torch.manual_seed(5)
    shapes = [p.shape for p in tiny_model().parameters()]
    numel = sum(math.prod(s) for s in shapes)
    shard = shard_numel(padded_numel(shapes, codec), world, codec)
    residuals = [[torch.zeros(s) for s in shapes] for _ in range(world)]
    shard_residuals = [torch.zeros(shard) for _ in range(world)]
    delivered = torch.zeros(numel)
    exact = torch.zeros(numel)
    for _ in range(5):
        inputs = [[torch.randn(s) for s in shapes] for _ in range(world)]
        exact += sum(torch.cat([t.reshape(-1) for t in w]) for w in inputs) / world
        average(comm, inputs, "pseudo_gradient", codec, residuals, shard_residuals)
        for w in range(1, world):  # every worker holds the same result, bit for bit
            assert all(torch.equal(a, b) for a, b in zip(inputs[w], inputs[0]))
        delivered += torch.cat([t.reshape(-1) for t in inputs[0]])
    held_by_workers = sum(torch.cat([e.reshape(-1) for e in r]) for r in residuals) / world
    held_by_owners = unpad(torch.cat(shard_residuals), shapes, codec.block)
    torch.testing.assert_close(delivered + held_by_workers + held_by_owners, exact, rtol=1e-5, atol=1e-5)
    assert float((delivered - exact).abs().max()) > 1e-3  # compression did lose something each round
    entries = comm.ledger.table()
    tag = f"pseudo_gradient_int{bits}"
    shard_bytes = codec.nbytes(shard)
    assert entries[f"all_to_all:{tag}"] == {"calls": 5, "bytes": 5 * world * shard_bytes, "tensors": 5 * world,
                                           "wire": 5 * (world - 1) * shard_bytes}
    assert entries[f"all_gather:{tag}"]["wire"] == 5 * (world - 1) * shard_bytes


@pytest.mark.parametrize("compress", ["bf16", "int8", "int4"])
def test_compressed_lordo_stays_close_to_uncompressed_and_counts_its_bytes(compress):
    params, ledger = two_workers(compress)
    reference, ref_ledger = two_workers("none")
    for a, b in zip(params, reference):
        torch.testing.assert_close(a, b, rtol=0.05, atol=2e-3 if compress != "int4" else 1e-2)
    n = sum(p.numel() for p in tiny_model().parameters())
    assert ref_ledger["all_reduce:pseudo_gradient"]["bytes"] == 2 * 4 * n
    full = ref_ledger["all_reduce:pseudo_gradient"]["wire"]  # two syncs of 2 workers: 2 x 2(M-1)/M x 4n
    assert full == 2 * 4 * n
    if compress == "bf16":
        assert ledger["all_reduce:pseudo_gradient_bf16"]["wire"] * 2 == full
        assert ledger["all_reduce:exp_avg_bf16"]["bytes"] * 2 == ref_ledger["all_reduce:exp_avg"]["bytes"]
        return
    sent = ledger[f"all_to_all:pseudo_gradient_{compress}"]["wire"] + ledger[f"all_gather:pseudo_gradient_{compress}"]["wire"]
    codec = BlockCodec(bits=int(compress[3:]), block=256 if compress == "int8" else 128)
    shard = shard_numel(padded_numel([p.shape for p in tiny_model().parameters()], codec), 2, codec)
    assert sent == 2 * 2 * codec.nbytes(shard)  # two syncs: each worker scatters one shard and gathers one
    assert sent < full * codec.bits / 32 * 1.5  # the bit width, plus scales and this tiny model's padding
    moments = ref_ledger["all_reduce:exp_avg"]["wire"]
    # int8 moments cost less than fp32 ones even here, where padding each tiny moment to a block dominates
    assert ledger["all_to_all:exp_avg_int8"]["wire"] + ledger["all_gather:exp_avg_int8"]["wire"] < moments


@pytest.mark.parametrize("compress", ["int8", "int4"])
def test_compression_on_gloo_matches_the_simulator(compress):
    with one_thread():  # bit for bit: rounding to codes would amplify a last-bit difference into a quantum
        sim, sim_ledger = two_workers(compress, steps=8)
    results = run_gloo(gloo_strategy_worker, 2, "lordo",
                       ["strategy.sync_every=4", "strategy.rank=4", f'strategy.compress="{compress}"'], 8)
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
    assert torch.equal(other.workers[1].shard_residual, strategy.workers[1].shard_residual)
    n = sum(p.numel() for p in models[0].parameters())
    shapes = [p.shape for p in models[0].parameters()]
    padded = shard_numel(padded_numel(shapes, BlockCodec(block=256)), 2, BlockCodec(block=256))
    assert strategy.state_bytes()["compression_feedback"] == 4 * (n + padded)


def test_compress_needs_a_local_update_strategy():
    with pytest.raises(ConfigError, match="strategy.compress applies to the synchronisations of local-adam"):
        strategy_config("ddp", ['strategy.compress="int8"'])
    with pytest.raises(ConfigError, match=r"strategy.compress must be one of 'none', 'bf16', 'int8', 'int4', 'sparse', 'basis', got 'fp8'"):
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
    assert opt16.state_bytes()["error_feedback"] * 2 == 24 * 10 * 4
    assert opt32.state_bytes()["error_feedback"] == 24 * 10 * 4 + 24 * 3 * 4  # and proj(E) of its deferred form


@pytest.mark.parametrize("owner", [0, 1, 2])
def test_add_shard_adds_exactly_the_owners_span_of_the_padded_layout(owner):
    """add_shard against the layout written out by hand: tensors of 5, 7 and 3 elements in blocks of 4 are laid out
    at offsets 0, 8 and 16 (zeros between, 20 elements padded), cut into 3 shards of 8; shard ``owner`` covers flat
    positions [8·owner, 8·owner + 8) and only the tensor elements there change."""
    torch.manual_seed(owner)
    tensors = [torch.randn(5, dtype=torch.float64), torch.randn(7, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    before = [t.clone() for t in tensors]
    values = torch.randn(8, dtype=torch.float64)
    offsets = [0, 8, 16]
    add_shard(tensors, values, owner, world=3, block=4)
    for t, old, offset in zip(tensors, before, offsets, strict=True):
        expected = old.clone()
        for i in range(t.numel()):
            flat = offset + i
            if 8 * owner <= flat < 8 * owner + 8:
                expected[i] += values[flat - 8 * owner]
        assert torch.equal(t, expected)


@pytest.mark.parametrize("codec", [BlockCodec(8, 256), BlockCodec(4, 128), BlockCodec(log=True)], ids=lambda c: c.name)
def test_a_span_decoded_alone_equals_the_same_span_of_the_whole_vector(codec):
    """decode_span reads only the blocks that hold the span: the same values as decoding every shard (a round held
    as codes is landed tensor by tensor from it)."""
    from lordo.comm.codec import decode_shards, decode_span

    shard = codec.block * 5
    gen = torch.Generator().manual_seed(0)
    sources = [[codec.encode(torch.randn(shard, generator=gen).abs())] for _ in range(3)]
    whole = decode_shards(sources, shard, codec)
    rng = random.Random(0)
    spans = [(0, 3 * shard), (shard - 1, shard + 1), (5, 5), (2 * shard, 3 * shard)]
    spans += [tuple(sorted((rng.randrange(3 * shard + 1), rng.randrange(3 * shard + 1)))) for _ in range(100)]
    for a, b in spans:
        assert torch.equal(decode_span(sources, shard, codec, a, b), whole[a:b]), (a, b)


def test_a_round_encoded_shard_by_shard_from_lazy_tensors_and_landed_tensor_by_tensor_is_the_whole_vectors():
    """shard_payloads over a sequence that computes each tensor when read gives the list's payloads byte for byte,
    and CodedTensors gives back what decoding the whole vector and scattering it gives (tensors straddle shards)."""
    from lordo.comm.codec import decode_shards, shard_payloads
    from lordo.strategies.delayed import CodedTensors

    codec, world = BlockCodec(4, 128), 3
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(shape, generator=gen) for shape in [(33, 7), (300,), (5, 64), (1,), (129, 3)]]
    reads: list[int] = []

    class Lazy:
        numels = [t.numel() for t in tensors]
        device = tensors[0].device

        def __len__(self):
            return len(tensors)

        def __getitem__(self, i):
            reads.append(i)
            return tensors[i].clone()

    shard = shard_numel(padded_numel([t.shape for t in tensors], codec), world, codec)
    flat = torch.zeros(world * shard)  # the layout by hand: each tensor padded to whole blocks, one after the other
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()] = t.reshape(-1)
        offset += math.ceil(t.numel() / codec.block) * codec.block
    eager = [codec.encode(flat[j * shard:(j + 1) * shard]) for j in range(world)]
    lazy = shard_payloads(Lazy(), world, shard, codec)
    assert all(torch.equal(a, b) for a, b in zip(eager, lazy, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(eager, shard_payloads(tensors, world, shard, codec), strict=True))
    assert sorted(set(reads)) == list(range(len(tensors)))
    sources = [[p] for p in eager]
    whole, expected, offset = decode_shards(sources, shard, codec), [], 0
    for t in tensors:
        expected.append(whole[offset:offset + t.numel()].view_as(t))
        offset += math.ceil(t.numel() / codec.block) * codec.block
    coded = CodedTensors(sources, [t.shape for t in tensors], shard, codec)
    assert len(coded) == len(tensors)
    for i, want in enumerate(expected):
        assert torch.equal(coded[i], want) and torch.equal(coded[i - len(coded)], want)
    with pytest.raises(IndexError):
        coded[len(coded)]
    with pytest.raises(TypeError, match="one tensor at a time"):
        coded[0:2]
