"""Turning training state into tensors plus a JSON document, and back, without pickle.

A state is a nested structure of dicts (plain, ordered, with any hashable plain keys), lists,
tuples (named or not), torch tensors, numpy arrays, objects with ``state_dict()`` and
``load_state_dict()`` (Stateful: modules, optimizers, schedulers) and plain values (None, bool,
int, float, str, bytes, numpy scalars). ``encode`` returns the JSON-able document, in which
tensors are references by name, and the tensors by name; ``decode`` rebuilds plain types from a
document (a named tuple as a plain tuple: a class made at load time could not be pickled).
Nothing in a checkpoint can make loading run code or import anything: unknown tags are an error
(docs/FORMAT.md lists the tags).
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from resilient import _C

if TYPE_CHECKING:
    import torch

# torch and numpy are imported where a function needs them, so that reading a checkpoint's
# documents (`resilient ckpt ls`, `show`, `verify`) does not import torch (2.5-10 s).

TENSOR, NDARRAY, TUPLE, DICT, ODICT, NAMEDTUPLE = (
    "$tensor", "$ndarray", "$tuple", "$dict", "$odict", "$namedtuple")
FLOAT, BIGINT, BYTES, NPSCALAR, STATEFUL = "$float", "$bigint", "$bytes", "$npscalar", "$stateful"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: Deepest nesting a document may have; deeper ones are rejected (a corrupt or hostile file).
MAX_DEPTH = 256


def is_stateful(obj: Any) -> bool:
    """True for objects that follow the Stateful protocol (modules, optimizers, schedulers)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint")
    return dt


@dataclass
class Encoded:
    """The result of encode(): a JSON-able document and the tensors it references by name."""

    doc: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def key_str(key: Any) -> str:
    """A dict key as one component of a '/'-joined path."""
    return str(key).replace("/", "%2F")


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and isinstance(getattr(type(obj), "_fields", None), tuple)


