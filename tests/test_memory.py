"""Optimizer memory: measured from the live tensors (strategies/footprint.py) against hand counts, and the lean
storage (optim/compact.py, strategies/anchor.py) against float32 and float64 references."""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import pytest
import torch

from lordo.comm import SimCommunicator
from lordo.config import build_config
from lordo.errors import ConfigError
from lordo.model import GPT, GPTConfig, group_parameters
from lordo.optim import LowRankQHAdam, compact
from lordo.strategies import build_strategy
from lordo.strategies.footprint import excluded_storages, storage_key, walk

from harness import VOCAB, batch, random_steps, resumes_bit_identically, strategy_config, tiny_model


def wider_model() -> GPT:
    """Matrices large enough (≥ 4,096 elements) to be held compact."""
    torch.manual_seed(1234)
    return GPT(GPTConfig(vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=2, seq_len=8))


def build(name: str, workers: int = 2, overrides=(), model=tiny_model):
    comm = SimCommunicator(workers)
    models = [model() for _ in range(workers)]
    cfg = strategy_config(name, ["strategy.rank=2", "strategy.sync_every=2", *overrides])
    return build_strategy(cfg, models, [group_parameters(m) for m in models], comm), models


def train(strategy, models, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        for rank, model in enumerate(models):
            model(*batch(rank, step))[1].backward()
        strategy.step(1e-2)


# --- measured against counted by hand ---------------------------------------------------------------------


def test_the_measured_state_of_lordo_is_the_hand_count_of_its_tensors():
    strategy, models = build("lordo")
    train(strategy, models, 3)  # a sync at 2, then a step: the deferred error feedback's proj(S) exists again
    opt, params = strategy.workers[0].optimizer, strategy.workers[0].params
    lowrank = {id(p) for p, _ in opt.lowrank_params()}
    expected = {"lowrank_moments": 0, "full_rank_moments": 0, "bases": 0, "error_feedback": 0, "anchor": 0}
    for p in params:
        n = p.numel()
        expected["anchor"] += 4 * n
        if id(p) in lowrank:
            big, small = max(p.shape), min(p.shape)
            # u, v (big x r) and the step counter; the basis (small x r); E (p x q) and its proj(S) (big x r)
            expected["lowrank_moments"] += 2 * 4 * big * 2 + 4
            expected["bases"] += 4 * small * 2
            expected["error_feedback"] += 4 * n + 4 * big * 2
        else:
            expected["full_rank_moments"] += 2 * 4 * n + 4
    assert strategy.measured_state_bytes() == expected
    accounted = strategy.state_bytes()
    assert sum(accounted.values()) == pytest.approx(sum(expected.values()), rel=0.02)


def test_every_tensor_a_strategy_holds_is_in_some_worker_s_count():
    """A walk of the whole strategy object (every hosted worker, the communicator, the codecs) finds no storage
    that no worker's measurement counts: nothing the strategy keeps escapes the count."""
    for name, overrides in (("lordo", ()), ("local-adam", ('strategy.compress="int8"',)),
                            ("lordo", ("strategy.sync_delay=1",)), ("lordo-local", ()), ("lowrank-ddp", ())):
        strategy, models = build(name, overrides=overrides)
        train(strategy, models, 3)
        skip = excluded_storages(models)
        everything = {k for _, t in walk(strategy) if (k := storage_key(t)) is not None and k not in skip}
        counted = set()
        for w in range(len(strategy.workers)):
            for objects in [strategy.held(w), {"opt": [vars(strategy.workers[w].optimizer)]}]:
                counted |= {k for _, t in walk(objects) if (k := storage_key(t)) is not None}
        assert everything <= counted, (name, overrides, len(everything - counted))


def _holding(buffer: torch.Tensor, release) -> Callable[[], float]:
    """A function that waits for ``release`` and reads ``buffer``: what a round's exchange holds in a closure."""
    def exchange() -> float:
        release.wait(10)
        return float(buffer[0])

    return exchange


def test_the_census_finds_what_only_a_thread_holds_and_nothing_else_escapes_the_walks():
    """What a round's exchange thread holds in its frame or a closure no walk reaches; the process's own view (gc)
    does: a hidden buffer shows in the in-flight peak while the thread runs, and with it gone nothing a strategy
    allocated is left unaccounted (lean, int4 rounds in flight included)."""
    import threading

    from lordo.strategies.footprint import InFlightPeak, live_storages, unreached

    compact.make_tables(torch.device("cpu"))  # the codec's tables: once per process, not the strategy's
    for name, overrides in (("lordo", ()), ("lordo", ('strategy.memory="lean"', 'strategy.compress="int4"',
                                                       "strategy.sync_delay=1"))):
        before = live_storages()
        strategy, models = build(name, overrides=overrides, model=wider_model)
        train(strategy, models, 3)
        # (a rounded anchor keeps its outer optimizer for its settings, over a 4-byte probe parameter)
        assert unreached(strategy, models, before) <= 4, (name, overrides)
        release = threading.Event()
        exchange = _holding(torch.ones(50_000), release)  # a float32 buffer only the thread's closure refers to
        thread = threading.Thread(target=exchange)
        thread.start()
        peak = InFlightPeak(strategy, models, before)
        timer = threading.Timer(0.2, release.set)
        timer.start()
        assert peak.follow(thread.is_alive) >= 200_000 and peak.samples >= 2
        thread.join()
        del exchange
        assert unreached(strategy, models, before) <= 4


def test_views_of_a_stacked_state_are_counted_once():
    model = tiny_model()
    matrices = [p for p in model.parameters() if p.ndim == 2 and p.shape[0] != 61]
    opt = LowRankQHAdam([{"params": matrices, "rank": 2}], lr=1e-2, batched=True)
    for step in range(2):
        model(*batch(0, step))[1].backward()
        opt.step()
        opt.zero_grad()
    from lordo.strategies.footprint import measure

    measured = measure({}, opt, [model], torch.device("cpu"))
    stacked = {storage_key(s["exp_avg"]) for s in opt.state.values()}
    assert len(stacked) < len(matrices)  # the per-matrix state is views of stacks
    storages = {storage_key(t): t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor)}
    extra = sum(stack._inside.untyped_storage().nbytes() for stack in opt._planner._stacks.values()
                if stack._inside is not None and storage_key(stack._inside) not in storages)
    assert sum(measured.values()) == sum(storages.values()) + extra
    plain = LowRankQHAdam([{"params": matrices, "rank": 2}], lr=1e-2, batched=True, omega=1.0)  # GaLore's update
    for step in range(2):
        model(*batch(0, step))[1].backward()
        plain.step()
        plain.zero_grad()
    assert all(stack._inside is None for stack in plain._planner._stacks.values())  # no proj(S) to keep: none held
    assert "optimizer_other" not in measure({}, plain, [model], torch.device("cpu"))


