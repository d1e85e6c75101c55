"""The library API: a user's own loop with lordo.distributed equals our trainer; generic models; errors."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import lordo
from lordo.config import build_config, tomllib
from lordo.data import prepare
from lordo.data.sampler import BatchSampler
from lordo.errors import ConfigError
from lordo.model.params import group_by_module
from lordo.train.loop import build_model, train
from lordo.train.schedule import lr_factor

from harness import one_thread, run_gloo

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["model.preset=nano", "train.batch_size=4", "train.eval_batches=2", "train.eval_every=100",
            "schedule.warmup_steps=2", "strategy.sync_every=3", "strategy.rank=4", "train.steps=8",
            "train.checkpoint_every=0", "optim.lr=0.004"]


def trainer_config(data_dir, strategy, workers):
    return build_config(overrides=[*SETTINGS, f'strategy.name="{strategy}"', f"dist.workers={workers}",
                                   f"data.dir={json.dumps(str(data_dir))}"])


def user_loop(data_dir, strategy, workers, backend):
    """What a user writes: their model, their batches, their lr schedule, and lordo.distributed."""
    cfg = trainer_config(data_dir, strategy, workers)
    data = prepare.load(prepare.prepared_dir(data_dir, 4096, 0.05))
    hosted = range(workers) if backend == "sim" else [int(os.environ["RANK"])]
    models = [build_model(cfg, data.vocab_size) for _ in hosted]
    opt = lordo.distributed(models if backend == "sim" else models[0], strategy, lr=cfg.optim.lr, backend=backend,
                            rank=4, sync_every=3)
    samplers = [BatchSampler(data.train, cfg.model.seq_len, 4, cfg.train.seed, r, workers) for r in hosted]
    for step in range(1, cfg.train.steps + 1):
        for model, sampler in zip(models, samplers):
            x, y = sampler.next()
            model(x, y)[1].backward()
        opt.step(lr=cfg.optim.lr * lr_factor(step - 1, cfg.train.steps, cfg.schedule))
    opt.finish()
    result = ({k: v.clone() for k, v in models[0].state_dict().items()}, opt.comm_report(), opt.memory_report())
    opt.close()
    return result


def trainer_run(data_dir, tmp_path, strategy, workers):
    out = tmp_path / f"trainer-{strategy}"
    summary = train(trainer_config(data_dir, strategy, workers), out, log=lambda _: None, stream=open(os.devnull, "w"))
    return torch.load(out / "model.pt", weights_only=True), summary


@pytest.mark.parametrize("strategy", ["lordo", "ddp"])
def test_user_loop_on_the_simulator_equals_the_trainer_bitwise(data_dir, tmp_path, strategy):
    expected, summary = trainer_run(data_dir, tmp_path, strategy, 2)
    state, comm, memory = user_loop(data_dir, strategy, 2, "sim")
    for k in expected:
        assert torch.equal(state[k], expected[k]), k
    assert comm["bytes_total"] == summary["comm_bytes_total"]
    assert comm["ratio_to_ddp"] == pytest.approx(summary["comm_ratio_to_ddp"])
    assert {k: v for k, v in memory.items() if k not in ("total", "device_total", "adamw")} == summary["optimizer_state_bytes"]
    assert memory["adamw"] == 8 * summary["params"]


def test_user_loop_on_gloo_processes_equals_the_trainer(data_dir, tmp_path):
    with one_thread():  # as the gloo processes run: GEMMs' last bits depend on the thread count
        expected, summary = trainer_run(data_dir, tmp_path, "lordo", 2)
    results = run_gloo(user_loop, 2, data_dir, "lordo", 2, "auto")
    for rank in (0, 1):
        status, value = results[rank]
        assert status == "ok", value
        state, comm, _ = value
        for k in expected:
            torch.testing.assert_close(state[k], expected[k], rtol=1e-5, atol=1e-6, msg=k)
        assert comm["bytes_total"] == summary["comm_bytes_total"]


def test_one_worker_ddp_on_any_model_is_torch_adamw():
    """Degenerate case: one worker, ddp, no clipping == torch.optim.AdamW with decay on matrices only."""

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 50))

    ours, ref = make(), make()
    opt = lordo.distributed(ours, "ddp", lr=1e-2, weight_decay=0.1, grad_clip=0.0, beta2=0.99)
    decay = [p for n, p in ref.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in ref.named_parameters() if p.ndim < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.99), eps=opt.cfg.optim.eps)
    tokens = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        for model in (ours, ref):
            nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        adamw.step()
        adamw.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert opt.world_size == 1 and opt.ledger.total_bytes == 0


def test_module_grouping_of_a_generic_model():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 16)
            self.pos = nn.Embedding(16, 16)  # as many entries as the width: not a reason to call 16x16 layers heads
            self.q = nn.Linear(16, 16, bias=False)
            self.up = nn.Linear(16, 48)
            self.norm = nn.LayerNorm(16)
            self.conv = nn.Conv1d(16, 16, 3)
            self.mha = nn.MultiheadAttention(16, 2, bias=False)
            self.head = nn.Linear(16, 100, bias=False)

    groups = {g.rule.group: g.names for g in group_by_module(Tiny())}
    assert groups == {
        "block_matrix": ["q.weight", "up.weight", "mha.in_proj_weight", "mha.out_proj.weight"],
        "embedding": ["embed.weight", "pos.weight", "head.weight"],
        "other_matrix": ["conv.weight"],
        "norm_bias": ["up.bias", "norm.weight", "norm.bias", "conv.bias"],
    }
    opt = lordo.distributed(Tiny(), "lordo", rank=4)
    lowrank = {id(p) for p, _ in opt.strategy.optimizers[0].lowrank_params()}
    model = opt.models[0]
    assert lowrank == {id(p) for p in (model.q.weight, model.up.weight, model.mha.in_proj_weight, model.mha.out_proj.weight)}


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "lordoo"}, r"strategy must be one of ddp, local-adam, diloco, lordo, .*got 'lordoo'"),
    ({"ranks": 4}, r"unknown option 'ranks'; options are strategy keys \(.*rank.*\) or optim keys"),
    ({"rank": 40}, r"strategy.rank must be in \[1, 16\] for 0.weight"),
    ({"omega": 1.5}, r"strategy.omega must be in \[0, 1\]"),
    ({"backend": "mpi"}, r"backend must be one of auto, sim, gloo, nccl, torchft or a Communicator, got 'mpi'"),
])
def test_bad_arguments_are_clear_errors(kwargs, message):
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with pytest.raises(ConfigError, match=message):
        lordo.distributed(model, **kwargs)


def test_several_replicas_need_the_simulator():
    with pytest.raises(ConfigError, match="list of replicas"):
        lordo.distributed([])
    opt = lordo.distributed([nn.Linear(8, 8), nn.Linear(8, 8)], "local-adam", backend="sim")
    assert opt.world_size == 2
    torch.testing.assert_close(opt.models[1].weight, opt.models[0].weight)  # replicas start equal


def test_public_api_is_what_init_lists():
    import importlib
    import inspect

    module = importlib.import_module("lordo")
    # submodules become attributes once anything imports them (another test module, at collection): not names
    public = {name for name in dir(module) if not name.startswith("_") and not inspect.ismodule(getattr(module, name))}
    assert public == set(lordo.__all__) - {"__version__"}
    for name in lordo.__all__:
        assert getattr(lordo, name) is not None
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == lordo.__version__


def test_average_into_is_the_mean_of_the_workers_and_not_in_the_ledger():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 8), nn.Linear(8, 32)) for _ in range(3)]
    opt = lordo.distributed(models, "lordo", backend="sim", rank=2, sync_every=4)
    for step in range(2):
        for i, m in enumerate(models):
            tokens = torch.randint(0, 32, (4, 5), generator=torch.Generator().manual_seed(10 * step + i))
            nn.functional.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
    assert not opt.in_sync
    before = opt.ledger.table()
    spare = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 8), nn.Linear(8, 32))
    opt.average_into(spare)
    for got, *replicas in zip(spare.parameters(), *(m.parameters() for m in models)):
        torch.testing.assert_close(got, sum(p.detach() for p in replicas) / 3)
    assert opt.ledger.table() == before
    assert not torch.equal(next(models[0].parameters()), next(models[1].parameters()))  # the run is untouched
    opt.finish()
    assert opt.in_sync


def _own_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 50))


def _own_groups(model):
    """A user's own parameter groups: decay on matrices, none on vectors, a smaller rate for the embedding."""
    emb = [model[0].weight]
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("0.")]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": emb, "lr": 5e-3, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.1},
            {"params": rest, "weight_decay": 0.0}]


