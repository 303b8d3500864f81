"""The load contract across ranks (gloo, CPU): replicated state that differs between ranks, a
save guarded by `if rank == 0`, one format for any world size (1 -> 2, 2 -> 1, 2 -> 4), and
Recovery's state broadcast without pickle. Each phase runs as torch.multiprocessing workers in
a subprocess of its own, bounded in time."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from procs import run_bounded


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))


def _phase_save2(rank: int, world: int, root: str) -> dict:
    """2 ranks: per-rank values in replicated state are refused; a save by rank 0 alone fails
    fast; a good save with rank_state."""
    import torch

    import resilient
    from resilient import CollectiveError, ReplicaMismatchError

    out: dict = {}
    m = _model()
    ck = resilient.Checkpointer(root, keep=3, collective_timeout=3)
    try:
        ck.save(1, {"model": m, "ema": torch.full((4,), float(rank))}).wait(60)
        out["replica"] = "saved"
    except ReplicaMismatchError as e:
        out["replica"] = str(e)
    ck.save(2, {"model": m}, rank_state={"x": torch.full((2,), float(rank)), "r": rank}).wait(60)
    out["steps"] = ck.steps()
    ck.close()
    # Another process holds the writer lock of a second root: every rank raises, none writes.
    locked = root + "-locked"
    holder = None
    if rank == 0:
        import subprocess
        import sys

        holder = subprocess.Popen([sys.executable, "-c", HOLDER, locked], stdout=subprocess.PIPE,
                                  text=True)
        assert holder.stdout.readline().strip() == "holding"
    import torch.distributed as dist

    dist.barrier()
    other = resilient.Checkpointer(locked, keep=3, collective_timeout=10)
    try:
        other.save(1, {"model": m})
        out["locked"] = "saved"
    except resilient.RootInUseError as e:
        out["locked"] = str(e)
    out["locked_leftovers"] = sorted(os.listdir(locked))
    if holder is not None:
        holder.kill()
        holder.wait(30)
    differ = resilient.Checkpointer(os.path.join(root, "..", "differ"), keep=3,
                                    collective_timeout=10)
    try:  # every rank raises, naming both steps, and nothing is written
        differ.save(10 + rank, {"model": m})
        out["differ"] = "saved"
    except CollectiveError as e:
        out["differ"] = str(e)
    out["differ_steps"] = differ.steps()
    guarded = resilient.Checkpointer(root, keep=3, collective_timeout=2)
    t0 = time.monotonic()
    if rank == 0:
        try:
            guarded.save(3, {"model": m})
            out["guarded"] = "saved"
        except CollectiveError as e:
            out["guarded"] = str(e)
    out["guarded_s"] = time.monotonic() - t0
    return out


HOLDER = """
import sys, time, torch, resilient
ck = resilient.Checkpointer(sys.argv[1])
ck.save(7, {"w": torch.ones(2)}).wait()
print("holding", flush=True)
time.sleep(120)
"""


def _phase_load(rank: int, world: int, root: str) -> dict:
    """Any world size loads what any world size saved; rank_state follows the ranks."""
    import torch

    import resilient

    m = _model()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    mine = {"x": torch.zeros(2), "r": -1}
    ck = resilient.Checkpointer(root, keep=3)
    step = ck.load({"model": m}, rank_state=mine)
    out = {"step": step, "sum": float(sum(p.double().sum() for p in m.parameters())),
           "x": mine["x"].tolist(), "r": mine["r"]}
    try:
        ck.load({"model": m}, rank_state=mine, world_change="raise")
        out["strict"] = "loaded"
    except resilient.IncompatibleCheckpointError as e:
        out["strict"] = str(e)
    ck.close()
    return out


def _phase_broadcast(rank: int, world: int, root: str) -> dict:
    """Recovery's state broadcast: objects restored in place, a LambdaLR keeps its lambda."""
    import torch

    from resilient.checkpoint.broadcast import broadcast_state

    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    if rank == 0:
        for _ in range(3):
            m(torch.randn(4, 6)).sum().backward()
            opt.step()
            sched.step()
    extra = {"seen": rank}
    broadcast_state({"optim": opt, "sched": sched, "extra": extra}, src=0)
    sched.step()  # still bound to this rank's optimizer, lambda intact
    return {"lr": opt.param_groups[0]["lr"], "epoch": sched.last_epoch, "seen": extra["seen"],
            "exp_avg": float(opt.state_dict()["state"][0]["exp_avg"].double().sum())}


PHASES = {"save2": _phase_save2, "load": _phase_load, "broadcast": _phase_broadcast}


