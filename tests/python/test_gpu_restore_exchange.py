"""The shared restore's exchange between hosts over NCCL (checkpoint.exchange): on every GPU of
the machine, one rank each, as 2 emulated hosts (RESILIENT_HOST_ID), with the default process
group on NCCL. Replicated CUDA state is read from storage once in all and arrives bit-exact; a
run altered on arrival fails the XXH3 check and every rank reads directly (still exact).
Skipped without 2 GPUs."""

from __future__ import annotations

import json
import os
import sys

import pytest

from procs import run_bounded

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    import resilient
    from resilient.checkpoint import exchange

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    os.environ["RESILIENT_HOST_ID"] = f"host-{rank * 2 // world}"
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(1000 + 37 * i, 301, device=device) for i in range(12)}
    result: dict = {"nccl": exchange.nccl_group() is not None}
    with resilient.Checkpointer(root, keep=0, create=True) as ck:
        ck.save(1, state).wait()
    exchange.NCCL_CHUNK = 1 << 20  # several rounds per run
    for case in ("flipped", "clean"):
        if case == "flipped" and rank == world - 1:  # the last rank's first receive is altered
            real = dist.irecv

            class Flipped:
                def __init__(self, work, tensor):
                    self.work, self.tensor = work, tensor

                def wait(self):
                    self.work.wait()
                    self.tensor[100] ^= 0x01

            def irecv(tensor, *args, real=real, **kwargs):
                dist.irecv = real
                return Flipped(real(tensor, *args, **kwargs), tensor)

            dist.irecv = irecv
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        with resilient.Checkpointer(root, restore="shared") as ck:
            ck.load(target)
            result[case] = {"same": all(torch.equal(target[k], state[k]) for k in state),
                            "bytes_read": ck.last_load.bytes_read}
    result["size"] = sum(t.numel() * t.element_size() for t in state.values())
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


@pytest.mark.timeout(300)
def test_nccl_exchange_reads_once_and_checks_what_crossed(tmp_path):
    world = torch.cuda.device_count()
    out = str(tmp_path / "result")
    rc, output = run_bounded([sys.executable, __file__, str(world), str(tmp_path / "ckpt"), out],
                             240, "nccl exchange")
    assert rc == 0, output[-4000:]
    for rank in range(world):
        r = json.load(open(f"{out}.{rank}"))
        assert r["nccl"], r
        assert r["clean"]["same"] and r["clean"]["bytes_read"] == r["size"], r
        assert r["flipped"]["same"], r  # fell back to direct reads: each rank read it all
        assert r["flipped"]["bytes_read"] >= world * r["size"], r


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    world = int(sys.argv[1])
    mp.start_processes(_worker, args=(world, free_port(), sys.argv[2], sys.argv[3]),
                       nprocs=world, start_method="spawn")
