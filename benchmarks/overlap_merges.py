"""Screen other merges of a delayed round (``strategy.sync_delay`` = τ) against the one lordo uses.

docs/results.md section 10's second table: each merge patches how a round that lands τ steps late is
merged with the τ local steps taken meanwhile, then runs ``lordo train`` in that setting (``micro``, 4
simulated workers, K = 32, r = 16, τ = 8, lr 3e-3, the 2,000-step schedule) and stops after ``--stop-at``
steps; the validation losses are in OUT/metrics.jsonl. The merges (θ_new: the outer step of the round's
mean Δ; θ_m(s): worker m's weights when the round started; outer lr 1, so θ_new = θ_anchor − Δ):

- ``keep``: lordo's (docs/concepts.md): θ_m ← θ_new + (θ_m(s+τ) − θ_m(s)), moments replayed;
- ``drop``: the τ steps' progress dropped, θ_m ← θ_new;
- ``mix``: Streaming DiLoCo's mixing with α = ½, θ_m ← ½·θ_m(s+τ) + ½·θ_new;
- ``eager``: the τ steps start from an estimate of the mean ("eager updates"): θ_anchor − Δ_m/M −
  (1 − 1/M)·Δ_prev (the previous round's mean), and their progress from there is kept;
- ``decorrelate``: ``keep``, with the progress's component along the worker's own drift Δ_m − Δ taken out
  (one coefficient per tensor);
- ``moments-first``: the moments' average applied at once (as a small blocking exchange would), only Δ late.

    python benchmarks/overlap_merges.py --merge drop --out runs/merge-drop [--stop-at 400] [--set KEY=VALUE ...]

A research screen of the simulator only (it patches lordo's internals in this process); not a feature.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

from lordo.cli import main as lordo_main
from lordo.strategies import local_adam

SETTING = ["--model", "micro", "--workers", "4", "--backend", "sim", "--sync-every", "32", "--rank", "16",
           "--steps", "2000", "--set", "strategy.sync_delay=8", "--set", "optim.lr=0.003", "--set",
           "train.batch_size=8", "--set", "train.eval_every=100", "--set", "train.threads=1", "--set",
           "schedule.warmup_steps=100", "--set", "train.checkpoint_every=0"]
MERGES = ("keep", "drop", "mix", "eager", "decorrelate", "moments-first")
Strategy = local_adam.LocalUpdateStrategy


def patch(merge: str, stop_at: int) -> None:
    send, apply_round, step = Strategy.send, Strategy.apply_round, Strategy.step

    @torch.no_grad()
    def patched_send(self) -> None:
        send(self)
        r = self.in_flight
        if merge == "moments-first":  # the averages land now; the landing has no moments left to replay
            with self.moments_open(tuple(r.moments)):
                for key, (sent, means) in r.moments.items():
                    for i, live in enumerate(self.worker_moments(key)):
                        for at_send, mean, mine in zip(sent[i], means[i], live, strict=True):
                            mine.add_(mean - at_send)
            r.moments = {}
        if merge == "eager" and getattr(self, "_previous_mean", None) is not None:
            m = len(self.workers)
            r.eager_own = []
            for w, own in zip(self.workers, r.own, strict=True):
                start = []
                for t, d, prev in zip(w.tensors, own, self._previous_mean, strict=True):
                    t.add_((1 - 1 / m) * (d - prev))  # θ_m(s) → θ_anchor − Δ_m/M − (1 − 1/M)·Δ_prev
                    start.append(d / m + (1 - 1 / m) * prev)  # θ_anchor − that start
                r.eager_own.append(start)

    @torch.no_grad()
    def patched_apply(self, delta, own=None):
        if own is None:
            return apply_round(self, delta, own)
        for w, mine in zip(self.workers, own, strict=True):
            for t, d, a, mean in zip(w.tensors, mine, self.anchor.tensors, delta, strict=True):
                if merge == "mix":  # leaves ½θ(s+τ) + ½θ_new once apply_round adds Δ_m − θ_anchor + θ_new
                    t.mul_(0.5).add_(a + mean, alpha=0.5).sub_(d)
                elif merge == "decorrelate":
                    drift, progress = d - mean, t - (a - d)
                    energy = float(drift.pow(2).sum())
                    if energy > 0:
                        t.sub_(drift, alpha=float((progress * drift).sum()) / energy)
        self._previous_mean = [d.clone() for d in delta]
        if merge == "drop":
            return apply_round(self, delta, None)
        return apply_round(self, delta, getattr(self, "_landing_own", None) or own)

    def patched_step(self, lr=None):
        landing = self.in_flight
        self._landing_own = getattr(landing, "eager_own", None) if landing is not None else None
        stats = step(self, lr)
        # a SIGTERM, as a scheduler sends, is read at the start of the next step, which the run finishes first
        if self.steps_done == stop_at - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return stats

    Strategy.send, Strategy.apply_round, Strategy.step = patched_send, patched_apply, patched_step  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--merge", choices=MERGES, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-at", type=int, default=400, help="stop after this step (default 400)")
    args, rest = parser.parse_known_args()
    patch(args.merge, args.stop_at)
    code = lordo_main(["train", *SETTING, "--out", args.out, *rest])
    return 0 if code == 128 + signal.SIGTERM else code


if __name__ == "__main__":
    sys.exit(main())
