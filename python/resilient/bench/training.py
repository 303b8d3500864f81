"""A small transformer training loop timed with and without overlapped checkpoints: the cost a
training job sees when it saves every N steps (N as small as the storage allows: each checkpoint
is durable before the next begins)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch

from resilient.bench.methods import Row


def _model(device: str) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(d_model=1024, nhead=16, dim_feedforward=4096,
                                             batch_first=True, dropout=0.0)
    return torch.nn.TransformerEncoder(layer, num_layers=8, enable_nested_tensor=False).to(device)


def _steps(model, opt, x, n: int, on_step: Callable[[int], None] | None = None) -> float:
    """Runs n steps; returns seconds per step (device-synchronised at the ends only)."""
    torch.cuda.synchronize() if x.is_cuda else None
    t0 = time.perf_counter()
    for i in range(n):
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step:
            on_step(i)
    torch.cuda.synchronize() if x.is_cuda else None
    return (time.perf_counter() - t0) / n


def train_row(root: Path, device: str, steps: int = 200, progress_fn=print) -> Row:
    from resilient.checkpoint import Checkpointer

    if device != "cuda":
        raise RuntimeError("the training-loop row needs --device cuda")
    torch.manual_seed(0)
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(8, 512, 1024, device=device)
    _steps(model, opt, x, 10)  # warm-up, creates optimizer state
    state = {"model": model, "optim": opt}
    with Checkpointer(root, keep=2) as ckpt:
        ckpt.attach(opt)
        # How long a checkpoint takes to become durable decides the smallest interval.
        ckpt.save(0, state).wait()
        h = ckpt.save(1, state, mode="overlap")
        h.wait()
        durable = h.stats()["durable_s"]
        base = _steps(model, opt, x, steps)
        every = max(1, math.ceil(durable * 1.25 / base))
        progress_fn(f"step {base * 1e3:.1f} ms, checkpoint durable in {durable:.2f} s: saving every {every} steps")
        pending: list = []

        def maybe_save(i: int) -> None:
            if i % every == every - 1:
                if pending and not pending[-1].done():
                    raise RuntimeError("previous checkpoint not durable before the next one: interval too small")
                pending.append(ckpt.save(100 + i, state, mode="overlap"))

        with_saves = _steps(model, opt, x, steps, maybe_save)
        for h in pending:
            h.wait()
        nbytes = h.stats()["bytes"]
        base2 = _steps(model, opt, x, steps)  # bracket: the baseline before and after
    baseline = min(base, base2)
    return Row("train_overlap", notes={
        "every": every, "step_s": baseline, "step_with_saves_s": with_saves, "step_ratio": with_saves / baseline,
        "checkpoints": len(pending), "checkpoint_bytes": nbytes, "durable_s": durable,
        "params": sum(p.numel() for p in model.parameters()),
    })