def test_a_single_worker_keeps_no_anchor_it_cannot_use():
    local_adam, _ = build("local-adam", workers=1)
    assert local_adam.measured_state_bytes().get("anchor", 0) == 0
    lordo, _ = build("lordo", workers=1)
    lowrank = sum(p.numel() for p, _ in lordo.workers[0].optimizer.lowrank_params())
    assert lordo.measured_state_bytes()["anchor"] == 4 * lowrank  # global bases read the low-rank matrices' Δ
    diloco, _ = build("diloco", workers=1)  # an outer momentum moves even one worker's model: all of it
    assert diloco.measured_state_bytes()["anchor"] == 4 * sum(p.numel() for p in diloco.workers[0].params)


def test_an_optimizer_a_user_brings_is_measured_as_it_is():
    bnb = pytest.importorskip("bitsandbytes")
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 8))
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=4096)
    model(torch.randn(2, 128)).sum().backward()
    opt.step()
    from lordo.strategies.footprint import measure

    measured = sum(measure({}, opt, [model], torch.device("cpu")).values())
    big = 128 * 64  # 8-bit codes of two moments, a float32 scale per block of 256 each, a shared 256-entry map each
    small = 64 + 64 * 8 + 8  # float32 moments of the tensors below min_8bit_size
    assert measured == 2 * big + 2 * 4 * (big // 256) + 2 * 256 * 4 + 2 * 4 * small


# --- compact storage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "int4", "lin8", "fp8", "uint8"])
def test_a_large_tensor_is_coded_a_chunk_at_a_time_into_the_same_codes_and_values(name, monkeypatch):
    """Blocks are coded alone, so encoding (rounding to the nearest code) and decoding CODEC_CHUNK elements at a
    time gives the codes, scales and values of one pass over the whole tensor, and a float64 reference of the decode
    (book[code] x scale); a stochastic format (uint8) draws its noise for the whole tensor at once (the same draws)."""
    from lordo.memtrack import PeakTracker

    fmt = compact.BY_NAME[name]
    x = (torch.randn(64 * 1024 + 70, generator=torch.Generator().manual_seed(0)) * 1e-2)
    x = x.abs() if fmt.root else x
    one_pass = PeakTracker().begin()
    with one_pass.tracking():
        whole = compact.encode(x, fmt, seed=3)
    monkeypatch.setattr(compact, "CODEC_CHUNK", 256)
    tracker = PeakTracker().begin()
    with tracker.tracking():
        chunked = compact.encode(x, fmt, seed=3)
    assert torch.equal(whole[0].view(torch.uint8), chunked[0].view(torch.uint8)) and torch.equal(whole[1], chunked[1])
    # a chunk's temporaries beside the codes: a fraction of one pass's (a stochastic format keeps its draws whole)
    assert tracker.transient < one_pass.transient / (2 if fmt.stochastic else 3)
    if not fmt.stochastic:
        assert tracker.transient < 0.75 * 4 * x.numel()  # under one float32 copy of the tensor
    values = compact.decode(*chunked, fmt, x.shape)
    codes = chunked[0].view(torch.uint8).reshape(-1)
    if fmt.bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)
    book = compact.code_book(fmt, x.device).double()
    expected = (book[codes.long()].view(-1, fmt.block) * chunked[1].double()[:, None]).reshape(-1)[: x.numel()]
    expected = expected.square() if fmt.root else expected
    torch.testing.assert_close(values.double(), expected, rtol=1e-6, atol=0)


