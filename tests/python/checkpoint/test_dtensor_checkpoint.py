"""Sharded (DTensor) state on CPU with gloo: FSDP2, HSDP, TP and FSDP+TP modules and their
optimizers saved without a ShardSpec, each rank writing its local chunks, and loaded onto another
mesh (FSDP 4 -> 4, 4 -> 2, 4 -> 1 process, HSDP 2x2 -> FSDP 4, FSDP+TP 2x2 -> FSDP 4, TP 2 -> 1
process, DDP <-> FSDP). Every phase runs
as torch.multiprocessing workers in a subprocess of its own, bounded in time; full tensors are
compared bit for bit."""


from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


pytest.importorskip("torch.distributed.fsdp")


def test_a_dtensor_on_a_mesh_of_another_device_type_is_refused(tmp_path):
    """A DTensor on a mesh whose device type the engine cannot read or write (here 'meta'):
    save and load raise naming the tensor and the mesh; nothing is written or changed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    import resilient

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        good = torch.arange(8.0)
        with resilient.Checkpointer(tmp_path / "c") as ck:
            ck.save(1, {"w": good}).wait()
            odd = DTensor.from_local(torch.zeros(8), DeviceMesh("meta", [0]), [Shard(0)],
                                     run_check=False)
            with pytest.raises(TypeError, match="'w'.*'meta' device mesh"):
                ck.save(2, {"w": odd})
            with pytest.raises(resilient.IncompatibleCheckpointError, match="'meta' device mesh"):
                ck.load({"w": odd})
            assert ck.steps() == [1]
    finally:
        dist.destroy_process_group()
