"""DTensor state (FSDP2, HSDP, tensor parallel): each rank saves and loads its local chunk.

A DTensor's global shape and this rank's chunk of it (offsets and sizes) come from its mesh and
placements, through the chunk list torch.distributed.checkpoint's planner also uses
(``DTensor.__create_chunk_list__``). The chunk becomes a ShardSpec, so the rest of the engine
treats it like a Megatron-style slice: chunks replicated over a mesh dimension (HSDP, Replicate)
are written once in total, spread over their holders; a load reads the saved bytes that overlap
the target chunk, whatever the mesh was at save time. Partial placements (pending reductions)
hold no savable value and are refused, naming the tensor.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from resilient.checkpoint.plan import ShardSpec


def is_dtensor(t: Any) -> bool:
    """True for a torch.distributed.tensor.DTensor."""
    # Importing torch.distributed.tensor takes most of a second (it pulls in sympy); a process
    # that never imported it holds no DTensor.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


# Chunk lists by placement spec (mesh, placements, global shape and stride, dtype): the same for
# every DTensor of that spec in this process. module.state_dict() hands out a new detached
# DTensor per parameter per save, so a cache on the object missed for every parameter.
_BY_SPEC: dict[Any, list] = {}


def _chunk_list(t: Any) -> list:
    """t.__create_chunk_list__() (torch builds it in Python: milliseconds per save for hundreds
    of sharded tensors), computed once per placement spec."""
    spec = getattr(t, "_spec", None)
    # Meshes compare equal by their layout alone, but the chunk depends on this process's place
    # in the mesh, which changes when a rebuilt group orders the same processes differently.
    key = (spec, tuple(t.device_mesh.get_coordinate() or ())) if spec is not None else None
    try:
        hit = _BY_SPEC.get(key) if key is not None else None
    except TypeError:  # an unhashable spec: no cache
        key, hit = None, None
    if hit is not None:
        return hit
    chunks = t.__create_chunk_list__()
    if key is not None:
        if len(_BY_SPEC) > 100_000:
            _BY_SPEC.clear()
        _BY_SPEC[key] = chunks
    return chunks


def local_tensor(t: Any) -> torch.Tensor:
    """t.to_local() without its autograd Function (tens of microseconds per call, per DTensor
    per save): the local tensor DTensor holds (torch.distributed.checkpoint reads it too)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def why_not_local(t: Any) -> str | None:
    """Why the DTensor `t` has no single local chunk resilient can read or write, or None."""
    mesh_type = t.device_mesh.device_type
    if mesh_type not in ("cpu", "cuda"):
        return (f"a DTensor on a {mesh_type!r} device mesh; resilient reads and writes DTensors "
                "on cpu and cuda meshes")
    partial = [str(p) for p in t.placements if p.is_partial()]
    if partial:
        return (f"a DTensor with a Partial placement ({', '.join(partial)}): its value is a "
                "pending reduction; reduce it (full_tensor() or redistribute to Replicate) "
                "before saving")
    chunks = _chunk_list(t)
    if len(chunks) != 1:
        return f"a DTensor whose local data is {len(chunks)} chunks of the global tensor"
    local = local_tensor(t)
    if tuple(local.shape) != tuple(chunks[0].sizes):
        return (f"a DTensor whose local tensor {list(local.shape)} differs from its chunk "
                f"{list(chunks[0].sizes)} (a padded or strided layout this version cannot map)")
    return None


# local_chunk's answer by placement spec object: id(spec) -> (spec, why_not_local, place,
# replicated). The spec is held, so its id is not reused while cached. A parameter keeps its spec
# object from save to save (module.state_dict(keep_vars=True) hands out the parameters
# themselves), and hashing a spec for _BY_SPEC costs microseconds per DTensor per save.
_BY_SPEC_OBJECT: dict[int, tuple[Any, str | None, ShardSpec | None, bool]] = {}


def local_chunk(t: Any) -> tuple[torch.Tensor, ShardSpec]:
    """(this rank's local tensor, sharing the DTensor's storage; its place in the global tensor).
    ValueError naming why for a DTensor that has no single local chunk."""
    local, place, _ = local_chunk_info(t)
    return local, place


def local_chunk_info(t: Any) -> tuple[torch.Tensor, ShardSpec, bool]:
    """local_chunk(t), and whether other ranks hold the same chunk (a Replicate placement)."""
    local = local_tensor(t)
    spec = getattr(t, "_spec", None)
    hit = _BY_SPEC_OBJECT.get(id(spec)) if spec is not None else None
    if hit is None or hit[0] is not spec or (hit[2] is not None
                                             and tuple(local.shape) != hit[2].shape):
        why = why_not_local(t)
        place = None
        if why is None:
            chunk = _chunk_list(t)[0]
            place = ShardSpec(tuple(int(x) for x in t.shape),
                              tuple(int(x) for x in chunk.offsets),
                              tuple(int(x) for x in chunk.sizes))
        replicated = any(p.is_replicate() for p in t.placements)
        if spec is not None:
            if len(_BY_SPEC_OBJECT) > 1 << 14:
                _BY_SPEC_OBJECT.clear()
            _BY_SPEC_OBJECT[id(spec)] = (spec, why, place, replicated)
    else:
        _, why, place, replicated = hit
    if why is not None:
        raise ValueError(why)
    return (local.detach() if local.requires_grad else local), place, replicated


def storage_ptr(t: torch.Tensor) -> int:
    """The data pointer of `t`, or of its local tensor for a DTensor."""
    return local_tensor(t).data_ptr() if is_dtensor(t) else t.data_ptr()


__all__ = ["is_dtensor", "local_chunk", "local_chunk_info", "local_tensor", "storage_ptr",
           "why_not_local"]
