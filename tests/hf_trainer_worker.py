"""One process of tests/test_integrations.py's multi-worker Trainer test, started by torchrun: a tiny Llama trained
by lordo.hf.LoRDOTrainer, resumed from a checkpoint when one is named; writes its final weights and numbers."""

from __future__ import annotations

import atexit
import json
import os
import sys

import torch
import transformers

import lordo.hf


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def group_left_at_exit(path: str) -> None:
    """Runs after LoRDOTrainer's exit handler (registered before the trainer, and atexit runs the last first)."""
    with open(path, "w") as f:
        json.dump({"initialized": torch.distributed.is_initialized()}, f)


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    os.makedirs(out, exist_ok=True)
    atexit.register(group_left_at_exit, os.path.join(out, f"exit-{os.environ.get('RANK', '0')}.json"))
    resume = sys.argv[3] if len(sys.argv) > 3 else None
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(config)
    # max_grad_norm left at the Trainer's default (1.0): LoRDOTrainer warns once and leaves clipping to LoRDO
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, save_strategy="steps", save_steps=4,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, learning_rate=5e-3, disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = lordo.hf.LoRDOTrainer(model=model, args=args, train_dataset=Tokens(),
                                    lordo_options={"rank": 4, "sync_every": 4})
    trainer.train(resume_from_checkpoint=resume)
    rank = int(os.environ.get("RANK", "0"))
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, f"final-{rank}.pt"))
    opt = trainer._lordo()
    # a file per rank: two processes' lines on one shared stdout can interleave
    with open(os.path.join(out, f"row-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "steps": opt.steps_done, "world": opt.world_size,
                   "ratio_to_ddp": opt.comm_report()["ratio_to_ddp"]}, f)


if __name__ == "__main__":
    main()
