"""lordo's optimizer inside other people's trainers: Hugging Face ``Trainer`` (with its checkpoint resume) and
Lightning's automatic optimization."""

import pytest
import torch
from torch import nn

import lordo

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the hf extra)")


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def hf_run(out, steps, resume=None):
    model = tiny_llama()
    opt = lordo.distributed(model, "lordo", lr=5e-3, rank=4, sync_every=3, backend="sim")
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, save_strategy="steps", save_steps=3,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, max_grad_norm=0.0,  # lordo clips itself
        disable_tqdm=True, dataloader_num_workers=0, save_only_model=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, schedule))
    trainer.train(resume_from_checkpoint=resume)
    return model, opt, trainer


def test_hf_trainer_trains_with_lordo_and_resumes_exactly(tmp_path):
    full, full_opt, trainer = hf_run(tmp_path / "full", 6)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 6 and full_opt.steps_done == 6 and losses[-1] < losses[0]
    resumed, resumed_opt, _ = hf_run(tmp_path / "full", 6, resume=str(tmp_path / "full" / "checkpoint-3"))
    assert resumed_opt.steps_done == 6
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_lightning_automatic_optimization_counts_steps_and_trains(tmp_path):
    pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 16, bias=False), nn.GELU(), nn.Linear(16, 40))
            self.losses = []

        def training_step(self, batch, _):
            (tokens,) = batch
            loss = nn.functional.cross_entropy(self.net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            self.opt = lordo.distributed(self, "lordo", lr=1e-2, rank=4, sync_every=4, backend="sim")
            return self.opt

    torch.manual_seed(0)
    tokens = torch.randint(0, 40, (8, 9)).repeat(16, 1)  # one batch, over and over: learnable
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)
    module = Module()
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    assert trainer.global_step == 10 and module.opt.steps_done == 10
    assert module.losses[-1] < module.losses[0] - 0.3


def test_lordo_s_trainer_runs_one_worker_per_process_and_resumes_each_exactly(tmp_path):
    """lordo.hf.LoRDOTrainer under torchrun, 2 gloo processes: no DDP wrapping (bytes well under DDP's), both
    workers end with one model, the Trainer's default max_grad_norm is not applied (one warning), a resume from
    the Trainer's checkpoint gives each worker its own optimizer state back: the final model is bit for bit the
    uninterrupted run's on both; and the process group, which the script leaves open, is gone before the
    interpreter's teardown (a gloo group left to it aborted a rank once: SIGABRT after a run that went well)."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("hf_trainer_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def torchrun(out, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker),
               str(out), "8", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    full = tmp_path / "full"
    done = torchrun(full)
    rows = [json.loads((full / f"row-{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["rank"] for r in rows) == [0, 1] and all(r["steps"] == 8 and r["world"] == 2 for r in rows)
    assert all(r["ratio_to_ddp"] < 0.5 for r in rows)  # two syncs in 8 steps, not an all-reduce a step
    assert done.stderr.count("max_grad_norm = 1.0 is not applied") == 2  # once per process
    ends = [torch.load(full / f"final-{r}.pt") for r in (0, 1)]
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    assert [json.loads((full / f"exit-{r}.json").read_text()) for r in (0, 1)] == [{"initialized": False}] * 2
    assert sorted(p.name for p in (full / "checkpoint-4").glob("optimizer-rank*.pt")) == ["optimizer-rank0.pt",
                                                                                         "optimizer-rank1.pt"]
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoint-4", resumed / "checkpoint-4")
    torchrun(resumed, str(resumed / "checkpoint-4"))
    for r in (0, 1):
        again = torch.load(resumed / f"final-{r}.pt")
        assert all(torch.equal(ends[r][k], again[k]) for k in again), r


def test_lordo_s_trainer_refuses_checkpoints_between_synchronisations(tmp_path):
    import lordo.hf
    from lordo.errors import ConfigError

    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=8, save_strategy="steps", save_steps=3,
                                          report_to=[], use_cpu=True)
    with pytest.raises(ConfigError, match=r"save_steps \(3\) must be a multiple of sync_every \(4\)"):
        lordo.hf.LoRDOTrainer(model=tiny_llama(), args=args, train_dataset=Tokens(), lordo_options={"sync_every": 4})


def lordo_trainer_run(out, steps, resume=None):
    import lordo.hf

    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, save_strategy="steps", save_steps=4,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, max_grad_norm=0.0, disable_tqdm=True,
        dataloader_num_workers=0)
    model = tiny_llama()
    trainer = lordo.hf.LoRDOTrainer(model=model, args=args, train_dataset=Tokens(),
                                    lordo_options={"rank": 4, "sync_every": 4})
    trainer.train(resume_from_checkpoint=resume)
    return model


def test_lordo_s_trainer_resumes_from_the_newest_checkpoint_every_worker_finished(tmp_path):
    """A worker killed while the Trainer saved left its optimizer file cut short in a folder that looks complete
    (the main process wrote trainer_state.json): resume_from_checkpoint=True took that folder and failed in
    torch.load. It takes the checkpoint before it, with a warning, and trains to the uninterrupted run's model; a
    cut file named explicitly is refused in one line that says so."""
    import shutil

    import lordo.hf

    full = lordo_trainer_run(tmp_path / "full", 8)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut, ignore=shutil.ignore_patterns("runs"))
    shutil.rmtree(cut / "checkpoint-8")
    shutil.copytree(tmp_path / "full" / "checkpoint-4", cut / "checkpoint-8")  # a later save ...
    state = cut / "checkpoint-8" / "optimizer-rank0.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # ... whose worker was killed while writing
    with pytest.raises(lordo.ConfigError, match="holds no complete optimizer state of worker 0 .* cut short"):
        lordo_trainer_run(tmp_path / "again", 8, resume=str(cut / "checkpoint-8"))
    with pytest.warns(UserWarning, match="checkpoint-8 is not resumed from: optimizer-rank0.pt"):
        resumed = lordo_trainer_run(cut, 8, resume=True)  # (its own save at step 8 then replaces the cut folder)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
