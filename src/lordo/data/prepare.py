"""Corpus → train/val split by document → tokenizer → token memmaps + manifest.

The corpus is the bundled one (Shakespeare + King James), the ``large`` one (plus Debian's free texts,
``debian.py``), your own text files (``textfiles.py``) or your own token files (``prepare_tokens``); the
tokenizer our byte-level BPE trained on the train split, or a ``tokenizers`` JSON file you name. Layout under
``<data.dir>/prepared/bpe<vocab>-val<fraction>/`` for the bundled corpus (other corpora: a folder named after
their content)::

    tokenizer.json   HF tokenizers byte-level BPE, trained on the train split only
    train.bin        token ids (uint16, or uint32 for vocabularies above 65,536), documents separated
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
from typing import Any, Callable, Iterable

import numpy as np

from ..errors import DataError
from ..files import waiting_lock
from .corpus import SOURCES, Document, iter_documents, sha256_file
from .debian import DEB_SOURCES, deb_path, iter_deb_documents
from .textfiles import fingerprint, iter_text_documents, text_files

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


EOT_CANDIDATES = (EOT, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")  # a user tokenizer's document separator


def eot_id(tok) -> int | None:
    """The id that separates documents: the first of ``EOT_CANDIDATES`` the tokenizer knows (None: none)."""
    return next((i for i in (tok.token_to_id(t) for t in EOT_CANDIDATES) if i is not None), None)


def encode_documents(tok, docs: list[Document], dtype=np.uint16) -> np.ndarray:
    """Token ids of all documents, each followed by the document separator (when the tokenizer has one)."""
    eot = eot_id(tok)
    ids: list[int] = []
    for enc in tok.encode_batch([text for _, text in docs]):
        ids.extend(enc.ids)
        if eot is not None:
            ids.append(eot)
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and arr.max() > np.iinfo(dtype).max:
        raise DataError(f"token id {int(arr.max())} does not fit {np.dtype(dtype).name}")
    return arr.astype(dtype)


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


@dataclass(frozen=True)
class CorpusSpec:
    """What to train on (the ``[data]`` section without its folder): ``corpus`` bundled | large | a folder,
    file or glob of text files; or ``tokens``, a folder of pre-tokenized ``train.bin``/``val.bin``;
    ``tokenizer`` bpe (trained on the corpus) | a ``tokenizers`` JSON file."""

    corpus: str = "bundled"
    tokens: str = ""
    token_dtype: str = "uint16"
    tokenizer: str = "bpe"
    vocab_size: int = 4096
    val_fraction: float = 0.05
    text_field: str = "text"  # the field of each .jsonl line that holds its text

    @classmethod
    def of(cls, d) -> CorpusSpec:
        return cls(d.corpus, d.tokens, d.token_dtype, d.tokenizer, d.vocab_size, d.val_fraction,
                   getattr(d, "text_field", "text"))

    @property
    def kind(self) -> str:
        if self.tokens:
            return "tokens"
        return self.corpus if self.corpus in ("bundled", "large") else "text"


def prepared_dir(data_dir: str | Path, vocab_size: int, val_fraction: float) -> Path:
    """The folder of the bundled corpus with our BPE tokenizer."""
    return Path(data_dir) / "prepared" / f"bpe{vocab_size}-val{val_fraction:g}"


def corpus_dir(data_dir: str | Path, spec: CorpusSpec) -> Path:
    """The prepared folder of ``spec``: named after the corpus's content, so a changed corpus (or tokenizer)
    gets a folder of its own."""
    if spec.kind == "bundled" and spec.tokenizer == "bpe":
        return prepared_dir(data_dir, spec.vocab_size, spec.val_fraction)
    if spec.kind == "tokens":
        return Path(data_dir) / "prepared" / f"tokens-{_tokens_fingerprint(spec)[:12]}"
    tok = f"bpe{spec.vocab_size}" if spec.tokenizer == "bpe" else f"tok-{sha256_file(_tokenizer_file(spec))[:12]}"
    return Path(data_dir) / "prepared" / f"{spec.kind}-{_sources(data_dir, spec)[1][:12]}-{tok}-val{spec.val_fraction:g}"


REBUILD_HINT = "rebuild it with `lordo data prepare --force`"


def _tokenizer_file(spec: CorpusSpec) -> Path:
    path = Path(spec.tokenizer).expanduser()
    if not path.is_file():
        raise DataError(f"data.tokenizer {spec.tokenizer!r}: no such file; give \"bpe\" or a tokenizers JSON file")
    return path


def _sources(data_dir: str | Path, spec: CorpusSpec) -> tuple[dict, str]:
    """(manifest entry of the corpus's sources, a digest of their content)."""
    entry: dict[str, dict[str, Any]]
    if spec.kind == "bundled":
        entry = {n: {"archive": SOURCES[n].archive, "sha256": SOURCES[n].sha256} for n in SOURCES}
    elif spec.kind == "large":
        entry = {n: {"archive": SOURCES[n].archive, "sha256": SOURCES[n].sha256} for n in SOURCES}
        for name, source in DEB_SOURCES.items():
            path = deb_path(Path(data_dir), source)
            if path is None:
                raise DataError(f"the {source.package} package is missing; run `lordo data fetch --corpus large`")
            entry[name] = {"archive": path.name, "sha256": sha256_file(path), "license": source.license}
    else:
        root, files = text_files(spec.corpus)
        entry = {"text": {"root": str(root.resolve()), "files": len(files), "sha256": fingerprint(files)}}
        if spec.text_field != "text":  # another field is other text (left out otherwise: folders prepared before)
            entry["text"]["text_field"] = spec.text_field
    digest = hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()
    return entry, digest


def _documents(data_dir: Path, spec: CorpusSpec) -> list[Document]:
    if spec.kind == "bundled":
        return list(iter_documents(data_dir))
    if spec.kind == "large":
        return list(iter_documents(data_dir)) + list(iter_deb_documents(data_dir))
    return list(iter_text_documents(*text_files(spec.corpus), text_field=spec.text_field))


def _tokenizer(spec: CorpusSpec, train_docs: list[Document]):
    if spec.tokenizer == "bpe":
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
        return train_tokenizer((text for _, text in train_docs), spec.vocab_size)
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(_tokenizer_file(spec)))
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise DataError(f"data.tokenizer {spec.tokenizer!r} is not a tokenizers JSON file: {exc}") from None


