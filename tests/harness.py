"""Shared helpers: a tiny model and synthetic batches to drive strategies on any communicator,
and a way to run the same function as N gloo processes."""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback

import torch

from lordo.config import build_config
from lordo.model import GPT, GPTConfig, group_parameters
from lordo.strategies import build_strategy

VOCAB = 61


def tiny_model(dtype: torch.dtype = torch.float32, d_model: int = 16) -> GPT:
    torch.manual_seed(1234)
    return GPT(GPTConfig(vocab_size=VOCAB, d_model=d_model, n_layers=1, n_heads=2, seq_len=8)).to(dtype)


def batch(rank: int, step: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = torch.randint(0, VOCAB, (size, 9), generator=g)
    return t[:, :-1], t[:, 1:]


def strategy_config(name: str, overrides=()):
    return build_config(overrides=[f'strategy.name="{name}"', "schedule.warmup_steps=0", *overrides])


def run_strategy(comm, cfg, steps: int, lr: float = 1e-2, dtype: torch.dtype = torch.float32, d_model: int = 16):
    """Train one tiny replica per hosted worker; returns worker 0's final parameters and the ledger."""
    models = [tiny_model(dtype, d_model) for _ in comm.local_ranks]
    groups = [group_parameters(m) for m in models]
    strategy = build_strategy(cfg, models, groups, comm)
    for step in range(steps):
        for model, rank in zip(models, comm.local_ranks):
            x, y = batch(rank, step)
            model(x, y)[1].backward()
        strategy.step(lr)
    strategy.finish()
    return [p.detach().clone() for p in models[0].parameters()], comm.ledger.table()


def random_steps(params, opt, start: int, n: int, seed_offset: int = 0) -> None:
    """Steps ``start`` … ``start + n − 1`` of ``opt`` on gradients drawn from each step's own seed."""
    for t in range(start, start + n):
        g = torch.Generator().manual_seed(seed_offset + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def resumes_bit_identically(build, steps, saved_check=None, loaded_check=None) -> None:
    """Six steps straight against three, a ``torch.save`` / ``weights_only`` load into a fresh optimizer (``build``:
    seed → (params, optimizer), the fresh one on another seed) and three more: every parameter equal. ``steps``:
    (params, opt, start, n); ``saved_check(saved)`` and ``loaded_check(params, opt)`` look at the file and the load."""
    params, opt = build(0)
    steps(params, opt, 0, 6)
    straight = [p.detach().clone() for p in params]
    params, opt = build(0)
    steps(params, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    if saved_check is not None:
        saved_check(saved)
    params, opt = build(5)
    for p, value in zip(params, saved["params"]):
        p.data.copy_(value)
    opt.load_state_dict(saved["opt"])
    if loaded_check is not None:
        loaded_check(params, opt)
    steps(params, opt, 3, 3)
    for a, b in zip(straight, params):
        assert torch.equal(a, b)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Gloo workers fork from a server process that has imported torch and lordo once per test session: a worker then
# starts in ~0.1 s instead of the ~3-5 s a spawned one spends importing torch (and torch._dynamo, which any torch
# optimizer's add_param_group imports). Like spawn, a worker gets nothing else of the test process: `_entry` hands
# it the caller's environment, and the preparation data its sys.path and working directory.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "lordo.comm.torch_dist",
                                 "lordo.strategies", "lordo.train", "harness"])


def _entry(fn, rank, world, port, queue, args, environ):
    os.environ.clear()
    os.environ.update(environ)  # the caller's, as now: the server's is from when it started
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        buf = io.BytesIO()
        torch.save(fn(*args), buf)  # plain bytes: shared-memory tensors would die with this process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # report, do not hang the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


@contextlib.contextmanager
def gloo_group():
    """The process group of a worker that builds its own (FSDP2's mesh needs one before lordo does). A worker that
    got through leaves in order: a barrier, so no rank closes its connections while a peer still reads from them
    (gloo fails that peer with 'Read error'), then the group is destroyed in this process, not at interpreter exit.
    A worker that raised tears its group down at once: a peer may be dead, and a barrier would wait for it."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def one_thread():
    """Run the simulator with one intra-op thread, like the gloo workers (``_entry``): GEMM results depend on
    the thread count in their last bits, so only then can simulator and gloo be compared bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_gloo(fn, world: int, *args, timeout: float = 120.0) -> dict:
    """Run ``fn(*args)`` in ``world`` fresh processes (forked from the preloaded server) wired as a gloo group.

    Returns {rank: (status, value)}: ("ok", result), ("error", traceback) or ("died", exit code)."""
    queue = _CONTEXT.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [_CONTEXT.Process(target=_entry, args=(fn, r, world, port, queue, args, environ)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.2)
            except queue_module.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            results[rank] = (status, torch.load(io.BytesIO(value), weights_only=False) if status == "ok" else value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        results.setdefault(r, ("died", p.exitcode))
    return results


def gloo_strategy_worker(name: str, overrides, steps: int, d_model: int = 16):
    from lordo.comm.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator("gloo", timeout_s=60)
    try:
        return run_strategy(comm, strategy_config(name, overrides), steps, d_model=d_model)
    finally:
        comm.close()


def assert_simulator_equals_gloo(name: str, overrides, steps: int = 8, d_model: int = 16):
    """The same strategy on the simulator (one thread) and on 2 gloo processes: equal parameters and ledgers,
    bit for bit. Returns the simulator's communicator for further checks."""
    from lordo.comm import SimCommunicator

    with one_thread():
        comm = SimCommunicator(2)
        sim_params, sim_ledger = run_strategy(comm, strategy_config(name, overrides), steps=steps, d_model=d_model)
    results = run_gloo(gloo_strategy_worker, 2, name, overrides, steps, d_model)
    assert all(status == "ok" for status, _ in results.values()), results
    for rank in range(2):
        params, ledger = results[rank][1]
        assert ledger == sim_ledger
        for a, b in zip(sim_params, params):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # same code, same thread count: bit for bit
    return comm
