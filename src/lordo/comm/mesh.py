"""The ranks of one LoRDO worker as a device mesh, for FSDP2 inside a worker."""

from __future__ import annotations

from ..errors import ConfigError


def worker_mesh(ranks_per_worker: int):
    """The ranks of this process's LoRDO worker as a 1-D ``DeviceMesh``, to shard the model over them with FSDP2
    before :func:`distributed` (with the same ``ranks_per_worker``)::

        mesh = lordo.worker_mesh(2)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, shard_placement_fn=lordo.optim.fsdp_placement)
        fully_shard(model, mesh=mesh, shard_placement_fn=lordo.optim.fsdp_placement)
        opt = lordo.distributed(model, "lordo", ranks_per_worker=2)

    A collective: every process calls it, after ``torch.distributed.init_process_group`` (FSDP2 needs the process
    group before ``lordo.distributed`` could start one). CUDA devices under nccl, the CPU otherwise."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("worker_mesh needs the process group: call torch.distributed.init_process_group() first "
                          "(under torchrun)")
    world = dist.get_world_size()
    if not (isinstance(ranks_per_worker, int) and not isinstance(ranks_per_worker, bool) and ranks_per_worker >= 1
            and world % ranks_per_worker == 0):
        raise ConfigError(f"ranks_per_worker must be an integer >= 1 that divides the {world} processes, got {ranks_per_worker!r}")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world // ranks_per_worker, ranks_per_worker), mesh_dim_names=("worker", "rank"))
    return mesh["rank"]
