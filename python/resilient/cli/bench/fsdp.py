"""`resilient bench --fsdp`: FSDP2-sharded training state (a model's parameter shapes plus AdamW
state, fsdp_state.py) saved by N processes, one rank each (gloo on CPU; NCCL and one GPU per rank
with --device cuda), and restored on the same mesh and onto N/2 ranks, in one run:

- ``resilient``: Checkpointer.save({"model": module, "optim": optimizer}), mode "blocking";
- ``resilient_overlap``: the same in mode "overlap" (the stall ends at wait_snapshot());
- ``dcp``: torch.distributed.checkpoint.save of get_state_dict(module, optimizer);
- ``dcp_async``: dcp.async_save with torch's DefaultStager (pinned on CUDA), one per save (see
  _Dcp.save for why not one for all);
- ``dcp_resilient``, ``dcp_resilient_async`` (only when named in --methods): the same DCP calls
  through resilient.dcp's ResilientStorageWriter/Reader (one writer for all saves, keep=1) and,
  for async_save, its ResilientStager bound to the writer (one, reused: it stages into the
  engine's pool); ``dcp_resilient_async_own``: an unbound ResilientStager instead (buffers of
  its own, which the engine copies again: the baseline for staging into the pool).

Each method saves once to warm up, then --repeat times, each save followed by a same-mesh restore.
A second job of N/2 processes then builds its own FSDP2 module and optimizer on a half-size mesh
and restores each method's last checkpoint into it --repeat times (resharding; DCP: get_state_dict
of the half mesh, dcp.load, set_state_dict). Before every restore the state is zeroed and the
page cache dropped; after it every rank checks every value of its chunks (fsdp_state.verify).

Seconds (all ranks start together after a barrier; medians over the repeats):
  return_s   the save call (slowest rank)
  stall_s    until the training thread may modify the state again (slowest rank; every rank's
             in stall_s_per_rank)
  durable_s  until the checkpoint is committed on storage on every rank
  write_gbps all ranks' bytes / (durable_s - stall_s): storage throughput once staged (dcp.save
             stages nothing apart from writing: / durable_s)
  restore_s, reshard_s  until every rank of N (N/2) holds its restored shards
The reference row copies each rank's bytes on every rank at once: a single-threaded memcpy on
CPU, a pinned device-to-host copy on CUDA (methods.memcpy_row, d2h_row); the stall goal is
measured against it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

FSDP_METHODS = ["resilient", "resilient_overlap", "dcp", "dcp_async"]
# resilient.dcp, on request
DCP_BACKEND_METHODS = ["dcp_resilient", "dcp_resilient_async", "dcp_resilient_async_own"]
STAGED = {"resilient", "resilient_overlap", "dcp_async", "dcp_resilient_async",
          "dcp_resilient_async_own"}


def _now() -> float:
    return time.perf_counter()


class _Resilient:
    def __init__(self, root: Path, mode: str, options: dict[str, Any], device: str):
        from resilient.checkpoint import Checkpointer

        self.ck = Checkpointer(root, keep=1, create=True, **options)
        self.mode, self.device = mode, device
        self.notes: dict[str, Any] = {"io": self.ck.io_backend}

    def settle(self) -> None:
        """Before the barrier that starts a timed save: the previous step's deletion (rank 0's
        retention) is not timed, DCP's neither. Called after that barrier it would be: every
        other rank would wait for rank 0 inside its save's first collective."""
        self.ck.wait_cleanup()

    def save(self, step: int, model: Any, opt: Any) -> tuple[float, float, float, float | None]:
        t0 = _now()
        h = self.ck.save(step, {"model": model, "optim": opt}, mode=self.mode)
        ret = _now() - t0
        h.wait_snapshot()
        stall = _now() - t0
        h.wait()
        return ret, stall, _now() - t0, h.stats()["snapshot_s"]

    def restore(self, step: int, model: Any, opt: Any) -> float:
        t0 = _now()
        self.ck.load({"model": model, "optim": opt}, step=step)
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        return _now() - t0

    def close(self) -> None:
        self.ck.close()


