"""`resilient ckpt`: ls, show, verify (a flipped byte in data, manifest or values), diff,
and clear errors for roots that are missing or not roots (exit 2, no traceback).

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_ckpt_cli.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_ckpt_cli import run_json

from resilient.checkpoint import Checkpointer
from resilient.cli import main


def test_console_script_error_has_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "resilient", "ckpt", "ls", str(tmp_path / "no")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    expected = f"resilient ckpt ls: error: checkpoint root {tmp_path / 'no'} does not exist\n"
    assert r.stderr == expected


@pytest.mark.parametrize("command", [["ls", "--verify"], ["show", "--tensors"], ["verify"]])
def test_inspecting_a_root_does_not_import_torch(root, command):
    """`ls`, `show` and `verify` read JSON and checksums only: without torch's import (2.5-10 s
    on a small VM) `resilient ckpt ls` takes a tenth of a second."""
    code = ("import sys\n"
            "from resilient.cli import main\n"
            f"rc = main(['ckpt', {command[0]!r}, {root!r}, *{command[1:]!r}])\n"
            "assert rc == 0, rc\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]"


def _two_rank_worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from resilient.checkpoint import ShardSpec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    specs = {"w": ShardSpec.split((8, 8), 0, rank, 2)}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    d = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    with Checkpointer(root, keep=0, create=True, specs=specs) as ck:
        ck.save(4, {"w": full[rank * 4:(rank + 1) * 4].clone(), "rep": torch.ones(3000, 100),
                    "d": d}, {"r": torch.tensor([rank])}).wait()
    # rank 0 hosts the store here: it must not go away while rank 1 still reads the commit's
    # outcome from it (under torchrun the agent hosts the store)
    dist.barrier()
    dist.destroy_process_group()


def _main_two_ranks(root: str, port: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_two_rank_worker, args=(port, root), nprocs=2, start_method="spawn")


def test_two_rank_root_lists_sharding_and_exports_global_tensors(tmp_path, free_port, capsys):
    from procs import run_bounded

    root = str(tmp_path / "r")
    rc, output = run_bounded([sys.executable, __file__, root, str(free_port)], 120, "2 ranks")
    assert rc == 0, output
    rc, doc = run_json(capsys, "ckpt", "ls", root, "--verify")
    (s,) = doc["steps"]
    assert (s["world_size"], s["tensors"], s["sharded"], s["verified"]) == (2, 5, 3, True)
    assert s["mesh"] == "2 (dp) cpu"  # the DTensor's mesh
    rc, doc = run_json(capsys, "ckpt", "show", root, "--tensors")
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["w"]["shape"] == [8, 8] and tensors["w"]["ranks"] == [0, 1]
    assert tensors["w"]["grid"] == [2, 1] and tensors["R0/r"]["grid"] == [1]
    assert set(tensors) == {"w", "rep", "d", "R0/r", "R1/r"} and doc["mesh"] == "2 (dp) cpu"
    out = str(tmp_path / "w.pt")
    assert main(["ckpt", "export", root, out, "--format", "torch"]) == 0
    state = torch.load(out, weights_only=True)
    assert torch.equal(state["w"], torch.arange(64, dtype=torch.float32).reshape(8, 8))
    assert state["_resilient"]["rank_state"]["1"]["r"].item() == 1


if __name__ == "__main__":
    _main_two_ranks(sys.argv[1], int(sys.argv[2]))
