"""``lordo bench link``: training timed over a slow link that is real, not modelled.

For each rate (unthrottled, 1 Gbit/s, 100 and 10 Mbit/s by default) a network namespace with a rate-limited
loopback is made (:mod:`lordo.link`: one shared medium of that rate for all workers), and M gloo worker
processes inside it train the same run for each variant (a strategy and its ``strategy.*`` settings). From
each run's summary.json and metrics.jsonl: tokens/s over the whole run and in the steady state (between the
first and the last synchronisation step, leaving out start-up and the final synchronisation), time per step,
seconds blocked in collectives, compute utilisation, and validation loss against seconds of training. The
measured collective time is set beside the ledger's model of the same bytes on a shared medium (latency
per call from the unthrottled run of the same variant). Results go to JSON and a PNG of loss against
wall-clock at one rate.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..comm.ledger import Entry, Ledger
from ..errors import ConfigError
from ..link import LinkError, ThrottledLink, end_process_group, unavailable

DEFAULT_VARIANTS = ("ddp", "lordo", "lordo,sync_delay=8", "lordo,compress=int8", "lordo,sync_delay=32,compress=int8")
EVERY_STEP = ("ddp", "lowrank-ddp")  # strategies that communicate at every step: fewer steps (see --every-step-steps)


def parse_rates(text: str) -> list[float | None]:
    rates: list[float | None] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "none":
            rates.append(None)
            continue
        try:
            rate = float(item)
        except ValueError:
            rate = float("nan")
        if not rate > 0:
            raise ConfigError(f"--rates: each rate is a number of Mbit/s > 0 or 'none' (unthrottled), got {item!r}")
        rates.append(rate)
    if not rates:
        raise ConfigError("--rates lists no rate")
    return rates


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME[,KEY=VALUE...]``: a strategy name and its settings, ``strategy.*`` unless the key names its section,
    e.g. ``lordo,sync_delay=8`` or ``local-adam,optim.inner=muon`` (MuLoCo)."""
    name, *settings = [x.strip() for x in text.split(",") if x.strip()]
    overrides = []
    for kv in settings:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ConfigError(f"--variants: {text!r}: settings are KEY=VALUE (strategy.KEY, or SECTION.KEY), got {kv!r}")
        quoted = value if value.replace(".", "", 1).lstrip("-").isdigit() or value in ("true", "false") else json.dumps(value)
        overrides.append(f"{key if '.' in key else 'strategy.' + key}={quoted}")
    return name, overrides


def steady_state(rows: list[dict[str, Any]], first: int, last: int) -> dict[str, float] | None:
    """Tokens/s and compute utilisation between the logged steps ``first`` and ``last`` (their train_s)."""
    by_step = {r["step"]: r for r in rows if "train_s" in r and "step" in r}
    if first not in by_step or last not in by_step or last <= first:
        return None
    a, b = by_step[first], by_step[last]
    seconds = b["train_s"] - a["train_s"]
    blocked = b.get("comm_blocked_s", 0.0) - a.get("comm_blocked_s", 0.0)
    return {"tokens_per_s": (b["tokens"] - a["tokens"]) / seconds, "utilisation": 1 - blocked / seconds,
            "s_per_step": seconds / (last - first)}


def ledger_of(summary: dict[str, Any]) -> Ledger:
    ledger = Ledger(summary["workers"])
    for key, e in summary["comm_by_collective"].items():
        ledger.entries[key] = Entry(e["calls"], e["bytes"], e["tensors"], e["wire"])
    return ledger


