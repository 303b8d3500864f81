"""`ckpt diff`: two steps compared tensor by tensor (bitwise, then how far apart) and by
their non-tensor values."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from resilient.checkpoint import codec
from resilient.checkpoint.catalog import BATCH_BYTES, Progress, StepReader, no_progress, placeholder


@dataclass
class TensorDiff:
    name: str
    status: str  # "equal", "differs", "only_a", "only_b", "mismatch" (dtype or shape)
    detail: str = ""
    max_abs_diff: float | None = None
    differing: int | None = None  # elements that differ
    numel: int | None = None


def diff_steps(root_a: str, root_b: str, step_a: int | None = None, step_b: int | None = None,
               progress: Progress = no_progress) -> dict[str, Any]:
    """Compares two steps tensor by tensor (bitwise: NaNs in the same places are equal) and
    their non-tensor values. Returns {"a", "b", "tensors": [TensorDiff...], "values": [...]}."""
    with StepReader(root_a, step_a) as ra, StepReader(root_b, step_b) as rb:
        la, lb = ra.logical, rb.logical
        out: list[TensorDiff] = []
        common = []
        for n in la:
            if n not in lb:
                out.append(TensorDiff(n, "only_a"))
            elif (la[n].dtype, la[n].shape) != (lb[n].dtype, lb[n].shape):
                out.append(TensorDiff(n, "mismatch", f"{la[n].dtype}{list(la[n].shape)} vs "
                                                     f"{lb[n].dtype}{list(lb[n].shape)}"))
            else:
                common.append(n)
        out += [TensorDiff(n, "only_b") for n in lb if n not in la]
        it_b = rb.iter_tensors(common, batch_bytes=BATCH_BYTES // 2)
        for name, ta in ra.iter_tensors(common, progress, batch_bytes=BATCH_BYTES // 2):
            name_b, tb = next(it_b)
            assert name_b == name
            out.append(compare(name, ta, tb))
        values = _value_diffs(ra.state_doc, rb.state_doc)
        return {"a": {"root": os.path.abspath(root_a), "step": ra.step},
                "b": {"root": os.path.abspath(root_b), "step": rb.step},
                "tensors": out, "values": values}


def compare(name: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    """Bitwise equality, then how far apart: elements that differ, largest absolute difference
    (in float64; for complex, of the modulus)."""
    if a.numel() == 0 or torch.equal(_bits(a), _bits(b)):
        return TensorDiff(name, "equal", numel=a.numel())
    ab, bb = _bits(a).reshape(a.numel(), -1), _bits(b).reshape(b.numel(), -1)
    differing = int((ab != bb).any(dim=1).sum())
    try:
        da, db = a.to(torch.complex128 if a.is_complex() else torch.float64), b.to(
            torch.complex128 if b.is_complex() else torch.float64)
        d = (da - db).abs()
        d = torch.where(torch.isnan(d), torch.tensor(math.inf, dtype=d.dtype), d)
        max_abs = float(d.max())
    except (RuntimeError, TypeError):  # dtypes torch cannot convert (some float8 kinds)
        max_abs = None
    return TensorDiff(name, "differs", max_abs_diff=max_abs, differing=differing,
                      numel=a.numel())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs with the same payload are equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and (
        a.numel() == 0 or torch.equal(_bits(a), _bits(b)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _value_diffs(a: Any, b: Any, path: str = "") -> list[dict[str, Any]]:
    """Non-tensor values that differ between two state documents, by path."""
    out: list[dict[str, Any]] = []
    ia = codec.dict_items(codec.unwrap(a)) if isinstance(codec.unwrap(a), dict) else None
    ib = codec.dict_items(codec.unwrap(b)) if isinstance(codec.unwrap(b), dict) else None
    if ia is not None and ib is not None:
        da, db = dict(ia), dict(ib)
        for k in list(da) + [k for k in db if k not in da]:
            p = f"{path}/{k}" if path else str(k)
            if k not in db or k not in da:
                out.append({"path": p, "a": _plain(da.get(k)), "b": _plain(db.get(k))})
            else:
                out += _value_diffs(da[k], db[k], p)
        return out
    ua, ub = codec.unwrap(a), codec.unwrap(b)
    if isinstance(ua, list) and isinstance(ub, list) and len(ua) == len(ub):
        for i, (x, y) in enumerate(zip(ua, ub)):
            out += _value_diffs(x, y, f"{path}/{i}")
        return out
    if codec.tensor_refs(ua) and codec.tensor_refs(ub):
        return out  # tensors are compared as tensors
    if ua != ub:
        out.append({"path": path or "<state>", "a": _plain(ua), "b": _plain(ub)})
    return out


def _plain(doc: Any) -> Any:
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    refs = codec.tensor_refs(doc)
    if refs:
        return f"<{len(refs)} tensors>"
    return codec.decode(doc, placeholder) if not isinstance(doc, list) else doc
