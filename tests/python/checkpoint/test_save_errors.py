"""A failed save raises one exception type per cause, in every mode, printed once (issue 44,
item 4).

A full disk is an OSError with errno ENOSPC (resilient.CheckpointIOError, also a
CheckpointCommitError) whether one process or several save, whether handle.wait(), the next
save(), wait() or close() raises it; on the rank where it happened it is chained to the
engine's original error. The library itself prints nothing about it.
"""


from __future__ import annotations

import errno
import time

import pytest
import torch

import resilient


def _until_done(handle, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not handle.done():
        assert time.monotonic() < deadline, "the save never ended"
        time.sleep(0.02)


@pytest.mark.parametrize("where", ["handle", "save", "wait", "close"])
def test_a_full_disk_is_an_oserror_with_enospc_wherever_it_is_raised(small_tmpfs, where):
    ck = resilient.Checkpointer(small_tmpfs / "c", keep=5, create=True)
    try:
        ck.save(1, {"w": torch.ones(1 << 20)}).wait()
        handle = ck.save(2, {"w": torch.full((4 << 20,), 2.0)})  # 16 MiB: does not fit
        _until_done(handle)
        with pytest.raises(OSError) as info:
            if where == "handle":
                handle.wait()
            elif where == "save":
                ck.save(3, {"w": torch.ones(8)})
            elif where == "wait":
                ck.wait()
            else:
                ck.close()
    finally:
        ck.close()
    e = info.value
    assert isinstance(e, resilient.CheckpointIOError)
    assert isinstance(e, resilient.CheckpointCommitError)
    assert e.errno == errno.ENOSPC
    assert "No space left on device" in str(e) and "step 2" in str(e)
    path = str(small_tmpfs / "c" / ".tmp-step-000000000002" / "rank-00000.data")
    assert str(e).count(path) == 1, str(e)
    assert isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.ENOSPC
