"""Copying training state from one rank to the others over a process group, without pickle.

The source encodes the state (codec: a JSON document plus tensors), sends the document as bytes
in a uint8 tensor, and every receiver plans the load against its live state with the same
contract as a checkpoint load (contract.plan_load): Stateful objects get load_state_dict(),
tensors are received in place. The members agree that every receiver's plan fits before any
tensor moves, so a mismatch raises IncompatibleCheckpointError on every member with nothing
modified.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from resilient.checkpoint import codec, contract, views
from resilient.errors import IncompatibleCheckpointError


def broadcast_state(state: Any, src: int, group: Any = None,
                    device: torch.device | None = None) -> None:
    """Collective over `group`: makes `state` on every member equal to group rank `src`'s.
    `device`: where the collective's tensors must live (a CUDA device for NCCL; default CPU)."""
    device = device or torch.device("cpu")
    me = dist.get_rank(group)
    enc = views.encode(state) if me == src else None
    if enc is not None:
        meta = {"doc": enc.doc, "tensors": [[n, codec.dtype_name(t.dtype), list(t.shape)]
                                            for n, t in enc.tensors.items()]}
        payload = json.dumps(meta, allow_nan=False).encode()
    else:
        payload = b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, group=group, group_src=src)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if me == src
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, group=group, group_src=src)
    meta = json.loads(bytes(buf.cpu().numpy()).decode()) if me != src else meta
    shapes = {n: (dt, tuple(s)) for n, dt, s in meta["tensors"]}
    into: dict[str, torch.Tensor] = {}  # receivers: where each tensor lands
    plan = None
    problem = ""
    if me != src:
        def check(name: str, live: torch.Tensor | None, path: str,
                  like: torch.Tensor | None = None) -> str | None:
            if name not in shapes:
                return "the source sent no such tensor"
            dtype, shape = shapes[name]
            if live is None and like is not None and type(like) is torch.Tensor:
                live = torch.empty(shape, dtype=codec.dtype_from_name(dtype), device=like.device)
            why = live is not None and contract.layout_mismatch(
                (dtype, shape), (codec.dtype_name(live.dtype), live.shape), "the source",
                "this rank")
            if why:
                return why
            into[name] = live if live is not None else torch.empty(
                shape, dtype=codec.dtype_from_name(dtype))
            return None

        plan = contract.plan_load(meta["doc"], state, check)
        if plan.issues:
            problem = str(plan.issues.error(f"state broadcast from rank {src}"))
    ok = torch.tensor([0 if problem else 1], dtype=torch.int64, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not int(ok.item()):
        raise IncompatibleCheckpointError(problem or f"state broadcast from rank {src}: another "
                                          "member's state does not fit; nothing was modified")
    with torch.no_grad():
        for name, _, _ in meta["tensors"]:
            t = enc.tensors[name] if enc is not None else into[name]
            wire = t if t.device == device and t.is_contiguous() else t.detach().to(
                device).contiguous()
            dist.broadcast(wire, group=group, group_src=src)
            if wire is not t and me != src:
                t.copy_(wire)
    if plan is not None:
        plan.finish(into)
