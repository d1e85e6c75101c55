"""Command line: ``lordo train``, ``sweep``, ``report``, ``plot``, ``sample``, ``export``, ``eval``, ``bench``, ``data
fetch|prepare|info``. Here: the parser, ``train`` and the errors' exit codes; ``sweep``, ``report`` and ``plot`` in
experiments/cli.py, ``sample``, ``export`` and ``eval`` in trained.py, ``bench`` in bench/cli.py, ``data`` in
data/cli.py."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

from . import __version__
from .errors import ConfigError, LordoError, Stopped
from .files import read_json


def _train(args: argparse.Namespace) -> int:
    from .comm.torch_dist import launched_by_torchrun
    from .config import build_config
    from .launch import launch_local, worker_command
    from .train.loop import train

    overrides = []  # the flags first: --set comes last and wins (docs/cli.md's order)
    for flag, key, quote in (
        (args.model, "model.preset", True),
        (args.steps, "train.steps", False),
        (args.data_dir, "data.dir", True),
        (args.strategy, "strategy.name", True),
        (args.workers, "dist.workers", False),
        (args.backend, "dist.backend", True),
        (args.sync_every, "strategy.sync_every", False),
        (args.rank, "strategy.rank", False),
        (args.omega, "strategy.omega", False),
        (args.log, "train.log", True),
        ("lean" if args.lean else None, "strategy.memory", True),
    ):
        if flag is not None:
            overrides.append(f"{key}={json.dumps(flag) if quote else flag}")
    overrides += list(args.set or [])
    tree = None
    if args.resume:
        tree = _resumed_config(Path(args.resume))
        if args.out and Path(args.out) != Path(args.resume):
            raise ConfigError("--resume DIR continues the run in DIR; leave out --out (or give the same folder)")
        args.out = args.resume
    cfg = build_config(args.config, overrides, tree=tree)
    _check_launch(cfg)
    out: Path | None
    if args.out:
        out = Path(args.out)
    elif launched_by_torchrun() and not os.environ.get("LORDO_LAUNCHED"):
        out = None  # under torchrun the main process names the folder for every process
    else:
        stamp = os.environ.get("LORDO_RUN_STAMP") or time.strftime("%Y%m%d-%H%M%S")
        os.environ["LORDO_RUN_STAMP"] = stamp  # launched workers agree on the folder name
        out = Path("runs") / f"{cfg.model.preset}-{cfg.strategy.name}-{stamp}"
    if cfg.dist.backend in ("gloo", "nccl") and not launched_by_torchrun():
        assert out is not None
        print(f"starting {cfg.dist.workers * cfg.dist.ranks_per_worker} {cfg.dist.backend} processes", file=sys.stderr)
        launch_local(worker_command(args.argv), cfg.dist.workers * cfg.dist.ranks_per_worker, out=str(out),
                     ranks_per_worker=cfg.dist.ranks_per_worker)
        summary = read_json(out / "summary.json")
        if summary is None:
            raise LordoError(f"the workers ended without writing {out / 'summary.json'} (or it is damaged); the run "
                             f"can continue with: lordo train --resume {out}")
    else:
        summary = train(cfg, out)
        if os.environ.get("RANK", "0") != "0" or os.environ.get("LORDO_LAUNCHED"):
            return 0  # one summary per job: rank 0 under torchrun, the launcher under `lordo train`
    _print_summary(summary, Path(summary["out_dir"]))
    return 0


def _check_launch(cfg) -> None:
    """Mistakes of how the run is started, named before any process starts."""
    from .comm.torch_dist import launched_by_torchrun

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.dist.backend == "sim" and launched_by_torchrun() and world > 1:
        raise ConfigError(f"dist.backend = \"sim\" simulates every worker in one process, but torchrun started {world} "
                          "processes: under torchrun use --backend auto (or gloo, nccl); without torchrun, sim runs "
                          "the --workers in this one process")
    if cfg.dist.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("dist.backend = \"nccl\" needs CUDA GPUs and torch sees none; on CPUs use gloo (or auto)")


def _resumed_config(folder: Path) -> dict:
    """The settings of the run in ``folder``: its config.json, or (when that is missing or damaged) the one
    its newest checkpoint holds. A folder without a complete checkpoint has nothing to resume."""
    from .train.checkpoint import Checkpointer, CheckpointError
    from .train.resume_settings import with_added_fields

    if not folder.is_dir():
        raise ConfigError(f"--resume {folder}: no such folder")
    checkpoints = Checkpointer(folder, None, keep=1)
    if not checkpoints.has_checkpoint():
        config = folder / "config.json"
        given = str(config) if read_json(config) is not None else "YOUR_CONFIG.toml"
        raise ConfigError(f"--resume {folder}: it holds no complete checkpoint, so there is nothing to resume; start the "
                          f"run again with: lordo train --config {given} --out {folder}")
    saved = read_json(folder / "config.json")
    if saved is None:  # written before the first step; a crash before this change could leave it empty
        try:
            saved = Checkpointer.read_meta(checkpoints.complete_dirs()[-1])["config"]
        except CheckpointError as exc:
            raise ConfigError(f"--resume {folder}: config.json is missing or damaged and {exc}") from None
    return {k: v for k, v in with_added_fields(saved).items() if k != "derived"}


def _print_summary(s: dict, out: Path) -> None:
    resumed = s.get("resumed_from_step")
    # wall_s is this process's; train_s (and tokens/s) cover every step, resumed runs' earlier ones included
    took = (f"in {s['train_s']:.0f}s of training ({s['wall_s']:.0f}s in this run, resumed at step {resumed})" if resumed
            else f"in {s['wall_s']:.0f}s")
    lines = [
        f"\ndone: {s['strategy']} with {s['workers']} worker(s), {s['steps']} steps, {s['tokens']:,} tokens "
        f"{took} ({s['tokens_per_s']:,.0f} tokens/s while training)",
        f"val perplexity {s['val_ppl']:.2f} (unigram baseline {s['unigram_val_ppl']:.1f}), val loss {s['val_loss']:.4f}",
    ]
    if s["workers"] > 1:
        walls = ", ".join(f"{k.replace('gbit', ' Gbit/s')}: {v:.0f}s" for k, v in s["modeled_wall_s"].items())
        lines.append(
            f"communication: {s['comm_wire_bytes_total'] / 2**20:,.1f} MiB sent per worker in {s['comm_calls']} "
            f"collectives, {_against_ddp(s['comm_ratio_to_ddp'])}; "
            f"modelled wall-clock {walls} (this run's measured compute time, under whatever load the machine had, plus "
            "its collectives at that rate: compare runs made on the same idle machine, or use lordo bench race)"
        )
    written = [name for name in ("config.json", "metrics.jsonl", "summary.json", "model.pt", "tokenizer.json", "checkpoints/")
               if (out / name.rstrip("/")).exists()]
    lines.append(f"outputs: {out}/{', '.join(written)}")
    print("\n".join(lines))


def _against_ddp(ratio: float) -> str:
    if ratio >= 0.9995:
        return f"{ratio:.3f}x of what ddp sends" + (" (ddp itself)" if ratio < 1.0005 else "")
    return f"{ratio:.3f}x of what ddp sends ({1 / ratio:.1f}x less)"


def _bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args.rest)


def make_parser() -> argparse.ArgumentParser:
    from .config import describe

    p = argparse.ArgumentParser(
        prog="lordo",
        description="Train language models data-parallel with LoRDO and its baselines.",
    )
    p.add_argument("--version", action="version", version=f"lordo {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser(
        "train",
        help="train a model and write config.json, metrics.jsonl and summary.json",
        description="Train a model. Settings: defaults < --model preset < --config file < the other flags < --set "
                    "overrides (every value given is checked, also one a later one replaces).",
        epilog="configuration keys (for --set and the TOML file):\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--config", metavar="FILE", help="TOML file with [section] tables of config keys")
    t.add_argument("--model", metavar="PRESET", help="model size preset: nano (0.16M parameters), micro (1.4M), small (5.9M), "
                   "paper-16m (4.3M: the paper's 16M shape with a 4,096-token vocabulary)")
    t.add_argument("--steps", type=int, metavar="N", help="optimizer steps (train.steps)")
    t.add_argument(
        "--out", metavar="DIR",
        help="output folder (default: runs/<preset>-<strategy>-<time>); a folder holding a checkpoint of the same "
        "settings is resumed",
    )
    t.add_argument(
        "--resume", metavar="DIR",
        help="continue the run in DIR from its newest intact checkpoint, with its saved settings (--set may change "
        "train.steps and other fields that do not alter the run)",
    )
    t.add_argument("--data-dir", metavar="DIR", help="data folder (data.dir, default ./data)")
    t.add_argument(
        "--strategy", metavar="NAME",
        help="strategy.name: lordo (the default), ddp, local-adam, diloco, lordo-global-noqh, lordo-local, lowrank-ddp",
    )
    t.add_argument("--workers", type=int, metavar="M", help="dist.workers: number of data-parallel workers")
    t.add_argument("--backend", metavar="B", help="dist.backend: auto, sim, gloo, nccl or torchft")
    t.add_argument("--sync-every", type=int, metavar="K", help="strategy.sync_every: local steps between syncs")
    t.add_argument("--rank", type=int, metavar="R", help="strategy.rank: rank of the low-rank moments")
    t.add_argument("--omega", type=float, metavar="W", help="strategy.omega: QH weight on the low-rank momentum")
    t.add_argument("--log", metavar="SINK", help="train.log: jsonl (default) or tensorboard (also OUT/tensorboard)")
    t.add_argument("--lean", action="store_true",
                   help="strategy.memory = lean: the optimizer state in the storage that passed its gates (about 0.34x "
                        "AdamW's for lordo; docs/performance.md)")
    t.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override one config key, e.g. --set optim.lr=3e-3 (repeatable)"
    )
    t.set_defaults(func=_train)

    from .experiments.cli import add_parsers as add_experiment_commands
    from .trained import add_parsers as add_model_commands

    add_experiment_commands(sub)  # sweep, report, plot
    add_model_commands(sub)  # sample, export, eval

    bn = sub.add_parser(
        "bench",
        help="benchmarks (not tests): step, basis, wire, memory, runs, link; each prints ratios measured side by side "
             "and writes JSON",
        description="lordo bench {step,basis,wire,memory,runs,link} [options]; lordo bench step --help for each one's "
                    "options.",
        add_help=False,
    )
    bn.add_argument("rest", nargs=argparse.REMAINDER)
    bn.set_defaults(func=_bench)

    from .data.cli import add_parsers as add_data_commands

    add_data_commands(sub)  # data fetch, prepare, info
    return p


def main(argv: list[str] | None = None) -> int:
    try:  # `kill -USR1 PID` prints where a (hung) worker is
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no SIGUSR1 (Windows) or stderr without a file descriptor
        pass
    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] in (["-h"], ["--help"]):  # the bench's own parser lists its benchmarks
        from .bench import make_parser as bench_parser

        bench_parser().print_help()
        return 0
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except Stopped as exc:
        print(f"lordo: {exc}", file=sys.stderr)
        return exc.exit_code
    except LordoError as exc:
        print(f"lordo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lordo: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`lordo sweep FILE --dry-run | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141
    except RuntimeError as exc:  # an allocator's refusal (torch.OutOfMemoryError is one too): said, not a traceback
        text = str(exc)
        if not any(marker in text for marker in ("out of memory", "can't allocate memory", "not enough memory")):
            raise
        print(f"lordo: error: out of memory ({text.splitlines()[0][:200]}); lower train.batch_size, model.d_model, "
              "model.n_layers or the workers one process hosts (dist.workers with backend sim)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
