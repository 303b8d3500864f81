"""Reading what `resilient ckpt import` takes in (safetensors files and directories, torch.save
files, DCP directories) without running code from them, and without dropping or substituting
a tensor (docs/SECURITY.md, "The import path").

* safetensors: a JSON header and raw bytes, read by the safetensors library. A directory with
  ``model.safetensors.index.json`` is read exactly as the index says, as Hugging Face reads it:
  each key from the file the index names for it. A key in two files, a key a file holds but the
  index does not give to that file, or one the index names but its file lacks, is an error.
  Without an index every ``*.safetensors`` file is read and a key in two of them is an error.
* torch.save files: ``torch.load(weights_only=True)``, torch's restricted unpickler.
* DCP directories: ``.metadata`` is unpickled by an unpickler that resolves only the classes of
  DCP's metadata (Metadata, its storage records, torch.Size, dtypes, layouts, paths; no
  function but torch's layout lookup), then checked field by field. A tensor item is the byte
  range of one ``.distcp`` file that ``torch.load(weights_only=True)`` reads, as DCP reads it.
  A bytes item (a non-tensor value) is unpickled with no global resolved but OrderedDict, set,
  frozenset, bytearray and bytes: numbers, strings, bytes, None and containers of them come
  back; anything that names another class or a function is refused, naming the key. DCP's
  own reader would call ``torch.load(weights_only=False)``, which runs whatever the pickle
  says.
* Every file a source names (index entries, DCP's relative paths) must be a regular file inside
  the source directory.

Every reader returns a Source: the tensors and the state as loaded, and the export record
(docs/FORMAT.md, "resilient-export/1") when the source is a whole-state resilient export.
Malformed input is a ValueError naming the file (OSError where the file system failed).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from resilient.checkpoint import codec

META_KEY = "_resilient"  # the export record's key in torch / DCP exports and safetensors metadata
INDEX = "model.safetensors.index.json"
#: Largest JSON index or DCP .metadata read (a hostile file must not exhaust memory first).
MAX_METADATA_BYTES = 1 << 30


@dataclass
class Source:
    """What a source holds: `tensors` by logical name (a record's names, or the flattened
    state's), `loaded` the state as loaded (without the record), `record` the export record
    of a resilient whole-state export (a dict, not yet checked), else None."""

    record: dict | None
    tensors: dict[str, torch.Tensor]
    loaded: Any


def read(src: str, fmt: str) -> Source:
    """The source at `src` in format `fmt` ("safetensors", "torch" or "dcp")."""
    if fmt == "safetensors":
        return read_safetensors(src)
    if fmt == "torch":
        try:
            loaded = torch.load(src, map_location="cpu", weights_only=True)
        except OSError:
            raise
        except Exception as e:  # an unpickling refusal or a damaged file: say which
            raise ValueError(f"{src}: cannot be read as a torch.save file with "
                             f"weights_only=True ({type(e).__name__}: {e})") from None
        return _split_record(src, loaded)
    return _split_record(src, read_dcp(src))


def _split_record(src: str, loaded: Any) -> Source:
    """A torch or DCP export keeps its record under META_KEY: {"record": JSON text,
    "rank_state": {rank: state}}; the state itself is `loaded` or, when the export had to
    wrap it, loaded["state"]."""
    if not (isinstance(loaded, dict) and META_KEY in loaded):
        return Source(None, _tensors(src, loaded), loaded)
    meta = loaded.pop(META_KEY)
    rank_state = meta.get("rank_state") if isinstance(meta, dict) else None
    if not (isinstance(meta, dict) and isinstance(meta.get("record"), str)
            and isinstance(rank_state or {}, dict)):
        raise ValueError(f"{src}: {META_KEY!r} is not a resilient export record (a dict of "
                         "'record': JSON text and 'rank_state')")
    record = _json_record(src, meta["record"])
    state = loaded["state"] if loaded.get("wrapped") is True else loaded
    tensors = _tensors(src, state)
    for r, rank in (rank_state or {}).items():
        tensors.update({f"R{r}/{n}": t for n, t in _tensors(src, rank).items()})
    return Source(record, tensors, loaded)


def _tensors(src: str, state: Any) -> dict[str, torch.Tensor]:
    """The tensors of `state` by key path; ValueError for a value a checkpoint cannot hold
    without pickle (a set, a complex number: docs/STATE.md)."""
    try:
        return dict(codec.encode(state).tensors)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{src}: {e}") from None


def _json_record(where: str, text: str) -> dict:
    try:
        record = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: the export record is not JSON ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: the export record is a {type(record).__name__}, not an "
                         "object")
    return record


def inside(root: str, name: Any, what: str) -> str:
    """The path of `name`, a relative path that a file in `root` gives for another file there;
    ValueError when it is not a string, is absolute, leaves `root` (``..``, a symbolic link
    out) or is not a regular file."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"{what}: {name!r} is not a file name")
    path = os.path.join(root, name)
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.isabs(name) or os.path.commonpath([real_root, real]) != real_root:
        raise ValueError(f"{what}: {name!r} points outside {root}; refusing to read it")
    if not os.path.isfile(real):
        raise ValueError(f"{what}: {name!r} is not a file in {root}")
    return path


# -- safetensors ---------------------------------------------------------------------------
def read_safetensors(src: str) -> Source:
    """A .safetensors file, or a directory of them (with or without an index)."""
    records: dict[str, str] = {}
    order: list[str] | None = None  # with an index: its keys, in its order
    if not os.path.isdir(src):
        plan: dict[str, list[str] | None] = {src: None}
    elif os.path.lexists(os.path.join(src, INDEX)):
        plan, order, record = _index_plan(src)
        if record is not None:
            records[os.path.join(src, INDEX)] = record
    else:
        plan = {os.path.join(src, n): None
                for n in sorted(os.listdir(src)) if n.endswith(".safetensors")}
    tensors: dict[str, torch.Tensor] = OrderedDict()
    where: dict[str, str] = {}
    for path, keys in plan.items():
        held, record = _read_file(path)
        if record is not None:
            records[path] = record
        if keys is not None:
            _match_index(path, keys, held)
        for k, t in held.items():
            if k in where:
                raise ValueError(f"tensor {k!r} is in both {where[k]} and {path}; refusing to "
                                 "pick one (remove the stale copy)")
            where[k] = path
            tensors[k] = t
    if order is not None:
        tensors = OrderedDict((k, tensors[k]) for k in order)
    texts = set(records.values())
    if len(texts) > 1:
        raise ValueError(f"{src}: {', '.join(sorted(records))} hold different export records")
    record = _json_record(next(iter(records)), texts.pop()) if texts else None
    return Source(record, tensors, tensors)


def _index_plan(src: str) -> tuple[dict[str, list[str]], list[str], str | None]:
    """{file path: the keys the index gives it}, every key in the index's order, and the
    export record in the index's metadata (or None)."""
    index = os.path.join(src, INDEX)
    with open(index, "rb") as f:
        raw = f.read(MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise ValueError(f"{index}: larger than {MAX_METADATA_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{index}: not JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no \"weight_map\" object of tensor name -> file")
    plan: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        path = inside(src, name, f"{index}: entry {key!r}")
        plan.setdefault(path, []).append(key)
    meta = doc.get("metadata")
    record = meta.get(META_KEY) if isinstance(meta, dict) else None
    if record is not None and not isinstance(record, str):
        raise ValueError(f"{index}: metadata.{META_KEY} is not JSON text")
    return plan, list(weight_map), record


def _match_index(path: str, keys: list[str], held: dict[str, Any]) -> None:
    missing = [k for k in keys if k not in held]
    if missing:
        raise ValueError(f"{INDEX} names {path} for {_names(missing)}, which it does not hold")
    listed = set(keys)
    extra = [k for k in held if k not in listed]
    if extra:
        raise ValueError(f"{path} holds {_names(extra)}, which {INDEX} does not give to it "
                         "(a stale or added tensor: fix the index or the file)")


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:3])
    return f"tensor {shown}" if len(keys) == 1 else (
        f"{len(keys)} tensors ({shown}{', ...' if len(keys) > 3 else ''})")


