"""MuLoCo at equal memory: Muon's momentum and AdamW's moments held in 8 bits (``strategy.moments_dtype = "int8"``,
opt-in: ``strategy.memory = "lean"`` leaves it off, its gate was missed), against the float32 step whose state is
rounded in storage, torch's AdamW, a checkpoint round trip and a hand count of the bytes."""

import pytest
import torch
from torch import nn

from lordo.config import build_config
from lordo.optim import LowRankQHAdam, MuonAdamW, compact
from lordo.optim.hybrid import PrecisionMuon

from harness import batch, random_steps, resumes_bit_identically, strategy_config, tiny_model


def _grads(shape, steps, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_with_an_8_bit_momentum_is_the_float32_step_with_its_momentum_rounded_in_storage(nesterov):
    """Each step computes in float32 from the decoded momentum and stores the new one rounded: equal, bit for bit, to
    the float32 step whose buffer is replaced by its int8 round trip after each step (the codec's own accuracy is
    tests/test_memory.py's)."""
    torch.manual_seed(0)
    start = torch.randn(96, 64) * 0.05  # 6,144 elements: above the size held compact
    ours, ref = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    options = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32)
    opt = PrecisionMuon([ours], moments_dtype="int8", **options)
    reference = PrecisionMuon([ref], **options)
    for g in _grads(start.shape, 6):
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        reference.step()
        buf = reference.state[ref]["momentum_buffer"]
        buf.copy_(compact.decode(*compact.encode(buf, compact.INT8), compact.INT8, buf.shape))
        assert torch.equal(ours, ref)
    held = opt.state[ours]
    assert set(held) == {"momentum_buffer.codes", "momentum_buffer.scale"} and held["momentum_buffer.codes"].dtype == torch.uint8
    assert float((ref.detach() - start).abs().max()) > 0.01  # the steps moved the matrix: the equality is not of a still one


def test_a_small_matrix_keeps_its_momentum_in_float32():
    w = nn.Parameter(torch.randn(8, 16))  # 128 elements: below compact.MIN_COMPACT_NUMEL
    opt = PrecisionMuon([w], moments_dtype="int8", ns_dtype=torch.float32)
    w.grad = torch.randn(8, 16)
    opt.step()
    assert set(opt.state[w]) == {"momentum_buffer"}


def _muloco(moments_dtype, seed=0):
    torch.manual_seed(seed)
    w, emb = nn.Parameter(torch.randn(96, 64) * 0.05), nn.Parameter(torch.randn(300, 32) * 0.05)
    norm = nn.Parameter(torch.ones(64))
    groups = [{"params": [w], "muon": True}, {"params": [emb], "muon": False},
              {"params": [norm], "muon": False, "weight_decay": 0.0}]
    return [w, emb, norm], MuonAdamW(groups, lr=1e-2, weight_decay=0.1, ns_dtype=torch.float32,
                                     moments_dtype=moments_dtype)


def _steps(params, opt, start, n):
    random_steps(params, opt, start, n, seed_offset=100)


def test_adamws_part_at_8_bits_is_torchs_adamw_first_and_stays_close():
    params, lean = _muloco("int8")
    ref_params, ref = _muloco("float32")
    assert isinstance(lean.adamw, LowRankQHAdam) and isinstance(ref.adamw, torch.optim.AdamW)
    _steps(params, lean, 0, 1)
    _steps(ref_params, ref, 0, 1)
    for a, b in zip(params, ref_params):  # zero state: only the storage differs, the first step is AdamW's
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    _steps(params, lean, 1, 19)
    _steps(ref_params, ref, 1, 19)
    start, _ = _muloco("float32")
    for a, b, s in zip(params, ref_params, start):  # 20 steps of random gradients: the rounding stays small
        assert float((a - b).norm() / (b - s).norm()) < 0.05
    assert compact.is_compact(lean.state[params[1]], "exp_avg_sq")  # the embedding's moments are 8-bit
    assert set(lean.state[params[2]]) >= {"exp_avg", "exp_avg_sq"}  # the norm's (64 elements) stay float32


