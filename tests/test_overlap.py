"""Synchronisations that run behind the next local steps (strategy.sync_delay): the merge against a float64
reference, simulator = gloo, resume with a round in flight, and the refusals."""

import io

import pytest
import torch

from lordo.comm import SimCommunicator
from lordo.errors import ConfigError
from lordo.optim import LowRankQHAdam
from lordo.strategies import LoRDOStrategy

from harness import assert_simulator_equals_gloo, strategy_config
from test_lordo import LOWRANK, make, train_steps
from test_optim import _SpecInFloat64


class OneMatrix(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        torch.manual_seed(11)
        self.w = torch.nn.Parameter(torch.randn(shape))


def top_basis(m: torch.Tensor, r: int) -> torch.Tensor:
    """The top-r singular basis of m on its compressed side, in float64 (signs do not change the weights)."""
    if m.shape[0] >= m.shape[1]:
        return torch.linalg.svd(m, full_matrices=False)[2][:r].T
    return torch.linalg.svd(m, full_matrices=False)[0][:, :r]


def reference_run(shape, grads, *, K, tau, r, options):
    """Delayed LoRDO written out in float64 from docs/concepts.md: 2 workers, one matrix, exact bases, model
    averaging; a round sent at the end of step s lands at the end of step s + τ."""
    workers = len(grads[0])
    w0 = OneMatrix(shape).w.detach()
    mean_g1 = sum(g for g in grads[0]) / workers
    specs = [_SpecInFloat64(w0, top_basis(mean_g1, r), **options) for _ in range(workers)]
    anchor, flight = w0.double().clone(), None

    def land(step):
        sent_at, own, delta, u_sent, v_sent, u_mean, v_mean = flight
        new = top_basis(delta, r)
        for m, s in enumerate(specs):
            s.u = s.u + options["betas"][0] ** (step - sent_at) * (u_mean - u_sent[m])
            s.v = s.v + options["betas"][1] ** (step - sent_at) * (v_mean - v_sent[m])
            s.set_basis(new)
            s.W = s.W + (-delta) + own[m]  # θ_new − θ_anchor = −Δ under model averaging
        return anchor - delta

    for t, per_worker in enumerate(grads, start=1):
        for s, g in zip(specs, per_worker):
            s.step(g)
        if flight is not None and t - flight[0] >= tau:
            anchor, flight = land(t), None
        if t % K == 0:
            own = [anchor - s.W for s in specs]
            flight = (t, own, sum(own) / workers, [s.u.clone() for s in specs], [s.v.clone() for s in specs],
                      sum(s.u for s in specs) / workers, sum(s.v for s in specs) / workers)
            if tau == 0:  # blocking: the round lands where it started
                anchor, flight = land(t), None
    if flight is not None:
        anchor, flight = land(len(grads)), None
    final = sum(s.W for s in specs) / workers  # the blocking final synchronisation: everyone at the mean
    return final


def delayed_run(shape, grads, K, tau, r, dtype):
    """Two workers of one matrix in ``dtype`` through the steps of ``grads`` (float64), rounds every K steps landing τ
    late; the final synchronisation left to the caller."""
    models = [OneMatrix(shape).to(dtype) for _ in range(2)]
    opts = [LowRankQHAdam([{"params": [m.w], "rank": r}], lr=0.05, betas=(0.8, 0.95), eps=1e-8, omega=0.9,
                          weight_decay=0.1, basis_method="svd") for m in models]
    strategy = LoRDOStrategy(models, SimCommunicator(2), optimizers=opts, sync_every=K, sync_delay=tau, grad_clip=0)
    for per_worker in grads:
        for m, g in zip(models, per_worker):
            m.w.grad = g.to(dtype)
        strategy.step()
    return models, strategy


@pytest.mark.parametrize("shape", [(12, 7), (5, 11)])
@pytest.mark.parametrize("tau", [0, 1, 2, 3])
def test_the_delayed_merge_equals_the_float64_reference(shape, tau):
    """Three rounds (K = 3, 11 steps), each landing τ steps late with a new basis from its Δ, the moments
    replayed through the τ steps' decay and rotated, the workers keeping their local steps; the last round
    lands early at finish, then a blocking final sync. τ = 3 = K: a round lands at the step the next starts;
    τ = 0: the blocking synchronisation, the same reference."""
    r, K, steps = 2, 3, 11
    options = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-8, omega=0.9, qh_source="grad+error", wd=0.1, after_qh="remove")
    torch.manual_seed(5)
    grads = [[torch.randn(shape, dtype=torch.float64) for _ in range(2)] for _ in range(steps)]
    expected = reference_run(shape, grads, K=K, tau=tau, r=r, options=options)

    models, strategy = delayed_run(shape, grads, K, tau, r, torch.float32)
    strategy.finish()
    for m in models:
        torch.testing.assert_close(m.w.detach().double(), expected, rtol=1e-4, atol=1e-5)
    if tau:  # the delay changes the trajectory: the comparison could tell a delayed run from a blocking one
        blocking = reference_run(shape, grads, K=K, tau=0, r=r, options=options)
        assert (blocking - expected).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["lordo", "lordo-local", "local-adam"])
