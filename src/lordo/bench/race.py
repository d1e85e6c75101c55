"""``lordo bench race``: minutes to a target perplexity over a link of a given rate, composed from two measurements
of the same setting: the time of a step over that link (``lordo bench link``'s steady state, 4 gloo workers on one
shared medium) and the steps each configuration needs to reach the target (its sweep runs, interpolated between
evaluations in log perplexity, per seed).

A race file names the link measurement, the targets and the configurations::

    [race]
    link = "../benchmarks/results/link-micro.json"   # relative to this file
    targets = [60, 50, 45, 40]
    rates = [100, 1000]                              # Mbit/s

    [[config]]
    label = "lordo"
    runs = ["long-stagnation"]                       # result folders; the best rate of the matching runs is taken
    where = { "strategy.name" = "lordo" }
    variant = "lordo"                                # its row in the link file: measured at the rates it ran

A rate the link file does not hold for a variant, or a configuration without one, is **modelled**: the compute time
of a step (``--compute-s-per-step``, else the link file's unthrottled step of ``compute_from`` or of ``variant``) plus
the configuration's own bytes per step on one shared medium of that rate (every worker's bytes cross it, as in the
namespace), plus the link file's latency per collective. Modelled cells say so; overlapped rounds are not credited
there (the model is the blocking one).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..experiments.runs import read_runs, wire_totals
from ..experiments.tables import best_rate, same_value, seed_of, setting_of
from ..files import read_json

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef,unused-ignore]

CONFIG_KEYS = {"label", "runs", "where", "variant", "compute_from"}


def steps_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which validation perplexity reaches ``target``, interpolated linearly in log perplexity
    between the evaluation before and the one that reached it; None if the curve never does."""
    previous: tuple[int, float] | None = None
    for step, ppl in curve:
        if ppl <= target:
            if previous is None or previous[1] <= ppl:
                return float(step)
            (s0, p0), lo = previous, math.log(target)
            return s0 + (step - s0) * (math.log(p0) - lo) / (math.log(p0) - math.log(ppl))
        previous = (step, ppl)
    return None


def curve_of(run: dict[str, Any]) -> list[tuple[int, float]]:
    return [(int(row["step"]), float(row["val_ppl"])) for row in run["metrics"] if "val_ppl" in row and "step" in row]


