"""Corpora beyond the bundled one: your text files, your token files, a tokenizer of your own, and the
Debian packages of the ``large`` corpus (read from synthetic .deb archives built here, so no download)."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import shutil
import struct
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from lordo.config import build_config
from lordo.data import prepare
from lordo.data.debian import DEB_SOURCES, deb_members, lazyload_objects, unserialize
from lordo.errors import ConfigError, DataError
from lordo.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
NANO = ["model.preset=nano", "train.batch_size=4", "train.eval_batches=2", "train.eval_every=100", "train.steps=6",
        "schedule.warmup_steps=1", "strategy.sync_every=3", "strategy.rank=4", "dist.workers=2", "data.vocab_size=512"]


def run(tmp_path, name, *overrides):
    cfg = build_config(overrides=[*NANO, f"data.dir={json.dumps(str(tmp_path / 'data'))}", *overrides])
    return train(cfg, tmp_path / name, log=lambda _: None, stream=io.StringIO())


def docs_corpus(tmp_path) -> Path:
    """This project's documentation as a corpus: a folder of markdown files."""
    folder = tmp_path / "texts"
    shutil.copytree(ROOT / "docs", folder)
    (folder / "notes.jsonl").write_text("\n".join(json.dumps({"text": f"note {i}: " + "word " * 50}) for i in range(40)))
    return folder