def test_codes_come_back_within_each_format_s_step():
    x = torch.randn(10_240, generator=torch.Generator().manual_seed(0)) * 0.03
    for fmt, bound in ((compact.INT8, 0.0072), (compact.LIN8, 1 / 254), (compact.INT4, 1 / 14)):
        codes, scale = compact.encode(x, fmt)
        y = compact.decode(codes, scale, fmt, x.shape)
        blocks = x.abs().view(-1, fmt.block).amax(dim=1).repeat_interleave(fmt.block)[: x.numel()]
        assert ((y - x).abs() <= bound * blocks + 1e-12).all(), fmt.name
    assert compact.nbytes(compact.INT8, 10_240) == 10_240 + 4 * 40
    assert compact.nbytes(compact.INT4, 10_240) == 5_120 + 4 * 160


def test_codes_are_the_nearest_book_value_and_stochastic_codes_bracket_the_value():
    """encode finds codes by table lookup; the reference is a search of the code book itself: the nearest value
    (ties to the lower code) and, for stochastic rounding, one of the two values around it. Inputs include the
    midpoints between book values, their float32 neighbours, zeros of both signs and subnormals."""
    gen = torch.Generator().manual_seed(3)
    for fmt in (compact.INT8, compact.UINT8, compact.INT4, compact.LIN8):
        book = compact.code_book(fmt, torch.device("cpu")).double()
        mids = ((book[1:] + book[:-1]) / 2).float()
        edges = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))])
        y = torch.cat([torch.rand(30_000, generator=gen) * 2 - 1, torch.randn(2_000, generator=gen) * 1e-5, edges,
                       torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0])])
        y = y[y.abs() <= 1]
        if not fmt.signed:
            y = y.abs()
        # one block per value, scaled by its own magnitude 1 (a leading 1 in each block): y is what gets rounded
        x = torch.stack([torch.ones_like(y), y], dim=1)
        x = torch.cat([x, x.new_zeros(len(y), fmt.block - 2)], dim=1).reshape(-1)
        value = (x.square() if fmt.root else x).view(-1, fmt.block)
        codes, scale = compact.encode(value.reshape(-1), fmt, seed=5 if fmt.stochastic else None)
        if fmt.bits == 4:
            codes = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)
        got = book[codes.long()].view(-1, fmt.block)[:, 1]
        y = y.double() if not fmt.root else value[:, 1].double().sqrt()
        if fmt.stochastic:
            lower = book[(torch.searchsorted(book, y, right=True) - 1).clamp(min=0)]
            upper = book[torch.searchsorted(book, y).clamp(max=len(book) - 1)]
            assert ((got == lower) | (got == upper)).all(), fmt.name
        else:
            nearest = (book[None, :] - y[:, None]).abs().min(dim=1).values
            ulp = 2.0**-23 * y.abs()  # the midpoints are float32: at a midpoint, either neighbour is nearest
            assert ((got - y).abs() <= nearest + ulp).all(), fmt.name


