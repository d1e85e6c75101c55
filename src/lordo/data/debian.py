"""The ``large`` corpus: free English text from Debian packages, read straight from the ``.deb`` archives.

``lordo data fetch --corpus large`` downloads the packages with ``apt-get download`` (no root, nothing
installed) into ``<data.dir>/debs/``; preparing reads their files from the archives (a ``.deb`` is an ``ar``
archive holding ``data.tar.xz``). Sources and their licenses (docs/training.md lists them too):

- ``austen``: Jane Austen's six novels (public domain), stored in ``r-cran-janeaustenr`` as R's lazy-load
  database, read here without R (:func:`unserialize`);
- ``fortunes``: the fortune cookie files of ``fortunes`` (BSD-licensed collection);
- ``gcide``: the GNU Collaborative International Dictionary of English (``dict-gcide``, GPL);
- ``linux-docs``: the Linux kernel's documentation sources (``linux-doc-6.1``, GPL-2.0);
- ``python-docs``: Python's documentation sources (``python3.11-doc``, PSF license).
"""

from __future__ import annotations

import gzip
import io
import shutil
import struct
import subprocess
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import DataError

Document = tuple[str, str]
CHUNK = 16_000  # characters per document where a source is one long text (a document is the unit of the split)


def deb_members(deb: Path) -> Iterator[tuple[str, bytes]]:
    """(path, content) of every regular file in a ``.deb``'s data archive."""
    raw = deb.read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise DataError(f"{deb} is not a Debian package (no ar header)")
    offset = 8
    while offset + 60 <= len(raw):
        header = raw[offset:offset + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = raw[offset + 60:offset + 60 + size]
        offset += 60 + size + (size % 2)
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                raise DataError(f"{deb}: zstd-compressed packages are not supported")
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                for member in tar:
                    if member.isfile():
                        f = tar.extractfile(member)
                        if f is not None:
                            yield str(PurePosixPath(member.name)).lstrip("./").lstrip("/"), f.read()
            return
    raise DataError(f"{deb} holds no data archive")


def chunks(doc_id: str, text: str, size: int = CHUNK) -> Iterator[Document]:
    """A long text as documents of about ``size`` characters, cut at line ends."""
    start, index = 0, 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end == -1 else end + 1
        piece = text[start:end].strip()
        if piece:
            yield f"{doc_id}#{index}", piece
        start, index = end, index + 1


# ---------------------------------------------------------------------------------------------------------
# R's serialization (XDR, version 2 or 3): enough of it for character vectors in lists and pairlists


class _RReader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0
        self.refs: list[Any] = []

    def read_int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def read_bytes(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def item(self):  # noqa: C901 - one branch per R type
        flags = self.read_int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 253, 252, 251, 250, 249, 248, 247, 242, 241):  # NULL, environments, markers
            return None
        if kind == 255:  # a reference to an earlier symbol or environment
            index = flags >> 8 or self.read_int()
            return self.refs[index - 1]
        if kind == 1:  # symbol
            name = self.item()
            self.refs.append(name)
            return name
        if kind in (2, 3, 5, 6, 17):  # pairlist-like: [attributes] [tag] car cdr
            attributes = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            node = [(tag, self.item())]
            rest = self.item()
            return {"pairlist": node + (rest["pairlist"] if isinstance(rest, dict) else []), "attributes": attributes}
        if kind == 9:  # CHARSXP
            n = self.read_int()
            return None if n == -1 else self.read_bytes(n).decode("utf-8", errors="replace")
        if kind in (16, 19, 20):  # character vector, list
            values = [self.item() for _ in range(self.read_int())]
        elif kind in (10, 13):  # logical, integer
            n = self.read_int()
            values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # double
            n = self.read_int()
            values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        else:
            raise DataError(f"R serialization: type {kind} is not supported")
        attributes = self.item() if has_attr else None
        names = dict(attributes["pairlist"]).get("names") if isinstance(attributes, dict) else None
        if kind == 19 and names:  # a named list
            return {"pairlist": list(zip(names, values))}
        return values


def unserialize(data: bytes):
    """An R object from its XDR serialization (``X\\n`` header): character vectors become lists of str,
    lists lists, pairlists ``{"pairlist": [(tag, value), ...]}``."""
    if data[:2] != b"X\n":
        raise DataError("not an R XDR serialization")
    reader = _RReader(data[2:])
    version = reader.read_int()
    reader.read_int(), reader.read_int()  # the writer's and the minimal reader's R versions
    if version == 3:
        reader.read_bytes(reader.read_int())  # native encoding
    return reader.item()


def lazyload_objects(rdx: bytes, rdb: bytes) -> dict[str, object]:
    """The named objects of an R lazy-load database (``.rdx``: gzip-compressed index; ``.rdb``: each object
    zlib-compressed behind its 4-byte length, at the index's offset)."""
    index = unserialize(gzip.decompress(rdx))
    variables = next(v for t, v in _pairs(index) if t == "variables")
    out = {}
    for name, (offset, length) in _pairs(variables):
        blob = rdb[int(offset):int(offset) + int(length)]
        out[name] = unserialize(zlib.decompress(blob[4:]))
    return out


def _pairs(obj) -> list[tuple[str, Any]]:
    """(name, value) of a named R list (its names attribute) or a pairlist."""
    if isinstance(obj, dict):
        return obj["pairlist"]
    raise DataError("R serialization: expected a named list")


# ---------------------------------------------------------------------------------------------------------
# the sources


def _austen(members: dict[str, bytes]) -> Iterator[Document]:
    base = "usr/lib/R/site-library/janeaustenr/data/Rdata"
    for book, lines in sorted(lazyload_objects(members[f"{base}.rdx"], members[f"{base}.rdb"]).items()):
        if isinstance(lines, list) and all(isinstance(x, str) or x is None for x in lines):
            yield from chunks(f"austen/{book}", "\n".join(x or "" for x in lines))


def _fortunes(members: dict[str, bytes]) -> Iterator[Document]:
    for path, content in sorted(members.items()):
        if path.startswith("usr/share/games/fortunes/") and "." not in PurePosixPath(path).name:
            text = "\n".join(c.strip() for c in content.decode("utf-8", errors="replace").split("\n%\n"))
            yield from chunks(f"fortunes/{PurePosixPath(path).name}", text)


def _gcide(members: dict[str, bytes]) -> Iterator[Document]:
    text = gzip.decompress(members["usr/share/dictd/gcide.dict.dz"]).decode("utf-8", errors="replace")
    yield from chunks("gcide", text)


def _gzipped_files(prefix: str, suffix: str, source: str) -> Callable[[dict[str, bytes]], Iterator[Document]]:
    def documents(members: dict[str, bytes]) -> Iterator[Document]:
        for path, content in sorted(members.items()):
            if path.startswith(prefix) and path.endswith(suffix):
                raw = gzip.decompress(content) if suffix.endswith(".gz") else content
                yield from chunks(f"{source}/{path[len(prefix):]}", raw.decode("utf-8", errors="replace"))
    return documents


@dataclass(frozen=True)
class DebSource:
    name: str
    package: str
    description: str
    license: str
    documents: Callable[[dict[str, bytes]], Iterator[Document]]


DEB_SOURCES = {s.name: s for s in (
    DebSource("austen", "r-cran-janeaustenr", "Jane Austen's six novels", "public domain", _austen),
    DebSource("fortunes", "fortunes", "fortune cookie files", "BSD-style", _fortunes),
    DebSource("gcide", "dict-gcide", "GNU Collaborative International Dictionary of English", "GPL-3.0+", _gcide),
    DebSource("linux-docs", "linux-doc-6.1", "Linux kernel documentation sources", "GPL-2.0",
              _gzipped_files("usr/share/doc/linux-doc-6.1/Documentation/", ".rst.gz", "linux-docs")),
    DebSource("python-docs", "python3.11-doc", "Python 3.11 documentation sources", "PSF-2.0",
              _gzipped_files("usr/share/doc/python3.11/html/_sources/", ".rst.txt", "python-docs")),
)}
DEBS = "debs"


def deb_path(data_dir: Path, source: DebSource) -> Path | None:
    found = sorted((Path(data_dir) / DEBS).glob(f"{source.package}_*.deb"))
    return found[-1] if found else None


def fetch_debs(data_dir: Path, log: Callable[[str], None] = print) -> list[Path]:
    """Download every source's package with ``apt-get download`` (a set-up step; needs Debian's mirrors)."""
    if shutil.which("apt-get") is None:
        raise DataError("the large corpus comes from Debian packages and needs apt-get, which this machine lacks; "
                        "the bundled corpus (data.corpus = \"bundled\") still works")
    dest = Path(data_dir) / DEBS
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in DEB_SOURCES.values():
        path = deb_path(data_dir, source)
        if path is not None:
            log(f"{path.name}: present")
        else:
            log(f"{source.package}: downloading (apt-get download {source.package})")
            done = subprocess.run(["apt-get", "download", source.package], cwd=dest, capture_output=True, text=True)
            path = deb_path(data_dir, source)
            if done.returncode != 0 or path is None:
                raise DataError(f"apt-get could not download {source.package} into {dest}:\n{done.stderr.strip()[-2000:]}")
        paths.append(path)
    return paths


def iter_deb_documents(data_dir: Path) -> Iterator[Document]:
    for source in DEB_SOURCES.values():
        path = deb_path(data_dir, source)
        if path is None:
            raise DataError(f"the {source.package} package is missing under {Path(data_dir) / DEBS}; "
                            "run `lordo data fetch --corpus large`")
        yield from source.documents(dict(deb_members(path)))