def _run(link: ThrottledLink, argv: list[str], timeout_s: float) -> str | None:
    """Run ``argv`` in the namespace; None on success, else what went wrong. A run past its time gets SIGTERM
    (the launcher forwards it: the workers save and exit), then SIGKILL; the namespace's processes are ended."""
    proc = subprocess.Popen(link.command(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_process_group(proc)
        return f"stopped after {timeout_s:.0f} s (--timeout)"
    finally:
        link.end_processes()
    if proc.returncode:
        return f"exit {proc.returncode}: {(err or '').strip().splitlines()[-1] if err and err.strip() else ''}"
    return None


def run_one(link: ThrottledLink, variant: str, rate: float | None, args: argparse.Namespace, out: Path,
            latency_s: float | None) -> dict[str, Any]:
    name, overrides = parse_variant(variant)
    steps = args.every_step_steps if name in EVERY_STEP else args.steps
    if name in EVERY_STEP and rate is not None and rate <= 10:
        steps = max(2, steps // 4)  # ~26 s a step for ddp on micro at 10 Mbit/s
    medium = ['comm.medium="shared"', f"comm.bandwidths_gbit=[{(rate or 1e5) / 1000}]"]
    if latency_s is not None:
        medium.append(f"comm.latency_s={latency_s}")
    sets = [*overrides, *medium, f"train.eval_every={args.sync_every}", 'train.eval_model="worker0"',
            "train.checkpoint_every=0", f"train.log_every={1 if name in EVERY_STEP else args.log_every}", *args.set]
    argv = [sys.executable, "-m", "lordo.cli", "train", "--model", args.model, "--strategy", name, "--workers",
            str(args.workers), "--backend", "gloo", "--steps", str(steps), "--sync-every", str(args.sync_every),
            "--rank", str(args.rank), "--data-dir", args.data_dir, "--out", str(out),
            *[x for kv in sets for x in ("--set", kv)]]
    row: dict[str, Any] = {"variant": variant, "rate_mbit": rate, "link": "unthrottled" if rate is None else f"{rate:g} Mbit/s",
                           "steps": steps}
    problem = _run(link, argv, args.timeout)
    if problem:
        row["error"] = problem
        return row
    s = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # the steady state: from the end of the first step (ddp) or first sync step to the last one before the end
    first, last = (1, steps - 1) if name in EVERY_STEP else (args.sync_every, (steps - 1) // args.sync_every * args.sync_every)
    steady = steady_state(rows, first, last)
    ledger = ledger_of(s)
    row.update(tokens_per_s=s["tokens_per_s"], s_per_step=s["train_s"] / steps, blocked_s=s["blocked_comm_s"],
               comm_s=s["measured_comm_s"], utilisation=s["compute_utilisation"], train_s=s["train_s"],
               val_loss=s["val_loss"], val_ppl=s["val_ppl"], calls=ledger.total_calls,
               medium_bytes=ledger.medium_bytes(), wire_bytes=s["comm_wire_bytes_total"],
               modeled_wall_s=next(iter(s["modeled_wall_s"].values())),
               curve=[(r.get("train_s", 0.0), r["val_loss"]) for r in rows if "val_loss" in r])  # step 0: 0 s
    if steady:
        row.update(steady_tokens_per_s=steady["tokens_per_s"], steady_utilisation=steady["utilisation"],
                   steady_s_per_step=steady["s_per_step"])
    if rate is not None and latency_s is not None:
        row["model_comm_s"] = ledger.modeled_comm_s(rate * 1e6, latency_s, medium="shared")
        row["measured_vs_model"] = row["comm_s"] / row["model_comm_s"] if row["model_comm_s"] else None
    return row


def stop_on_sigterm() -> None:
    """SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C: the running training is ended and the namespace
    deleted on the way out, where Python's default would leave both behind."""
    def unwind(signum, frame) -> None:
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, unwind)


def link_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    reason = unavailable()
    if reason:
        raise LinkError(reason)
    rates, variants = parse_rates(args.rates), list(args.variants or DEFAULT_VARIANTS)
    for v in variants:
        parse_variant(v)
    if None in rates:  # the unthrottled runs first: they calibrate the model's latency per call
        rates = [None, *[r for r in rates if r is not None]]
    rows: list[dict[str, Any]] = []
    latency: dict[str, float] = {}
    stop_on_sigterm()
    with tempfile.TemporaryDirectory() as tmp:
        for rate in rates:
            with ThrottledLink(rate) as link:
                for variant in variants:
                    print(f"[{'unthrottled' if rate is None else f'{rate:g} Mbit/s'}] {variant} ...", file=sys.stderr,
                          flush=True)
                    out = Path(tmp) / f"{len(rows)}"
                    row = run_one(link, variant, rate, args, out, latency.get(variant))
                    if rate is None and "error" not in row and row["calls"]:
                        latency[variant] = row["comm_s"] / row["calls"]
                    rows.append(row)
                    print(f"  {row.get('error') or _line(row)}", file=sys.stderr, flush=True)
    _relate(rows)
    return {"model": args.model, "workers": args.workers, "sync_every": args.sync_every, "rank": args.rank,
            "steps": args.steps, "every_step_steps": args.every_step_steps, "latency_s": latency, "rows": rows}


def _line(row: dict[str, Any]) -> str:
    return (f"{row['tokens_per_s']:,.0f} tokens/s ({row.get('steady_tokens_per_s', float('nan')):,.0f} steady), "
            f"blocked {row['blocked_s']:.1f} s of {row['train_s']:.1f} s, val loss {row['val_loss']:.3f}")


def _relate(rows: list[dict[str, Any]]) -> None:
    """Ratios side by side: each run's steady tokens/s against its own variant unthrottled and against
    blocking lordo at the same rate."""
    def key(row: dict[str, Any]) -> float:
        return row.get("steady_tokens_per_s") or row.get("tokens_per_s") or math.nan

    base = {r["variant"]: key(r) for r in rows if r["rate_mbit"] is None and "error" not in r}
    lordo = {r["rate_mbit"]: key(r) for r in rows if r["variant"] == "lordo" and "error" not in r}
    for r in rows:
        if "error" in r:
            continue
        if r["variant"] in base:
            r["vs_unthrottled"] = key(r) / base[r["variant"]]
        if r["rate_mbit"] in lordo:
            r["vs_lordo"] = key(r) / lordo[r["rate_mbit"]]


def plot(rows: list[dict[str, Any]], rate: float, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'lordo[report]'): no plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in rows:
        if r["rate_mbit"] == rate and r.get("curve"):
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, marker="o", markersize=3, label=r["variant"])
    ax.set_xlabel("seconds of training (measured)")
    ax.set_ylabel("validation loss (worker 0's model; last: everyone's)")
    ax.set_title(f"over a real {rate:g} Mbit/s link (shared), 4 gloo workers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


COLUMNS = [("variant", "variant", "s"), ("link", "link", "s"), ("steps", "steps", "d"),
           ("steady_tokens_per_s", "tokens/s (steady)", ",.0f"), ("vs_unthrottled", "× unthrottled", ".2f"),
           ("vs_lordo", "× lordo", ".2f"), ("steady_utilisation", "compute util.", ".2f"),
           ("tokens_per_s", "tokens/s (run)", ",.0f"), ("blocked_s", "blocked s", ".1f"), ("comm_s", "comm s", ".1f"),
           ("model_comm_s", "model s", ".1f"), ("measured_vs_model", "meas./model", ".2f"), ("train_s", "train s", ".1f"),
           ("modeled_wall_s", "model wall s", ".1f"), ("val_loss", "val loss", ".3f")]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    k = sub.add_parser("link", help="training timed over a real throttled link (network namespace + tc; needs root)",
                       description=__doc__.splitlines()[0])
    k.add_argument("--rates", default="none,1000,100,10", help="Mbit/s, comma-separated; none = unthrottled (default %(default)s)")
    k.add_argument("--variants", nargs="+", metavar="NAME[,KEY=VALUE]",
                   help=f"strategies with strategy.* settings, or SECTION.KEY=VALUE for others (local-adam,optim.inner=muon: "
                        f"MuLoCo) (default: {' '.join(DEFAULT_VARIANTS)})")
    k.add_argument("--model", default="micro", help="model preset (default micro)")
    k.add_argument("--workers", type=int, default=4, help="gloo worker processes (default 4)")
    k.add_argument("--steps", type=int, default=104, help="steps of the local-update runs (default 104: 3 rounds + 8)")
    k.add_argument("--every-step-steps", type=int, default=16,
                   help="steps of ddp / lowrank-ddp runs (default 16; a quarter of it at 10 Mbit/s or less)")
    k.add_argument("--sync-every", type=int, default=32, help="K (default 32)")
    k.add_argument("--rank", type=int, default=16, help="r (default 16)")
    k.add_argument("--log-every", type=int, default=8, help="metrics rows every N steps (default 8)")
    k.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    k.add_argument("--plot-rate", type=float, default=100.0, help="the rate whose loss-against-time curves are drawn")
    k.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides for every run")
    return k


def main(args: argparse.Namespace, out: Path | None, write_json, print_table) -> None:
    for name in ("workers", "steps", "every_step_steps", "sync_every", "rank", "log_every"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    res = link_benchmark(args)
    print_table(f"{args.model}, {args.workers} gloo workers in a throttled namespace (one shared medium), K = "
                f"{args.sync_every}, r = {args.rank}; steady state: between the first and the last sync step",
                res["rows"], COLUMNS)
    if out is None:  # printed only: a benchmark writes nothing into the checkout unless asked (--json)
        return
    picture = plot(res["rows"], args.plot_rate, out.with_name(out.stem + f"-{args.plot_rate:g}mbit.png"))
    if picture:
        res["plot"] = str(picture)
        print(f"wrote {picture}")
    write_json(out, res)