def encode(state: Any, state_of: Callable[[Any], Any] | None = None,
           native: bool = True) -> Encoded:
    """Encodes `state`; tensor names are the '/'-joined key paths (unique, deterministic).
    `state_of(obj)`: what a Stateful object saves (default: its ``state_dict()``).

    Runs in every save (a few thousand nodes for a large model's state and its optimizer), so
    the walk carries its path as one string and tests the common exact types first, and with
    `native` the dicts, lists, plain scalars and tensors are walked by ``_C.codec_walk`` (the
    same walk in C++, which hands every other object to this one; the same result)."""
    import numpy as np
    import torch

    out = Encoded(doc=None)
    tensors = out.tensors
    state_of = state_of or (lambda obj: obj.state_dict())
    tensor_type, ndarray = torch.Tensor, np.ndarray

    def name_for(path: str | None) -> str:
        base = path or "tensor"
        name, n = base, 1
        while name in tensors:
            n += 1
            name = f"{base}#{n}"
        return name

    def tensor(obj: torch.Tensor, path: str | None) -> dict:
        name = path or "tensor"
        if name in tensors:
            name = name_for(path)
        tensors[name] = obj
        return {TENSOR: name}

    # `path`: the '/'-join of the keys leading to a value (None at the root); `depth`: the
    # nesting of its place in the document (a JSON level each), the loader's measure, so that
    # whatever is saved can be loaded: a list or sorted dict adds 1, a tuple 2, a dict stored
    # as pairs or a named tuple 3, a Stateful or numpy scalar 1.
    def pairs(obj: dict, path: str | None, depth: int) -> list:
        # [[key, value]...]; the loop inlines the common cases (a str key, a tensor value).
        key_path = "$key" if path is None else f"{path}/$key"
        prefix = "" if path is None else f"{path}/"
        depth += 3
        inline = depth <= MAX_DEPTH
        out = []
        for k, v in obj.items():
            if type(k) is str:
                sub = prefix + k.replace("/", "%2F")
                if not _plain_str(k):
                    k = enc(k, key_path, depth)
            else:
                sub = prefix + key_str(k)
                k = enc(k, key_path, depth)
            out.append([k, tensor(v, sub) if inline and isinstance(v, tensor_type)
                        else enc(v, sub, depth)])
        return out

    def mapping(obj: dict, path: str | None, prefix: str, depth: int) -> Any:
        if not _plain_sorted(obj):  # a JSON object keeps sorted keys only
            return {DICT: pairs(obj, path, depth)}
        depth += 1
        inline = depth <= MAX_DEPTH
        out = {}
        for k, v in obj.items():  # a loop, not a comprehension: one frame less per level
            sub = prefix + (k.replace("/", "%2F") if type(k) is str else key_str(k))
            out[k] = (tensor(v, sub) if inline and isinstance(v, tensor_type)
                      else enc(v, sub, depth))
        return out

    def too_deep(path: str | None) -> ValueError:
        shown = "/".join((path or "").split("/")[:8])
        return ValueError(f"{shown}...: state nested too deeply: its checkpoint document would "
                          f"be deeper than {MAX_DEPTH} levels (a dict whose keys are not sorted "
                          "strings and a named tuple count 3, a tuple 2)")

    def tagged(tag: str, value: Any, path: str | None, depth: int) -> dict:
        # A value stored as {tag: payload}: the payload is one level deeper.
        if depth >= MAX_DEPTH:
            raise too_deep(path)
        return {tag: value}

    def enc(obj: Any, path: str | None, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise too_deep(path)
        kind = type(obj)
        if kind is str:
            obj.encode("utf-8")  # lone surrogates cannot be stored; fail here, clearly
            return obj
        if isinstance(obj, tensor_type):
            return tensor(obj, path)
        prefix = "" if path is None else f"{path}/"
        if kind is dict:
            return mapping(obj, path, prefix, depth)
        if kind is list:
            return [enc(v, f"{prefix}{i}", depth + 1) for i, v in enumerate(obj)]
        if obj is None or kind is bool:
            return obj
        if kind is int:
            return obj if _INT64_MIN <= obj <= _INT64_MAX else tagged(BIGINT, str(obj), path,
                                                                      depth)
        if kind is float:
            return obj if math.isfinite(obj) else tagged(FLOAT, repr(obj), path, depth)
        if isinstance(obj, ndarray):
            if obj.dtype.hasobject:
                raise TypeError(f"{path or '<root>'}: numpy object arrays cannot be saved "
                                "without pickle")
            name = name_for(path)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(obj))
            return {NDARRAY: name}
        if isinstance(obj, (bool, str)):  # subclasses
            if isinstance(obj, str):
                obj.encode("utf-8")
            return obj
        if isinstance(obj, np.generic):
            return {NPSCALAR: obj.dtype.str, "value": enc(obj.item(), path, depth + 1)}
        if isinstance(obj, int):
            return obj if _INT64_MIN <= obj <= _INT64_MAX else tagged(BIGINT, str(obj), path,
                                                                      depth)
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else tagged(FLOAT, repr(obj), path, depth)
        if isinstance(obj, (bytes, bytearray)):
            return tagged(BYTES, base64.b64encode(bytes(obj)).decode("ascii"), path, depth)
        if _is_namedtuple(obj):
            values = [enc(v, prefix + str(f), depth + 3) for f, v in zip(obj._fields, obj)]
            return {NAMEDTUPLE: {"name": type(obj).__name__, "fields": list(obj._fields),
                                 "values": values}}
        if isinstance(obj, tuple):
            return {TUPLE: [enc(v, f"{prefix}{i}", depth + 2) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [enc(v, f"{prefix}{i}", depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, OrderedDict):
            return {ODICT: pairs(obj, path, depth)}
        if isinstance(obj, dict):
            return mapping(obj, path, prefix, depth)
        if is_stateful(obj):
            return {STATEFUL: walk(state_of(obj), path, depth + 1)}
        raise TypeError(
            f"{path or '<root>'}: cannot save a {type(obj).__name__} without pickle; "
            "use tensors, numpy arrays, plain values, containers or objects with state_dict()"
        )

    walk = enc
    if native:  # the same walk in C++ for the common types, this one for the others

        def walk(obj: Any, path: str | None, depth: int) -> Any:
            return _C.codec_walk(obj, path, depth, tensors, tensor_type, OrderedDict, enc,
                                 MAX_DEPTH)

    out.doc = walk(state, None, 0)
    return out


def _plain_str(key: str) -> bool:
    """A str key that enc() returns as it is (one it does not need to check or tag)."""
    return key.isascii()


def _plain_sorted(obj: dict) -> bool:
    """True when every key is a str not starting with '$' and the keys are in sorted order."""
    prev = None
    for k in obj:
        if not isinstance(k, str) or k.startswith("$") or (prev is not None and k < prev):
            return False
        prev = k
    return True


def tag_of(obj: dict) -> str | None:
    """The "$" key of a tagged dict; None for a plain dict. A tagged dict holds its tag alone
    ($npscalar: and "value"); anything else is malformed."""
    tags = [k for k in obj if isinstance(k, str) and k.startswith("$")]
    if not tags:
        return None
    allowed = 2 if tags[0] == NPSCALAR and "value" in obj else 1
    if len(tags) > 1 or len(obj) != allowed:
        raise ValueError(f"malformed checkpoint values: a tagged object with keys "
                         f"{sorted(map(str, obj))[:4]}")
    return tags[0]


def hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(hashable(k) for k in key)
    if isinstance(key, dict):
        raise ValueError("malformed checkpoint values: a mapping used as a dict key")
    return key


def unwrap(doc: Any) -> Any:
    """The saved state_dict of a Stateful object stands for itself."""
    while isinstance(doc, dict) and len(doc) == 1 and STATEFUL in doc:
        doc = doc[STATEFUL]
    return doc


def dict_items(doc: dict) -> list[tuple[Any, Any]] | None:
    """(key, value document) pairs of a saved dict (plain, $dict or $odict); None otherwise."""
    tag = tag_of(doc)
    if tag is None:
        return list(doc.items())
    if tag in (DICT, ODICT):
        items = doc[tag]
        if not isinstance(items, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in items
        ):
            raise ValueError(f"malformed checkpoint values: {tag} is not a list of pairs")
        out = [(hashable(decode(k, _no_tensors)), v) for k, v in items]
        if len({k for k, _ in out}) != len(out):
            raise ValueError("malformed checkpoint values: a dict with duplicate keys")
        return out
    return None


def decode_key(key_doc: Any) -> Any:
    """A saved dict key (of a $dict or $odict pair) as the hashable key it was."""
    return hashable(decode(key_doc, _no_tensors))


def _no_tensors(kind: str, name: str) -> Any:
    raise ValueError("malformed checkpoint values: a tensor used as a dict key")


def decode(doc: Any, tensor_for: Callable[[str, str], torch.Tensor]) -> Any:
    """Rebuilds plain types from `doc` (a Stateful object's state as its plain state dict);
    `tensor_for(kind, name)` supplies each tensor. Raises ValueError for a malformed document."""

    def dec(obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"malformed checkpoint values: nested deeper than {MAX_DEPTH}")
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, list):
            return [dec(v, depth + 1) for v in obj]
        if not isinstance(obj, dict):
            raise ValueError(f"unexpected {type(obj).__name__} in checkpoint values")
        tag = tag_of(obj)
        if tag is None:
            return {k: dec(v, depth + 1) for k, v in obj.items()}
        value = obj[tag]
        if tag == TENSOR:
            return tensor_for("tensor", value)
        if tag == NDARRAY:
            return tensor_for("ndarray", value).numpy()
        if tag == TUPLE:
            return tuple(dec(v, depth + 1) for v in _list(value, tag))
        if tag in (DICT, ODICT):
            items = {k: dec(v, depth + 1) for k, v in dict_items(obj) or ()}
            return OrderedDict(items) if tag == ODICT else items
        if tag == NAMEDTUPLE:  # a named tuple target keeps its type (contract.py); here a tuple
            if not isinstance(value, dict):
                raise ValueError("malformed checkpoint values: $namedtuple")
            return tuple(dec(v, depth + 1) for v in _list(value.get("values"), tag))
        if tag == FLOAT:
            return float(value)
        if tag == BIGINT:
            return int(value)
        if tag == BYTES:
            return base64.b64decode(value, validate=True)
        if tag == NPSCALAR:
            import numpy as np

            return np.dtype(value).type(dec(obj.get("value"), depth + 1))
        if tag == STATEFUL:
            return dec(value, depth + 1)
        raise ValueError(f"unknown tag {tag!r} in checkpoint values")

    return dec(doc, 0)


def _list(value: Any, tag: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"malformed checkpoint values: {tag} holds no list")
    return value


def tensor_refs(doc: Any) -> list[str]:
    """Every tensor name a document references, in document order."""
    out: list[str] = []

    def walk(d: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ValueError(f"malformed checkpoint values: nested deeper than {MAX_DEPTH}")
        if isinstance(d, list):
            for v in d:
                walk(v, depth + 1)
        elif isinstance(d, dict):
            tag = tag_of(d)
            if tag in (TENSOR, NDARRAY):
                if not isinstance(d[tag], str):
                    raise ValueError("malformed checkpoint values: a tensor name is not a string")
                out.append(d[tag])
            else:
                for v in d.values():
                    walk(v, depth + 1)

    walk(doc, 0)
    return out