def _read_file(path: str) -> tuple[dict[str, torch.Tensor], str | None]:
    """A safetensors file's tensors in file order, and its export record (or None)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            held = OrderedDict((k, f.get_tensor(k)) for k in f.keys())
    except OSError:
        raise
    except Exception as e:  # the library's SafetensorError: a malformed header or data
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    return held, meta.get(META_KEY)


# -- DCP -----------------------------------------------------------------------------------
def _metadata_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                     "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "_MEM_FORMAT_ENCODING")}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = OrderedDict
    for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", cls)] = _path
    return allowed


def _path(*parts: Any) -> str:
    """A pickled pathlib path (StorageMeta.checkpoint_id) as text; never a live path object."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path of non-strings")
    return "/".join(parts)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves the classes of DCP's metadata and nothing else."""

    def __init__(self, file: Any):
        super().__init__(file)
        self._allowed = _metadata_classes()

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        found = self._allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a class of "
                                         "DCP's metadata")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids have no place in DCP's metadata")


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """How pickle protocol 2 (torch.save's) spells bytes: _codecs.encode(text, "latin1"); here
    with no other codec."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("_codecs.encode other than bytes spelled as latin1 text")
    return text.encode("latin1")


class _PlainUnpickler(pickle.Unpickler):
    """Plain values only: numbers, strings, bytes, None, and lists, tuples, dicts, sets of
    them. No global is resolved except the containers OrderedDict, set, frozenset and
    bytearray, and protocol 2's spelling of bytes (latin1 text encoded)."""

    _ALLOWED = {("collections", "OrderedDict"): OrderedDict, ("builtins", "set"): set,
                ("builtins", "frozenset"): frozenset, ("builtins", "bytearray"): bytearray,
                ("_codecs", "encode"): _latin1}

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocol 2 (torch.save's) names builtins as Python 2 did
            module = "builtins"
        found = self._ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it refers to tensor storage")


def read_dcp(src: str) -> dict:
    """The state a DCP directory holds, nested again as DCP's planner flattened it."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    md = read_dcp_metadata(src)
    flat: dict[str, Any] = {}
    storage = md.storage_data
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            flat[fqn] = _read_bytes_item(src, fqn, _storage(storage, MetadataIndex(fqn), fqn))
        elif isinstance(item, TensorStorageMetadata):
            flat[fqn] = _read_tensor(src, fqn, item, storage)
        else:
            raise ValueError(f"{src}/.metadata: {fqn!r} is a {type(item).__name__}, neither a "
                             "tensor nor a bytes item")
    return _unflatten(src, flat, md.planner_data)


def read_dcp_metadata(src: str) -> Any:
    """DCP's Metadata of `src`, unpickled by _MetadataUnpickler and checked."""
    path = os.path.join(src, ".metadata")
    with open(path, "rb") as f:
        raw = f.read(MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise ValueError(f"{path}: larger than {MAX_METADATA_BYTES} bytes")
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # UnpicklingError, and whatever a malformed stream makes a class raise
        raise ValueError(f"{path}: not DCP metadata that resilient reads without running code "
                         f"from it ({type(e).__name__}: {e})") from None
    _check_metadata(path, md)
    return md


def _check_metadata(path: str, md: Any) -> None:
    """The unpickled objects have the types DCP gives them (unpickling sets attributes without
    any constructor's checks)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: malformed DCP metadata: {what}")

    def dims(value: Any) -> bool:
        return isinstance(value, torch.Size) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)

    if type(md) is not Metadata or not isinstance(md.state_dict_metadata, dict):
        raise bad(f"a {type(md).__name__}, not a Metadata")
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"a key {fqn!r} is not a string")
        if type(item) is TensorStorageMetadata:
            p = item.properties
            if type(p) is not TensorProperties or not isinstance(p.dtype, torch.dtype) or (
                    p.layout != torch.strided):
                raise bad(f"{fqn!r}: tensor properties are not a strided tensor's")
            if not dims(item.size) or not isinstance(item.chunks, list) or not all(
                    type(c) is ChunkStorageMetadata and dims(c.offsets) and dims(c.sizes)
                    and len(c.offsets) == len(c.sizes) == len(item.size) for c in item.chunks):
                raise bad(f"{fqn!r}: size or chunks are not lists of dimensions")
        elif type(item) is not BytesStorageMetadata:
            raise bad(f"{fqn!r} is a {type(item).__name__}")
    if not isinstance(md.storage_data, dict):
        raise bad("storage_data is not a dict")
    for index, info in md.storage_data.items():
        if type(index) is not MetadataIndex or not isinstance(index.fqn, str) or not (
                index.offset is None or dims(index.offset)):
            raise bad(f"a storage key {index!r} is not a MetadataIndex")
        if type(info) is not _StorageInfo or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for v in (info.offset, info.length)):
            raise bad(f"the storage of {index.fqn!r} is not a file range")
        if info.transform_descriptors:
            raise ValueError(f"{path}: {index.fqn!r} is stored through transforms "
                             f"{list(info.transform_descriptors)!r} (a storage extension), "
                             "which the import does not read")
    planner = md.planner_data
    if planner is not None and not (isinstance(planner, dict) and all(
            isinstance(k, str) and isinstance(p, (tuple, list)) and p and all(
                isinstance(c, str) or (isinstance(c, int) and not isinstance(c, bool))
                for c in p) for k, p in planner.items())):
        raise bad("planner_data is not a map of key -> path of names and indices")


def _storage(storage: dict, index: Any, fqn: str) -> Any:
    info = storage.get(index)
    if info is None:
        raise ValueError(f"DCP metadata lists {fqn!r} but stores no data for it")
    return info


def _read_range(src: str, fqn: str, info: Any) -> bytes:
    path = inside(src, info.relative_path, f"{src}/.metadata: {fqn!r}")
    with open(path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length:
        raise ValueError(f"{path}: {fqn!r} ends past the end of the file (offset "
                         f"{info.offset}, {info.length} bytes)")
    return data


def _read_tensor(src: str, fqn: str, item: Any, storage: dict) -> torch.Tensor:
    """The whole tensor `fqn` from its chunks, which must tile it exactly."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    size = tuple(item.size)
    out = torch.empty(size, dtype=item.properties.dtype)
    covered = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for c in item.chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise ValueError(f"{src}/.metadata: a chunk of {fqn!r} lies outside its size {size}")
        for o2, s2 in boxes:
            if all(a < b + t and b < a + s for a, s, b, t in zip(offsets, sizes, o2, s2)):
                raise ValueError(f"{src}/.metadata: two chunks of {fqn!r} overlap")
        boxes.append((offsets, sizes))
        data = _read_range(src, fqn, _storage(storage, MetadataIndex(fqn, offsets), fqn))
        try:
            chunk = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{src}: the data of {fqn!r} cannot be read with "
                             f"weights_only=True ({type(e).__name__}: {e})") from None
        if not isinstance(chunk, torch.Tensor) or tuple(chunk.shape) != sizes or (
                chunk.dtype != out.dtype):
            raise ValueError(f"{src}: a chunk of {fqn!r} is not a {out.dtype} tensor of shape "
                             f"{list(sizes)}")
        out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = chunk
        covered += chunk.numel()
    if covered != out.numel():
        raise ValueError(f"{src}/.metadata: the chunks of {fqn!r} cover {covered} of its "
                         f"{out.numel()} elements")
    return out


def _read_bytes_item(src: str, fqn: str, info: Any) -> Any:
    """A non-tensor value, which DCP stores as a torch.save archive: its pickle is read by
    _PlainUnpickler."""
    data = _read_range(src, fqn, info)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise ValueError("not a torch.save archive")
            return _PlainUnpickler(io.BytesIO(z.read(names[0]))).load()
    except (pickle.UnpicklingError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{src}: refusing the value of {fqn!r}: {e} (the import reads "
                         "numbers, strings, bytes, None and containers of them from a DCP "
                         "checkpoint, never objects: docs/SECURITY.md)") from None


def _unflatten(src: str, flat: dict[str, Any], planner_data: Any) -> dict:
    """Nests DCP's flat {fqn: value} again along planner_data's paths (a dict whose keys are
    0..n-1 becomes a list, as the saved one was); without planner_data the keys stay flat."""
    if planner_data is None:
        return flat
    root = _Node()
    for fqn, value in flat.items():
        path = planner_data.get(fqn, (fqn,))
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, _Node())
            if not isinstance(node, _Node):
                raise ValueError(f"{src}/.metadata: {fqn!r} nests inside a value")
        if path[-1] in node:
            raise ValueError(f"{src}/.metadata: two items at {list(path)!r}")
        node[path[-1]] = value

    def rebuilt(node: Any) -> Any:
        if not isinstance(node, _Node):
            return node
        out = {k: rebuilt(v) for k, v in node.items()}
        if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
            return [out[i] for i in range(len(out))]
        return out

    return rebuilt(root)


class _Node(dict):
    """A dict that _unflatten made (not a value read from the checkpoint)."""
