"""Rebuilding torch.distributed groups: pure helpers, and the 4-process gloo kill scenario.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_comm_process_group.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from test_comm_process_group import ROOT, dist

import gloo_recovery_demo as gloo_demo  # noqa: E402


@pytest.mark.timeout(150)
def test_four_gloo_ranks_survive_a_sigkill(capsys: pytest.CaptureFixture[str]) -> None:
    """4 processes; rank 1 is SIGKILLed; the 3 survivors, told the dead rank, rebuild a gloo
    group of generation 1, all-reduce successfully and re-wrap DDP in sync."""
    res = gloo_demo.run(world=4, kill_rank=1, timeout_s=120)
    survivors = res["survivors"]
    assert sorted(r["rank"] for r in survivors) == [0, 2, 3]
    assert sorted(r["new_rank"] for r in survivors) == [0, 1, 2]
    assert all(r["new_size"] == 3 and r["method"] == "reinit" for r in survivors)
    assert all(r["ddp_in_sync"] for r in survivors)
    assert all(r["steps"] > 0 for r in survivors)
    # Far below the 20 s group timeout: a stuck collective must not delay the rebuild.
    assert res["total_s"] < 10, res
    with capsys.disabled():
        timings = {k: round(v, 4) for k, v in res.items() if isinstance(v, float)}
        print("\ngloo kill->first collective:", json.dumps(timings))


_JOIN_AFTER_FAILED_ATTEMPT = r"""
import sys
from datetime import timedelta
import torch.distributed as dist
from resilient.comm.process_group import join_process_group, verify_group

role, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
if role == "late":
    # A survivor that entered generation 1, whose peer never came: its rendezvous times out.
    try:
        join_process_group(store, generation=1, rank=0, world_size=2, backend="gloo",
                           timeout=timedelta(seconds=2))
    except Exception as e:
        print("generation 1 failed:", type(e).__name__, flush=True)
    store.set("gen1-failed", "1")
else:
    store.wait(["gen1-failed"], timedelta(seconds=30))  # joins generation 2 directly
rank = 0 if role == "late" else 1
join_process_group(store, generation=2, rank=rank, world_size=2, backend="gloo",
                   timeout=timedelta(seconds=20))
verify_group()
print("generation 2 ok", dist.distributed_c10d._get_default_group().group_name, flush=True)
dist.barrier()
import os
import signal
os._exit(0)  # no gloo teardown at exit (tests/python/procs.py says why)
"""


@pytest.mark.timeout(120)
def test_a_failed_rendezvous_does_not_rename_the_next_generation(tmp_path: Path) -> None:
    """One survivor's generation-1 rendezvous timed out (its peer went on to generation 2); both
    then meet in generation 2 (torch's per-process group counter had named the first one's
    group "1" and the other's "0": each waited for keys the other never wrote)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    script = tmp_path / "join.py"
    script.write_text(_JOIN_AFTER_FAILED_ATTEMPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    procs = [subprocess.Popen([sys.executable, str(script), role, str(store.port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for role in ("late", "direct")]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=90)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "generation 1 failed" in outs[0], outs[0]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "generation 2 ok 0" in out, out[-2000:]


_DROP_A_STUCK_GROUP = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from resilient.comm.process_group import retire_groups
role, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=int(role != "stuck"), world_size=2)
group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
if role == "silent":  # alive, connected, never joins the all-reduce
    print("silent", flush=True)
    time.sleep(600)
work = dist.all_reduce(torch.ones(1), group=group, async_op=True)  # waits for the silent peer
time.sleep(0.2)
assert not work.is_completed()
if role == "stuck":
    retire_groups([group])
dist.destroy_process_group()  # torch's registry lets go of the group too
t0 = time.monotonic()
del work, group  # the last references of this thread
print(f"dropped in {time.monotonic() - t0:.1f} s", flush=True)
sys.exit(0)  # a normal interpreter exit, not os._exit
"""


@pytest.mark.timeout(120)
def test_a_retired_group_is_destroyed_neither_by_its_last_reference_nor_at_exit(
        tmp_path: Path) -> None:
    """A gloo group whose worker waits in an all-reduce for a live peer that never joins (as
    a frozen one): retired, its last references dropped on the training thread and the
    interpreter's exit return at once (its destructor would join that worker until the group's
    120 s timeout)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    script = tmp_path / "drop.py"
    script.write_text(_DROP_A_STUCK_GROUP)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    procs = [subprocess.Popen([sys.executable, str(script), role, str(store.port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for role in ("stuck", "silent")]
    try:
        out = procs[0].communicate(timeout=90)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    assert procs[0].returncode == 0 and "dropped in 0.0 s" in out, out[-3000:]
