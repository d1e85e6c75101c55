"""LoRDO in a plain PyTorch training loop: your model, your data, your schedule.

Two processes over gloo on one machine (CPU):

    torchrun --standalone --nproc-per-node 2 examples/plain_loop.py --steps 60

One process (a single worker; nothing is communicated):

    python examples/plain_loop.py --steps 60

Four processes as two workers of two ranks, each worker's model sharded over its ranks with FSDP2:

    torchrun --standalone --nproc-per-node 4 examples/plain_loop.py --ranks-per-worker 2 --fsdp

The data is lordo's bundled corpus (run `lordo data fetch` once); swap in your own token stream.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lordo
from lordo.data import prepare


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int = 64, layers: int = 2, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--strategy", default="lordo")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data-dir", default=os.environ.get("LORDO_DATA_DIR", "data"))
    ap.add_argument("--ranks-per-worker", type=int, default=1, help="consecutive ranks that form one LoRDO worker")
    ap.add_argument("--fsdp", action="store_true", help="shard each worker's model over its ranks (FSDP2)")
    args = ap.parse_args()

    if "RANK" in os.environ:  # started by torchrun: one worker per process
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)  # the same initial model everywhere (lordo also broadcasts worker 0's)

    # --- your data (here: lordo's corpus, tokenised once per machine) ---
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        prepare.ensure(args.data_dir, 4096, 0.05, log=lambda _: None)
    if dist.is_initialized():
        dist.barrier()
    data = prepare.load(prepare.prepared_dir(args.data_dir, 4096, 0.05))
    train_tokens = torch.from_numpy(data.train.astype("int64"))
    val_tokens = torch.from_numpy(data.val[: 8 * 65].astype("int64")).view(8, 65)
    seq = 64
    g = torch.Generator().manual_seed(1000 + rank)  # each worker reads its own batches

    model = TinyLM(data.vocab_size, seq=seq)
    if args.fsdp:  # each block, then the rest, sharded over the worker's ranks; matrices along their long side
        from torch.distributed.fsdp import fully_shard

        mesh = lordo.worker_mesh(args.ranks_per_worker)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, shard_placement_fn=lordo.optim.fsdp_placement)
        fully_shard(model, mesh=mesh, shard_placement_fn=lordo.optim.fsdp_placement)
    # --- the ten lines that matter ---
    opt = lordo.distributed(model, args.strategy, lr=args.lr, rank=args.rank, sync_every=args.sync_every,
                            ranks_per_worker=args.ranks_per_worker)
    # any torch LR scheduler: 10 warm-up steps, then cosine
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
    for step in range(args.steps):
        starts = torch.randint(0, len(train_tokens) - seq - 1, (args.batch_size,), generator=g)
        batch = torch.stack([train_tokens[s : s + seq + 1] for s in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        schedule.step()
        stats = opt.last_stats  # diagnostics of the step: "synced" at a synchronisation
        if opt.is_main and (step % 20 == 0 or "synced" in stats):
            synced = "  (synced)" if "synced" in stats else ""
            print(f"step {step:4d}  loss {loss.item():.3f}  lr {schedule.get_last_lr()[0]:.2e}{synced}")
    opt.finish()  # every worker now holds the same model
    # ---------------------------------

    with torch.no_grad():
        val = F.cross_entropy(model(val_tokens[:, :-1]).flatten(0, 1), val_tokens[:, 1:].flatten()).item()
    comm, memory = opt.comm_report(), opt.memory_report()
    if opt.is_main:
        ratio = f"{1 / comm['ratio_to_ddp']:.1f}x less than DDP" if comm["ratio_to_ddp"] else "one worker: nothing sent"
        print(f"{opt}\nval loss {val:.3f} (ppl {math.exp(val):.1f}); sent {comm['bytes_total']:,} bytes per worker, {ratio}; "
              f"optimizer state {memory['total']:,} bytes ({memory['total'] / memory['adamw']:.2f}x AdamW's)")
    opt.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
