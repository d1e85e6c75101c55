"""Writes tests/data/saved_optimizer.pt: a LowRankQHAdam state after 3 steps and the parameters after 3 more (a
basis set anew at step 5), as the code of the commit it is run from computes them. Run from a checkout of that
commit: PYTHONPATH=<that checkout>/src python tests/data/make_saved_optimizer.py. The stored file was made at
commit 0cd4596, before the optimizer's redesign; tests/test_optim.py loads it with today's code."""

import copy
import sys
from pathlib import Path

import torch

from lordo.optim import LowRankQHAdam


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 4))


def optimizer(m):
    mats = [p for p in m.parameters() if p.ndim == 2]
    vecs = [p for p in m.parameters() if p.ndim != 2]
    return LowRankQHAdam([{"params": mats, "rank": 2}, {"params": vecs, "rank": None}], lr=1e-2, omega=0.9,
                         weight_decay=0.1)


def step(m, opt, t):
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    ((m(x) - y) ** 2).mean().backward()
    if t == 5:  # a basis change: the deferred buffer and its factor are settled
        w = m[0].weight
        opt.set_basis(w, torch.linalg.qr(torch.randn(min(w.shape), 2, generator=g))[0])
    opt.step()


if __name__ == "__main__":
    m = model()
    opt = optimizer(m)
    for t in range(3):
        step(m, opt, t)
    saved = {"model": {k: v.clone() for k, v in m.state_dict().items()}, "optimizer": copy.deepcopy(opt.state_dict())}
    for t in range(3, 7):
        step(m, opt, t)
    saved["after"] = {k: v.clone() for k, v in m.state_dict().items()}
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("saved_optimizer.pt"))
    torch.save(saved, out)
    print(f"wrote {out}")
