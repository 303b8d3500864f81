"""Where the training-loop overhead of overlapped saves comes from (issue 3, GPU only).

Runs the bench's transformer in blocks of --every steps. Each round runs one block per mode, in
a shuffled order; every block starts with nothing in flight and is timed from its start (the
save call included) to the training stream's end after its last step (copies still running on
other streams then are counted as "late"). Modes:
  none  no save;
  call  the Python part of save() only (state walk, descriptors), nothing copied;
  d2h   torch copies of the same tensors into pinned buffers on a side stream, with a device
        fence before optimizer.step() (the device side of an overlapped save, no engine);
  d2h_nofence  the same copies without the fence (what the copies cost by themselves);
  d2d   copies into spare device memory first, fenced, then device-to-host from there,
        unfenced;
  host  the engine saving a host copy of the same state from a helper thread (memcpy into the
        pool, checksums, io_uring writes: the host side of a save, no GPU work);
  full  Checkpointer.save(mode="overlap"), what the bench's training row measures.
Prints and writes (--json) each mode's block times and its ratio to the "none" block of the
same round (median, bootstrap 90% interval).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time

import torch

from resilient.checkpoint import Checkpointer, tensor_descriptor
from resilient.checkpoint.codec import encode
from resilient.cli.bench.training import _model, _steps


def clocks() -> str:
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError as e:
        return str(e)


def trace_block(mode: str, start, run) -> dict:
    """One block under the CUDA profiler: the GPU's kernel time, how much of the block's span
    kernels covered, and kernel time while device-to-host copies ran."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        finish = start(mode, 5000)
        run()
        finish()
    path = f"{tempfile.gettempdir()}/trace-{mode}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    os.unlink(path)
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    busy, end = 0.0, 0.0
    for a, b in kernels:  # union of kernel intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    out = {"kernels": len(kernels), "kernel_sum_ms": sum(b - a for a, b in kernels) / 1e3,
           "busy_ms": busy / 1e3, "span_ms": (max(b for _, b in kernels) - kernels[0][0]) / 1e3,
           "d2h_copies": len(copies)}
    if copies:
        lo, hi = min(a for a, _ in copies), max(b for _, b in copies)
        inside = [(a, b) for a, b in kernels if a >= lo and b <= hi]
        out["copy_window_ms"] = (hi - lo) / 1e3
        out["kernels_in_copy_window"] = len(inside)
        out["kernel_sum_in_copy_window_ms"] = sum(b - a for a, b in inside) / 1e3
        first = next(a for a, _ in kernels if a >= lo)
        out["first_kernel_after_copy_start_ms"] = (first - lo) / 1e3
        # Host side: when the first kernel after the copies was launched, and how long the
        # launch call took (a launch that blocks would delay the kernel on the host's side).
        launches = sorted((e["ts"], e["dur"]) for e in events if e.get("cat") == "cuda_runtime"
                          and e.get("name", "").startswith("cudaLaunchKernel") and e["ts"] > lo)
        issues = [e["ts"] + e["dur"] for e in events if e.get("cat") == "cuda_runtime"
                  and e.get("name", "").startswith("cudaMemcpyAsync")]
        if launches:
            out["first_launch_after_copy_start_ms"] = (launches[0][0] - lo) / 1e3
            out["launch_call_max_ms"] = max(d for _, d in launches[:200]) / 1e3
        if issues:
            out["copies_issued_by_ms"] = (max(issues) - lo) / 1e3
    print(f"trace {mode}: {out}", flush=True)
    print("CUDA_DEVICE_MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--modes", default="none,call,d2h,host,full")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json")
    ap.add_argument("--trace", action="store_true",
                    help="also profile one block of each mode and compare kernel time and gaps")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "none" not in modes or args.batch < 2:
        ap.error("--modes must include none (the baseline) and --batch must be at least 2")
    torch.manual_seed(0)
    model = _model("cuda")
    x = torch.randn(args.batch, 512, 1024, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    _steps(model, opt, x, 10)
    state = {"model": model, "optim": opt}
    report: dict = {"clocks_start": clocks(), "batch": args.batch, "every": args.every}

    # Is the loop bound by the host (kernel launches) or by the GPU? Time per step against batch.
    scale = {}
    for b in (args.batch // 2, args.batch, args.batch * 2):
        xb = torch.randn(b, 512, 1024, device="cuda")
        _steps(model, opt, xb, 5)
        scale[b] = min(_steps(model, opt, xb, 20) for _ in range(3))
    report["step_s_by_batch"] = scale
    # Host time to queue one block (the CPU's share) vs its wall time.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.every):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    queued = time.perf_counter() - t0
    torch.cuda.synchronize()
    report["queue_s_per_step"] = queued / args.every
    report["wall_s_per_step"] = (time.perf_counter() - t0) / args.every
    print(f"step by batch {scale}; queue {queued / args.every * 1e3:.2f} ms/step, "
          f"wall {report['wall_s_per_step'] * 1e3:.2f} ms/step", flush=True)

    tensors = encode(state).tensors
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in tensors.items()}
    host_state = {k: t.detach().cpu() for k, t in tensors.items()}
    spare = {k: torch.empty_like(t) for k, t in tensors.items()} if "d2d" in modes else {}
    side = torch.cuda.Stream()
    fence_event: list = []
    copy_ms: dict[str, list[float]] = {}

    def timed_copies(mode: str, fenced: bool):
        side.wait_stream(torch.cuda.current_stream())
        begin, fence_at, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        with torch.cuda.stream(side):
            begin.record(side)
            for k, t in encode(state).tensors.items():
                (spare if mode == "d2d" else pinned)[k].copy_(t, non_blocking=True)
            fence_at.record(side)
            if mode == "d2d":
                for k, t in spare.items():
                    pinned[k].copy_(t, non_blocking=True)
            end.record(side)
        if fenced:
            fence_event.append(fence_at)

        def finish():
            end.synchronize()
            copy_ms.setdefault(mode, []).append(begin.elapsed_time(end))
            if mode == "d2d":
                copy_ms.setdefault("d2d_fenced_part", []).append(begin.elapsed_time(fence_at))
        return finish

    def pre_step(*_):
        if fence_event:
            torch.cuda.current_stream().wait_event(fence_event.pop())

    opt.register_step_pre_hook(pre_step)
    ckpt = Checkpointer(f"{args.dir}/attr-full", keep=2)
    ckpt.attach(opt)
    ckpt_host = Checkpointer(f"{args.dir}/attr-host", keep=2)
    ckpt.save(0, state).wait()
    ckpt_host.save(0, host_state).wait()

    def start(mode: str, tag: int):
        if mode == "none":
            return lambda: None
        if mode == "call":
            enc = encode(state)
            keep: list = []
            streams: dict = {}
            [tensor_descriptor(n, t, keep, streams) for n, t in enc.tensors.items()]
            return lambda: None
        if mode in ("d2h", "d2h_nofence", "d2d"):
            return timed_copies(mode, fenced=mode != "d2h_nofence")
        if mode == "host":
            th = threading.Thread(target=lambda: ckpt_host.save(tag, host_state).wait())
            th.start()
            return th.join
        if mode == "full":
            h = ckpt.save(tag, state, mode="overlap")

            def finish():
                h.wait()
                copy_ms.setdefault("full_snapshot", []).append(h.stats()["snapshot_s"] * 1e3)
            return finish
        raise ValueError(mode)

    torch.cuda.synchronize()
    timed_copies("idle", fenced=False)()  # the copies on an idle GPU
    fence_event.clear()
    times: dict[str, list[float]] = {m: [] for m in modes}
    late: dict[str, int] = {m: 0 for m in modes}
    rng = random.Random(1)
    for r in range(args.rounds):
        order = modes[:]
        rng.shuffle(order)
        for m in order:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            finish = start(m, 1000 + r)
            _steps(model, opt, x, args.every)
            times[m].append((time.perf_counter() - t0) / args.every)
            t1 = time.perf_counter()
            finish()
            if time.perf_counter() - t1 > 0.005:
                late[m] += 1  # background work outlived the block: its cost is underestimated
    if args.trace:
        report["trace"] = {m: trace_block(m, start, lambda: _steps(model, opt, x, args.every))
                           for m in modes}
    ckpt.close()
    ckpt_host.close()
    report["clocks_end"] = clocks()
    report["times"] = times
    report["late"] = late
    report["copy_ms"] = copy_ms
    for m, v in copy_ms.items():
        print(f"copies {m}: {statistics.median(v):.1f} ms (median of {len(v)})", flush=True)
    rows = {}
    for m in modes:
        paired = [a / b for a, b in zip(times[m], times["none"])]
        boot = sorted(statistics.median(rng.choices(paired, k=len(paired))) for _ in range(2000))
        rows[m] = {"median_ms": statistics.median(times[m]) * 1e3,
                   "ratio": statistics.median(paired), "ci90": [boot[100], boot[1899]],
                   "late": late[m]}
        print(f"{m:<5} {rows[m]['median_ms']:6.2f} ms/step  ratio {rows[m]['ratio']:.4f} "
              f"ci90 {boot[100]:.4f}-{boot[1899]:.4f}  late {late[m]}", flush=True)
    report["rows"] = rows
    print(report["clocks_start"], "|", report["clocks_end"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