def test_stochastic_rounding_keeps_the_expected_value_of_a_decaying_second_moment():
    """Each block's largest entry stays (it sets the scale); the others decay by β2 = 0.999 a step with no new
    gradient, less than one code step: stochastic rounding follows them, rounding to the nearest code freezes them."""
    v = torch.rand(4096, generator=torch.Generator().manual_seed(1)) ** 4 * 1e-7
    v.view(-1, 256)[:, 0] = 1e-6
    rest = torch.ones_like(v, dtype=torch.bool)
    rest.view(-1, 256)[:, 0] = False

    def decay(held, fmt, seed):
        x = compact.decode(*held, fmt, v.shape)
        x[rest] *= 0.999
        return compact.encode(x, fmt, seed=seed)

    stochastic, nearest = compact.encode(v, compact.UINT8, seed=0), compact.encode(v, compact.INT8)
    for step in range(1, 501):
        stochastic, nearest = decay(stochastic, compact.UINT8, step), decay(nearest, compact.INT8, None)
    expected = float(v[rest].sum()) * 0.999**500
    assert float(compact.decode(*stochastic, compact.UINT8, v.shape)[rest].sum()) == pytest.approx(expected, rel=0.01)
    assert float(compact.decode(*nearest, compact.INT8, v.shape)[rest].sum()) > 1.3 * expected  # frozen


def _toy(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(96, 64) * 0.02)
    e = torch.nn.Parameter(torch.randn(200, 32) * 0.02)
    options = {"float32": {}, "lean": {"error_feedback_dtype": "int8", "moments_dtype": "int8"},
               "int4": {"error_feedback_dtype": "int4"}}[kind]
    return [w, e], LowRankQHAdam([{"params": [w], "rank": 4}, {"params": [e], "rank": None}], lr=1e-2, **options)


def _steps(params, opt, start: int, n: int) -> None:
    random_steps(params, opt, start, n)


def test_the_first_step_with_compact_state_is_the_float32_step_and_later_ones_stay_close():
    ref_params, ref = _toy("float32")
    params, lean = _toy("lean")
    _steps(ref_params, ref, 0, 1)
    _steps(params, lean, 0, 1)
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)  # zero state: the step computed in float32 is the same; only storage rounds
    _steps(ref_params, ref, 1, 19)
    _steps(params, lean, 1, 19)
    for a, b in zip(ref_params, params):  # 20 steps of random gradients at lr 1e-2: the rounding stays small
        assert float((a - b).norm() / a.norm()) < 0.05


