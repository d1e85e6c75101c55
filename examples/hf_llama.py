"""Train a Hugging Face `transformers` Llama with LoRDO: the model is built from a config (no weights are
downloaded), the data is lordo's bundled corpus.

    pip install 'lordo[hf]'            # transformers
    lordo data fetch                    # the corpus archives, once
    torchrun --standalone --nproc-per-node 2 examples/hf_llama.py --steps 60     # 2 gloo processes
    python examples/hf_llama.py --steps 60                                       # one worker
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from the Hub: the model comes from a config

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lordo  # noqa: E402
from lordo.data import prepare  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description="LoRDO on a Hugging Face Llama")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--strategy", default="lordo")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data-dir", default=os.environ.get("LORDO_DATA_DIR", "data"))
    ap.add_argument("--save", metavar="DIR", help="save the trained model and tokenizer there (save_pretrained): "
                    "from_pretrained loads it, lm_eval --model hf --model_args pretrained=DIR scores it")
    args = ap.parse_args()
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ModuleNotFoundError:
        raise SystemExit("this example needs transformers: pip install 'lordo[hf]'") from None

    if "RANK" in os.environ:  # torchrun: one worker per process
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        prepare.ensure(args.data_dir, 4096, 0.05, log=lambda _: None)
    if dist.is_initialized():
        dist.barrier()
    data = prepare.load(prepare.prepared_dir(args.data_dir, 4096, 0.05))
    tokens = torch.from_numpy(data.train.astype("int64"))
    n = args.seq_len + 1
    val = torch.from_numpy(data.val[: 8 * n].astype("int64")).view(8, n)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=data.vocab_size, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.seq_len, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    # attention and MLP projections train low-rank; the (tied) embedding and the norms full-rank
    opt = lordo.distributed(model, args.strategy, lr=args.lr, rank=args.rank, sync_every=args.sync_every)
    # any torch LR scheduler: 10 warm-up steps, then cosine
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        starts = torch.randint(0, len(tokens) - n, (args.batch_size,), generator=g).tolist()
        batch = torch.stack([tokens[s : s + n] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        schedule.step()
        stats = opt.last_stats  # diagnostics of the step: "synced" at a synchronisation
        if opt.is_main and (step % 20 == 0 or "synced" in stats):
            print(f"step {step:4d}  loss {loss.item():.3f}" + ("  (synced)" if "synced" in stats else ""))
    opt.finish()

    model.eval()
    with torch.no_grad():
        val_loss = model(input_ids=val, labels=val).loss.item()
    comm, memory = opt.comm_report(), opt.memory_report()
    if opt.is_main:
        saved = f"{1 / comm['ratio_to_ddp']:.1f}x less than DDP" if comm["ratio_to_ddp"] else "one worker: nothing sent"
        print(f"{opt}\nval loss {val_loss:.3f} (ppl {math.exp(val_loss):.1f}); {comm['bytes_total']:,} bytes sent per "
              f"worker, {saved}; optimizer state {memory['total'] / memory['adamw']:.2f}x AdamW's")
    if opt.is_main and args.save:  # after finish(): every worker holds this model
        from transformers import PreTrainedTokenizerFast

        model.save_pretrained(args.save)
        PreTrainedTokenizerFast(tokenizer_file=str(data.root / "tokenizer.json"), eos_token="<|endoftext|>",
                                bos_token="<|endoftext|>", model_max_length=args.seq_len).save_pretrained(args.save)
        print(f"saved the model and its tokenizer to {args.save}")
    opt.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
