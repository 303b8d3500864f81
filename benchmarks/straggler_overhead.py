"""Overhead of StragglerMonitor on a small transformer training step (CPU, or CUDA with
--device cuda).

Two measurements:
  * micro: the monitor's own cost per step (step + compute + wait regions, and the every-K-steps
    summary exchange), timed over many empty steps. Divided by the real step time it gives the
    overhead fraction without the noise of timing a whole step twice.
  * A/B: the same training step with and without the monitor, in alternating blocks; the median
    step times give an end-to-end ratio (noisy on a shared host; the micro number is the bound).

The exchange is real: a one-process gloo group (TorchExchange, async all_gather) unless --local.
Run: python benchmarks/straggler_overhead.py [--device cuda] [--steps 60] [--blocks 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from resilient.straggler import LocalExchange, MonitorSettings, StragglerMonitor, TorchExchange


def make_model(device: str, d_model: int, layers: int):
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model,
                                             batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=layers).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def run_block(model, opt, x, steps: int, monitor: StragglerMonitor | None, device: str) -> list:
    times = []
    grad_sync = torch.zeros(1, device=device)
    for _ in range(steps):
        t0 = time.perf_counter()
        if monitor is not None:
            monitor.step_begin()
            monitor.compute_begin()
        loss = model(x).square().mean()
        loss.backward()
        if monitor is not None:
            monitor.compute_end()
            monitor.wait_begin()
        grad_sync += 1  # stands in for the gradient all-reduce, which is not what is measured
        if monitor is not None:
            monitor.wait_end()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.step_end()
        if device == "cuda":
            torch.cuda.synchronize()  # only to time the step itself; the monitor never syncs
        times.append(time.perf_counter() - t0)
    return times


def micro(monitor: StragglerMonitor, steps: int) -> float:
    """Seconds of monitor bookkeeping per step (no work inside the regions)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        monitor.step_begin()
        monitor.compute_begin()
        monitor.compute_end()
        monitor.wait_begin()
        monitor.wait_end()
        monitor.step_end()
    if monitor._gpu is not None:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=60, help="steps per block")
    ap.add_argument("--blocks", type=int, default=3, help="blocks per configuration")
    ap.add_argument("--micro-steps", type=int, default=20000)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--local", action="store_true", help="no gloo group (LocalExchange)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    store_dir = None
    if not args.local:
        store_dir = tempfile.mkdtemp(prefix="straggler-bench-")
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
    settings = MonitorSettings(cuda_events="on" if args.device == "cuda" else "off")

    def new_monitor() -> StragglerMonitor:
        exchange = LocalExchange() if args.local else TorchExchange()
        return StragglerMonitor(exchange, settings=settings, log_rank=-1)

    model, opt = make_model(args.device, args.d_model, args.layers)
    x = torch.randn(args.batch, args.seq, args.d_model, device=args.device)
    run_block(model, opt, x, 5, None, args.device)  # warm-up
    base, mon_times = [], []
    monitor = new_monitor()
    for _ in range(args.blocks):
        base += run_block(model, opt, x, args.steps, None, args.device)
        mon_times += run_block(model, opt, x, args.steps, monitor, args.device)
    step_s = statistics.median(base)
    with_s = statistics.median(mon_times)
    per_step = micro(new_monitor(), args.micro_steps)

    out = {
        "device": args.device,
        "model": f"TransformerEncoder d={args.d_model} layers={args.layers} "
                 f"batch={args.batch} seq={args.seq}",
        "step_ms_without": step_s * 1e3,
        "step_ms_with": with_s * 1e3,
        "ab_ratio": with_s / step_s,
        "monitor_us_per_step": per_step * 1e6,
        "overhead_fraction": per_step / step_s,
        "exchange": "LocalExchange" if args.local else "gloo TorchExchange (1 rank)",
        "windows_scored": monitor.detector.windows,
    }
    for k, v in out.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if store_dir is not None:
        dist.destroy_process_group()
        for name in os.listdir(store_dir):
            os.unlink(os.path.join(store_dir, name))
        os.rmdir(store_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
