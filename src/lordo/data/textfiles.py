"""Your own text as a corpus: a folder, a file or a glob of ``.txt``, ``.md``, ``.jsonl``, ``.parquet`` and
``.arrow`` files (a Hugging Face ``datasets`` folder written by ``save_to_disk`` is a folder of ``.arrow`` files).

A ``.txt`` or ``.md`` file is cut into documents of up to about 16,000 characters at line ends (the document
is the unit of the train/validation split; a line longer than that is cut at whitespace); each line of a
``.jsonl`` file, and each row of a ``.parquet`` or ``.arrow`` table, is one document: its ``"text"`` field
(``data.text_field``). Tables need pyarrow (``pip install 'lordo[data]'``).
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import DataError
from .debian import chunks

Document = tuple[str, str]
TABLE_SUFFIXES = (".parquet", ".arrow")
TEXT_SUFFIXES = (".txt", ".md", ".jsonl", *TABLE_SUFFIXES)
KINDS = ".txt, .md, .jsonl, .parquet or .arrow files (a datasets folder)"


def text_files(spec: str) -> tuple[Path, list[Path]]:
    """(root the document ids are relative to, the files) of ``data.corpus`` = a folder, a file or a glob."""
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        root = Path(spec.split("*")[0].split("?")[0].split("[")[0] or ".")
        root = root if root.is_dir() else root.parent
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    elif path.is_dir():
        root, files = path, sorted(p for p in path.rglob("*") if p.is_file())
    elif path.is_file():
        root, files = path.parent, [path]
    else:
        raise DataError(f"data.corpus {spec!r}: no such folder or file (or a glob that matches nothing); give "
                        f"\"bundled\", \"large\", or a folder, file or glob of {KINDS}")
    files = [f for f in files if f.suffix.lower() in TEXT_SUFFIXES]
    if not files:
        raise DataError(f"data.corpus {spec!r} holds no {KINDS}")
    return root, files


def fingerprint(files: list[Path]) -> str:
    """A digest of the files' contents and names: a changed corpus gets a new prepared folder."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.name).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def _read(f: Path) -> str:
    raw = f.read_bytes()
    if b"\x00" in raw:
        raise DataError(f"{f} is not text (it holds NUL bytes); data.corpus takes .txt, .md and .jsonl text files")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{f} is not UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8") from None


def iter_text_documents(root: Path, files: list[Path], text_field: str = "text") -> Iterator[Document]:
    """The documents of the files. Text is cut into pieces of 1,000 to 16,000 characters: small enough that a
    small corpus still has a few hundred documents to split into train and validation."""
    texts = [(f, "" if f.suffix.lower() in TABLE_SUFFIXES else _read(f)) for f in files]
    size = max(1_000, min(16_000, sum(len(t) for f, t in texts if f.suffix.lower() in (".txt", ".md")) // 200))
    for f, text in texts:
        name = str(f.relative_to(root)) if f.is_relative_to(root) else str(f)
        if f.suffix.lower() in TABLE_SUFFIXES:
            yield from _table_documents(f, name, text_field)
        elif f.suffix.lower() == ".jsonl":
            yield from _jsonl_documents(f, name, text, text_field)
        else:
            for doc_id, piece in chunks(name, text, size):
                yield from _split_long(doc_id, piece, size)


def _split_long(doc_id: str, piece: str, size: int) -> Iterator[Document]:
    """A piece longer than twice ``size`` (a text whose lines are that long: a file on one line) cut at the last
    whitespace before each 2·size characters, or at 2·size where there is none; other pieces as they are."""
    if len(piece) <= 2 * size:
        yield doc_id, piece
        return
    start, index = 0, 0
    while start < len(piece):
        end = min(len(piece), start + 2 * size)
        if end < len(piece):
            space = max(piece.rfind(" ", start + size, end), piece.rfind("\n", start + size, end))
            end = space + 1 if space > 0 else end
        if part := piece[start:end].strip():
            yield f"{doc_id}.{index}", part
        start, index = end, index + 1


def _jsonl_documents(f: Path, name: str, text: str, field: str = "text") -> Iterator[Document]:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            body = record[field]
        except (json.JSONDecodeError, KeyError, TypeError):
            keys = ""
            try:
                found = json.loads(line)
                keys = f" (its keys: {', '.join(sorted(found))}; set data.text_field)" if isinstance(found, dict) else ""
            except json.JSONDecodeError:
                pass
            raise DataError(f"{f}:{number}: each line of a .jsonl corpus must be a JSON object with a {field!r} string"
                            f"{keys}") from None
        if not isinstance(body, str):
            raise DataError(f"{f}:{number}: {field!r} must be a string, got {type(body).__name__}")
        if body.strip():
            yield f"{name}:{number}", body


def _table(f: Path, field: str):
    """The column ``field`` of a .parquet file or an .arrow file (Arrow's stream format, as ``datasets`` writes
    it, or its file format)."""
    try:
        import pyarrow as pa
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"{f}: reading .parquet and .arrow files needs pyarrow: pip install 'lordo[data]'") from None
    try:
        if f.suffix.lower() == ".parquet":
            table = pyarrow.parquet.read_table(f)
        else:
            try:
                table = pyarrow.ipc.open_stream(f).read_all()
            except pa.ArrowInvalid:
                table = pyarrow.ipc.open_file(f).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{f} is not a readable {f.suffix} table ({exc})") from None
    if field not in table.column_names:
        raise DataError(f"{f} has no column {field!r} (its columns: {', '.join(table.column_names)}; set "
                        "data.text_field)")
    return table.column(field)


def _table_documents(f: Path, name: str, field: str = "text") -> Iterator[Document]:
    for number, body in enumerate(_table(f, field).to_pylist()):
        if body is None:
            continue
        if not isinstance(body, str):
            raise DataError(f"{f}, row {number}: column {field!r} must hold strings, got {type(body).__name__}")
        if body.strip():
            yield f"{name}:{number}", body
