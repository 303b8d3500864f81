"""A failed save raises one exception type per cause, in every mode, printed once (issue 44,
item 4).

A full disk is an OSError with errno ENOSPC (resilient.CheckpointIOError, also a
CheckpointCommitError) whether one process or several save, whether handle.wait(), the next
save(), wait() or close() raises it; on the rank where it happened it is chained to the
engine's original error. The library itself prints nothing about it.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_save_errors.py."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import torch
from test_save_errors import _until_done

import resilient
from procs import spawn_ranks


def test_the_failure_is_printed_once_by_the_caller_not_by_the_library(tmp_path, small_tmpfs):
    script = textwrap.dedent(f"""
        import time, torch, resilient
        ck = resilient.Checkpointer({str(small_tmpfs / "c")!r}, create=True)
        h = ck.save(2, {{"w": torch.full((4 << 20,), 2.0)}})
        while not h.done():
            time.sleep(0.02)
        try:
            ck.save(3, {{"w": torch.ones(8)}})
        except OSError as e:
            print("caught", type(e).__name__, e.errno, flush=True)
        ck.save(3, {{"w": torch.ones(8)}}).wait()
        ck.close()
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "caught CheckpointIOError 28"
    assert "No space" not in p.stderr, p.stderr


def _two_ranks(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from resilient import _C

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    root = out["root"]
    ck = resilient.Checkpointer(root, create=True, o_direct="off")
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    ck.save(1, state).wait(60)
    if rank == 1:  # this rank's disk fills up
        _C.install_fault_hook(["write"], errno.ENOSPC, path_contains="step-000000000002")
    h = ck.save(2, state)
    _until_done(h)
    try:
        ck.save(3, state)
    except OSError as e:
        out[rank] = (type(e).__name__, e.errno, str(e),
                     type(e.__cause__).__name__ if e.__cause__ else None)
    finally:
        _C.clear_fault_hook()
    ck.save(3, state).wait(60)
    out[f"steps{rank}"] = ck.steps()
    ck.close()
    dist.destroy_process_group()


def test_a_full_disk_on_one_rank_is_enospc_on_every_rank(tmp_path):
    got = spawn_ranks(_Ranks(str(tmp_path / "c")), 2)
    for rank in (0, 1):
        name, err, text, cause = got[rank]
        assert (name, err) == ("CheckpointIOError", errno.ENOSPC), got[rank]
        assert "rank 1" in text and "step 3 was not saved" in text
    assert got[1][3] == "OSError" and got[0][3] is None  # chained where it happened
    assert got["steps0"] == [1, 3]


class _Ranks:
    """spawn_ranks' function, with the root put into the shared dict first."""

    def __init__(self, root: str):
        self.root = root

    def __call__(self, rank: int, port: int, out) -> None:
        out["root"] = self.root
        _two_ranks(rank, port, out)
