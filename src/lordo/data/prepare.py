"""Corpus → train/val split by document → byte-level BPE → uint16 token memmaps + manifest.

Layout under ``<data.dir>/prepared/bpe<vocab>-val<fraction>/``::

    tokenizer.json   HF tokenizers byte-level BPE, trained on the train split only
    train.bin        uint16 token ids, documents separated by <|endoftext|>
    val.bin
    manifest.json    settings, source archive checksums, per-split counts, file checksums, unigram baseline

Preparation runs once; later runs verify the files against the manifest and reuse them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..errors import DataError
from .corpus import SOURCES, Document, iter_documents, sha256_file

FORMAT_VERSION = 1
EOT = "<|endoftext|>"


def is_val(doc_id: str, val_fraction: float) -> bool:
    """Deterministic split: a document is held out when the hash of its id falls below the fraction."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < val_fraction


def split_documents(docs: Iterable[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    train: list[Document] = []
    val: list[Document] = []
    for doc in docs:
        (val if is_val(doc[0], val_fraction) else train).append(doc)
    return train, val


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenisation), one special token <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_documents(tok, docs: list[Document]) -> np.ndarray:
    """Token ids of all documents, each followed by <|endoftext|>, as uint16."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch([text for _, text in docs]):
        ids.extend(enc.ids)
        ids.append(eot)
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and arr.max() > np.iinfo(np.uint16).max:
        raise DataError("token id does not fit uint16; lower data.vocab_size")
    return arr.astype(np.uint16)


def unigram_baseline(train: np.ndarray, val: np.ndarray, vocab_size: int) -> dict[str, float]:
    """Cross-entropy of val under the train unigram distribution (add-one smoothing): the floor to beat."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    loss = float(-logp[val.astype(np.int64)].mean())
    return {"val_loss": loss, "val_ppl": math.exp(loss)}


@dataclass
class Dataset:
    """A prepared corpus: memmapped token arrays, the tokenizer and the manifest."""

    root: Path
    manifest: dict
    train: np.ndarray
    val: np.ndarray

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["settings"]["vocab_size"])

    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.root / "tokenizer.json"))


def prepared_dir(data_dir: str | Path, vocab_size: int, val_fraction: float) -> Path:
    return Path(data_dir) / "prepared" / f"bpe{vocab_size}-val{val_fraction:g}"


REBUILD_HINT = "rebuild it with `lordo data prepare --force`"


def prepare(
    data_dir: str | Path,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    sources: list[str] | None = None,
    out: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Build the prepared dataset (overwriting one that exists) and return its folder."""
    names = sources or list(SOURCES)
    root = Path(out) if out is not None else prepared_dir(data_dir, vocab_size, val_fraction)
    t0 = time.perf_counter()
    docs = list(iter_documents(Path(data_dir), names))
    train_docs, val_docs = split_documents(docs, val_fraction)
    if not train_docs or not val_docs:
        raise DataError(f"split gave {len(train_docs)} train and {len(val_docs)} val documents; adjust data.val_fraction")
    log(f"corpus: {len(docs)} documents ({len(train_docs)} train, {len(val_docs)} val)")

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    tok = train_tokenizer((text for _, text in train_docs), vocab_size)
    log(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens")

    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    splits = {}
    arrays = {}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        arr = encode_documents(tok, split_docs)
        arrays[split] = arr
        arr.tofile(tmp / f"{split}.bin")
        nbytes = sum(len(text.encode("utf-8")) for _, text in split_docs)
        splits[split] = {
            "documents": len(split_docs),
            "tokens": int(arr.size),
            "text_bytes": nbytes,
            "bytes_per_token": round(nbytes / arr.size, 4),
            "file": f"{split}.bin",
            "sha256": sha256_file(tmp / f"{split}.bin"),
        }
        log(f"{split}: {arr.size:,} tokens from {nbytes:,} bytes ({nbytes / arr.size:.2f} bytes/token)")
    manifest = {
        "format": FORMAT_VERSION,
        "settings": {"vocab_size": tok.get_vocab_size(), "val_fraction": val_fraction, "sources": names},
        "sources": {n: {"archive": SOURCES[n].archive, "sha256": SOURCES[n].sha256} for n in names},
        "tokenizer": {"file": "tokenizer.json", "sha256": sha256_file(tmp / "tokenizer.json")},
        "splits": splits,
        "unigram_baseline": unigram_baseline(arrays["train"], arrays["val"], tok.get_vocab_size()),
        "dtype": "uint16",
        "eot_id": tok.token_to_id(EOT),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    # the finished folder appears in one rename, so a crash never leaves a half-built dataset behind
    if root.exists():
        shutil.rmtree(root)
    os.replace(tmp, root)
    log(f"prepared dataset in {root} ({manifest['seconds']:.1f}s)")
    return root


def load(root: str | Path, verify: bool = True) -> Dataset:
    """Open a prepared dataset, checking every file against the manifest."""
    root = Path(root)
    mpath = root / "manifest.json"
    if not mpath.is_file():
        raise DataError(f"no prepared dataset at {root} (missing manifest.json); build it with `lordo data prepare`")
    try:
        manifest = json.loads(mpath.read_text())
        files = [manifest["tokenizer"]] + [manifest["splits"][s] for s in ("train", "val")]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(f"{mpath} is corrupt ({exc}); {REBUILD_HINT}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise DataError(f"{root} was prepared by another version of lordo; {REBUILD_HINT}")
    for entry in files:
        path = root / entry["file"]
        if not path.is_file():
            raise DataError(f"prepared data file {path} is missing; {REBUILD_HINT}")
        if verify and sha256_file(path) != entry["sha256"]:
            raise DataError(f"prepared data file {path} is corrupt (checksum mismatch); {REBUILD_HINT}")
    arrays = {}
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        arr = np.memmap(root / entry["file"], dtype=np.uint16, mode="r")
        if arr.size != entry["tokens"]:
            raise DataError(f"{root / entry['file']} has {arr.size} tokens, manifest says {entry['tokens']}; {REBUILD_HINT}")
        arrays[split] = arr
    return Dataset(root, manifest, arrays["train"], arrays["val"])


def ensure(data_dir: str | Path, vocab_size: int, val_fraction: float, log: Callable[[str], None] = print) -> Dataset:
    """The prepared dataset for these settings, building it first if it does not exist yet."""
    root = prepared_dir(data_dir, vocab_size, val_fraction)
    if not (root / "manifest.json").exists():
        log(f"preparing the corpus once into {root} ...")
        prepare(data_dir, vocab_size, val_fraction, log=log)
    return load(root)