def _own_diloco(models, comm):
    from lordo.strategies import LocalUpdateStrategy

    return LocalUpdateStrategy(models, comm, optimizers=[torch.optim.AdamW(_own_groups(m), lr=1e-2) for m in models],
                               outer_optimizer=lambda anchor: torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True),
                               sync_every=3, grad_clip=0.0)


def _own_batch(worker, step):
    return torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(100 * worker + step))


def _loss(model, tokens):
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def test_a_strategy_with_your_own_inner_and_outer_optimizers_is_diloco_written_out():
    """lordo.distributed with a factory: torch's AdamW with the user's parameter groups inside, SGD with Nesterov
    momentum outside, K = 3, on two simulated workers, against DiLoCo written out with torch's optimizers:
    each replica K AdamW steps, Δ = mean(anchor − θ_m), anchor ← SGD step with Δ as its gradient, θ_m ← anchor."""
    ours = [_own_model(), _own_model()]
    opt = lordo.distributed(ours, _own_diloco, backend="sim")
    refs = [_own_model(), _own_model()]
    inner = [torch.optim.AdamW(_own_groups(m), lr=1e-2) for m in refs]
    anchor = [p.detach().clone() for p in refs[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(7):
        for w, (mine, ref) in enumerate(zip(ours, refs)):
            _loss(mine, _own_batch(w, step)).backward()
            _loss(ref, _own_batch(w, step)).backward()
            inner[w].step()
            inner[w].zero_grad()
        opt.step()
        if (step + 1) % 3 == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    a.grad = torch.stack([a - list(r.parameters())[i] for r in refs]).mean(0)
                outer.step()
                for r in refs:
                    for p, a in zip(r.parameters(), anchor):
                        p.copy_(a)
    for mine, ref in zip(ours, refs):
        for a, b in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["lr"] == 5e-3  # the user's groups, mirrored for schedulers
    assert "LocalUpdateStrategy" in repr(opt)
    opt.finish()


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=1e-3), r"lr: options configure a named strategy"),
    (dict(rank=4, sync_every=8), r"rank, sync_every: options configure a named strategy"),
    (dict(backend="torchft"), r"backend 'torchft' runs named strategies only"),
])
def test_a_strategy_factory_refuses_what_does_not_apply_to_it(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        lordo.distributed([_own_model(), _own_model()], _own_diloco, **{"backend": "sim", **kwargs})


def test_a_strategy_factory_must_return_a_strategy():
    with pytest.raises(ConfigError, match="must return a lordo.strategies Strategy, got AdamW"):
        lordo.distributed(_own_model(), lambda models, comm: torch.optim.AdamW(models[0].parameters()), backend="sim")


def _own_diloco_on_gloo():
    rank, model = int(os.environ["RANK"]), _own_model()
    opt = lordo.distributed(model, _own_diloco, backend="gloo")
    for step in range(7):
        _loss(model, _own_batch(rank, step)).backward()
        opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt.finish()
    return state


@pytest.mark.slow
def test_a_strategy_factory_on_gloo_processes_equals_the_simulator():
    """The same factory on two gloo processes (one replica each) ends where the simulator's two replicas end."""
    sim = [_own_model(), _own_model()]
    opt = lordo.distributed(sim, _own_diloco, backend="sim")
    for step in range(7):
        for w, m in enumerate(sim):
            _loss(m, _own_batch(w, step)).backward()
        opt.step()
    expected = [{k: v.clone() for k, v in m.state_dict().items()} for m in sim]
    opt.finish()
    results = run_gloo(_own_diloco_on_gloo, 2)
    for rank in range(2):
        status, state = results[rank]
        assert status == "ok", state
        for k, v in expected[rank].items():
            torch.testing.assert_close(state[k], v, rtol=1e-6, atol=1e-7)


def test_a_state_saved_with_other_round_settings_is_refused_and_nothing_is_loaded():
    """A plain lean state into an optimizer with int4 rounds, the residual folded and a delay: the load raised a raw
    KeyError after writing part of the state. It is one line that names the missing part, and the optimizer's state
    is what it was."""
    import warnings

    def make(**options):
        torch.manual_seed(0)
        models = [torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 64))
                  for _ in range(2)]
        opt = lordo.distributed(models, "lordo", backend="sim", rank=4, sync_every=4, **options)
        for _ in range(6):
            for m in models:
                t = torch.randint(0, 64, (4, 9))
                torch.nn.functional.cross_entropy(m(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
        return opt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the runs end between synchronisations
        saved = make(memory="lean").state_dict()
        opt = make(memory="lean", compress="int4", compress_residual="model", sync_delay=2)
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(lordo.ConfigError, match=r"nothing was loaded: it lacks 'shard_compression_error'"):
            opt.load_state_dict(saved)
        after = opt.state_dict()
    leaves_before, leaves_after = torch.utils._pytree.tree_leaves(before), torch.utils._pytree.tree_leaves(after)
    assert len(leaves_before) == len(leaves_after)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(leaves_before, leaves_after))
