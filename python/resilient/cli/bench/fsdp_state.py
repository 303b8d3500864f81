"""The training state `resilient bench --fsdp` saves: a module with a model's parameter shapes,
FSDP2-sharded over a 1-D mesh, and AdamW with its state materialized.

Every value is a function of its tensor's name and its position in the *global* tensor (a
multiplicative hash of the linear index, scaled to a value the dtype holds exactly), so any rank
of any mesh can check the chunk it holds without the saver's copy: a restore that misses,
misplaces or truncates a chunk fails `verify`.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from resilient.checkpoint.dtensor import is_dtensor, local_chunk

STEP = 7.0  # the optimizer step every saved state holds (a restore must bring it back)
_BITS = {torch.float32: 24, torch.float64: 24, torch.bfloat16: 8, torch.float16: 11}
_BLOCK = 1 << 22  # elements generated at once (bounds the int64 scratch)


def shape_module(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> torch.nn.Module:
    """A module tree whose parameters have `shapes` (dotted names become submodules), on the
    meta device: nothing is allocated until FSDP2 has sharded it."""
    root = torch.nn.Module()
    with torch.device("meta"):
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=dtype)))
    return root


def build(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, mesh: Any,
          device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """(FSDP2 module, AdamW) over `mesh`: each transformer layer and the root fully_shard-ed as
    FSDP2 training does, parameters materialized on `device` shard by shard, one optimizer step
    with zero gradients to create exp_avg/exp_avg_sq, then every value set by `fill`."""
    from torch.distributed.fsdp import fully_shard

    model = shape_module(shapes, dtype)
    for name, child in model.named_modules():
        if re.fullmatch(r"layers\.\d+", name):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    fill(model, opt)
    return model, opt


def leaves(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Iterator[tuple[str, Any]]:
    """(key, tensor) for every parameter and optimizer state tensor, keyed by FQN. Walked afresh
    each time: a load may replace the optimizer's state tensors."""
    for fqn, p in model.named_parameters():
        yield f"param/{fqn}", p
        for k, v in sorted(opt.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                yield f"{k}/{fqn}", v


def _local(t: Any) -> tuple[torch.Tensor, tuple, tuple]:
    """(local tensor, global shape, offset of the local chunk)."""
    if is_dtensor(t):
        local, spec = local_chunk(t)
        return local, tuple(spec.global_shape), tuple(spec.offset)
    t = t.detach()
    return t, tuple(t.shape), (0,) * t.dim()


def local_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's bytes: every leaf's local chunk (what the reference copy row copies)."""
    return {k: _local(t)[0] for k, t in leaves(model, opt)}


def _blocks(key: str, local: torch.Tensor, gshape: tuple,
            offset: tuple) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(slice of `local`, the values it must hold), a block of rows at a time."""
    if local.dim() == 0:
        yield local, torch.full((), STEP, dtype=local.dtype, device=local.device)
        return
    bits = _BITS[local.dtype]
    seed = zlib.crc32(key.encode())
    row = max(1, local[0].numel()) if local.shape[0] else 1
    step = max(1, _BLOCK // row)
    for r0 in range(0, local.shape[0], step):
        part = local[r0 : r0 + step]
        idx = torch.zeros((), dtype=torch.int64, device=local.device)
        stride = 1
        for d in reversed(range(local.dim())):
            start = offset[d] + (r0 if d == 0 else 0)
            r = torch.arange(start, start + part.shape[d], dtype=torch.int64, device=local.device)
            idx = idx + (r * stride).view([-1] + [1] * (local.dim() - 1 - d))
            stride *= gshape[d]
        k = (idx * 2654435761 + seed) & ((1 << bits) - 1)
        yield part, (k.to(torch.float32) * 2.0**-bits).to(local.dtype)


def fill(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Sets every local value to what its global position should hold."""
    with torch.no_grad():
        for key, t in leaves(model, opt):
            for part, want in _blocks(key, *_local(t)):
                part.copy_(want)


def clobber(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Zeroes every local value (before a restore, so a restore that skips anything shows)."""
    with torch.no_grad():
        for _, t in leaves(model, opt):
            _local(t)[0].zero_()


def verify(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Keys whose local chunk differs from what it should hold (empty: all equal, bit for bit),
    or a note when the optimizer holds no state at all."""
    bad, n = [], 0
    for key, t in leaves(model, opt):
        n += key.startswith("exp_avg/")
        if any(not torch.equal(part, want) for part, want in _blocks(key, *_local(t))):
            bad.append(key)
    return bad if n else [*bad, "optimizer state missing"]