class _Dcp:
    def __init__(self, root: Path, use_async: bool, device: str, group: Any,
                 backend: bool = False, own_stager: bool = False):
        from resilient.cli.bench.methods import dcp_stager

        self.root, self.device, self.group = root, device, group
        self.notes: dict[str, Any] = {}
        self.use_async = use_async
        self._stager = dcp_stager
        self._writer: Any = None
        if backend:  # resilient.dcp: <root>/step-<N> is step N of the root
            from resilient.dcp import ResilientStager, ResilientStorageWriter

            self._writer = ResilientStorageWriter(root, keep=1)
            stager = ResilientStager() if own_stager else ResilientStager(self._writer)
            self._stager = lambda device, notes: stager

    def _state(self, model: Any, opt: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def settle(self) -> None:
        """Nothing to wait for: the bench deletes DCP's previous step itself, untimed."""

    def save(self, step: int, model: Any, opt: Any) -> tuple[float, float, float, float | None]:
        import torch.distributed.checkpoint as dcp

        path = str(self.root / f"step-{step}")
        t0 = _now()
        sd = self._state(model, opt)
        kw = {} if self._writer is None else {"storage_writer": self._writer}
        if not self.use_async:
            dcp.save(sd, checkpoint_id=path, process_group=self.group, **kw)
            s = _now() - t0
            return s, s, s, None
        # A DefaultStager per save: torch 2.11's stage() closes its StateDictStager (clearing
        # its copier table and storage cache), so a reused one fails on its second save with
        # KeyError: <class 'type'> and would allocate afresh anyway.
        stager = self._stager(self.device, self.notes)
        try:
            resp = dcp.async_save(sd, checkpoint_id=path, process_group=self.group,
                                  async_stager=stager, **kw)
            ret = _now() - t0
            if hasattr(resp, "staging_completion"):
                resp.staging_completion.result()
                stall = _now() - t0
                resp.upload_completion.result()
            else:  # a torch without staging futures: the call stages
                stall = ret
                resp.result()
            return ret, stall, _now() - t0, None
        finally:
            if stager is not None and hasattr(stager, "close") and self._writer is None:
                stager.close()

    def restore(self, step: int, model: Any, opt: Any) -> float:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        t0 = _now()
        sd = self._state(model, opt)
        kw = {}
        if self._writer is not None:
            from resilient.dcp import ResilientStorageReader

            kw["storage_reader"] = ResilientStorageReader(self.root)
        dcp.load(sd, checkpoint_id=str(self.root / f"step-{step}"), process_group=self.group,
                 **kw)
        self.notes["load_only_s"] = _now() - t0  # dcp.load without the set_state_dict below
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if self.device == "cuda":
            torch.cuda.synchronize()
        return _now() - t0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _method(name: str, root: Path, args: argparse.Namespace, group: Any) -> Any:
    if name.startswith("resilient"):
        from resilient import _C

        options = {"request_bytes": _C.parse_bytes(args.request_bytes),
                   "queue_depth": args.queue_depth, "zstd_level": args.zstd_level}
        mode = "overlap" if name == "resilient_overlap" else "blocking"
        return _Resilient(root, mode, options, args.device)
    return _Dcp(root, "_async" in name, args.device, group, name.startswith("dcp_res"),
                name.endswith("_own"))


def _worker(rank: int, phase: str, world: int, port: int, args: argparse.Namespace,
            out: str) -> None:
    """One rank of the save job (phase "save", N ranks) or the reshard job (N/2 ranks)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from resilient.cli.bench import fsdp_state
    from resilient.cli.bench.methods import d2h_row, drop_cache, memcpy_row
    from resilient.cli.bench.shapes import model_shapes

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")  # barriers, gathers and DCP's collectives
    mesh = init_device_mesh(args.device, (world,))
    model, opt = fsdp_state.build(model_shapes(args.model), getattr(torch, args.dtype), mesh,
                                  args.device)
    local = fsdp_state.local_tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in local.values())
    root = Path(args.dir)
    methods = [m for m in args.methods.split(",") if m]
    mine: dict[str, Any] = {"bytes": nbytes, "methods": {}}

    def barrier() -> None:
        dist.barrier(group=group)

    def cold() -> str:
        how = drop_cache(root) if rank == 0 else ""
        barrier()
        return how

    def restore_checked(m: Any, step: int) -> dict[str, Any]:
        fsdp_state.clobber(model, opt)
        how = cold()
        seconds = m.restore(step, model, opt)
        return {"s": seconds, "bad": fsdp_state.verify(model, opt)[:5], "cache": how}

    if phase == "save":
        ref = (d2h_row if cuda else memcpy_row)(local, nbytes, args.repeat, before=barrier)
        mine["reference"] = {"method": ref.method, "s": ref.stall_s}
    del local
    for name in methods:
        d = root / name
        if phase == "save" and rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        barrier()
        m = _method(name, d, args, group)
        rec: dict[str, Any] = {"saves": [], "restores": []}
        try:
            if phase == "save":
                m.save(0, model, opt)  # warm-up: pools and stagers are allocated once
                for step in range(1, args.repeat + 1):
                    m.settle()
                    barrier()
                    rec["saves"].append(m.save(step, model, opt))
                    rec["restores"].append(restore_checked(m, step))
                    barrier()
                    if rank == 0 and isinstance(m, _Dcp):  # keep=1, as the Checkpointer's
                        shutil.rmtree(d / f"step-{step - 1}", ignore_errors=True)
                if rank == 0:
                    from resilient.cli.bench.world import dir_bytes

                    rec["written_bytes"] = dir_bytes(d)
            else:
                for _ in range(args.repeat):
                    barrier()
                    rec["restores"].append(restore_checked(m, args.repeat))
        except Exception as e:  # one method's failure (torch's own, too) is its row's result
            rec["error"] = f"rank {rank}: {type(e).__name__}: {str(e)[:400]}"
        finally:
            m.close()
        rec["notes"] = dict(m.notes)
        mine["methods"][name] = rec
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    barrier()
    dist.destroy_process_group()


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(save_ranks: list[dict], reshard_ranks: list[dict] | None,
              methods: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(reference row, one row per method) from every rank's records of both jobs."""
    total = sum(r["bytes"] for r in save_ranks)
    ref_per_rank = [r["reference"]["s"] for r in save_ranks]
    reference = {"method": save_ranks[0]["reference"]["method"], "stall_s": max(ref_per_rank),
                 "stall_s_per_rank": ref_per_rank}
    rows = []
    for name in methods:
        recs = [r["methods"][name] for r in save_ranks]
        failed = [rec["error"] for rec in recs if "error" in rec]
        if failed:
            rows.append({"method": name, "error": failed[0], "restore_verified": None,
                         "reshard_verified": None, "mismatches": [], "notes": {},
                         **{c: None for c in ("return_s", "stall_s", "durable_s", "write_gbps",
                                              "restore_s", "restore_gbps", "reshard_s",
                                              "reshard_gbps")}})
            continue
        repeats = len(recs[0]["saves"])
        ret = [_med([rec["saves"][i][0] for i in range(repeats)]) for rec in recs]
        stall = [_med([rec["saves"][i][1] for i in range(repeats)]) for rec in recs]
        durable = _med([max(rec["saves"][i][2] for rec in recs) for i in range(repeats)])
        restore = _med([max(rec["restores"][i]["s"] for rec in recs) for i in range(repeats)])
        write_s = durable - max(stall) if name in STAGED else durable
        native = [rec["saves"][i][3] for rec in recs for i in range(repeats)]
        bad = sorted({b for rec in recs for x in rec["restores"] for b in x["bad"]})
        row: dict[str, Any] = {
            "method": name, "return_s": max(ret), "stall_s": max(stall),
            "stall_s_per_rank": stall, "return_s_per_rank": ret, "durable_s": durable,
            "write_gbps": total / write_s / 1e9 if write_s > 0 else None,
            "restore_s": restore, "restore_gbps": total / restore / 1e9,
            "reshard_s": None, "reshard_gbps": None, "restore_verified": not bad,
            "reshard_verified": None, "mismatches": bad,
            "notes": {**recs[0]["notes"], "written_bytes": recs[0].get("written_bytes"),
                      # the engine's own snapshot time (the rest of the stall is Python:
                      # state_dict, DTensor chunk lists, the collectives that plan the save)
                      "native_snapshot_s": (max(_med([rec["saves"][i][3] for i in range(repeats)])
                                                for rec in recs) if None not in native else None),
                      "cache": recs[0]["restores"][-1]["cache"], "repeats": repeats},
        }
        rr = [r["methods"][name] for r in reshard_ranks] if reshard_ranks is not None else []
        if any("error" in x for x in rr):
            row["reshard_verified"] = False
            row["mismatches"].append("reshard failed: " + next(x["error"] for x in rr
                                                                if "error" in x))
        elif rr:
            n = len(rr[0]["restores"])
            row["reshard_s"] = _med([max(x["restores"][i]["s"] for x in rr) for i in range(n)])
            row["reshard_gbps"] = total / row["reshard_s"] / 1e9
            rbad = sorted({b for x in rr for y in x["restores"] for b in y["bad"]})
            row["reshard_verified"] = not rbad
            row["mismatches"] += [f"reshard: {b}" for b in rbad]
            if "load_only_s" in rr[0]["notes"]:
                row["notes"]["reshard_load_only_s"] = rr[0]["notes"]["load_only_s"]
        rows.append(row)
    return reference, rows


def goals(reference: dict, rows: list[dict], device: str) -> list[dict[str, Any]]:
    """Issue 15's goals as ratios measured in this run (value <= target is met)."""
    out: list[dict[str, Any]] = []
    by = {r["method"]: r for r in rows}
    ref = reference["stall_s_per_rank"]

    def add(goal: str, value: float | None, target: float, note: str = "") -> None:
        met = None if value is None else value <= target
        out.append({"goal": goal, "value": value, "target": f"<= {target}", "met": met,
                    "note": note})

    res, ov = by.get("resilient"), by.get("resilient_overlap")
    if res:
        add(f"resilient stall / {reference['method']}, worst rank",
            max(s / r for s, r in zip(res["stall_s_per_rank"], ref)), 1.15)
    if ov:
        note = ("" if device == "cuda" else
                "host tensors have no device copy to overlap: the call copies them")
        add(f"resilient_overlap return / {reference['method']}, worst rank",
            max(s / r for s, r in zip(ov["return_s_per_rank"], ref)), 0.10, note)
    for other in ("dcp", "dcp_async"):
        o = by.get(other)
        if not (res and o):
            continue
        for key in ("durable_s", "restore_s", "reshard_s"):
            v = res[key] / o[key] if res[key] and o[key] else None
            add(f"resilient {key.removesuffix('_s')} / {other}'s (< 1: ahead)", v, 1.0)
    for name, other in (("dcp_resilient", "dcp"), ("dcp_resilient_async", "dcp_async")):
        b, o = by.get(name), by.get(other)
        for key in ("durable_s", "restore_s", "reshard_s") if b and o else ():
            v = b[key] / o[key] if b[key] and o[key] else None
            add(f"{name} {key.removesuffix('_s')} / {other}'s (< 1: ahead)", v, 1.0)
    if res and res["reshard_s"] and res["restore_s"]:
        add("resilient reshard / same-mesh restore", res["reshard_s"] / res["restore_s"], 1.2)
    return out


def run_fsdp_bench(args: argparse.Namespace) -> int:
    """Runs both jobs and prints a table (or JSON with --json)."""
    import torch

    from resilient.cli.bench.world import spawn
    from resilient.ports import free_port

    if args.world_size is None:
        args.world_size = 4 if args.device == "cpu" else torch.cuda.device_count()
    world = int(args.world_size)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(FSDP_METHODS) - set(DCP_BACKEND_METHODS)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if unknown or world < 1:
        print(f"error: unknown methods {sorted(unknown)} (--fsdp runs {','.join(FSDP_METHODS)})"
              if unknown else "error: --world-size must be at least 1", file=sys.stderr)
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < world:
        print(f"error: --device cuda --world-size {world} needs {world} GPUs, "
              f"found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    args.methods = ",".join(methods)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    half = world // 2
    skipped = None if half else "world size 1 has no half mesh (run with --world-size 2 or more)"
    load_before = os.getloadavg()
    started = time.time()
    try:
        spawn(_worker, world, ("save", world, free_port(), args, str(root / "save.json")))
        save_ranks = json.loads((root / "save.json").read_text())
        reshard_ranks = None
        if half:
            spawn(_worker, half, ("reshard", half, free_port(), args, str(root / "half.json")))
            reshard_ranks = json.loads((root / "half.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    reference, rows = summarize(save_ranks, reshard_ranks, methods)
    result = {
        "mode": "fsdp", "model": args.model, "dtype": args.dtype, "device": args.device,
        "world_size": world, "reshard_world_size": half or None, "reshard_skipped": skipped,
        "bytes": sum(r["bytes"] for r in save_ranks),
        "bytes_per_rank": [r["bytes"] for r in save_ranks],
        "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - started, 1),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "reference": reference, "rows": rows,
    }
    result["goals"] = goals(reference, rows, args.device)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)
    # a baseline's own failure (torch's) is reported in its row; resilient's fails the run
    def ok(r: dict) -> bool:
        if "error" in r:
            return "resilient" not in r["method"]
        return bool(r["restore_verified"]) and r["reshard_verified"] is not False

    return 0 if all(ok(r) for r in rows) else 1


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def print_table(result: dict) -> None:
    ref = result["reference"]
    print(f"resilient bench --fsdp: {result['model']} + AdamW ({result['dtype']}), "
          f"{result['bytes'] / 2**30:.2f} GiB over {result['world_size']} ranks "
          f"({result['device']}), torch {result['torch']}, {result['date']}, load average "
          f"{result['loadavg_before']} -> {result['loadavg_after']}")
    print(f"reference {ref['method']}: {ref['stall_s']:.3f} s on the slowest rank "
          f"({', '.join(f'{s:.3f}' for s in ref['stall_s_per_rank'])})")
    cols = ["return_s", "stall_s", "durable_s", "write_gbps", "restore_s", "reshard_s"]
    print(f"{'method':>23} " + " ".join(f"{c:>10}" for c in cols) + "  verified")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['method']:>23} FAILED: {r['error'][:200]}")
            continue
        ok = "yes" if r["restore_verified"] and r["reshard_verified"] is not False else (
            "NO: " + ", ".join(r["mismatches"][:3]))
        print(f"{r['method']:>23} " + " ".join(f"{_fmt(r[c]):>10}" for c in cols) + f"  {ok}")
    if result["reshard_skipped"]:
        print(f"reshard skipped: {result['reshard_skipped']}")
    else:
        print(f"reshard: restored onto {result['reshard_world_size']} ranks")
    print("goals (this run):")
    for g in result["goals"]:
        mark = {True: "met", False: "MISSED", None: "-"}[g["met"]]
        note = f"  ({g['note']})" if g["note"] else ""
        print(f"  {g['goal']:<52} {_fmt(g['value']):>7}  target {g['target']:<7} {mark}{note}")