def _worker(rank: int, phases: str, world: int, port: int, roots: str, results: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    for phase, root in zip(phases.split(","), roots.split(",")):
        out = PHASES[phase](rank, world, root)
        with open(os.path.join(results, f"{phase}-{world}-rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()  # every rank has its result
    sys.stdout.flush()  # then leave without the interpreter's teardown
    os._exit(0)  # (gloo's teardown at exit aborted now and then on the loaded 2-core CI host)


def _run(phases: list[str], world: int, roots: list, results,
         timeout=150) -> dict[str, list[dict]]:
    """Each phase's results (rank order), the phases run in turn by one process group, each on
    its root."""
    rc, output = run_bounded([sys.executable, __file__, ",".join(phases), str(world),
                              ",".join(map(str, roots)), str(results)], timeout, ",".join(phases))
    assert rc == 0, output[-4000:]
    return {phase: [json.load(open(results / f"{phase}-{world}-rank{r}.json"))
                    for r in range(world)] for phase in phases}


@pytest.fixture(scope="module")
def at2(tmp_path_factory):
    """Every 2-rank job of this module in one process group (each start costs seconds of imports
    on a small machine): load a root that one process saved, recovery's state broadcast, then
    save2 (last: rank 0's lone guarded save is left behind). Returns (the roots' directory,
    each phase's results)."""
    import torch

    import resilient

    tmp = tmp_path_factory.mktemp("at2")
    one = tmp / "one"  # 1 process -> 2 ranks
    with resilient.Checkpointer(one) as ck:
        ck.save(5, {"model": _model()}, rank_state={"x": torch.ones(2), "r": 7}).wait()
    return tmp, _run(["load", "broadcast", "save2"], 2, [one, tmp / "unused", tmp / "two"], tmp)


@pytest.mark.timeout(400)
def test_world_size_changes_replica_checks_and_guarded_saves(at2, tmp_path):
    import torch

    import resilient

    tmp, at2 = at2
    root = tmp / "two"
    saved = at2["save2"]
    for r in saved:
        assert "'ema'" in r["replica"] and "rank_state" in r["replica"], r["replica"]
        assert r["steps"] == [2]
    assert "collective" in saved[0]["guarded"] and "1 of 2" in saved[0]["guarded"]
    for r in saved:
        assert "different arguments" in r["differ"] and "10" in r["differ"], r["differ"]
        assert "11" in r["differ"] and r["differ_steps"] == []
    for r in saved:  # a root locked by another process: every rank refuses, nothing written
        assert "another process" in r["locked"], r["locked"]
        assert not any(n.startswith(".tmp-step-000000000001") for n in r["locked_leftovers"])
    assert saved[0]["guarded_s"] < 10

    expect = float(sum(p.detach().double().sum() for p in _model().parameters()))
    # 2 ranks -> 4 ranks: ranks 2 and 3 start with fresh per-rank state
    four = _run(["load"], 4, [root], tmp_path)["load"]
    for rank, r in enumerate(four):
        assert r["step"] == 2 and r["sum"] == pytest.approx(expect, abs=0)
        assert r["x"] == ([float(rank)] * 2 if rank < 2 else [0.0, 0.0])
        assert r["r"] == (rank if rank < 2 else -1)
        assert "saved by" in r["strict"] or "holds per-rank state of 2 ranks" in r["strict"]
    # 2 ranks -> 1 process: rank 1's per-rank state is dropped (with a warning)
    m = _model()
    mine = {"x": torch.zeros(2), "r": -1}
    with resilient.Checkpointer(root) as ck:
        assert ck.load({"model": m}, rank_state=mine) == 2
        assert mine["r"] == 0
        with pytest.raises(resilient.IncompatibleCheckpointError, match="2 ranks"):
            ck.load({"model": m}, rank_state=mine, world_change="raise")
    # 1 process -> 2 ranks (saved by the at2 fixture before its job)
    two = at2["load"]
    assert [r["step"] for r in two] == [5, 5]
    assert two[0]["r"] == 7 and two[1]["r"] == -1 and two[1]["x"] == [0.0, 0.0]


@pytest.mark.timeout(400)
def test_recovery_state_broadcast_restores_objects_in_place(at2):
    r0, r1 = at2[1]["broadcast"]
    assert r0 == {**r1, "seen": 0} and r1["seen"] == 0
    assert r1["epoch"] == 4 and r1["lr"] == pytest.approx(1e-3 / 5)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    port = free_port()
    phases, world, roots, results_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mp.start_processes(_worker, args=(phases, world, port, roots, results_dir), nprocs=world,
                       start_method="spawn")
