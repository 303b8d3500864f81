"""Turning training state into tensors plus a JSON document, and back, without pickle.

A state is a nested structure of dicts, lists, tuples, torch tensors, numpy arrays, objects with
``state_dict()``/``load_state_dict()`` (Stateful: modules, optimizers, schedulers) and plain values
(None, bool, int, float, str, bytes). ``encode`` returns the JSON-able document (tensors replaced by
references) and the tensors by name; ``decode`` rebuilds the structure. Nothing in a checkpoint can
make loading run code: unknown tags are an error.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

# Tags used inside the JSON document; a plain dict whose keys start with "$" is stored as pairs.
_TENSOR, _NDARRAY, _TUPLE, _DICT, _FLOAT, _BIGINT, _BYTES, _NPSCALAR, _STATEFUL = (
    "$tensor",
    "$ndarray",
    "$tuple",
    "$dict",
    "$float",
    "$bigint",
    "$bytes",
    "$npscalar",
    "$stateful",
)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def is_stateful(obj: Any) -> bool:
    """True for objects that follow the Stateful protocol (modules, optimizers, schedulers)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint")
    return dt


@dataclass
class Encoded:
    """The result of encode(): a JSON-able document and the tensors it references by name."""

    doc: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _key_str(key: Any) -> str:
    return str(key).replace("/", "%2F")


def encode(state: Any) -> Encoded:
    """Encodes `state`; tensor names are the '/'-joined key paths (unique, deterministic)."""
    out = Encoded(doc=None)

    def name_for(path: tuple[str, ...]) -> str:
        base = "/".join(path) or "tensor"
        name, n = base, 1
        while name in out.tensors:
            n += 1
            name = f"{base}#{n}"
        return name

    def enc(obj: Any, path: tuple[str, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            name = name_for(path)
            out.tensors[name] = obj
            return {_TENSOR: name}
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError(
                    f"{'/'.join(path)}: numpy object arrays cannot be saved without pickle"
                )
            name = name_for(path)
            out.tensors[name] = torch.from_numpy(np.ascontiguousarray(obj))
            return {_NDARRAY: name}
        if obj is None or isinstance(obj, (bool, str)):
            if isinstance(obj, str):
                obj.encode("utf-8")  # lone surrogates cannot be stored; fail here, clearly
            return obj
        if isinstance(obj, np.generic):
            return {_NPSCALAR: obj.dtype.str, "value": enc(obj.item(), path)}
        if isinstance(obj, int):
            return obj if _INT64_MIN <= obj <= _INT64_MAX else {_BIGINT: str(obj)}
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}
        if isinstance(obj, (bytes, bytearray)):
            return {_BYTES: base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, tuple):
            return {_TUPLE: [enc(v, (*path, str(i))) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [enc(v, (*path, str(i))) for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in obj):
                return {k: enc(v, (*path, _key_str(k))) for k, v in obj.items()}
            return {
                _DICT: [
                    [enc(k, (*path, "$key")), enc(v, (*path, _key_str(k)))] for k, v in obj.items()
                ]
            }
        if is_stateful(obj):
            return {_STATEFUL: enc(obj.state_dict(), path)}
        raise TypeError(
            f"{'/'.join(path) or '<root>'}: cannot save a {type(obj).__name__} without pickle; "
            "use tensors, numpy arrays, plain values, containers or objects with state_dict()"
        )

    out.doc = enc(state, ())
    return out


def decode(doc: Any, tensor_for: Callable[[str, str], torch.Tensor]) -> Any:
    """Rebuilds a structure from `doc`; `tensor_for(kind, name)` supplies each tensor."""

    def dec(obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        if not isinstance(obj, dict):
            raise ValueError(f"unexpected {type(obj).__name__} in checkpoint values")
        tag = _tag(obj)
        if tag == _TENSOR:
            return tensor_for("tensor", obj[_TENSOR])
        if tag == _NDARRAY:
            return tensor_for("ndarray", obj[_NDARRAY]).numpy()
        if tag == _TUPLE:
            return tuple(dec(v) for v in obj[_TUPLE])
        if tag == _DICT:
            return {_hashable(dec(k)): dec(v) for k, v in obj[_DICT]}
        if tag == _FLOAT:
            return float(obj[_FLOAT])
        if tag == _BIGINT:
            return int(obj[_BIGINT])
        if tag == _BYTES:
            return base64.b64decode(obj[_BYTES], validate=True)
        if tag == _NPSCALAR:
            return np.dtype(obj[_NPSCALAR]).type(dec(obj["value"]))
        if tag == _STATEFUL:
            return StatefulState(dec(obj[_STATEFUL]))
        if tag is not None:
            raise ValueError(f"unknown tag {tag!r} in checkpoint values")
        return {k: dec(v) for k, v in obj.items()}

    return dec(doc)


def _tag(obj: dict) -> str | None:
    """The one "$" key of a tagged dict; None for a plain dict. Several tags are malformed."""
    tags = [k for k in obj if isinstance(k, str) and k.startswith("$")]
    if len(tags) > 1:
        raise ValueError(f"malformed checkpoint values: several tags {tags[:3]}")
    return tags[0] if tags else None


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key


@dataclass
class StatefulState:
    """The saved state_dict of a Stateful object, to be passed to its load_state_dict()."""

    state_dict: Any


def tensor_paths(doc: Any, target: Any) -> dict[str, Any]:
    """Maps each tensor name in `doc` to the object at the same place in `target` (or None)."""
    found: dict[str, Any] = {}

    def walk(d: Any, t: Any) -> None:
        if isinstance(d, list):
            for i, v in enumerate(d):
                walk(v, t[i] if isinstance(t, (list, tuple)) and i < len(t) else None)
            return
        if not isinstance(d, dict):
            return
        tag = _tag(d)
        if tag in (_TENSOR, _NDARRAY):
            found[d[tag]] = t
        elif tag == _TUPLE:
            walk(d[_TUPLE], t)
        elif tag == _DICT:
            for k, v in d[_DICT]:
                key = _hashable(decode(k, lambda kind, name: None))
                walk(v, t.get(key) if isinstance(t, dict) else None)
        elif tag == _STATEFUL:
            walk(d[_STATEFUL], t.state_dict() if is_stateful(t) else None)
        elif tag is None:
            for k, v in d.items():
                walk(v, t.get(k) if isinstance(t, dict) else None)

    walk(doc, target)
    return found