def prepare(
    data_dir: str | Path,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    out: str | Path | None = None,
    log: Callable[[str], None] = print,
    spec: CorpusSpec | None = None,
) -> Path:
    """Build the prepared dataset of ``spec`` (default: the bundled corpus at ``vocab_size``, overwriting one
    that exists) and return its folder."""
    spec = spec or CorpusSpec(vocab_size=vocab_size, val_fraction=val_fraction)
    root = Path(out) if out is not None and spec.kind != "tokens" else corpus_dir(data_dir, spec)
    with waiting_lock(_lock_path(root)):  # two builds of one folder take turns
        return _build_or_index(data_dir, spec, root, log)


def _build_or_index(data_dir: str | Path, spec: CorpusSpec, root: Path, log: Callable[[str], None]) -> Path:
    return prepare_tokens(data_dir, spec, log) if spec.kind == "tokens" else _build(data_dir, spec, root, log)


def _lock_path(root: Path) -> Path:
    return root.with_name(f".{root.name}.lock")


def _build(data_dir: str | Path, spec: CorpusSpec, root: Path, log: Callable[[str], None]) -> Path:
    t0 = time.perf_counter()
    docs = _documents(Path(data_dir), spec)
    train_docs, val_docs = split_documents(docs, spec.val_fraction)
    if not train_docs or not val_docs:
        raise DataError(f"the split gave {len(train_docs)} train and {len(val_docs)} validation documents of "
                        f"{len(docs)}; raise data.val_fraction ({spec.val_fraction}) or give more text")
    log(f"corpus: {len(docs)} documents ({len(train_docs)} train, {len(val_docs)} val)")
    tok = _tokenizer(spec, train_docs)
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    log(f"tokenizer: {'byte-level BPE' if spec.tokenizer == 'bpe' else spec.tokenizer}, {vocab} tokens")
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    splits, arrays = {}, {}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        arrays[split] = arr = encode_documents(tok, split_docs, dtype)
        arr.tofile(tmp / f"{split}.bin")
        nbytes = sum(len(text.encode("utf-8")) for _, text in split_docs)
        splits[split] = _split_entry(tmp / f"{split}.bin", f"{split}.bin", arr, documents=len(split_docs), text_bytes=nbytes)
        log(f"{split}: {arr.size:,} tokens from {nbytes:,} bytes ({nbytes / max(arr.size, 1):.2f} bytes/token)")
    manifest = {
        "format": FORMAT_VERSION,
        "settings": {"vocab_size": vocab, "val_fraction": spec.val_fraction, "corpus": spec.corpus,
                     "tokenizer": spec.tokenizer, "sources": list(SOURCES) if spec.kind == "bundled" else [spec.kind]},
        "sources": _sources(data_dir, spec)[0],
        "tokenizer": {"file": "tokenizer.json", "sha256": sha256_file(tmp / "tokenizer.json")},
        "splits": splits,
        "unigram_baseline": unigram_baseline(arrays["train"], arrays["val"], vocab),
        "dtype": np.dtype(dtype).name,
        "eot_id": eot_id(tok),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    return _commit(tmp, root, manifest, log)


def _split_entry(path: Path, name: str, arr: np.ndarray, **extra) -> dict:
    entry = {**extra, "tokens": int(arr.size), "file": name, "sha256": sha256_file(path)}
    if "text_bytes" in extra and arr.size:
        entry["bytes_per_token"] = round(extra["text_bytes"] / arr.size, 4)
    return entry


def _commit(tmp: Path, root: Path, manifest: dict, log: Callable[[str], None]) -> Path:
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    # the finished folder appears in one rename, so a crash never leaves a half-built dataset behind
    if root.exists():
        shutil.rmtree(root)
    os.replace(tmp, root)
    log(f"prepared dataset in {root} ({manifest['seconds']:.1f}s)")
    return root


def _tokens_fingerprint(spec: CorpusSpec) -> str:
    folder = Path(spec.tokens).expanduser().resolve()
    sizes = [(f, (folder / f).stat().st_size if (folder / f).is_file() else -1) for f in ("train.bin", "val.bin")]
    return hashlib.sha256(json.dumps([str(folder), sizes, spec.token_dtype, spec.vocab_size]).encode()).hexdigest()


def _check_token_dtype(path: Path, arr: np.ndarray) -> None:
    """uint32 ids (little-endian) read as uint16 come out as id, 0, id, 0, ...: every other value is 0 or 1 (the
    high halves) while the others vary. Refuse that pattern, on the first 2^20 values, naming the fix."""
    if arr.dtype != np.uint16 or arr.size < 64:
        return
    head = np.asarray(arr[: 1 << 20])
    head = head[: head.size // 2 * 2]
    high, low = head[1::2], head[0::2]
    if (high <= 1).mean() > 0.99 and (low > 1).mean() > 0.5:
        raise DataError(f"{path} read as uint16 has every other value 0 or 1 ({(high <= 1).mean():.1%} of them): it looks "
                        "like uint32 token ids; set data.token_dtype = \"uint32\"")


def prepare_tokens(data_dir: str | Path, spec: CorpusSpec, log: Callable[[str], None] = print) -> Path:
    """A manifest for pre-tokenized ``train.bin``/``val.bin`` (the nanoGPT convention: flat arrays of
    ``token_dtype``) after checking them: present, whole tokens, non-empty, every id below ``vocab_size``.
    The arrays stay where they are; the manifest records their paths and checksums."""
    folder = Path(spec.tokens).expanduser().resolve()
    dtype = np.dtype(spec.token_dtype)
    t0 = time.perf_counter()
    root = corpus_dir(data_dir, spec)
    arrays, splits = {}, {}
    for split in ("train", "val"):
        path = folder / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"data.tokens {spec.tokens!r}: {path} is missing (a token folder holds train.bin and val.bin)")
        size = path.stat().st_size
        if size == 0 or size % dtype.itemsize:
            raise DataError(f"{path} holds {size} bytes: not a whole number of {dtype.name} tokens (data.token_dtype)")
        arr = np.memmap(path, dtype=dtype, mode="r")
        _check_token_dtype(path, arr)
        top = int(arr.max())
        if top >= spec.vocab_size:
            hint = ""
            if dtype == np.uint32 and top >= 2**16:
                hint = " (if the file holds uint16 ids, two of them read as one uint32 look like this: data.token_dtype = \"uint16\")"
            raise DataError(f"{path} holds token id {top}, not below data.vocab_size = {spec.vocab_size}{hint}")
        arrays[split] = arr
        splits[split] = _split_entry(path, str(path), arr)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest = {
        "format": FORMAT_VERSION,
        "settings": {"vocab_size": spec.vocab_size, "val_fraction": None, "tokens": str(folder), "sources": ["tokens"]},
        "sources": {"tokens": {"folder": str(folder)}},
        "splits": splits,
        "unigram_baseline": unigram_baseline(arrays["train"], arrays["val"], spec.vocab_size),
        "dtype": dtype.name,
        "eot_id": None,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    log(f"tokens: {arrays['train'].size:,} train and {arrays['val'].size:,} validation tokens from {folder}")
    return _commit(tmp, root, manifest, log)


def load(root: str | Path, verify: bool = True) -> Dataset:
    """Open a prepared dataset, checking every file against the manifest."""
    root = Path(root)
    mpath = root / "manifest.json"
    if not mpath.is_file():
        raise DataError(f"no prepared dataset at {root} (missing manifest.json); build it with `lordo data prepare`")
    try:
        manifest = json.loads(mpath.read_text())
        files = [manifest["tokenizer"]] if "tokenizer" in manifest else []
        files += [manifest["splits"][s] for s in ("train", "val")]
        dtype = np.dtype(manifest.get("dtype", "uint16"))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(f"{mpath} is corrupt ({exc}); {REBUILD_HINT}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise DataError(f"{root} was prepared by another version of lordo; {REBUILD_HINT}")
    for entry in files:
        path = root / entry["file"]
        if not path.is_file():
            raise DataError(f"prepared data file {path} is missing; {REBUILD_HINT}")
        if verify and sha256_file(path) != entry["sha256"]:
            raise DataError(f"prepared data file {path} is corrupt or changed (checksum mismatch); {REBUILD_HINT}")
    arrays = {}
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        arr = np.memmap(root / entry["file"], dtype=dtype, mode="r")
        if arr.size != entry["tokens"]:
            raise DataError(f"{root / entry['file']} has {arr.size} tokens, manifest says {entry['tokens']}; {REBUILD_HINT}")
        arrays[split] = arr
    return Dataset(root, manifest, arrays["train"], arrays["val"])


def ensure(data_dir: str | Path, vocab_size: int, val_fraction: float, log: Callable[[str], None] = print,
           spec: CorpusSpec | None = None) -> Dataset:
    """The prepared dataset of ``spec`` (default: the bundled corpus at ``vocab_size``), building it first if
    it does not exist yet."""
    spec = spec or CorpusSpec(vocab_size=vocab_size, val_fraction=val_fraction)
    root = corpus_dir(data_dir, spec)
    if not (root / "manifest.json").exists():
        # runs started together (a sweep's jobs) take turns: the first builds, the others wait and reuse it
        with waiting_lock(_lock_path(root)):
            if not (root / "manifest.json").exists():
                log(f"preparing the corpus once into {root} ...")
                _build_or_index(data_dir, spec, root, log)
    return load(root)
