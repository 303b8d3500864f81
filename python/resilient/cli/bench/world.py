"""`resilient bench --world-size N`: N CPU processes (gloo), or with ``--device cuda`` one per GPU
(NCCL), holding the same replicated state, as DDP ranks do. Compares, in one run:

- ``sharded``: resilient's Checkpointer (collective), every rank writing ~1/N, one global commit;
  restore: every rank reads what it needs from the shared directory;
- ``sharded_redist``: the same save; restore reads each shard once and broadcasts it (gloo);
- ``sharded_shm``: the same save; restore reads each piece once per host into a /dev/shm
  buffer the host's ranks share (restore="shared");
- ``every_rank``: every rank writes the whole state with its own Checkpointer (N copies);
- ``dcp``: torch.distributed.checkpoint save/load (deduplicated across ranks by its planner).

Save time runs from a barrier until every rank's save is committed (durable); restore time from a
barrier until every rank holds the whole state again, after zeroing it and dropping the page cache
where allowed (untimed, every restore is then checked against the saved state's block sums).
Write bandwidth is bytes written to storage / save time; restore bandwidth is bytes delivered to
all ranks (N x state) / restore time. After every restore, one raw reader (rank 0, io_uring
O_DIRECT, cache dropped) reads a file of the state's size written at the start: `x_raw_paired`
is the median over repeats of the checkpoint's bytes counted once over the restore time against
that read's bandwidth, so that the disk's drift over a run (on the GPU machines' disks 1.6-2.2
GB/s within 20 minutes) does not enter the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from resilient.ports import free_port

WORLD_METHODS = ["sharded", "sharded_redist", "sharded_shm", "every_rank", "dcp"]
_RESTORE = {"sharded": "direct", "sharded_redist": "redistribute", "sharded_shm": "shared"}


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path` (what a save put on storage), leaving out earlier steps
    that retention is still deleting in the background (`.trash-*`)."""
    def kept(f: Path) -> bool:
        return f.is_file() and not any(p.startswith(".trash-") for p in f.relative_to(path).parts)

    return sum(f.stat().st_size for f in path.rglob("*") if kept(f))


def spawn(worker: Callable[..., None], nprocs: int, args: tuple) -> None:
    """Runs worker(rank, *args) in `nprocs` fresh processes and waits for all of them; raises
    if one fails (torch.multiprocessing's ProcessRaisedException names the rank)."""
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=args, nprocs=nprocs, start_method="spawn")