def test_a_round_landed_at_once_is_the_blocking_synchronisation(name):
    """sync_delay = K with the steps ending at a sync: finish lands the last round at once (τ = 0), exactly
    the blocking sync; a blocking run and a delayed run agree on everything up to the first landing."""
    blocking, delayed = make(name, ["strategy.sync_delay=0"]), make(name, ["strategy.sync_delay=3"])
    for models, strategy, _ in (blocking, delayed):
        train_steps(models, strategy, 0, 3)
    for a, b in zip(blocking[0][0].parameters(), delayed[0][0].parameters()):
        assert not torch.equal(a, b) or a.ndim < 2  # blocking has synchronised, delayed has not yet landed
    delayed[1].finish()
    for a, b in zip(blocking[0][0].parameters(), delayed[0][0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


FOLDED_INT4 = ['strategy.compress="int4"', 'strategy.compress_residual="model"']  # a round in flight held as codes


@pytest.mark.parametrize("name, extra", [("lordo", []), ("lordo-local", []), ("local-adam", []), ("lordo", FOLDED_INT4)],
                         ids=["lordo", "lordo-local", "local-adam", "lordo-int4-folded"])
def test_resume_with_a_round_in_flight_equals_uninterrupted(name, extra):
    over = ["strategy.sync_delay=2", *(['strategy.average_moments="all"'] if name == "local-adam" else []), *extra]
    models, strategy, _ = make(name, over)
    train_steps(models, strategy, 0, 10)
    strategy.finish()
    reference = [p.detach().clone() for p in models[0].parameters()]

    models, strategy, _ = make(name, over)
    train_steps(models, strategy, 0, 4)  # sent at step 3, lands at step 5
    assert strategy.in_flight is not None
    buf = io.BytesIO()
    torch.save({"models": [m.state_dict() for m in models], "strategy": strategy.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    models, strategy, _ = make(name, over)
    for m, s in zip(models, saved["models"]):
        m.load_state_dict(s)
    strategy.load_state_dict(saved["strategy"])
    assert strategy.in_flight is not None and strategy.in_flight.sent_at == 3
    assert (strategy.in_flight.coded is not None) == bool(extra)
    train_steps(models, strategy, 4, 10)
    strategy.finish()
    for a, b in zip(reference, models[0].parameters()):
        assert torch.equal(a, b)


DELAYED = [*LOWRANK, "strategy.sync_delay=2", "strategy.compress=\"int8\""]


@pytest.mark.parametrize("name, extra", [("lordo", []), ("local-adam", []), ("lordo", ['strategy.compress_residual="model"'])],
                         ids=["lordo", "local-adam", "lordo-folded"])
def test_simulator_and_gloo_give_the_same_trajectory_with_rounds_in_flight(name, extra):
    """On gloo the round's collectives run in a thread on their own process group while the next steps train;
    on the simulator at once: the same code gives the same trajectory and the same ledger, bit for bit (folded:
    the round in flight held as codes)."""
    comm = assert_simulator_equals_gloo(name, [*DELAYED, *extra])
    assert comm.ledger.overlapped_calls > 0 and comm.ledger.wait_s == 0


@pytest.mark.parametrize("override, message", [
    ("strategy.sync_delay=4", "sync_delay must be in [0, strategy.sync_every = 3]"),
    ("strategy.sync_delay=-1", "strategy.sync_delay"),
    ("strategy.sync_exp_avg_every=2", "sync_exp_avg_every"),
])
def test_bad_delays_are_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make("lordo", ["strategy.sync_delay=2", override] if "exp_avg" in override else [override])


def test_strategies_without_synchronisations_refuse_a_delay():
    with pytest.raises(ConfigError, match="strategy 'ddp' communicates every step"):
        strategy_config("ddp", ["strategy.sync_delay=1"])


def test_torchft_refuses_a_delay_by_name():
    class FaultTolerant(SimCommunicator):
        fault_tolerant = True

    with pytest.raises(ConfigError, match="torchft"):
        models, _, _ = make("local-adam")
        from lordo.strategies import LocalUpdateStrategy

        LocalUpdateStrategy(models, FaultTolerant(2), optimizers=[torch.optim.AdamW(m.parameters()) for m in models],
                            sync_every=3, sync_delay=1)


def test_the_modelled_wall_clock_hides_each_round_behind_its_delay_by_hand():
    """12 steps of 1 s compute, K = 4, τ = 2: the rounds sent at steps 4 and 8 each ran behind 2 steps (the one
    at 12 lands at once); each takes 3 s on the shared medium, so 1 s of each shows: 12 + 2 × (3 − 2) = 14 s."""
    from lordo.comm import Ledger
    from lordo.train.summary import modeled_wall_s

    cfg = strategy_config("lordo", ["strategy.sync_every=4", "strategy.sync_delay=2", "train.steps=12",
                                    'comm.medium="shared"', "comm.latency_s=0"])
    ledger = Ledger(world_size=4)
    for _ in range(2):
        ledger.record("all_reduce", "pseudo_gradient", 1_000_000, 1, background=True)
    bandwidth = 4 * 1_500_000 * 8 / 3.0  # one round: 4 workers × 1.5 MB on the medium in 3 s
    assert modeled_wall_s(cfg, ledger, 12.0, bandwidth) == pytest.approx(14.0)
    blocking = strategy_config("lordo", ["strategy.sync_every=4", "train.steps=12", 'comm.medium="shared"',
                                         "comm.latency_s=0"])
    waited = Ledger(world_size=4)
    for _ in range(2):
        waited.record("all_reduce", "pseudo_gradient", 1_000_000, 1)
    assert modeled_wall_s(blocking, waited, 12.0, bandwidth) == pytest.approx(12.0 + 2 * 3.0)  # nothing hidden


def test_local_bases_move_at_every_landing_when_a_round_lands_as_the_next_starts():
    """lordo-local with τ = K: the step a round lands is the step the next starts, and each worker's own
    gradients of that step belong to the new round, not to the landing one (which brought its own)."""
    models, strategy, _ = make("lordo-local", ["strategy.sync_delay=3"])
    stats = train_steps(models, strategy, 0, 12)
    overlaps = [s["basis_overlap"] for s in stats if "basis_overlap" in s]
    assert len(overlaps) == 3  # landings at steps 6, 9, 12 of the rounds sent at 3, 6, 9
    assert max(overlaps) < 0.999  # each moved the bases (a lost capture keeps them: overlap exactly 1)


def test_the_delayed_merge_of_a_float64_model_stays_exact():
    """The anchor of a float64 parameter is kept in float64 and decoded to it (it was decoded to float32, so a
    delayed landing of a float64 run rounded its anchor): the same three delayed rounds as above with a float64
    model equal the float64 reference (to the float32 bases' rounding: the bases are computed in float32)."""
    shape, r, K, steps, tau = (12, 7), 2, 3, 11, 2
    options = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-8, omega=0.9, qh_source="grad+error", wd=0.1, after_qh="remove")
    torch.manual_seed(5)
    grads = [[torch.randn(shape, dtype=torch.float64) for _ in range(2)] for _ in range(steps)]
    expected = reference_run(shape, grads, K=K, tau=tau, r=r, options=options)
    models, strategy = delayed_run(shape, grads, K, tau, r, torch.float64)
    assert strategy.anchor.decoded(0).dtype == torch.float64
    strategy.finish()
    for m in models:
        torch.testing.assert_close(m.w.detach(), expected, rtol=1e-5, atol=1e-6)
