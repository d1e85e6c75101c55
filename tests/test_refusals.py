"""What a red team tried, refused by name with nothing loaded or lost: another strategy's or rank's state (W2),
parameters frozen after building and a negative learning rate (W6), a data folder that is a file (W8), a non-finite
loss on another worker (W9), the Lighthouse lost before any checkpoint (W4)."""

from __future__ import annotations

import pytest
import torch

import lordo
from lordo.errors import ConfigError

from harness import batch, tiny_model


def replicas(n: int = 2):
    return [tiny_model() for _ in range(n)]


def trained(strategy: str, steps: int = 3, **options):
    models = replicas()
    opt = lordo.distributed(models, strategy, backend="sim", sync_every=2, **options)
    for step in range(steps):
        for rank, m in enumerate(models):
            m(*batch(rank, step))[1].backward()
        opt.step()
    return models, opt


def weights(models):
    return [p.detach().clone() for m in models for p in m.parameters()]


@pytest.mark.parametrize("other, options, what", [
    ("lordo", {"rank": 4}, "rank of each parameter group: saved [4, None"),
    ("ddp", {}, "strategy: saved ddp, here lordo"),
    ("local-adam", {}, "strategy: saved local-adam, here lordo"),
])
def test_another_strategy_s_or_rank_s_state_is_refused_and_nothing_loads(other, options, what):
    _, source = trained(other, **options)
    state = source.state_dict()
    models, target = trained("lordo", rank=2)
    before, held = weights(models), {k: v.clone() for k, v in target.strategy.state_dict()["shared"].items()
                                     if isinstance(v, torch.Tensor)}
    with pytest.raises(ConfigError, match="does not fit this optimizer; nothing was loaded") as err:
        target.load_state_dict(state)
    assert what in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(models)))
    after = target.strategy.state_dict()["shared"]
    assert all(torch.equal(v, after[k]) for k, v in held.items())
    assert target.strategy.steps_done == 3


def test_a_state_saved_before_identity_existed_is_compared_by_its_structure():
    _, source = trained("ddp")
    state = source.state_dict()
    del state["identity"]
    _, target = trained("lordo")
    with pytest.raises(ConfigError, match="saved by one without an anchor"):
        target.load_state_dict(state)
    _, rank4 = trained("lordo", rank=4)
    state = rank4.state_dict()
    del state["identity"]
    with pytest.raises(ConfigError, match=r"rank of each parameter group: saved \[4"):
        target.load_state_dict(state)


def test_a_matching_state_still_loads():
    _, source = trained("lordo", rank=2)
    _, target = trained("lordo", rank=2, steps=1)
    target.load_state_dict(source.state_dict())
    assert target.strategy.steps_done == 3


def test_parameters_frozen_after_building_and_a_negative_rate_are_refused():
    models = replicas()
    opt = lordo.distributed(models, "lordo", backend="sim", sync_every=2)
    for rank, m in enumerate(models):
        m(*batch(rank, 0))[1].backward()
    with pytest.raises(ConfigError, match=r"step\(lr=\.\.\.\) must be a finite number >= 0, got -1"):
        opt.step(lr=-1)
    before = weights(models)
    for m in models:
        m.tok_emb.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"tok_emb.weight were frozen \(requires_grad=False\) after the optimizer was built"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(models)))


def test_a_data_folder_that_is_a_file_is_named(tmp_path, capsys):
    from lordo.cli import main

    (tmp_path / "notes.txt").write_text("x")
    assert main(["train", "--data-dir", str(tmp_path / "notes.txt"), "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    assert "data.dir (--data-dir) must be a folder" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_non_finite_loss_names_the_worker_that_had_it(data_dir, tmp_path, monkeypatch):
    """W9: every worker stops together, and the message names the worker whose loss was not finite, not a
    healthy one's finite loss."""
    from lordo.config import build_config
    from lordo.errors import NonFiniteError
    from lordo.train import loop

    original = loop.Trainer._forward_backward
    calls = {"n": 0}

    def poisoned(self, forward, sampler):
        loss = original(self, forward, sampler)
        calls["n"] += 1
        return torch.tensor(float("nan")) if calls["n"] == 2 * 3 + 2 else loss  # worker 1 at step 4

    monkeypatch.setattr(loop.Trainer, "_forward_backward", poisoned)
    cfg = build_config(overrides=['model.preset="nano"', "train.steps=6", "dist.workers=2", f'data.dir="{data_dir}"',
                                  "strategy.sync_every=2", "strategy.sync_delay=1"])
    with pytest.raises(NonFiniteError, match=r"not finite at step 4 on worker\(s\) \[1\]"):
        loop.train(cfg, tmp_path / "run", log=lambda _: None, stream=open("/dev/null", "w"))


@pytest.mark.parametrize("every, hint", [(0, "This worker has no checkpoint yet: started again, it begins at step 0"),
                                         (2, "Started again, this worker resumes from its checkpoint .*step-00000002")])
def test_a_lost_link_says_what_a_restart_starts_from(data_dir, tmp_path, monkeypatch, every, hint):
    """W4: a collective that fails (torchft's Lighthouse gone, a peer lost) says where this worker would restart:
    its newest intact checkpoint, or step 0 when there is none (it used to promise a checkpoint that did not exist)."""
    from lordo.comm.torch_dist import CommError
    from lordo.config import build_config
    from lordo.distributed_optimizer import DistributedOptimizer
    from lordo.train import loop

    original = DistributedOptimizer.step

    def failing(self, *args, **kwargs):
        if self.strategy.steps_done == 3:
            raise CommError("no quorum for the sync round after step 3: the Lighthouse did not answer")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DistributedOptimizer, "step", failing)
    cfg = build_config(overrides=['model.preset="nano"', "train.steps=6", f'data.dir="{data_dir}"',
                                  f"train.checkpoint_every={every}"])
    with pytest.raises(CommError, match=hint):
        loop.train(cfg, tmp_path / "run", log=lambda _: None, stream=open("/dev/null", "w"))