def barrier_timed(fn: Callable[[], Any]) -> float:
    """Seconds from a barrier (every rank starts together) until every rank finished `fn`."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from resilient import _C
    from resilient.checkpoint import Checkpointer
    from resilient.cli.bench.methods import drop_cache
    from resilient.cli.bench.shapes import make_state, synthetic_shapes

    torch.set_num_threads(1)
    hosts = max(1, min(world, getattr(args, "hosts", 1)))
    if hosts > 1:  # emulated hosts: consecutive ranks share one (the shared restore's unit)
        os.environ["RESILIENT_HOST_ID"] = f"bench-host-{rank * hosts // world}"
    # As torchrun sets them: a rank's share of the host's CPUs (the restore's reader and copy
    # threads) follows from its host's rank count.
    per_host = -(-world // hosts)
    os.environ.update(LOCAL_WORLD_SIZE=str(per_host), LOCAL_RANK=str(rank % per_host))
    device = "cpu"
    kwargs: dict[str, Any] = {}
    if getattr(args, "device", "cpu") == "cuda":  # one GPU per rank, NCCL (the exchange's path)
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(torch.device(device))
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group("nccl" if device != "cpu" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            **kwargs)
    dtype = getattr(torch, args.dtype)
    shapes = synthetic_shapes(_C.parse_bytes(args.size), args.tensors, dtype)
    torch.manual_seed(0)  # replicated state: the same bytes on every rank (check_replicas)
    state = make_state(shapes, dtype, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    from resilient.checkpoint.device_share import digest

    def sums() -> list[list[int]]:
        return [digest(t.reshape(-1).view(torch.uint8)).tolist() for t in state.values()]

    expect = sums()  # every restore must bring these back: the targets are zeroed before it

    def zero_then_cold(path: Path) -> None:
        for t in state.values():
            t.zero_()
        cold(path)

    root = Path(args.dir)
    rows: dict[str, Any] = {}
    methods = [m.strip() for m in args.world_methods.split(",") if m.strip()]

    def cold(path: Path) -> None:
        if rank == 0:
            drop_cache(path)
        dist.barrier()

    request = _C.parse_bytes(getattr(args, "request_bytes", "16MiB"))
    depth = getattr(args, "queue_depth", 8)
    paired = root / "raw-paired" / "raw.bin"  # read after every restore: the disk's speed then
    if rank == 0:
        paired.parent.mkdir(parents=True, exist_ok=True)
        _C.raw_write(str(paired), nbytes, request_bytes=request, queue_depth=depth)

    def raw_now() -> float:
        """Rank 0 reads the paired file cold; every rank gets its GB/s."""
        got = [0.0]
        if rank == 0:
            drop_cache(paired)
            r = _C.raw_read(str(paired), request_bytes=request, queue_depth=depth)
            got[0] = nbytes / r["seconds"] / 1e9
        dist.broadcast_object_list(got, src=0)
        return got[0]

    for method in methods:
        d = root / method
        saves, loads, written, read, phases, raws = [], [], 0, 0, {}, []
        for i in range(args.repeat):
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
            dist.barrier()
            if method.startswith("sharded"):
                ck = Checkpointer(d, keep=1, restore=_RESTORE[method])
                saves.append(barrier_timed(lambda ck=ck, i=i: ck.save(i + 1, state).wait()))
                zero_then_cold(d)
                loads.append(barrier_timed(lambda ck=ck: ck.load(state)))
                read, phases = ck.last_load.bytes_read, ck.last_load.seconds
                ck.close()
            elif method == "every_rank":
                ck = Checkpointer(d / f"rank{rank}", keep=1, distributed=False)
                saves.append(barrier_timed(lambda ck=ck, i=i: ck.save(i + 1, state).wait()))
                zero_then_cold(d)
                loads.append(barrier_timed(lambda ck=ck: ck.load(state)))
                ck.close()
            else:
                import torch.distributed.checkpoint as dcp

                saves.append(barrier_timed(lambda d=d: dcp.save(state, checkpoint_id=str(d))))
                zero_then_cold(d)
                loads.append(barrier_timed(lambda d=d: dcp.load(state, checkpoint_id=str(d))))
            if sums() != expect:
                raise RuntimeError(f"{method}: rank {rank}'s state after the restore differs "
                                   "from what was saved")
            raws.append(raw_now())
            if rank == 0:
                written = dir_bytes(d)
        save_s, load_s = statistics.median(saves), statistics.median(loads)
        rows[method] = {
            "method": method,
            "state_bytes": nbytes,
            "written_bytes": written,
            "save_s": round(save_s, 4),
            "write_gbps": round(written / save_s / 1e9, 3),
            "restore_s": round(load_s, 4),
            "restore_gbps": round(world * nbytes / load_s / 1e9, 3),
            "save_all_s": [round(x, 4) for x in saves],  # every repeat, in order
            "restore_all_s": [round(x, 4) for x in loads],
            "raw_paired_gbps": [round(x, 3) for x in raws],  # read right after each restore
            "x_raw_paired": round(statistics.median(
                nbytes / t / 1e9 / g for t, g in zip(loads, raws)), 3),
        }
        if read:  # resilient's own count of the bytes its restore read from storage (all ranks)
            rows[method]["storage_read_bytes"] = read
            rows[method]["storage_read_gbps"] = round(read / load_s / 1e9, 3)
        every: list[Any] = [None] * world  # every rank's phases: where the slowest one waited
        dist.all_gather_object(every, phases)
        if phases:  # rank 0's phases of its last restore, then every rank's
            rows[method]["restore_phases_s"] = phases
            rows[method]["restore_phases_by_rank_s"] = every
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    if rank == 0:  # the storage limit in the same run: one reader, the checkpoint's bytes
        from resilient.cli.bench.methods import raw_row

        shutil.rmtree(paired.parent, ignore_errors=True)
        d = root / "raw"
        d.mkdir(parents=True, exist_ok=True)
        raw = raw_row(nbytes, d, request, depth, args.repeat)
        shutil.rmtree(d, ignore_errors=True)
        rows["raw"] = {"method": "raw (1 reader)", "state_bytes": nbytes, "written_bytes": nbytes,
                       "save_s": round(raw.durable_s, 4), "write_gbps": raw.write_gbps,
                       "restore_s": round(nbytes / 1e9 / raw.restore_gbps, 4),
                       "restore_gbps": raw.restore_gbps, "storage_read_bytes": nbytes,
                       "storage_read_gbps": raw.restore_gbps}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(list(rows.values())))


def run_world_bench(args: argparse.Namespace) -> int:
    """Runs the multi-process comparison and prints a table (or JSON with --json)."""
    world = int(args.world_size)
    if not hasattr(args, "world_methods"):
        args.world_methods = ",".join(WORLD_METHODS)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    out = root / "world-results.json"
    port = free_port()
    load_before = os.getloadavg()
    started = time.time()
    try:
        spawn(_worker, world, (world, port, args, str(out)))
        rows = json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "world_size": world,
        "hosts": max(1, min(world, getattr(args, "hosts", 1))),
        "size": args.size,
        "tensors": args.tensors,
        "dtype": args.dtype,
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.time() - started, 1),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(
        f"world size {world} on {result['hosts']} host(s), state {args.size} "
        f"({args.tensors} tensors, {args.dtype}) per rank, "
        f"{result['cpus']} CPUs, load average {result['loadavg_before']} -> "
        f"{result['loadavg_after']}",
        file=sys.stdout,
    )
    print(
        f"{'method':<16}{'written MiB':>12}{'save s':>9}{'write GB/s':>12}"
        f"{'restore s':>11}{'restore GB/s':>14}{'read MiB':>10}"
    )
    for r in rows:
        read = r.get("storage_read_bytes")
        print(
            f"{r['method']:<16}{r['written_bytes'] / 2**20:>12.1f}{r['save_s']:>9.3f}"
            f"{r['write_gbps']:>12.3f}{r['restore_s']:>11.3f}{r['restore_gbps']:>14.3f}"
            f"{'-' if read is None else f'{read / 2**20:.1f}':>10}"
        )
    raw = next((r for r in rows if r["method"].startswith("raw")), None)
    if raw and raw["restore_gbps"]:  # the checkpoint's bytes counted once, against one reader
        for r in rows:
            if r is not raw and r["restore_s"]:
                once = r["state_bytes"] / r["restore_s"] / 1e9
                print(f"{r['method']}: {once:.3f} GB/s for the bytes counted once, "
                      f"{once / raw['restore_gbps']:.2f}x raw, "
                      f"{r['x_raw_paired']:.2f}x the raw read after each restore (median)")
    return 0
