"""LoRDO over torchft: workers that fail without stopping the others.

A Lighthouse (torchft's quorum server), then one process per worker, each in its own terminal or machine:

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 10000
    TORCHFT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=3 TORCHFT_MIN_REPLICAS=2 REPLICA_GROUP_ID=0 \
        python examples/fault_tolerant.py --steps 400

(and the same with REPLICA_GROUP_ID=1 and 2). Kill a worker (even with kill -9): the others go on without it.
Start it again with the same REPLICA_GROUP_ID: it receives the current state from one of them and trains on
from their step. The data is lordo's bundled corpus (run `lordo data fetch` once).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F
from plain_loop import TinyLM  # the model of examples/plain_loop.py

import lordo
from lordo.data import prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--strategy", default="lordo")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data-dir", default=os.environ.get("LORDO_DATA_DIR", "data"))
    args = ap.parse_args()

    prepare.ensure(args.data_dir, 4096, 0.05, log=lambda _: None)
    data = prepare.load(prepare.prepared_dir(args.data_dir, 4096, 0.05))
    train_tokens = torch.from_numpy(data.train.astype("int64"))
    val_tokens = torch.from_numpy(data.val[: 8 * 65].astype("int64")).view(8, 65)
    seq = 64
    torch.manual_seed(0)  # every worker starts from the same weights (under torchft nothing broadcasts them)
    model = TinyLM(data.vocab_size, seq=seq)

    # --- what changes for fault tolerance: the backend, and join() before the first step ---
    opt = lordo.distributed(model, args.strategy, lr=args.lr, rank=args.rank, sync_every=args.sync_every,
                            backend="torchft")
    start = opt.join()  # 0 on a fresh start; after a restart, the others' step (their state is now ours)
    replica = opt.comm.local_ranks[0]
    for step in range(start + 1, args.steps + 1):
        # the batches and the learning rate depend on the step alone: a restarted worker picks up where it was
        g = torch.Generator().manual_seed(1_000_000 * replica + step)
        starts = torch.randint(0, len(train_tokens) - seq - 1, (args.batch_size,), generator=g)
        batch = torch.stack([train_tokens[s : s + seq + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step(lr=args.lr * min(1.0, step / 10) * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        if "synced" in opt.last_stats:
            print(f"worker {replica} step {step:4d}  loss {loss.item():.3f}  ({opt.comm.contributors} workers)", flush=True)
    opt.finish()  # every worker now holds the same model
    # ---------------------------------------------------------------------------------------

    with torch.no_grad():
        val = F.cross_entropy(model(val_tokens[:, :-1]).flatten(0, 1), val_tokens[:, 1:].flatten()).item()
    rounds = opt.comm.rounds
    print(f"worker {replica}: val loss {val:.3f} (ppl {math.exp(val):.1f}); {len(rounds)} rounds, "
          f"{sum(r['attempts'] - 1 for r in rounds)} run again, workers per round {[r['contributors'] for r in rounds]}")
    opt.close()


if __name__ == "__main__":
    main()