def test_a_folder_of_text_trains_and_its_tokens_train_to_the_same_loss(tmp_path):
    folder = docs_corpus(tmp_path)
    from_text = run(tmp_path, "text", f"data.corpus={json.dumps(str(folder))}")
    spec = prepare.CorpusSpec(corpus=str(folder), vocab_size=512)
    prepared = prepare.corpus_dir(tmp_path / "data", spec)
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["settings"]["vocab_size"] == 512 and manifest["splits"]["val"]["documents"] > 0
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    for split in ("train", "val"):
        shutil.copy(prepared / f"{split}.bin", tokens / f"{split}.bin")
    from_tokens = run(tmp_path, "tokens", f"data.tokens={json.dumps(str(tokens))}")
    assert from_tokens["val_loss"] == from_text["val_loss"]
    a = torch.load(tmp_path / "text" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "tokens" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_tokenizer_file_of_your_own_sets_the_vocabulary(tmp_path, dataset):
    folder = docs_corpus(tmp_path)
    tokenizer = dataset.root / "tokenizer.json"  # the bundled corpus's 4096-token BPE
    summary = run(tmp_path, "tok", f"data.corpus={json.dumps(str(folder))}", f"data.tokenizer={json.dumps(str(tokenizer))}")
    assert summary["params"] > 4096 * 32  # the embedding has the tokenizer's 4096 rows, not data.vocab_size's 512
    config = json.loads((tmp_path / "tok" / "config.json").read_text())
    assert config["derived"]["vocab_size"] == 4096


def test_uint32_token_files_with_a_large_vocabulary(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 70_000, 20_000).astype(np.uint32).tofile(tokens / "train.bin")
    rng.integers(0, 70_000, 2_000).astype(np.uint32).tofile(tokens / "val.bin")
    summary = run(tmp_path, "big", f"data.tokens={json.dumps(str(tokens))}", 'data.token_dtype="uint32"',
                  "data.vocab_size=70000", "train.steps=2")
    assert summary["steps"] == 2 and np.isfinite(summary["val_loss"])


def test_a_jsonl_corpus_reads_the_named_text_field(tmp_path):
    """data.text_field picks the field of each line (a Hugging Face export keeps it as "content", say); a
    prepared corpus of one field is not reused for another."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    rows = [{"id": i, "content": f"document {i}: " + "words and more words " * 40} for i in range(300)]
    (folder / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    summary = run(tmp_path, "field", f"data.corpus={json.dumps(str(folder))}", 'data.text_field="content"')
    assert summary["steps"] == 6
    with pytest.raises(DataError, match=r"rows.jsonl:1: .* 'text' string \(its keys: content, id; set data.text_field\)"):
        run(tmp_path, "default", f"data.corpus={json.dumps(str(folder))}")


def test_hugging_face_datasets_folders_and_parquet_files_are_corpora(tmp_path):
    """A datasets folder (save_to_disk: one dataset, or a DatasetDict of splits, all read) and a parquet file:
    each row one document, its data.text_field column; a missing column names the ones there are."""
    datasets = pytest.importorskip("datasets")
    from lordo.data.textfiles import iter_text_documents, text_files

    texts = [f"document {i}: " + "words and more words " * 40 for i in range(300)]
    rows = {"id": list(range(300)), "content": texts}
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({k: v[:250] for k, v in rows.items()}),
                                   "test": datasets.Dataset.from_dict({k: v[250:] for k, v in rows.items()})})
    splits.save_to_disk(str(tmp_path / "hf"))
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "rows.parquet"))
    for spec in (tmp_path / "hf", tmp_path / "rows.parquet"):
        root, files = text_files(str(spec))
        assert sorted(body for _, body in iter_text_documents(root, files, "content")) == sorted(texts)
    summary = run(tmp_path, "hf", f"data.corpus={json.dumps(str(tmp_path / 'hf'))}", 'data.text_field="content"')
    assert summary["steps"] == 6 and np.isfinite(summary["val_loss"])
    with pytest.raises(DataError, match=r"rows.parquet has no column 'text' \(its columns: id, content; set "
                                        r"data.text_field\)"):
        run(tmp_path, "default", f"data.corpus={json.dumps(str(tmp_path / 'rows.parquet'))}")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.parquet").write_bytes(b"not a table")
    with pytest.raises(DataError, match=r"a.parquet is not a readable .parquet table"):
        run(tmp_path, "junk", f"data.corpus={json.dumps(str(tmp_path / 'junk'))}")


def test_token_files_of_the_other_dtype_are_recognised(tmp_path):
    """uint32 ids read as the default uint16 would train on id, 0, id, 0, ...: refused, naming data.token_dtype;
    uint16 ids read as uint32 give ids beyond the vocabulary, and the message says why."""
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 20_000), ("val", 2_000)):
        rng.integers(2, 500, n).astype(np.uint32).tofile(tokens / f"{split}.bin")
    with pytest.raises(DataError, match=r"train.bin read as uint16 has every other value 0 or 1 \(100.0% of them\): it "
                                        r"looks like uint32 token ids; set data.token_dtype = \"uint32\""):
        run(tmp_path, "t", f"data.tokens={json.dumps(str(tokens))}")
    for split, n in (("train", 20_000), ("val", 2_000)):
        rng.integers(2, 500, n).astype(np.uint16).tofile(tokens / f"{split}.bin")
    with pytest.raises(DataError, match=r"not below data.vocab_size = 512 \(if the file holds uint16 ids"):
        run(tmp_path, "t", f"data.tokens={json.dumps(str(tokens))}", 'data.token_dtype="uint32"')


def test_a_text_on_one_line_is_cut_into_documents(tmp_path):
    """A 600,000-character file without a line break is one line; it is cut at whitespace into documents, so
    the split has validation documents (it blamed data.val_fraction before)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    (folder / "one.txt").write_text(" ".join(rng.choice(words, 100_000)))
    from lordo.data.textfiles import iter_text_documents

    docs = list(iter_text_documents(folder, [folder / "one.txt"]))
    assert len(docs) > 100 and max(len(t) for _, t in docs) <= 2 * 3_000
    assert " ".join(t for _, t in docs) == (folder / "one.txt").read_text()  # cut at spaces: nothing lost
    assert run(tmp_path, "one", f"data.corpus={json.dumps(str(folder))}")["steps"] == 6


@pytest.mark.parametrize("setup, overrides, message", [
    (lambda d: d.mkdir(), [], r"holds no .txt, .md, .jsonl, .parquet or .arrow files \(a datasets folder\)"),
    (lambda d: (d.mkdir(), (d / "a.txt").write_bytes(b"text\x00\x01\x02")), [], r"a.txt is not text \(it holds NUL bytes\)"),
    (lambda d: (d.mkdir(), (d / "a.txt").write_bytes(b"caf\xe9 " * 100)), [], r"a.txt is not UTF-8 text"),
    (lambda d: (d.mkdir(), (d / "a.jsonl").write_text('{"body": "x"}\n')), [],
     r"a.jsonl:1: each line .* 'text' string \(its keys: body; set data.text_field\)"),
    (lambda d: (d.mkdir(), (d / "a.txt").write_text("one short document")), [],
     r"the split gave 1 train and 0 validation documents of 1; raise data.val_fraction"),
])
def test_bad_corpora_give_clear_errors(tmp_path, setup, overrides, message):
    folder = tmp_path / "corpus"
    setup(folder)
    with pytest.raises(DataError, match=message):
        run(tmp_path, "bad", f"data.corpus={json.dumps(str(folder))}", *overrides)


def test_bad_token_files_give_clear_errors(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    np.arange(100, dtype=np.uint16).tofile(tokens / "train.bin")
    with pytest.raises(DataError, match=r"val.bin is missing"):
        run(tmp_path, "t", f"data.tokens={json.dumps(str(tokens))}")
    np.array([1, 2, 600], dtype=np.uint16).tofile(tokens / "val.bin")
    with pytest.raises(DataError, match=r"val.bin holds token id 600, not below data.vocab_size = 512"):
        run(tmp_path, "t", f"data.tokens={json.dumps(str(tokens))}")
    (tokens / "val.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match=r"3 bytes: not a whole number of uint16 tokens"):
        run(tmp_path, "t", f"data.tokens={json.dumps(str(tokens))}")
    with pytest.raises(ConfigError, match=r"data.vocab_size must be in \(1, 65536\] for uint16 token files"):
        build_config(overrides=[f"data.tokens={json.dumps(str(tokens))}", "data.vocab_size=70000"])
    with pytest.raises(DataError, match=r"data.tokenizer 'missing.json': no such file"):
        run(tmp_path, "t", f"data.corpus={json.dumps(str(docs_corpus(tmp_path)))}", 'data.tokenizer="missing.json"')


# ------------------------------------------------------------------------------------------------------------
# the large corpus's readers, on synthetic Debian packages


def r_xdr(obj) -> bytes:
    """R's XDR serialization (version 3) of str lists (character vectors) and {name: value} dicts (named
    lists), written out independently of the reader under test."""
    def item(x) -> bytes:
        if isinstance(x, dict):
            body = struct.pack(">ii", 19 | 1 << 9, len(x)) + b"".join(item(v) for v in x.values())
            names = struct.pack(">i", 1) + charsxp("names")  # SYMSXP names
            attributes = struct.pack(">i", 2 | 1 << 10) + names + item(list(x)) + struct.pack(">i", 254)
            return body + attributes
        if isinstance(x, list) and all(isinstance(v, str) for v in x):
            return struct.pack(">ii", 16, len(x)) + b"".join(charsxp(v) for v in x)
        if isinstance(x, tuple):  # an integer vector
            return struct.pack(f">ii{len(x)}i", 13, len(x), *x)
        raise TypeError(x)

    def charsxp(s: str) -> bytes:
        raw = s.encode()
        return struct.pack(">ii", 9 | 1 << 15, len(raw)) + raw

    header = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    return header + item(obj)


def make_deb(path: Path, files: dict[str, bytes]) -> Path:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", b""), ("data.tar.xz", data.getvalue())]
    out = b"!<arch>\n"
    for name, body in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(body):<10}`\n".encode() + body + (b"\n" if len(body) % 2 else b"")
    path.write_bytes(out)
    return path


def test_r_lazyload_database_reads_without_r():
    books = {"emma": ["EMMA", "", "Emma Woodhouse, handsome, clever, and rich"], "persuasion": ["Sir Walter Elliot"]}
    blobs, offsets, offset = [], {}, 0
    for name, lines in books.items():
        raw = r_xdr(lines)
        blob = struct.pack(">i", len(raw)) + zlib.compress(raw)
        offsets[name] = (offset, len(blob))
        blobs.append(blob)
        offset += len(blob)
    index = gzip.compress(r_xdr({"variables": offsets, "references": [], "compressed": ["TRUE"]}))
    assert lazyload_objects(index, b"".join(blobs)) == books
    assert unserialize(r_xdr({"a": ["x", "y"]})) == {"pairlist": [("a", ["x", "y"])]}


def test_every_debian_source_yields_documents_from_its_package(tmp_path):
    austen = {"emma": ["Emma Woodhouse, handsome, clever, and rich, ..."] * 50}
    raw = r_xdr(austen["emma"])
    blob = struct.pack(">i", len(raw)) + zlib.compress(raw)
    index = gzip.compress(r_xdr({"variables": {"emma": (0, len(blob))}, "references": []}))
    packages = {
        "r-cran-janeaustenr": {"usr/lib/R/site-library/janeaustenr/data/Rdata.rdx": index,
                               "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb": blob},
        "fortunes": {"usr/share/games/fortunes/wisdom": b"A fortune.\n%\nAnother one.\n%\n",
                     "usr/share/games/fortunes/wisdom.dat": b"\x00\x01"},
        "dict-gcide": {"usr/share/dictd/gcide.dict.dz": gzip.compress(b"Apple\n  A fruit.\n")},
        "linux-doc-6.1": {"usr/share/doc/linux-doc-6.1/Documentation/PCI/acpi.rst.gz": gzip.compress(b"ACPI\n====\n")},
        "python3.11-doc": {"usr/share/doc/python3.11/html/_sources/about.rst.txt": b"About these documents\n"},
    }
    found = {}
    for source in DEB_SOURCES.values():
        deb = make_deb(tmp_path / f"{source.package}_1.0_all.deb", packages[source.package])
        found[source.name] = list(source.documents(dict(deb_members(deb))))
    assert found["austen"][0][0] == "austen/emma#0" and "Emma Woodhouse" in found["austen"][0][1]
    assert found["fortunes"] == [("fortunes/wisdom#0", "A fortune.\nAnother one.")]  # the .dat index is skipped
    assert found["gcide"] == [("gcide#0", "Apple\n  A fruit.")]
    assert found["linux-docs"] == [("linux-docs/PCI/acpi.rst.gz#0", "ACPI\n====")]
    assert found["python-docs"] == [("python-docs/about.rst.txt#0", "About these documents")]
    with pytest.raises(DataError, match="not a Debian package"):
        list(deb_members(tmp_path / "wisdom.txt") if (tmp_path / "wisdom.txt").write_text("x") else [])


def test_a_damaged_debian_archive_is_named_not_a_raw_traceback(tmp_path):
    deb = make_deb(tmp_path / "fortunes_1.0_all.deb", {"usr/share/games/fortunes/wisdom": b"A fortune.\n%\n" * 2000})
    raw = deb.read_bytes()
    deb.write_bytes(raw[: len(raw) // 2])  # truncated
    with pytest.raises(DataError, match=r"fortunes_1.0_all.deb is damaged \(EOFError: .*delete it and run "
                                        r"`lordo data fetch --corpus large` again"):
        list(deb_members(deb))
    flipped = bytearray(raw)
    flipped[len(raw) - 200] ^= 0xFF  # a bit flip inside the xz stream
    deb.write_bytes(bytes(flipped))
    with pytest.raises(DataError, match=r"fortunes_1.0_all.deb is damaged"):
        list(deb_members(deb))


def fake_apt(tmp_path, monkeypatch, versions: dict[str, bytes], current: dict[str, bytes] | None = None):
    """An ``apt-get`` on PATH that "downloads" ``pkg=version`` from ``versions`` (and a bare ``pkg`` from
    ``current``), writing the file under apt's name; every call is logged."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    store = tmp_path / "store"
    store.mkdir()
    for key, body in {**versions, **{f"{k}=CURRENT": v for k, v in (current or {}).items()}}.items():
        (store / key.replace("/", "_")).write_bytes(body)
    script = bin_dir / "apt-get"
    script.write_text(f"""#!{sys.executable}
import pathlib, sys
store = pathlib.Path({str(store)!r})
arg = sys.argv[2]
with open(store.parent / "apt.log", "a") as log:
    log.write(arg + "\\n")
pkg, _, version = arg.partition("=")
src = store / (arg if version else pkg + "=CURRENT")
if not src.exists():
    sys.stderr.write(f"E: Version '{{version}}' for '{{pkg}}' was not found\\n")
    sys.exit(100)
name = f"{{pkg}}_{{(version or '9.9').replace(':', '%3a')}}_all.deb"
pathlib.Path(name).write_bytes(src.read_bytes())
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return tmp_path / "apt.log"


def test_the_large_corpus_is_fetched_at_pinned_versions_checked_and_refetched_when_damaged(tmp_path, monkeypatch):
    import hashlib

    from lordo.data import debian

    bodies = {name: make_deb(tmp_path / f"{name}.deb", {"usr/share/x": name.encode()}).read_bytes() for name in DEB_SOURCES}
    pinned = {name: dataclasses.replace(s, sha256=hashlib.sha256(bodies[name]).hexdigest())
              for name, s in DEB_SOURCES.items()}
    monkeypatch.setattr(debian, "DEB_SOURCES", pinned)
    log = fake_apt(tmp_path, monkeypatch, {f"{s.package}={s.version}": bodies[n] for n, s in pinned.items()})
    data = tmp_path / "data"
    paths = debian.fetch_debs(data, log=lambda _: None)
    assert [p.name for p in paths] == [s.file_name for s in pinned.values()]  # fortunes_1%3a1.99.1-7.3_all.deb ...
    assert log.read_text().splitlines() == [f"{s.package}={s.version}" for s in pinned.values()]
    damaged = paths[1]
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")
    messages = []
    debian.fetch_debs(data, log=messages.append)
    assert f"{damaged.name}: does not match its pinned SHA-256 (damaged); fetching it again" in messages
    assert damaged.read_bytes() == bodies["fortunes"]
    assert any(m.endswith("present (SHA-256 checked)") for m in messages)
    damaged.write_bytes(b"!<arch>\n")  # prepare refuses it by name rather than reading other text
    monkeypatch.setattr(debian, "DEB_SOURCES", {"fortunes": pinned["fortunes"]})
    with pytest.raises(DataError, match=r"does not match the SHA-256 pinned for fortunes 1:1.99.1-7.3"):
        list(debian.iter_deb_documents(data))


def test_a_pinned_version_gone_from_the_mirrors_is_refused_unless_unpinned(tmp_path, monkeypatch):
    from lordo.data import debian

    body = make_deb(tmp_path / "x.deb", {"usr/share/games/fortunes/wisdom": b"A fortune.\n%\n"}).read_bytes()
    only = {"fortunes": DEB_SOURCES["fortunes"]}
    monkeypatch.setattr(debian, "DEB_SOURCES", only)
    fake_apt(tmp_path, monkeypatch, {}, current={"fortunes": body})
    with pytest.raises(DataError, match=r"apt-get could not download fortunes=1:1.99.1-7.3 .* if 1:1.99.1-7.3 is gone "
                                        r"from the mirrors, `lordo data fetch --corpus large --unpinned`"):
        debian.fetch_debs(tmp_path / "data", log=lambda _: None)
    messages = []
    (path,) = debian.fetch_debs(tmp_path / "data", log=messages.append, unpinned=True)
    assert path.name == "fortunes_9.9_all.deb" and any("taking their current version" in m for m in messages)
    debian.fetch_debs(tmp_path / "data", log=messages.append)
    assert messages[-1] == "fortunes_9.9_all.deb: present (not the pinned 1:1.99.1-7.3)"
