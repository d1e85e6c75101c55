"""The ledger's wire bytes are what a worker really sends: checked against the bytes each gloo process writes
(``wchar`` of /proc/self/io: every write to its sockets) around each collective, for 2 and 4 workers."""

import sys

import pytest
import torch

from lordo.comm.ledger import broadcast_children, wire_bytes

from harness import run_gloo

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/io is Linux's")


def written() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def wire_worker(n: int):
    from lordo.comm.sparse import SparseCodec
    from lordo.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator("gloo", timeout_s=60)
    world = comm.world_size
    sparse = SparseCodec(density=1.0, bits=8)
    out = {}
    collectives = {
        "all_reduce:x": lambda: comm.all_reduce_mean([[torch.ones(n // 2), torch.ones(n // 2)]], tag="x"),
        "all_gather:x": lambda: comm.all_gather([[torch.ones(n)]], tag="x"),
        "broadcast:x": lambda: comm.broadcast([[torch.ones(n)]], tag="x"),
        "all_to_all:x": lambda: comm.all_to_all([[torch.ones(n // world) for _ in range(world)]], tag="x"),
        # a sparse payload (compress = sparse / basis): packed uint8 buffers, all-gathered
        "all_gather:sparse": lambda: comm.all_gather([[sparse.encode(torch.randn(n))]], tag="sparse"),
    }
    try:
        for key, run in collectives.items():
            comm.barrier()
            before = written()
            run()
            measured = written() - before
            comm.barrier()
            out[key] = (measured, comm.ledger.entries[key].wire)
        return out
    finally:
        comm.close()


@pytest.mark.parametrize("world", [2, 4])
def test_ledger_wire_bytes_match_the_bytes_written_to_the_sockets(world):
    n = 2**18  # 1 MiB of float32 per worker
    results = run_gloo(wire_worker, world, n)
    assert all(status == "ok" for status, _ in results.values()), results
    for rank, (_, measured) in results.items():
        for key, (sent, counted) in measured.items():
            if counted == 0:  # a leaf of the broadcast tree sends nothing but a few control bytes
                assert sent < 1024, (rank, key, sent)
                continue
            assert abs(sent - counted) / counted < 0.02, (rank, key, sent, counted)


def test_wire_model_by_hand():
    s = 1000
    assert wire_bytes("all_reduce", s, 4) == 1500 and wire_bytes("all_reduce", s, 2) == 1000
    assert wire_bytes("all_gather", s, 4) == 3000
    assert wire_bytes("all_to_all", s, 4) == 750
    assert [broadcast_children(r, 4) for r in range(4)] == [2, 1, 0, 0]
    assert [broadcast_children(r, 8) for r in range(8)] == [3, 2, 1, 1, 0, 0, 0, 0]
    assert wire_bytes("broadcast", s, 4, rank=0) == 2000 and wire_bytes("anything", s, 1) == 0
