"""torchft's DiLoCo loop with LoRDO inside: the one-line switch.

torchft's own example (torchft/train_diloco.py) builds a Manager, an inner AdamW and an outer Nesterov SGD, and
wraps its loop in ``with DiLoCo(...)``. This is that loop on lordo's bundled corpus; the only change is the import:

    from torchft.local_sgd import DiLoCo                 # torchft
    from lordo.torchft import LoRDO as DiLoCo            # LoRDO: low-rank local steps, global bases, the same loop

A Lighthouse, then one process per worker:

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 10000
    RUST_LOG=warn TORCHFT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=3 REPLICA_GROUP_ID=0 python examples/torchft_diloco.py

(and REPLICA_GROUP_ID=1, 2; RUST_LOG=warn keeps torchft's Rust side from logging every quorum at INFO, some 50 lines
per 48 steps: it is read when torchft is first imported, so it must be in the environment). Kill one: the others go
on; start it again: it recovers from them. Run lordo data fetch once for the corpus.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os

import torch
import torch.nn.functional as F
from plain_loop import TinyLM  # the model of examples/plain_loop.py
from torchft import Manager, ProcessGroupGloo

from lordo.data import prepare
from lordo.torchft import LoRDO as DiLoCo  # instead of: from torchft.local_sgd import DiLoCo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8, help="lordo's rank (an option torchft's DiLoCo does not have)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--data-dir", default=os.environ.get("LORDO_DATA_DIR", "data"))
    args = ap.parse_args()
    replica = int(os.environ["REPLICA_GROUP_ID"])

    prepare.ensure(args.data_dir, 4096, 0.05, log=lambda _: None)
    data = prepare.load(prepare.prepared_dir(args.data_dir, 4096, 0.05))
    tokens = torch.from_numpy(data.train.astype("int64"))
    val = torch.from_numpy(data.val[: 8 * 65].astype("int64")).view(8, 65)
    seq = 64
    torch.manual_seed(0)  # every worker starts from the same weights
    model = TinyLM(data.vocab_size, seq=seq)

    # as in torchft's example: a Manager of this replica group (one rank), an inner and an outer optimizer
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)), min_replica_size=2,
                      load_state_dict=None, state_dict=None, replica_id=f"train_diloco_{replica}",
                      store_addr="localhost", store_port=store.port, rank=0, world_size=1, use_async_quorum=False,
                      timeout=datetime.timedelta(seconds=10), quorum_timeout=datetime.timedelta(seconds=90))
    inner_optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.999))
    outer_optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)  # averaging; DiLoCo: 0.7, 0.9, nesterov
    schedule = torch.optim.lr_scheduler.LambdaLR(inner_optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps)))

    with DiLoCo(manager, [model], inner_optimizer, outer_optimizer, sync_every=args.sync_every, rank=args.rank) as diloco:
        for _ in range(diloco.start_step):  # a worker that recovered continues the others' schedule
            schedule.step()
        for step in range(diloco.start_step, args.steps):
            g = torch.Generator().manual_seed(1_000_000 * replica + step)  # the data depends on the step alone
            starts = torch.randint(0, len(tokens) - seq - 1, (args.batch_size,), generator=g).tolist()
            batch = torch.stack([tokens[s : s + seq + 1] for s in starts])
            inner_optimizer.zero_grad()
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            inner_optimizer.step()
            schedule.step()
            if diloco.steps_done % args.sync_every == 0:
                print(f"worker {replica} step {step + 1:4d}  loss {loss.item():.3f}", flush=True)

    with torch.no_grad():
        loss = F.cross_entropy(model(val[:, :-1]).flatten(0, 1), val[:, 1:].flatten()).item()
    rounds = diloco.optimizer.comm.rounds
    print(f"worker {replica}: val loss {loss:.3f} (ppl {math.exp(loss):.1f}); {len(rounds)} rounds, workers per round "
          f"{[r['contributors'] for r in rounds]}; bytes sent {diloco.comm_report()['bytes_total']:,}", flush=True)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
