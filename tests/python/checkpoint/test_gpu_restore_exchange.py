"""The shared restore in an NCCL job, on every GPU of the machine (one rank each):

- CUDA targets: each replicated piece is read once in all straight into one rank's GPU and
  broadcast over NCCL (checkpoint.device_share), in several rounds of reads and broadcasts; a
  piece altered on arrival fails the check and every rank reads directly (still exact); a
  damaged piece in storage raises CorruptCheckpointError on every rank;
- CPU targets, as 2 emulated hosts (RESILIENT_HOST_ID): the host buffers' exchange runs over
  NCCL staged through the GPUs (checkpoint.exchange), in several rounds; a run altered on
  arrival makes every rank read directly.

Every case is bit-exact and counts the bytes read from storage. Skipped without 2 GPUs."""

from __future__ import annotations

import json
import os
import sys

import pytest

from procs import run_bounded

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _flip_once(dist, name: str) -> None:
    """The next dist.<name> (broadcast or irecv) delivers its tensor with one byte flipped."""
    real = getattr(dist, name)

    class Flipped:
        def __init__(self, work, tensor):
            self.work, self.tensor, self.done = work, tensor, False

        def is_completed(self):
            return self.work.is_completed()

        def wait(self):  # a second wait is a no-op, as NCCL's is
            self.work.wait()
            if not self.done:
                self.tensor[min(100, self.tensor.numel() - 1)] ^= 0x01
                self.done = True

    def flipped(tensor, *args, **kwargs):
        setattr(dist, name, real)
        work = real(tensor, *args, **kwargs)
        if work is None:  # a synchronous broadcast
            tensor[min(100, tensor.numel() - 1)] ^= 0x01
            return None
        return Flipped(work, tensor)

    setattr(dist, name, flipped)


def _corrupt_copy(root: str, to: str) -> None:
    """Copies the checkpoint at `root` to `to` and flips bytes inside its largest data file."""
    import pathlib
    import shutil

    shutil.copytree(root, to, symlinks=True)
    data = max((p for p in pathlib.Path(to).rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        chunk = bytearray(f.read(64))
        f.seek(data.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    import resilient
    from resilient.checkpoint import exchange

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(1000 + 37 * i, 301, device=device) for i in range(12)}
    state["cpu_step"] = torch.tensor(7.0)  # a small CPU target (an optimizer's step) rides along
    result: dict = {"size": sum(t.numel() * t.element_size() for t in state.values())}
    with resilient.Checkpointer(root, keep=0, create=True) as ck:
        ck.save(1, state).wait()
    exchange.NCCL_CHUNK = 1 << 20  # several rounds per run
    os.environ["RESILIENT_RESTORE_ROUND_BYTES"] = "2MiB"  # the GPU path: several rounds
    if rank == 0:  # a copy with a damaged piece: whichever rank reads it, every rank raises
        _corrupt_copy(root, root + "-corrupt")
    dist.barrier()
    cases = [("gpu", "cuda", "broadcast"), ("gpu_flipped", "cuda", "broadcast"),
             ("hosts", "cpu", "irecv"), ("hosts_flipped", "cpu", "irecv")]
    for case, where, op in cases:
        if case.startswith("hosts"):
            os.environ["RESILIENT_HOST_ID"] = f"host-{rank * 2 // world}"
        if case.endswith("flipped") and rank == world - 1:
            _flip_once(dist, op)
        target = {k: torch.zeros_like(v, device=where if v.numel() > 1 else "cpu")
                  for k, v in state.items()}
        with resilient.Checkpointer(root, restore="shared") as ck:
            ck.load(target)
            result[case] = {"same": all(torch.equal(target[k].cpu(), state[k].cpu())
                                        for k in state),
                            "bytes_read": ck.last_load.bytes_read,
                            "phases": sorted(ck.last_load.seconds)}
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with resilient.Checkpointer(root + "-corrupt", restore="shared") as ck:
        try:
            ck.load(target, step=1)
            result["gpu_corrupt"] = "loaded"
        except Exception as e:  # noqa: BLE001 -- reported to the test
            result["gpu_corrupt"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


@pytest.mark.timeout(300)
def test_shared_restore_over_nccl_reads_once_and_checks_what_crossed(tmp_path):
    world = torch.cuda.device_count()
    out = str(tmp_path / "result")
    rc, output = run_bounded([sys.executable, __file__, str(world), str(tmp_path / "ckpt"), out],
                             240, "nccl shared restore")
    assert rc == 0, output[-4000:]
    for rank in range(world):
        r = json.load(open(f"{out}.{rank}"))
        for case in ("gpu", "hosts"):
            assert r[case]["same"] and r[case]["bytes_read"] == r["size"], (case, r,
                                                                             output[-3000:])
        assert "broadcast" in r["gpu"]["phases"], r  # GPU to GPU, no host buffer
        assert "exchange" in r["hosts"]["phases"], r  # the host buffers' exchange
        for case in ("gpu_flipped", "hosts_flipped"):  # fell back: each rank read it all
            assert r[case]["same"] and r[case]["bytes_read"] >= world * r["size"], (case, r)
        assert "Corrupt" in r["gpu_corrupt"], r  # on every rank, none left waiting


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    world = int(sys.argv[1])
    mp.start_processes(_worker, args=(world, free_port(), sys.argv[2], sys.argv[3]),
                       nprocs=world, start_method="spawn")