class Race:
    """A race file, read and checked: its link measurement and each configuration's runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            spec = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such race file") from None
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path} cannot be read as TOML: {exc}") from None
        race = spec.get("race", {})
        targets = race.get("targets")
        if not (isinstance(targets, list) and targets and all(isinstance(t, (int, float)) and t > 1 for t in targets)):
            raise ConfigError(f"{path}: race.targets must list perplexities > 1, got {targets!r}")
        self.targets = sorted((float(t) for t in targets), reverse=True)
        self.rates = [float(r) for r in race.get("rates", [100, 1000])]
        if not self.rates or min(self.rates) <= 0:
            raise ConfigError(f"{path}: race.rates must list rates in Mbit/s > 0, got {race.get('rates')!r}")
        link_path = path.parent / str(race.get("link", ""))
        link = read_json(link_path) if race.get("link") else None
        if link is None or not isinstance(link.get("rows"), list):
            raise ConfigError(f"{path}: race.link must name a `lordo bench link --json` file; {link_path} is missing or "
                              "not one")
        self.link: dict[str, Any] = link
        self.configs = spec.get("config", [])
        if not self.configs:
            raise ConfigError(f"{path}: no [[config]]")
        for i, c in enumerate(self.configs):
            unknown = set(c) - CONFIG_KEYS
            if unknown or not isinstance(c.get("label"), str) or not isinstance(c.get("runs"), list):
                raise ConfigError(f"{path}: config {i + 1} needs label and runs (a list of folders), and takes "
                                  f"{', '.join(sorted(CONFIG_KEYS))}; got {sorted(c)}")

    def runs(self, config: dict[str, Any]) -> list[dict[str, Any]]:
        """The configuration's runs at its best rate, one per seed; a folder that is missing or a configuration that
        matches no finished run is an error that names it."""
        found = []
        for folder in config["runs"]:
            root = self.path.parent / folder
            if not root.is_dir():
                raise ConfigError(f"{self.path}: {config['label']}: results folder {root} does not exist (run its sweep)")
            found += [r for r in read_runs(root) if all(same_value(setting_of(r, k), v) for k, v in config.get("where", {}).items())]
        if not found:
            raise ConfigError(f"{self.path}: {config['label']}: no finished run in {', '.join(config['runs'])} matches "
                              f"{config.get('where', {})}")
        return sorted(best_rate(found), key=seed_of)

    def link_row(self, variant: str | None, rate: float | None) -> dict[str, Any] | None:
        for row in self.link["rows"]:
            if row["variant"] == variant and (row["rate_mbit"] == rate or (rate is not None and row["rate_mbit"] is not None
                                                                           and math.isclose(row["rate_mbit"], rate))):
                return row
        return None

    def step_time(self, config: dict[str, Any], run: dict[str, Any], rate: float,
                  compute_s: float | None) -> tuple[float, str]:
        """Seconds per step at ``rate`` Mbit/s and how it was found (``measured`` or ``modelled``)."""
        variant = config.get("variant")
        measured = self.link_row(variant, rate) if compute_s is None else None
        if measured is not None:
            return float(measured["steady_s_per_step"]), "measured"
        if compute_s is None:
            source = config.get("compute_from", variant)
            base = self.link_row(source, None)
            if base is None:
                raise ConfigError(f"{self.path}: {config['label']}: no unthrottled row of {source!r} in the link file to take "
                                  "the compute time of a step from: set variant or compute_from, or --compute-s-per-step")
            compute_s = float(base["steady_s_per_step"])
        summary = run["summary"]
        workers, steps = int(summary.get("workers", 1)), max(int(summary["steps"]), 1)
        latency = float((self.link.get("latency_s") or {}).get(variant or "", 0.0))
        calls = float(summary.get("comm_calls", 0)) / steps
        medium_bits = float(wire_totals(summary)[0]) * workers * 8 / steps
        return compute_s + calls * latency + medium_bits / (rate * 1e6), "modelled"


def race(path: Path, rates: list[float] | None = None, compute_s: float | None = None) -> dict[str, Any]:
    """Minutes to each target at each rate for every configuration of race file ``path`` (JSON-ready)."""
    spec = Race(path)
    rates = rates or spec.rates
    out: dict[str, Any] = {"race": str(path), "targets": spec.targets, "rates_mbit": rates,
                           "link": spec.link.get("command"), "compute_s_per_step": compute_s, "rows": []}
    for config in spec.configs:
        runs = spec.runs(config)
        for rate in rates:
            seconds, how = spec.step_time(config, runs[0], rate, compute_s)
            seeds: dict[str, dict[str, Any]] = {}
            for run in runs:
                curve = curve_of(run)
                seeds[str(seed_of(run))] = {
                    "minutes": {f"{t:g}": (None if (s := steps_to(curve, t)) is None else s * seconds / 60)
                                for t in spec.targets},
                    "curve": [(step * seconds / 60, ppl) for step, ppl in curve],
                }
            mean: dict[str, float | None] = {}
            for t in spec.targets:
                values = [seed["minutes"][f"{t:g}"] for seed in seeds.values()]
                mean[f"{t:g}"] = None if any(v is None for v in values) else statistics.mean(values)
            out["rows"].append({"label": config["label"], "rate_mbit": rate, "s_per_step": seconds, "step_time": how,
                                "lr": setting_of(runs[0], "optim.lr"), "seeds": seeds, "mean_minutes": mean})
    return out


def print_race(res: dict[str, Any]) -> None:
    targets = [f"{t:g}" for t in res["targets"]]
    for rate in res["rates_mbit"]:
        print(f"\nminutes to validation perplexity {' / '.join(targets)} at {rate:g} Mbit/s (one shared medium; mean over "
              "seeds, '–' where a seed never reached it)")
        width = max(len(r["label"]) for r in res["rows"])
        for row in (r for r in res["rows"] if r["rate_mbit"] == rate):
            cells = " / ".join("–" if row["mean_minutes"][t] is None else f"{row['mean_minutes'][t]:.1f}" for t in targets)
            print(f"  {row['label']:<{width}}  {cells}   ({row['s_per_step']:.3f} s/step, {row['step_time']}, "
                  f"{len(row['seeds'])} seed(s))")


def plot_race(res: dict[str, Any], out: Path) -> Path:
    """Validation perplexity against minutes (both on log scales: ddp's hours beside local steps' minutes), one panel
    per rate, one line per configuration (its first seed; dashed where the step time is modelled), a colour of its
    own in both panels and one legend under them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("the plot needs matplotlib: pip install 'lordo[report]'") from None
    rates = res["rates_mbit"]
    labels = list(dict.fromkeys(r["label"] for r in res["rows"]))
    palette = plt.get_cmap("tab20")  # an integer picks one of its 20 colours
    colour = {label: palette((2 * i) % 20 + (2 * i) // 20 % 2) for i, label in enumerate(labels)}  # dark shades first
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5 + 0.22 * len(labels)), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for row in (r for r in res["rows"] if r["rate_mbit"] == rate):
            first = next(iter(row["seeds"].values()))
            xs, ys = zip(*first["curve"][1:]) if len(first["curve"]) > 1 else ((), ())
            ax.plot(xs, ys, label=f"{row['label']} ({row['step_time']})", color=colour[row["label"]],
                    linestyle="-" if row["step_time"] == "measured" else "--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("minutes of training over the link", fontsize=11)
        ax.set_ylabel("validation perplexity", fontsize=11)
        ax.set_title(f"{rate:g} Mbit/s, one shared medium", fontsize=12)
        ax.grid(True, which="both", alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    rows_of_legend = -(-len(names) // 2)
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * rows_of_legend * 4.5 / (4.5 + 0.22 * len(labels)), 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
