"""A small transformer training loop timed with and without overlapped checkpoints: the cost a
training job sees when it saves every N steps (N as small as the storage allows: each checkpoint
is durable before the next begins)."""

from __future__ import annotations

import math
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from resilient.cli.bench.methods import Row


def _model(device: str) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(
        d_model=1024, nhead=16, dim_feedforward=4096, batch_first=True, dropout=0.0
    )
    return torch.nn.TransformerEncoder(layer, num_layers=8, enable_nested_tensor=False).to(device)


def _step(model, opt, x) -> None:
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(x: torch.Tensor) -> None:
    """Waits for the training stream, as a loop's ``loss.item()`` does. Not the whole device:
    ``torch.cuda.synchronize()`` also waits for the checkpoint's copy streams, which serialises
    an overlapped snapshot with the next steps (it cost 2-9% per save block on the H100)."""
    if x.is_cuda:
        torch.cuda.current_stream(x.device).synchronize()


def _steps(model, opt, x, n: int, on_step: Callable[[int], None] | None = None) -> float:
    """Runs n steps; returns seconds per step (the training stream synchronised at the ends)."""
    _sync(x)
    t0 = time.perf_counter()
    for i in range(n):
        _step(model, opt, x)
        if on_step:
            on_step(i)
    _sync(x)
    return (time.perf_counter() - t0) / n


def _diagnose(ckpt, model, opt, x, state) -> dict:
    """Where a save's cost lands: the save call, the fence before optimizer.step(), and the
    first steps after the save (each synchronised, so only for diagnosis)."""
    fence: list[float] = []
    wait = ckpt.fence

    def timed_wait():
        t0 = time.perf_counter()
        wait()
        fence.append(time.perf_counter() - t0)

    ckpt.fence = timed_wait
    try:
        _sync(x)
        t0 = time.perf_counter()
        h = ckpt.save(999_999, state, mode="overlap")
        call = time.perf_counter() - t0
        steps = [_steps(model, opt, x, 1) for _ in range(8)]
        h.wait()
        after = [_steps(model, opt, x, 1) for _ in range(4)]
    finally:
        ckpt.fence = wait
    return {
        "diag_save_call_ms": call * 1e3,
        "diag_fence_ms": sum(fence) * 1e3,
        "diag_steps_after_save_ms": [round(v * 1e3, 2) for v in steps],
        "diag_steps_idle_ms": [round(v * 1e3, 2) for v in after],
    }


def train_row(root: Path, device: str, steps: int = 100, rounds: int = 30, progress_fn=print,
              model: torch.nn.Module | None = None, x: torch.Tensor | None = None,
              batch: int = 64) -> Row:
    """The training-loop row: the transformer on ``batch`` sequences of 512 tokens per step.

    ``batch`` sets whether the loop is bound by the GPU, as training at scale is, or by the
    host's Python and kernel launches: on an H100 the step time is flat from batch 4 to 16
    (19-20 ms, the host's pace), and such a loop's step time drifts by +-20% between blocks on a
    VM, far more than the 2% to be resolved. The row reports ``host_step_s``, the step time at
    batch 1 (an upper bound on the host's pace), next to the step time. ``model`` and ``x``
    replace the transformer and its batch, which also lifts the CUDA requirement (the unit tests
    run a small model on the CPU)."""
    from resilient.checkpoint import Checkpointer

    if model is None and device != "cuda":
        raise RuntimeError("the training-loop row needs --device cuda")
    torch.manual_seed(0)
    if model is None:
        model = _model(device)
        x = torch.randn(batch, 512, 1024, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    _steps(model, opt, x, 10)  # warm-up, creates optimizer state
    one = x[:1]  # a batch of one: about the host's pace (an upper bound: the GPU's part is small)
    _steps(model, opt, one, 3)
    host_step = min(_steps(model, opt, one, max(3, steps // 4)) for _ in range(3))
    state = {"model": model, "optim": opt}
    with Checkpointer(root, keep=2) as ckpt:
        ckpt.attach(opt)
        ckpt.save(0, state).wait()  # allocates the pool once
        base = _steps(model, opt, x, steps)
        # The smallest interval: how many training steps pass while a checkpoint becomes durable
        # with training running, over three back-to-back checkpoints (the disk slows under
        # sustained writes), plus a 30% margin.
        counts = []
        for k in range(3):
            h = ckpt.save(1 + k, state, mode="overlap")
            n = 0
            while not h.done():
                _steps(model, opt, x, 1)
                n += 1
            h.wait()
            counts.append(n)
        every = max(1, math.ceil(max(counts) * 1.3))
        progress_fn(
            f"step {base * 1e3:.1f} ms (batch of one: {host_step * 1e3:.1f} ms); checkpoints "
            f"became durable within {counts} steps: saving every {every} steps"
        )
        # Pairs of blocks of `every` steps, one without and one with an overlapped save at its
        # start, in alternating order (ABBA), so drift of clocks and neighbours hits both sides.
        late = 0
        without: list[float] = []
        with_save: list[float] = []
        h = None

        def block_without() -> float:
            nonlocal late
            if h is not None and not h.done():
                late += 1  # a save still running must not leak into a block without saves
                h.wait()
            return _steps(model, opt, x, every)

        def block_with(tag: int) -> float:
            nonlocal h, late
            if h is not None and not h.done():
                late += 1  # the disk is slower than the interval: wait (counted in the step time)
            t0 = time.perf_counter()
            if h is not None:
                h.wait()
            h = ckpt.save(tag, state, mode="overlap")
            _steps(model, opt, x, every)
            return (time.perf_counter() - t0) / every  # the save call counts too

        for r in range(rounds):
            if r % 2 == 0:
                without.append(block_without())
                with_save.append(block_with(100 + r))
            else:
                with_save.append(block_with(100 + r))
                without.append(block_without())
        h.wait()
        stats = h.stats()
        diag = _diagnose(ckpt, model, opt, x, state)
    base = statistics.median(without)
    with_saves = statistics.median(with_save)
    # Each block with a save against the block without just before it: the step time drifts by
    # several percent over a run (clocks, other tenants), which pairs of neighbours cancel.
    paired = [w / wo for w, wo in zip(with_save, without)]
    rng = random.Random(0)  # bootstrap: how well the median of these pairs is known
    medians = sorted(statistics.median(rng.choices(paired, k=len(paired))) for _ in range(2000))
    return Row(
        "train_overlap",
        notes={
            "every": every,
            "calibration_steps": counts,
            "step_s": base,
            "batch": x.shape[0],
            "host_step_s": host_step,
            "step_with_saves_s": with_saves,
            "step_ratio": statistics.median(paired),
            "step_ratio_of_medians": with_saves / base,
            "step_ratios_paired": [round(v, 4) for v in paired],
            "step_ratio_ci90": [medians[100], medians[1899]],
            "rounds": rounds,
            "late_checkpoints": late,
            "checkpoint_bytes": stats["bytes"],
            "durable_s": stats["durable_s"],
            "params": sum(p.numel() for p in model.parameters()),
            **diag,
        },
    )
