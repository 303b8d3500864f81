"""Per-rank profile of Checkpointer.save() of FSDP2 state (diagnosis only): one process per rank
(NCCL and one GPU each with --device cuda), a few timed saves, then one save under cProfile on
every rank; prints each rank's save timings, SaveHandle.stats() and its top functions.

python benchmarks/profile_fsdp_save.py --device cuda --world 2 --model gpt-350m
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, args: argparse.Namespace, port: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from resilient.checkpoint import Checkpointer
    from resilient.cli.bench import fsdp_state
    from resilient.cli.bench.shapes import model_shapes

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world)
    mesh = init_device_mesh(args.device, (args.world,))
    model, opt = fsdp_state.build(model_shapes(args.model), torch.float32, mesh, args.device)
    lines = []
    if cuda:  # the floor: a pinned device-to-host copy of this rank's bytes (as the bench's)
        from resilient.cli.bench.methods import d2h_row

        local = fsdp_state.local_tensors(model, opt)
        nbytes = sum(t.numel() * t.element_size() for t in local.values())
        ref = d2h_row(local, nbytes, 3, before=dist.barrier)
        lines.append(f"rank {rank} d2h reference: {ref.stall_s:.4f} s for {nbytes / 2**30:.2f} GiB")
    modes = ["overlap", "blocking"] if args.mode == "both" else [args.mode]
    with Checkpointer(root, keep=1, create=True) as ck:
        state = {"model": model, "optim": opt}
        ck.save(0, state, mode=modes[0]).wait()
        for step in range(1, 1 + args.steps * len(modes)):
            mode = modes[(step - 1) // args.steps]
            ck.wait_cleanup()
            dist.barrier()
            t0 = time.perf_counter()
            h = ck.save(step, state, mode=mode)
            ret = time.perf_counter() - t0
            h.wait_snapshot()
            stall = time.perf_counter() - t0
            h.wait()
            st = {k: round(v, 4) if isinstance(v, float) else v for k, v in h.stats().items()}
            lines.append(f"rank {rank} step {step} {mode}: return {ret:.4f} s stall {stall:.4f} s "
                         f"{st}")
            if args.restore:  # as `resilient bench --fsdp` does between its timed saves
                t0 = time.perf_counter()
                ck.load(state, step=step)
                if cuda:
                    torch.cuda.synchronize()
                took = time.perf_counter() - t0
                local = fsdp_state.local_tensors(model, opt).values()
                devices = sorted({str(t.device) for t in local})
                lines.append(f"rank {rank} load: {took:.3f} s, state on {devices}")
        ck.wait_cleanup()
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        h = ck.save(99, state, mode=modes[0])
        h.wait_snapshot()
        prof.disable()
        h.wait()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumtime").print_stats(25)
    for r in range(args.world):  # one rank at a time
        if r == rank:
            print("\n".join(lines), flush=True)
            print(f"--- rank {rank} profile of one save ---\n{out.getvalue()}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="gpt-350m")
    ap.add_argument("--mode", default="overlap", help="overlap, blocking, or both")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--steps", type=int, default=3, help="timed saves per mode")
    ap.add_argument("--restore", action="store_true", help="load each step after saving it")
    args = ap.parse_args()
    from resilient.ports import free_port

    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        mp.spawn(worker, args=(args, free_port(), os.path.join(root, "ck")), nprocs=args.world)


if __name__ == "__main__":
    main()
