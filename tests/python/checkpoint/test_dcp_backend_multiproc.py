"""resilient.dcp: torch.distributed.checkpoint's save/load/async_save through resilient's engine.

A module and its optimizer (get_state_dict/set_state_dict, as torchtitan does) round-trip bit
for bit; FSDP2 state saved by 2 gloo ranks (uneven shards) loads onto 2 FSDP2 ranks, onto 2
ranks holding whole tensors and onto 1 process (DCP's planner reshards; 4 -> 2 ranks is the
bench's resharded restore, verified value for value); async_save through ResilientStager
stages into the engine's pool (also under DCP's deduplication over 2 ranks) and reuses it;
kill -9 of the writer during a save leaves the previous step loadable; a flipped data byte is
CorruptCheckpointError naming the file and offset; a hostile metadata record is refused;
nothing resilient writes is pickle.
Multi-rank phases run as torch.multiprocessing workers in a bounded subprocess.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_dcp_backend.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_dcp_backend import (
    _load_into_fresh,
    _model,
    _same_model_and_optim,
    _save,
    _state,
    _trained,
    dcp,
    torch,
)

from full_state import full_values
from procs import run_bounded


def _kill_child(root: str, point: str) -> None:
    """Saves step 0, then stops at `point` of the save of step 1 and waits to be killed."""
    import resilient.checkpoint.dcp_storage as ds

    model, opt = _trained(7)
    _save(root, _state(model, opt, 0))
    real = ds._C

    class Stop:
        def __getattr__(self, name):
            return getattr(real, name)

        def commit_shards(self, *args):  # everything is written: only the rename is left
            print("STOPPED", flush=True)
            time.sleep(120)

    class Writer(ds.ResilientStorageWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)  # this rank's shard is durable
            if point == "write":
                print("STOPPED", flush=True)
                time.sleep(120)
            return future

    if point == "commit":
        ds._C = Stop()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    dcp.save(_state(model, opt, 1), storage_writer=Writer(root))


@pytest.mark.parametrize("point", ["write", "commit"])
def test_kill_9_during_a_save_leaves_the_previous_step_loadable(tmp_path, point):
    from resilient import _C

    root = str(tmp_path / "k")
    proc = subprocess.Popen([sys.executable, __file__, "kill", root, point],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "STOPPED" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "STOPPED" in line, proc.stdout.read()[-3000:]
        assert os.path.isdir(os.path.join(root, ".tmp-step-000000000001"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert list(_C.committed_steps(root)) == [0]
    reference, reference_opt = _trained(7)
    model, opt, state, reader = _load_into_fresh(root)
    assert reader.step == 0 and state["extra"]["step"] == 0
    _same_model_and_optim(model, opt, reference, reference_opt)
    # the next save (a new writer, the dead one's lock gone with it) commits and cleans up
    _save(root, _state(reference, reference_opt, 1))
    assert list(_C.committed_steps(root)) == [0, 1]
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]


def _full(state: dict) -> dict:
    return full_values(state, with_values=True)  # as the workers report it


def _fsdp(seed: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _fsdp_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from resilient.dcp import ResilientStager, ResilientStorageReader, ResilientStorageWriter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model, opt = _fsdp(8, world)
    g = torch.Generator().manual_seed(8)
    for _ in range(2):
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = _state(model, opt, 2)
    saved = _full(state)
    with ResilientStorageWriter(root) as w:
        dcp.save(state, storage_writer=w)
    # async_save staged into the writer's pool, with a tensor every rank holds: DCP's planner
    # deduplicates it (one rank writes it; the other's staging drops it)
    with ResilientStorageWriter(root + "-async") as w:
        dcp.async_save(dict(state, rep=torch.arange(10.0)), storage_writer=w,
                       async_stager=ResilientStager(w)).result()
    # onto 2 ranks: a fresh FSDP2 model and optimizer (other values, state after one step)
    model2, opt2 = _fsdp(9, world)
    model2(torch.randn(4, 6, generator=g)).square().mean().backward()
    opt2.step()
    state2 = _state(model2, opt2, 0)
    dcp.load(state2, storage_reader=ResilientStorageReader(root))
    set_state_dict(model2, opt2, model_state_dict=state2["model"],
                   optim_state_dict=state2["optim"])
    loaded = _full(_state(model2, opt2, state2["extra"]["step"]))
    # onto 2 ranks holding whole, unsharded tensors (each reads both saved ranks' chunks)
    plain, plain_opt = _trained(10, steps=1)
    state3 = _state(plain, plain_opt, 0)
    dcp.load(state3, storage_reader=ResilientStorageReader(root))
    set_state_dict(plain, plain_opt, model_state_dict=state3["model"],
                   optim_state_dict=state3["optim"])
    unsharded = _full(_state(plain, plain_opt, state3["extra"]["step"]))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"saved": saved, "loaded": loaded, "unsharded": unsharded,
                   "files": sorted(os.listdir(os.path.join(root, "step-000000000000")))}, f)
    dist.barrier()
    os._exit(0)


@pytest.mark.timeout(300)
def test_fsdp2_state_of_two_ranks_loads_onto_two_ranks_sharded_or_not_and_one_process(tmp_path):
    root, out = tmp_path / "f", tmp_path / "out"
    out.mkdir()
    rc, output = run_bounded([sys.executable, __file__, "fsdp", "2", str(root), str(out)], 240,
                             "fsdp x2")
    assert rc == 0, output[-4000:]
    ranks = [json.load(open(out / f"rank{r}.json")) for r in range(2)]
    saved = ranks[0]["saved"]
    assert ranks[1]["saved"] == saved
    for r in ranks:
        assert r["loaded"] == saved
        assert r["unsharded"] == saved
    assert {"rank-00000.data", "rank-00001.data", "dcp-metadata.json"} <= set(ranks[0]["files"])
    # onto one process without a process group: plain full tensors, resharded by DCP's planner
    model, opt, state, _ = _load_into_fresh(str(root))
    assert _full(_state(model, opt, state["extra"]["step"])) == saved
    # the async save through the pool stager: the same state, and the deduplicated tensor
    from resilient.dcp import ResilientStorageReader

    model, opt, state, _ = _load_into_fresh(f"{root}-async")
    assert _full(_state(model, opt, state["extra"]["step"])) == saved
    rep = {"rep": torch.zeros(10)}
    dcp.load(rep, storage_reader=ResilientStorageReader(f"{root}-async"))
    assert torch.equal(rep["rep"], torch.arange(10.0))


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        _kill_child(sys.argv[2], sys.argv[3])
    else:

        import torch.multiprocessing as mp

        from resilient.ports import free_port

        port = free_port()
        world = int(sys.argv[2])
        mp.start_processes(_fsdp_worker, args=(world, port, sys.argv[3], sys.argv[4]),
                           nprocs=world, start_method="spawn")