def test_compact_state_is_saved_as_it_is_and_a_resumed_run_is_bit_identical():
    def no_silent_widening(saved):
        codes = saved["opt"]["state"][0]["error_feedback" + compact.CODES]
        assert codes.dtype == torch.uint8 and "error_feedback" not in saved["opt"]["state"][0]

    resumes_bit_identically(lambda seed: _toy("lean", seed=seed), _steps, saved_check=no_silent_widening)


def test_a_float32_state_loads_into_a_compact_optimizer_and_back():
    params, opt = _toy("float32")
    _steps(params, opt, 0, 3)
    state = opt.state_dict()
    lean_params, lean = _toy("lean")
    lean.load_state_dict(state)
    assert compact.is_compact(lean.state[lean_params[0]], "error_feedback")
    assert compact.is_compact(lean.state[lean_params[1]], "exp_avg_sq")
    back_params, back = _toy("float32")
    back.load_state_dict(lean.state_dict())
    e32 = opt.error_feedback(params[0])
    assert float((back.error_feedback(back_params[0]) - e32).abs().max()) <= 0.0072 * float(e32.abs().max())
    assert not compact.is_compact(back.state[back_params[1]], "exp_avg")


def test_compact_error_feedback_reads_and_forgets():
    params, opt = _toy("int4")
    _steps(params, opt, 0, 2)
    e = opt.error_feedback(params[0])
    assert e.shape == params[0].shape and float(e.abs().max()) > 0
    opt.forget_error_feedback()
    assert float(opt.error_feedback(params[0]).abs().max()) == 0
    with pytest.raises(ValueError, match="held compact"):
        opt.settled_error_feedback(params[0])


# --- the anchor --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_a_rounded_anchor_leaves_the_averaged_model_exact(dtype):
    """With plain averaging the new model is the mean of the workers' models (float64 reference), whatever the
    anchor's rounding: only the kept copy is rounded."""
    strategy, models = build("local-adam", workers=3, overrides=[f'strategy.anchor_dtype="{dtype}"'], model=wider_model)
    before: list = []
    synchronise = strategy.synchronise

    def recording():  # the workers' models just before each synchronisation
        before.append([[t.detach().double().clone() for t in w.tensors] for w in strategy.workers])
        return synchronise()

    strategy.synchronise = recording
    train(strategy, models, 4)  # two synchronisations: the second starts from the first one's rounded anchor
    assert len(before) == 2
    mean = [sum(ms) / 3 for ms in zip(*before[-1])]
    for p, ref in zip(strategy.workers[1].tensors, mean):
        assert torch.allclose(p.double(), ref, rtol=0, atol=8 * torch.finfo(torch.float32).eps * float(ref.abs().max()))
    kept = max(strategy.anchor.tensors, key=lambda a: a[0].numel() if isinstance(a, tuple) else a.numel())
    assert (kept[0].dtype == torch.uint8) if dtype != "bfloat16" else (kept.dtype == torch.bfloat16)
    if dtype == "int4":  # two codes a byte and a scale per 64: an eighth of float32's bytes and a sixty-fourth
        assert kept[0].numel() * 2 == kept[1].numel() * 64
    bound = {"bfloat16": 0.55, "int8": 0.4, "int4": 0.3}[dtype]  # the tensors under 4,096 elements stay float32
    assert strategy.measured_state_bytes()["anchor"] < bound * 4 * sum(t.numel() for t in strategy.workers[0].tensors)
    assert strategy.measured_state_bytes()["anchor"] == strategy.anchor.accounted_bytes()


def test_a_rounded_anchor_is_refused_with_an_outer_momentum():
    with pytest.raises(ConfigError, match="plain averaging"):
        build("diloco", overrides=['strategy.anchor_dtype="bfloat16"'])
    with pytest.raises(ConfigError, match="average_error_feedback"):
        build("lordo", overrides=['strategy.error_feedback_dtype="int4"', "strategy.average_error_feedback=true"])


