"""Rank 0 serves the job's store (init_process_group over tcp://) and exits right after its
close(): its close() first waits until every rank has read the commit's outcome, so rank 1 (made
slow to read it) still sees its checkpoint committed instead of "coordination failed"."""

from __future__ import annotations

import json
import os
import sys

import pytest

from procs import run_bounded


def _worker(rank: int, port: int, root: str, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    import resilient
    from resilient.checkpoint import checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    if rank == 1:  # read the published outcome late
        real = checkpointer.wait_key

        def late(store, key, *args, **kwargs):
            if key.endswith("/result"):
                time.sleep(1.5)
            return real(store, key, *args, **kwargs)

        checkpointer.wait_key = late
    ck = resilient.Checkpointer(root, keep=0, create=True)
    handle = ck.save(1, {"w": torch.ones(1000)})
    result = "committed"
    try:
        handle.wait()
        ck.close()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        result = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"result": result}, f)
    sys.stdout.flush()
    os._exit(0)  # rank 0: the store goes with it, at once


@pytest.mark.timeout(120)
def test_rank_zero_hosting_the_store_waits_until_the_outcome_was_read(tmp_path):
    rc, output = run_bounded([sys.executable, __file__, str(tmp_path / "ckpt"), str(tmp_path)],
                             90, "two ranks")
    assert rc == 0, output[-4000:]
    for r in (0, 1):
        got = json.load(open(tmp_path / f"rank{r}.json"))["result"]
        assert got == "committed", (r, got, output[-3000:])


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    port = free_port()
    mp.start_processes(_worker, args=(port, sys.argv[1], sys.argv[2]), nprocs=2,
                       start_method="spawn")
