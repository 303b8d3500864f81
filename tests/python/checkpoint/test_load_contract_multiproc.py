"""The load contract (docs/STATE.md), one process: each case of the load-contract issue as a
regression test. Multi-rank cases: test_load_contract_dist.py; generated states:
test_load_contract_props.py.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_load_contract.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import resilient

DTENSOR = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    import resilient
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    root = sys.argv[1]
    plain = nn.Linear(4, 4)
    with resilient.Checkpointer(root) as ck:
        ck.save(1, {"model": plain}).wait()
        sharded = nn.Linear(4, 4)
        fully_shard(sharded)
        ck.load({"model": sharded})
        after = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
        print("RESTORED", all(torch.equal(plain.state_dict()[k], after[k].cpu()) for k in after))
        ck.save(2, {"model": sharded}).wait()
        again = nn.Linear(4, 4)
        ck.load({"model": again}, step=2)
        print("ROUNDTRIP", all(torch.equal(plain.state_dict()[k], again.state_dict()[k].cpu())
                               for k in after))
    dist.destroy_process_group()
""")


DTENSOR_BAD = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    import resilient
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    with resilient.Checkpointer(sys.argv[1], create=True) as ck:
        ck.save(1, {"model": nn.Linear(4, 4)}).wait()
        wider = nn.Linear(4, 5)
        fully_shard(wider)
        before = {k: v.full_tensor().clone() for k, v in wider.state_dict().items()}
        try:
            ck.load({"model": wider})
            print("LOADED")
        except resilient.IncompatibleCheckpointError as e:
            print("RAISED", e)
        after = {k: v.full_tensor() for k, v in wider.state_dict().items()}
        print("UNCHANGED", all(torch.equal(before[k], after[k]) for k in before))
        try:
            ck.save(2, {"model": wider}, rank_state={"x": wider.weight})
            print("SAVED")
        except TypeError as e:
            print("SAVE-RAISED", e, ck.steps())
    dist.destroy_process_group()
""")


def test_a_dtensor_target_of_another_global_shape_raises_and_nothing_changes(tmp_path,
                                                                             free_port):
    out = subprocess.run([sys.executable, "-c", DTENSOR_BAD, str(tmp_path / "c"),
                          str(free_port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RAISED" in out.stdout and "'model/weight'" in out.stdout, out.stdout
    assert "[4, 4]" in out.stdout and "[5, 4]" in out.stdout, out.stdout
    assert "UNCHANGED True" in out.stdout, out.stdout
    assert "SAVE-RAISED" in out.stdout and "rank_state" in out.stdout, out.stdout
    assert "[1]" in out.stdout  # step 2 was not saved


def test_fsdp2_dtensor_targets_are_restored_not_skipped(tmp_path, free_port):
    """A null data_ptr() once meant "verify only": FSDP2 targets kept their random init. Now a
    DTensor target gets its local chunk (tests/python/test_dtensor_checkpoint.py reshards)."""
    out = subprocess.run([sys.executable, "-c", DTENSOR, str(tmp_path / "c"), str(free_port)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RESTORED True" in out.stdout and "ROUNDTRIP True" in out.stdout, out.stdout


SLOW_SAVER = textwrap.dedent("""
    import signal, sys, time, torch, resilient
    # A shell runs background jobs with SIGINT ignored, and Python keeps an inherited SIG_IGN:
    # under a CI runner started with `&` the Ctrl-C below would be dropped. Take it as an
    # interactive process does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ck = resilient.Checkpointer(sys.argv[1])
    ck.save(1, {"w": torch.ones(1 << 10)}).wait()
    h = ck.save(2, {"w": torch.ones(4 << 20)})
    t0 = time.monotonic()
    try:
        print("waiting", flush=True)  # inside the try: a SIGINT from now on is caught below
        h.wait()
    except KeyboardInterrupt:
        print(f"interrupted {time.monotonic() - t0:.2f}", flush=True)
""")


def test_ctrl_c_interrupts_wait_and_leaves_the_previous_checkpoint(tmp_path):
    # Every write of step 2 waits 2 s, so the save is still running when SIGINT comes 0.5 s
    # after "waiting".
    env = dict(os.environ, RESILIENT_FAULT_OPS="write", RESILIENT_FAULT_ERRNO="0",
               RESILIENT_FAULT_DELAY_MS="2000", RESILIENT_FAULT_PATH="step-000000000002",
               RESILIENT_EXIT_TIMEOUT_S="2", RESILIENT_O_DIRECT="off")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVER, str(tmp_path / "c")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        exit_s = time.monotonic() - t0
    finally:
        proc.kill()
    assert "interrupted" in out, (out, err)
    assert exit_s < 10, f"exit took {exit_s:.1f} s"  # bounded: RESILIENT_EXIT_TIMEOUT_S
    with resilient.Checkpointer(tmp_path / "c") as ck:  # step 2 finished at exit, or never
        state = {"w": torch.zeros(1 << 10)}
        assert ck.load(state, step=1) == 1 and torch.equal(state["w"], torch.ones(1 << 10))
        assert ck.load({}) in (1, 2) and ck.last_load.skipped == []


TWO_WRITERS = textwrap.dedent("""
    import sys, time, torch, resilient
    ck = resilient.Checkpointer(sys.argv[1], keep=2)
    ck.save(1, {"w": torch.ones(4)}).wait()
    print("holding", flush=True)
    time.sleep(60)
""")


def test_one_writer_per_root(tmp_path):
    root = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-c", TWO_WRITERS, str(root)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        with resilient.Checkpointer(root) as ck:
            assert ck.load({"w": torch.zeros(4)}) == 1  # readers are never refused
            t0 = time.monotonic()
            with pytest.raises(resilient.RootInUseError, match=f"pid {proc.pid}"):
                ck.save(2, {"w": torch.zeros(4)})
            assert time.monotonic() - t0 < 5
    finally:
        proc.kill()
        proc.wait(30)
    with resilient.Checkpointer(root) as ck:  # the kernel dropped the dead writer's lock
        ck.save(2, {"w": torch.zeros(4)}).wait()
        with pytest.raises(resilient.RootInUseError, match="this process"):
            resilient.Checkpointer(root).save(3, {"w": torch.zeros(4)})
    with resilient.Checkpointer(root) as ck:  # closed: free again
        ck.save(3, {"w": torch.zeros(4)}).wait()
