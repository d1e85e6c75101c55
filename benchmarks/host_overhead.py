"""Host time of the batched low-rank step, the part of a GPU step that launches kernels: 84 tiny matrices
(12 layers of q, k, v, o 32×32, two 64×32 and one 32×64, as a transformer's shapes repeat) and a 256×32
embedding, `LowRankQHAdam` at r = 4 on the batched path (``--per-matrix``: the other one), one CPU thread. The tensors are so small that the
time is Python and dispatch, which is what an accelerator step of many small matrices is bound by.

Compares source trees side by side (each in its own process, alternating, medians), e.g. this checkout
against an older commit:

    git worktree add /tmp/lordo-old <commit>
    python benchmarks/host_overhead.py src /tmp/lordo-old/src [--compile] [--repeats 3]

The first tree is the reference of the ratios; a tree given twice shows the machine's noise.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = r"""
import sys, time, statistics
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from lordo.optim import LowRankQHAdam
torch.manual_seed(0)
shapes = [(32, 32)] * 4 + [(64, 32)] * 2 + [(32, 64)]
mats = [torch.nn.Parameter(torch.randn(s)) for _ in range(12) for s in shapes]
emb = torch.nn.Parameter(torch.randn(256, 32))
for p in mats + [emb]:
    p.grad = torch.randn_like(p) * 1e-3
extra = {"compile": True} if sys.argv[2] == "1" else {}
opt = LowRankQHAdam([{"params": mats, "rank": 4}, {"params": [emb], "rank": None}], lr=1e-3, omega=0.98,
                    basis_method="subspace", batched=sys.argv[3] == "1", **extra)
for _ in range(10):
    opt.step()
times = []
for _ in range(15):
    t = time.perf_counter()
    for _ in range(50):
        opt.step()
    times.append((time.perf_counter() - t) / 50 * 1e3)
print(statistics.median(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", help="source folders holding the lordo package (the first is the reference)")
    parser.add_argument("--compile", action="store_true", help="LowRankQHAdam(compile=True) (trees that have it)")
    parser.add_argument("--per-matrix", action="store_true", help="the per-matrix path (the CPU's default), not the batched one")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ms: list[list[float]] = [[] for _ in args.trees]
    for _ in range(args.repeats):
        for i, tree in enumerate(args.trees):
            out = subprocess.run([sys.executable, "-c", CHILD, tree, "1" if args.compile else "0",
                                  "0" if args.per_matrix else "1"],
                                 capture_output=True, text=True, check=True)
            ms[i].append(float(out.stdout.strip().splitlines()[-1]))
    reference = statistics.median(ms[0])
    print("| source tree | ms per step (median of the repeats' medians) | × the first |")
    print("|---|---|---|")
    for tree, values in zip(args.trees, ms):
        print(f"| {tree} | {statistics.median(values):.2f} | {statistics.median(values) / reference:.2f} |")


if __name__ == "__main__":
    main()
