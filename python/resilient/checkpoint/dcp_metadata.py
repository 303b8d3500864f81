"""DCP's ``Metadata`` as JSON, without pickle (what ``dcp-metadata.json`` of a step holds).

torch's FileSystemWriter pickles its Metadata object into ``.metadata``; resilient writes the
same information as a JSON document and rebuilds the object from a closed set of types, so
reading a checkpoint never constructs an arbitrary object:

    {"format": "resilient-dcp-metadata", "version": 1, "torch_version": "2.11.0",
     "dcp_version": "1.0.0" | null,
     "state": {"<fqn>": {"type": "tensor", "dtype": "bfloat16", "layout": "strided",
                         "requires_grad": false, "memory_format": "contiguous_format",
                         "pin_memory": false, "size": [8192, 1024],
                         "chunks": [{"offsets": [0, 0], "sizes": [4096, 1024]}, ...]},
               "<fqn>": {"type": "bytes"}},
     "planner_data": {"<fqn>": ["model", "layers", 0, "weight"]} | null,
     "storage_meta": {"checkpoint_id": "...", "save_id": "...", "load_id": null,
                      "modules": [...]} | null}

``planner_data`` is what torch's DefaultSavePlanner puts there (each flattened FQN's path in
the nested state dict: strings and integers); anything else is refused when saving. The
``storage_data`` of the Metadata (where each chunk is stored) is not written: it is the chunk's
entry name in the step's manifest, computed from the FQN and the chunk's offsets
(entry_name()). The record is one line of compact JSON followed by a line with its XXH3-64 in
hex, like ``lineage.json`` (docs/FORMAT.md).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from resilient import _C
from resilient.checkpoint.codec import dtype_from_name, dtype_name
from resilient.checkpoint.plan import piece_name
from resilient.errors import CorruptCheckpointError

FORMAT = "resilient-dcp-metadata"
VERSION = 1
FILE = "dcp-metadata.json"
_MAX_BYTES = 1 << 30

_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo,
            "sparse_csr": torch.sparse_csr}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format,
                   "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


def entry_name(index: MetadataIndex) -> str:
    """The manifest entry that stores the DCP item `index`: ``S/<fqn>#@<offsets>`` (a piece of
    the global tensor, docs/FORMAT.md); a bytes item is a uint8 piece at offset 0."""
    offset = tuple(index.offset) if index.offset is not None else (0,)
    return "S/" + piece_name(index.fqn, offset)


def _name_of(table: dict, value: Any, what: str) -> str:
    for name, v in table.items():
        if v == value:
            return name
    raise TypeError(f"DCP metadata: {what} {value!r} cannot be stored (known: {sorted(table)})")


def encode(metadata: Metadata) -> str:
    """The JSON record of `metadata` (without its storage_data). TypeError naming what cannot
    be stored without pickle (a custom planner's planner_data, an unknown storage type)."""
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            p = md.properties
            state[fqn] = {
                "type": "tensor",
                "dtype": dtype_name(p.dtype),
                "layout": _name_of(_LAYOUTS, p.layout, "layout"),
                "requires_grad": bool(p.requires_grad),
                "memory_format": _name_of(_MEMORY_FORMATS, p.memory_format, "memory format"),
                "pin_memory": bool(p.pin_memory),
                "size": [int(x) for x in md.size],
                "chunks": [{"offsets": [int(x) for x in c.offsets],
                            "sizes": [int(x) for x in c.sizes]} for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            state[fqn] = {"type": "bytes"}
        else:
            raise TypeError(f"DCP metadata of {fqn!r} is a {type(md).__name__}, which resilient "
                            "cannot store without pickle (TensorStorageMetadata and "
                            "BytesStorageMetadata can be)")
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "torch_version": torch.__version__.split("+")[0],
        "dcp_version": metadata.version if isinstance(metadata.version, str) else None,
        "state": state,
        "planner_data": _encode_planner_data(metadata.planner_data),
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
    }
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    return f"{body}\n{_C.xxh3_hex(body.encode())}\n"


def _encode_planner_data(data: Any) -> Any:
    if data is None:
        return None
    if isinstance(data, dict):
        out = {}
        for k, path in data.items():
            if (isinstance(k, str) and isinstance(path, (tuple, list))
                    and all(isinstance(c, str) or (isinstance(c, int) and not isinstance(c, bool))
                            for c in path)):
                out[k] = list(path)
            else:
                break
        else:
            return out
    raise TypeError(
        "DCP metadata: planner_data is not what DefaultSavePlanner writes (a dict of FQN -> "
        f"tuple of str/int path components), but {type(data).__name__}; resilient stores the "
        "metadata as JSON and cannot store it (use DefaultSavePlanner's planner_data)")


def _encode_storage_meta(meta: StorageMeta | None) -> Any:
    if meta is None:
        return None
    cid = meta.checkpoint_id
    return {"checkpoint_id": None if cid is None else str(cid),
            "save_id": meta.save_id, "load_id": meta.load_id,
            "modules": [str(m) for m in meta.modules]}


def decode(text: str, path: str) -> Metadata:
    """The Metadata of a record written by encode(), with storage_data mapping each chunk's
    MetadataIndex to its manifest entry name. CorruptCheckpointError naming `path` for a record
    that fails its checksum, does not parse, or holds anything but the known types."""
    try:
        body, digest = text.rstrip("\n").split("\n")
    except ValueError:
        raise CorruptCheckpointError(f"{path}: not a DCP metadata record", path=path) from None
    if _C.xxh3_hex(body.encode()) != digest:
        raise CorruptCheckpointError(f"{path}: DCP metadata checksum mismatch", path=path)
    try:
        doc = json.loads(body)
        return _decode_doc(doc)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CorruptCheckpointError(f"{path}: malformed DCP metadata: {e}", path=path) from e


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        raise ValueError(f"{what} is not a list of non-negative integers")
    return value


def _decode_doc(doc: Any) -> Metadata:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"format is not {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise ValueError(f"version {doc.get('version')!r} is not {VERSION}")
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, str] = {}
    if not isinstance(doc["state"], dict):
        raise ValueError("state is not an object")
    for fqn, md in doc["state"].items():
        kind = md.get("type") if isinstance(md, dict) else None
        if kind == "bytes":
            state[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = entry_name(MetadataIndex(fqn))
            continue
        if kind != "tensor":
            raise ValueError(f"{fqn!r}: unknown storage type {kind!r} (tensor or bytes)")
        for key in ("layout", "memory_format"):
            if md[key] not in (_LAYOUTS if key == "layout" else _MEMORY_FORMATS):
                raise ValueError(f"{fqn!r}: unknown {key} {md[key]!r}")
        if not isinstance(md["requires_grad"], bool) or not isinstance(md["pin_memory"], bool):
            raise ValueError(f"{fqn!r}: requires_grad and pin_memory must be booleans")
        size = _ints(md["size"], f"{fqn!r} size")
        chunks = []
        for c in md["chunks"]:
            offsets, sizes = _ints(c["offsets"], f"{fqn!r} chunk"), _ints(c["sizes"], f"{fqn!r}")
            if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o + s > n for o, s, n in zip(offsets, sizes, size)):
                raise ValueError(f"{fqn!r}: a chunk lies outside the tensor's size {size}")
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[MetadataIndex(fqn, offsets)] = entry_name(MetadataIndex(fqn, offsets))
        props = TensorProperties(dtype=dtype_from_name(md["dtype"]), layout=_LAYOUTS[md["layout"]],
                                 requires_grad=md["requires_grad"],
                                 memory_format=_MEMORY_FORMATS[md["memory_format"]],
                                 pin_memory=md["pin_memory"])
        state[fqn] = TensorStorageMetadata(props, torch.Size(size), chunks)
    planner = doc.get("planner_data")
    if planner is not None:
        if not isinstance(planner, dict) or not all(
                isinstance(p, list) and all(isinstance(c, (str, int)) and not isinstance(c, bool)
                                            for c in p) for p in planner.values()):
            raise ValueError("planner_data is not a map of FQN -> path components")
        planner = {k: tuple(p) for k, p in planner.items()}
    sm = doc.get("storage_meta")
    storage_meta = None
    if sm is not None:
        if not isinstance(sm, dict) or not all(
                isinstance(sm.get(k), (str, type(None))) for k in ("checkpoint_id", "save_id",
                                                                  "load_id")):
            raise ValueError("storage_meta is malformed")
        modules = sm.get("modules", [])
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise ValueError("storage_meta.modules is not a list of strings")
        storage_meta = StorageMeta(sm.get("checkpoint_id"), sm.get("save_id"), sm.get("load_id"),
                                   modules)
    version = doc.get("dcp_version")
    if version is not None and not isinstance(version, str):
        raise ValueError("dcp_version is not a string")
    return Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                    storage_meta=storage_meta, version=version)