@pytest.mark.parametrize("anchor", ["int8", "int4"])
def test_a_lean_lordo_checkpoint_resumes_bit_identically(anchor):
    lean = [f'strategy.anchor_dtype="{anchor}"', 'strategy.error_feedback_dtype="int8"', 'strategy.moments_dtype="int8"']
    straight, models = build("lordo", overrides=lean, model=wider_model)
    train(straight, models, 5)
    expected = [p.detach().clone() for p in models[0].parameters()]
    first, models = build("lordo", overrides=lean, model=wider_model)
    train(first, models, 3)
    buf = io.BytesIO()
    torch.save({"models": [m.state_dict() for m in models], "strategy": first.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["strategy"]["shared"]["anchor_dtype"] == anchor
    second, models = build("lordo", overrides=lean, model=wider_model)
    for m, s in zip(models, saved["models"]):
        m.load_state_dict(s)
    second.load_state_dict(saved["strategy"])
    train(second, models, 2, start=3)
    for a, b in zip(expected, models[0].parameters()):
        assert torch.equal(a, b)
    assert math.isfinite(float(sum(p.sum() for p in models[0].parameters())))


# --- compression residuals folded into the model -----------------------------------------------------------


def padded_flat(tensors, block):
    """The tensors laid end to end, each padded with zeros to a whole number of blocks (the block codecs' layout)."""
    parts = []
    for t in tensors:
        flat = t.reshape(-1)
        parts += [flat, flat.new_zeros(-flat.numel() % block)]
    return torch.cat(parts)


@pytest.mark.parametrize("compress", ["int4", "bf16", "sparse"])
def test_a_folded_residual_is_the_buffered_one_subtracted_from_the_model(compress):
    """After one round from the same state, the model of a worker that folds what compressing lost (``model``) is
    the buffered run's model minus that run's residual buffer: the same e, kept in the weights instead. A block
    codec (int4) also loses when a shard's owner re-encodes the mean (r, the buffered run's shard buffer): the
    folded owner's model is M·r lower on the elements of its shard (its next Δ then brings r to the mean), and a
    folded run keeps no compression buffer at all."""
    over, workers = [f'strategy.compress="{compress}"'], 3
    buffered, models_b = build("local-adam", workers=workers, overrides=over, model=wider_model)
    folded, models_f = build("local-adam", workers=workers, overrides=[*over, 'strategy.compress_residual="model"'],
                             model=wider_model)
    train(buffered, models_b, 2)
    train(folded, models_f, 2)
    for owner, (w_b, w_f) in enumerate(zip(buffered.workers, folded.workers)):
        assert w_f.residuals == [] and w_f.shard_residual is None and any(float(e.abs().max()) > 0 for e in w_b.residuals)
        scale = max(float(t.abs().max()) for t in w_b.tensors)
        if compress != "int4":
            assert w_b.shard_residual is None
            for t_b, t_f, e in zip(w_b.tensors, w_f.tensors, w_b.residuals):
                assert torch.allclose(t_f, t_b - e, rtol=0, atol=1e-6 * scale)
            continue
        block = 128  # the int4 wire codec's
        gap = padded_flat([t_b - e - t_f for t_b, t_f, e in zip(w_b.tensors, w_f.tensors, w_b.residuals)], block)
        r = w_b.shard_residual
        assert float(r.abs().max()) > 0
        expected = torch.zeros(workers * r.numel())
        expected[owner * r.numel():(owner + 1) * r.numel()] = workers * r
        assert torch.allclose(gap, expected[:gap.numel()], rtol=0, atol=1e-6 * scale)
        assert not expected[gap.numel():].any()  # the padding past the last tensor loses nothing
    assert "compression_feedback" not in folded.measured_state_bytes()
    assert buffered.measured_state_bytes()["compression_feedback"] > 0


def test_a_folded_residual_reaches_the_model_of_a_delayed_round_too():
    """sync_delay = 1: a round that lands a step late carries the fold as well (the worker's own part of the round
    is what it sent, x − e), so the worker's model after the landing differs from the buffered run's by −e."""
    over = ['strategy.compress="int4"', "strategy.sync_delay=1"]
    buffered, models_b = build("local-adam", workers=2, overrides=over, model=wider_model)
    folded, models_f = build("local-adam", workers=2, overrides=[*over, 'strategy.compress_residual="model"'],
                             model=wider_model)
    train(buffered, models_b, 3)  # sent at step 2, landed at step 3 after the same local step in both runs
    train(folded, models_f, 3)
    assert buffered.in_flight is None and folded.in_flight is None
    for w_b, w_f in zip(buffered.workers, folded.workers):
        for t_b, t_f, e in zip(w_b.tensors, w_f.tensors, w_b.residuals):
            assert torch.allclose(t_f, t_b - e, rtol=0, atol=1e-6 * float(t_b.abs().max()))


@pytest.mark.parametrize("delay", [0, 1])
def test_a_folded_run_ends_with_one_model_on_every_worker(delay):
    """The last round carries no residual into the models (no round follows to deliver it, as a buffered run
    keeps its buffer undelivered): every worker ends with the round's mean model, bit for bit."""
    over = ['strategy.compress="int4"', 'strategy.compress_residual="model"', f"strategy.sync_delay={delay}"]
    folded, models = build("local-adam", workers=3, overrides=over, model=wider_model)
    train(folded, models, 3)
    assert any(not torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    folded.finish()
    for other in models[1:]:
        for a, b in zip(models[0].parameters(), other.parameters()):
            assert torch.equal(a, b)


def test_a_folded_block_coded_round_in_flight_is_held_as_its_codes():
    """int4 rounds with the residual folded and sync_delay = 1: between the send and the landing the worker holds
    its sent payloads and the mean's, not two float32 copies of the model; measured as accounted, and a fraction
    of the float32 pair that an unfolded round holds."""
    over = ['strategy.compress="int4"', "strategy.sync_delay=1"]
    folded, models = build("lordo", workers=2, overrides=[*over, 'strategy.compress_residual="model"'], model=wider_model)
    buffered, models_b = build("lordo", workers=2, overrides=over, model=wider_model)
    train(folded, models, 2)  # sent at the end of step 2
    train(buffered, models_b, 2)
    assert folded.in_flight is not None and folded.in_flight.coded is not None and buffered.in_flight.coded is None
    assert folded.in_flight.own == [] and folded.in_flight.mean == []
    measured, accounted = folded.measured_state_bytes()["round_in_flight"], folded.state_bytes()["round_in_flight"]
    assert measured == pytest.approx(accounted, rel=0.02)
    float_pair = 2 * 4 * sum(t.numel() for t in folded.workers[0].tensors)
    assert measured < 0.25 * buffered.measured_state_bytes()["round_in_flight"] and measured < 0.25 * float_pair


def test_one_flag_turns_the_lean_storage_on_where_the_strategy_has_it():
    lean = build_config(overrides=['strategy.name="lordo"', 'strategy.memory="lean"', 'strategy.compress="int4"'])
    s = lean.strategy
    assert (s.anchor_dtype, s.error_feedback_dtype, s.moments_dtype, s.compress_residual) == ("int8", "int8", "int8", "model")
    diloco = build_config(overrides=['strategy.name="diloco"', 'strategy.memory="lean"']).strategy
    assert diloco.anchor_dtype == "float32"  # an outer momentum needs a float32 anchor: lean leaves it
    mine = build_config(overrides=['strategy.memory="lean"', 'strategy.error_feedback_dtype="bfloat16"']).strategy
    assert mine.error_feedback_dtype == "bfloat16" and mine.anchor_dtype == "int8"  # a value set is kept