def test_an_8_bit_muloco_state_survives_a_checkpoint_and_resumes_bit_identically():
    def codes_stay_8_bit(params, opt):  # torch's load casts to the parameter's dtype; undone
        assert opt.muon.state[params[0]]["momentum_buffer.codes"].dtype == torch.uint8

    resumes_bit_identically(lambda seed: _muloco("int8", seed=seed), _steps, loaded_check=codes_stay_8_bit)


def test_a_muon_momentum_loads_into_either_storage_and_adamws_moments_are_refused_across():
    params, opt = _muloco("float32")
    _steps(params, opt, 0, 3)
    momentum = opt.muon.state[params[0]]["momentum_buffer"].clone()
    lean = PrecisionMuon([nn.Parameter(params[0].detach().clone())], moments_dtype="int8", ns_dtype=torch.float32)
    lean.load_state_dict(opt.muon.state_dict())
    lean.param_groups[0]["params"][0].grad = torch.zeros_like(momentum)
    lean.step()  # a float32 buffer stepped where 8 bits are kept: decayed by μ and stored as codes
    back = PrecisionMuon([nn.Parameter(params[0].detach().clone())], ns_dtype=torch.float32)
    back.load_state_dict(lean.state_dict())
    back.param_groups[0]["params"][0].grad = torch.zeros_like(momentum)
    back.step()  # codes loaded where float32 is kept: expanded, not dropped
    moved = back.state[back.param_groups[0]["params"][0]]["momentum_buffer"]
    assert moved.dtype == torch.float32 and set(back.state[back.param_groups[0]["params"][0]]) == {"momentum_buffer"}
    torch.testing.assert_close(moved, 0.95 * 0.95 * momentum, rtol=0, atol=0.01 * float(momentum.abs().max()))
    _, int8 = _muloco("int8")
    with pytest.raises(ValueError, match="saved with moments_dtype='float32'.*build it with the saved storage"):
        int8.load_state_dict(opt.state_dict())


def test_the_lean_flag_leaves_muloco_float32_and_the_8_bit_bytes_are_counted():
    muon = ['strategy.name="local-adam"', 'optim.inner="muon"', 'strategy.memory="lean"']
    lean = build_config(overrides=muon).strategy
    assert (lean.anchor_dtype, lean.moments_dtype) == ("int8", "float32")  # missed its gate: opt-in only
    asked = build_config(overrides=[*muon, 'strategy.moments_dtype="int8"']).strategy
    assert (asked.anchor_dtype, asked.moments_dtype) == ("int8", "int8")
    params, opt = _muloco("int8")
    _steps(params, opt, 0, 2)
    w, emb, norm = params
    def int8(n):  # one byte per element, padded to whole blocks of 256, and a float32 scale per block
        blocks = -(-n // 256)
        return 256 * blocks + 4 * blocks

    counted = {"muon_momentum": int8(w.numel()),
               "full_rank_moments": 2 * int8(emb.numel()) + 4  # + its step counter
               + 2 * 4 * norm.numel() + 4}
    accounted = opt.state_bytes()  # from the shapes, without the last block's padding and the step counters
    for key, value in counted.items():
        assert accounted[key] == pytest.approx(value, rel=0.02)
    held = {"muon_momentum": 0, "full_rank_moments": 0}
    for p in params:
        for key, t in opt.state[p].items():
            held[opt.state_category(p, [key])] += t.numel() * t.element_size()
    assert held == counted


def test_ddp_with_8_bit_moments_steps_adamw_with_them_compact():
    from lordo.comm import SimCommunicator
    from lordo.model import group_parameters
    from lordo.strategies import build_strategy

    cfg = strategy_config("ddp", ['strategy.moments_dtype="int8"'])
    models = [tiny_model(d_model=64) for _ in range(2)]  # its MLP matrices are large enough to be held compact
    strategy = build_strategy(cfg, models, [group_parameters(m) for m in models], SimCommunicator(2))
    for rank, model in enumerate(models):
        model(*batch(rank, 0))[1].backward()
    strategy.step(1e-2)
    opt = strategy.workers[0].optimizer
    assert isinstance(opt, LowRankQHAdam) and all(g["moments_dtype"] == "int8" for g in opt.param_groups)
    assert any(compact.is_compact(s, "exp_avg") for s in opt.state.values())
