"""Sharded (DTensor) state on CPU with gloo: FSDP2, HSDP, TP and FSDP+TP modules and their
optimizers saved without a ShardSpec, each rank writing its local chunks, and loaded onto another
mesh (FSDP 4 -> 4, 4 -> 2, 4 -> 1 process, HSDP 2x2 -> FSDP 4, FSDP+TP 2x2 -> FSDP 4, TP 2 -> 1
process, DDP <-> FSDP). Every phase runs
as torch.multiprocessing workers in a subprocess of its own, bounded in time; full tensors are
compared bit for bit.

The tests here start processes (the multiproc tier,
tests/python/tiers.py); the others are in test_dtensor_checkpoint.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
from test_dtensor_checkpoint import torch

from full_state import full_values
from procs import run_bounded


def _model(seed: int):
    from torch import nn

    torch.manual_seed(seed)
    # FSDP over 4 ranks: 6 rows make uneven chunks (2, 2, 2, 0); TP over 2 splits 8 evenly
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))


def _shard(model, mesh, kind: str = "fsdp"):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if kind in ("tp", "fsdp_tp"):  # Megatron-style: column- then row-parallel
        tp = mesh if kind == "tp" else mesh["tp"]
        parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if kind == "tp":
            return model
        mesh = mesh["dp"]
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _mesh(kind: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "hsdp":  # replicate x shard
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if kind == "fsdp_tp":  # FSDP over dp, tensor parallel over tp (strided sharding)
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (world,))


def _train(model, opt, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


_full = full_values  # name -> full tensor as a list (DTensors gathered)


def _optim_full(opt) -> dict:
    return _full({str(i): s for i, s in opt.state_dict()["state"].items()})


def _phase_save(rank: int, world: int, root: str, kind: str) -> dict:
    import resilient

    model = _model(0)
    if kind == "ddp":  # every rank holds the whole module; saved under its unwrapped names
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        _shard(model, _mesh(kind, world), kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    with resilient.Checkpointer(root, create=True) as ck:
        ck.save(2, {"model": model, "optim": opt}).wait()
    bare = model.module if kind == "ddp" else model
    return {"model": _full(bare.state_dict()), "optim": _optim_full(opt)}


def _phase_load(rank: int, world: int, root: str, kind: str) -> dict:
    import resilient

    fresh = kind.endswith("-fresh")  # an optimizer without state yet, as at a job's start
    kind = kind.removesuffix("-fresh")
    model = bare = _model(123)  # other values: the load must overwrite every one
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(bare)
    elif kind != "plain":
        _shard(model, _mesh(kind, world), kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind != "plain" and not fresh:
        _train(model, opt, 1)  # optimizer state exists (DTensor moments) and must be replaced
    with resilient.Checkpointer(root) as ck:
        step = ck.load({"model": model, "optim": opt})
    out = {"step": step, "model": _full(bare.state_dict()), "optim": _optim_full(opt)}
    _train(model, opt, 1)  # training goes on from the loaded state
    out["after"] = _full(model.state_dict())
    return out


def _phase_partial(rank: int, world: int, root: str, kind: str) -> dict:
    from torch.distributed.tensor import Partial, distribute_tensor

    import resilient

    mesh = _mesh("fsdp", world)
    t = distribute_tensor(torch.ones(4, 2), mesh, [Partial()])
    with resilient.Checkpointer(root, create=True) as ck:
        try:
            ck.save(1, {"t": t})
        except TypeError as e:
            return {"error": str(e), "steps": ck.steps()}
    return {"error": None}


# One process group per world size runs a sequence of (phase, kind, root) steps for every test
# of this module (the `sequences` fixture): spawning is the slow part on a small CI host. The
# refused Partial save comes last in its group, on a root of its own.
SEQUENCES = {
    4: [("save", "fsdp", "fsdp"), ("load", "fsdp", "fsdp"), ("save", "hsdp", "hsdp"),
        ("load", "fsdp", "hsdp"), ("save", "fsdp_tp", "fsdp_tp"), ("load", "fsdp", "fsdp_tp")],
    2: [("load", "fsdp-fresh", "fsdp"), ("save", "tp", "tp"), ("save", "ddp", "ddp"),
        ("load", "fsdp", "ddp"), ("load", "ddp", "fsdp"), ("partial", "fsdp", "partial")],
    1: [("load", "plain", "fsdp"), ("load", "plain", "tp")],
}


def _phase_sequence(rank: int, world: int, root: str, kind: str) -> dict:
    import torch.distributed as dist

    out = {}
    for phase, k, sub in SEQUENCES[world]:
        out[f"{phase}/{k}/{sub}"] = PHASES[phase](rank, world, os.path.join(root, sub), k)
        dist.barrier()
    return out


PHASES = {"save": _phase_save, "load": _phase_load, "partial": _phase_partial,
          "sequence": _phase_sequence}


def _worker(rank: int, phase: str, world: int, port: int, root: str, results: str,
            kind: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    out = PHASES[phase](rank, world, root, kind)
    with open(os.path.join(results, f"{phase}-{kind}-{world}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _run(phase: str, world: int, kind: str, root, results, timeout=300) -> list[dict]:
    rc, output = run_bounded([sys.executable, __file__, phase, str(world), str(root),
                              str(results), kind], timeout, f"{phase} {kind} x{world}")
    assert rc == 0, output[-4000:]
    return [json.load(open(results / f"{phase}-{kind}-{world}-rank{r}.json"))
            for r in range(world)]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k


@pytest.fixture(scope="module")
def sequences(tmp_path_factory):
    """(the roots' directory, each rank's results of the 4-, 2- and 1-rank sequences), in
    that order: the 2-rank group loads what the 4 ranks saved, the single process both."""
    root = tmp_path_factory.mktemp("dtensor")
    results = root / "results"
    results.mkdir()
    return root, {world: _run("sequence", world, "-", root, results) for world in (4, 2, 1)}


@pytest.mark.timeout(900)
def test_fsdp_hsdp_tp_state_saves_and_reshards_on_load(sequences):
    tmp_path, by_world = sequences
    four = by_world[4]
    saved = four[0]["save/fsdp/fsdp"]
    # the same mesh: bit-exact, and every rank agrees
    for r in four:
        got = r["load/fsdp/fsdp"]
        assert got["step"] == 2
        _same(got["model"], saved["model"])
        _same(got["optim"], saved["optim"])
        _same(got["after"], four[0]["load/fsdp/fsdp"]["after"])
    # each rank wrote only its own chunks: 4 shard files
    assert len(list((tmp_path / "fsdp" / "step-000000000002").glob("rank-*.data"))) == 4
    # HSDP 2x2 -> FSDP 4 (replicated chunks written once); FSDP+TP 2x2 (strided) -> FSDP 4
    for src in ("hsdp", "fsdp_tp"):
        for r in four:
            _same(r[f"load/fsdp/{src}"]["model"], four[0][f"save/{src}/{src}"]["model"])
            _same(r[f"load/fsdp/{src}"]["optim"], four[0][f"save/{src}/{src}"]["optim"])
    # FSDP 4 -> 2 into a fresh optimizer (its state is created sharded, like its parameters,
    # so the next step does not mix Tensor and DTensor); DDP 2 -> FSDP 2 and FSDP 4 -> DDP 2
    # (DDP's 'module.' prefix is not part of the saved names; optimizer state goes by name)
    two = by_world[2]
    for r in two:
        _same(r["load/fsdp-fresh/fsdp"]["model"], saved["model"])
        _same(r["load/fsdp-fresh/fsdp"]["optim"], saved["optim"])
        _same(r["load/fsdp/ddp"]["model"], two[0]["save/ddp/ddp"]["model"])
        _same(r["load/fsdp/ddp"]["optim"], two[0]["save/ddp/ddp"]["optim"])
        _same(r["load/ddp/fsdp"]["model"], saved["model"])
        _same(r["load/ddp/fsdp"]["optim"], saved["optim"])
    # FSDP 4 and TP 2 -> one process holding plain full tensors
    one = by_world[1][0]
    _same(one["load/plain/fsdp"]["model"], saved["model"])
    _same(one["load/plain/fsdp"]["optim"], saved["optim"])
    _same(one["load/plain/tp"]["model"], two[0]["save/tp/tp"]["model"])
    _same(one["load/plain/tp"]["optim"], two[0]["save/tp/tp"]["optim"])


@pytest.mark.timeout(900)
def test_a_partial_dtensor_is_refused_naming_it(sequences):
    _, by_world = sequences
    for r in (rank["partial/fsdp/partial"] for rank in by_world[2]):
        assert r["error"] and "'t'" in r["error"] and "Partial" in r["error"], r
        assert r["steps"] == []


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from resilient.ports import free_port

    port = free_port()
    phase, world, root_dir, results_dir, kind = (sys.argv[1], int(sys.argv[2]), sys.argv[3],
                                                 sys.argv[4], sys.argv[5])
    mp.start_processes(_worker, args=(phase, world, port, root_dir, results_dir, kind),
                       nprocs=world, start_method="spawn")
