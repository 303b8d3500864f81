"""Looking at a checkpoint root without loading it into a model: its steps and lineage
(list_root) and one step's contents (describe_step). verify.py re-checks every checksum,
diff.py compares two steps, convert.py exports and imports; all of them read through
StepReader, which assembles each logical tensor to its global shape, a batch at a time.

Everything here reads through the native engine (manifest parsing with its seal check, chunk
checksums, O_NOFOLLOW below the root) and never takes the writer lock, so it is safe to run
while a job is saving to the root. Listing, describing and verifying never import torch (it
takes seconds to import): only reading tensors (StepReader.read) does.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from resilient import _C
from resilient.checkpoint import codec, tiers
from resilient.checkpoint import root as roots
from resilient.checkpoint.plan import Saved, split_piece_name
from resilient.errors import CheckpointNotFoundError, CorruptCheckpointError

if TYPE_CHECKING:
    import torch

#: Callback for long work: (done, total, what) -> None.
Progress = Callable[[int, int, str], None]
#: Bytes assembled in memory at a time when tensors are streamed.
BATCH_BYTES = 1 << 30


def no_progress(done: int, total: int, what: str) -> None:
    """A Progress that reports nothing."""


def check_root(path: str) -> str:
    """Returns `path` if it is a checkpoint root; CheckpointNotFoundError saying what it is
    otherwise."""
    if not roots.is_root(path):
        raise CheckpointNotFoundError(roots.why_not_root(path).split(" (for a run")[0], path)
    return path


@dataclass
class Logical:
    """One logical tensor of a step: a replicated (possibly sharded) tensor by its key path, or
    a per-rank tensor as "R<rank>/<path>"."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Saved]
    ranks: list[int]
    itemsize: int = 0  # bytes per element, from the manifest (0 when every piece is empty)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def grid(self) -> list[int]:
        """How the pieces cut the tensor: distinct piece offsets along each dimension ([2, 1]:
        split in two along dim 0; all ones: stored whole)."""
        return [len({p.offset[d] for p in self.pieces}) for d in range(len(self.shape))]


def open_engine(root: str) -> Any:
    """The native engine, opened for reading `root` (it writes nothing until asked to save)."""
    opts = _C.CheckpointOptions(root)
    opts.keep = 0
    return _C.Checkpointer(opts)


class StepReader:
    """One committed step of a root, opened for reading (this process alone)."""

    def __init__(self, root: str, step: int | None = None, engine: Any = None):
        """`engine`: a native reader from open_engine() to share (several steps of one root);
        by default the reader opens its own and close() closes it."""
        self.root = check_root(root)
        self._owned = engine is None
        self._engine = open_engine(self.root) if engine is None else engine
        try:
            self._open(step)
        except BaseException:
            self.close()
            raise

    def _open(self, step: int | None) -> None:
        steps = list(_C.committed_steps(self.root))
        if not steps:
            raise CheckpointNotFoundError(f"{self.root} holds no committed step", self.root)
        if step is None:
            chain, info = roots.history(self.root, steps)
            good = [s for s in chain if info.get(s) is not roots.DAMAGED]
            step = good[0] if good else steps[-1]
        elif step not in steps:
            raise CheckpointNotFoundError(
                f"{self.root} has no committed step {step} (it has {step_list(steps)})", self.root)
        self.step = int(step)
        self.manifest = self._engine.manifest(self.step)
        self.entries = {e["name"]: e for e in self.manifest.tensors()}
        self.values = _values(self.manifest, roots.step_dir(self.root, self.step))
        self.logical = _logical(self.entries)

    @property
    def state_doc(self) -> Any:
        """The replicated state's document (rank 0's record)."""
        return self.values["ranks"][0].get("state")

    def rank_docs(self) -> list[Any]:
        """Each saved rank's rank_state document (None where it had none)."""
        return [r.get("rank_state") for r in self.values["ranks"]]

    def verify(self) -> None:
        """Reads every chunk and checks its checksum (CorruptCheckpointError)."""
        self._engine.verify(self.manifest)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The logical tensors `names`, assembled to their global shapes."""
        from resilient.checkpoint.reader import Reader

        reader = Reader(self._engine, self.manifest, self.entries)
        wanted = {}
        for n in names:
            lg = self.logical[n]
            wanted[n] = reader.want(n, None, lg.dtype, lg.shape, None, lg.pieces)
        reader.run()
        return {n: w.out for n, w in wanted.items()}

    def iter_tensors(self, names: list[str] | None = None, progress: Progress = no_progress,
                     batch_bytes: int = BATCH_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for `names` (default: all, in manifest order), reading about
        `batch_bytes` at a time."""
        names = list(self.logical) if names is None else names
        total = sum(self.logical[n].nbytes for n in names)
        done, batch, size = 0, [], 0
        for i, n in enumerate(names):
            batch.append(n)
            size += self.logical[n].nbytes
            if size >= batch_bytes or i == len(names) - 1:
                yield from self.read(batch).items()
                done += size
                progress(done, total, f"step {self.step}")
                batch, size = [], 0

    def close(self) -> None:
        if self._owned:
            self._engine.close(None)

    def __enter__(self) -> StepReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _values(manifest: Any, step_path: str) -> dict:
    try:
        values = json.loads(manifest.values_json)
        ranks = values["ranks"]
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict)
                                                               for r in ranks):
            raise ValueError("no per-rank records")
        for r in ranks:
            codec.decode(r.get("state"), placeholder)
            codec.decode(r.get("rank_state"), placeholder)
        return values
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"malformed checkpoint values: {e}",
                                     path=os.path.join(step_path, "manifest.json")) from None


class _Unread:
    """What placeholder() gives for a tensor or array: nothing (no torch needed)."""

    def numpy(self) -> None:
        return None


def placeholder(kind: str, name: str) -> Any:
    """A codec.decode tensor source that checks names and reads nothing."""
    if not isinstance(name, str):
        raise ValueError("a tensor name is not a string")
    return _Unread()


def _logical(entries: dict[str, dict]) -> dict[str, Logical]:
    out: dict[str, Logical] = {}
    for e in entries.values():
        shape = tuple(e["shape"])
        numel = math.prod(shape)
        itemsize = e["nbytes"] // numel if numel else 0
        split = split_piece_name(e["name"][2:]) if e["name"].startswith("S/") else None
        if split is None:  # a per-rank tensor: stored whole
            saved = Saved(e["name"], e["dtype"], shape, shape, tuple(0 for _ in shape))
            out[e["name"]] = Logical(e["name"], e["dtype"], shape, [saved], [e["rank"]],
                                     itemsize)
            continue
        name, offset = split
        gshape = tuple(e.get("global_shape", shape))
        saved = Saved(e["name"], e["dtype"], shape, gshape, offset)
        lg = out.setdefault(name, Logical(name, e["dtype"], gshape, [], []))
        lg.itemsize = lg.itemsize or itemsize
        lg.pieces.append(saved)
        if e["rank"] not in lg.ranks:
            lg.ranks.append(e["rank"])
    return out


def step_list(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 12 else (
        f"{len(steps)} steps, {steps[0]}..{steps[-1]}")


# -- ls ------------------------------------------------------------------------------------
@dataclass
class StepInfo:
    """One committed step as `ckpt ls` shows it."""

    step: int
    seq: int | None
    parent: int | None
    lineage: str  # "current" (load() would try it), "abandoned" (another branch), "damaged"
    world_size: int | None = None
    mesh: str | None = None  # the DTensors' device mesh(es), e.g. "2x2 (dp_shard, tp)"
    tensors: int | None = None
    sharded: int | None = None  # logical tensors stored as several pieces
    bytes: int | None = None  # tensor payload
    stored_bytes: int | None = None  # data files on disk
    verified: bool | None = None  # None: not checked (ls --verify checks)
    error: str | None = None
    tiers: list[str] = field(default_factory=list)  # URLs of the slower tiers that hold it


@dataclass
class RootInfo:
    root: str
    head: int | None
    latest_hint: str | None
    steps: list[StepInfo] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)  # .tmp-step-* directories
    tiers: list[dict[str, Any]] = field(default_factory=list)  # tiers.json: the drain's state
    tiers_updated: float | None = None  # when the drain last wrote tiers.json

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mesh_text(values: Any) -> str | None:
    """Rank 0's record of the save's DTensor meshes as text ("2x2 (dp_shard, tp) cuda"; several
    joined by "; "), or None (no DTensors, or a step written before meshes were recorded)."""
    try:
        recs = values["ranks"][0].get("meshes")
        out = []
        for m in recs or []:
            shape, names = m.get("shape"), m.get("dim_names")
            if not isinstance(shape, list) or not (names is None or isinstance(names, list)):
                continue  # not what a save writes: information only, so left out
            out.append("x".join(str(x) for x in shape)
                       + (f" ({', '.join(map(str, names))})" if names else "")
                       + f" {m.get('device_type', '?')}")
        return "; ".join(out) or None
    except (TypeError, KeyError, IndexError, AttributeError):
        return None


def list_root(path: str, verify: bool = False, progress: Progress = no_progress) -> RootInfo:
    """Every committed step of root `path` with its lineage, sizes and world size; `verify`
    re-reads every chunk of every step."""
    check_root(path)
    steps = list(_C.committed_steps(path))
    chain, info = roots.history(path, steps)
    latest = None
    try:
        with open(os.path.join(path, "latest")) as f:
            latest = f.read(64).strip() or None
    except OSError:
        pass
    out = RootInfo(os.path.abspath(path), chain[0] if chain else None, latest)
    out.in_progress = sorted(n for n in os.listdir(path) if n.startswith(".tmp-step-"))
    current = set(chain)
    status = tiers.read_status(path)
    if status is not None:
        out.tiers = [t for t in status["tiers"] if isinstance(t, dict)]
        updated = status.get("updated")
        out.tiers_updated = updated if isinstance(updated, (int, float)) else None
    engine = open_engine(path) if steps else None
    for i, s in enumerate(steps):
        li = info[s]
        if li is roots.DAMAGED:
            si = StepInfo(s, None, None, "damaged")
        else:
            kind = "current" if s in current else "abandoned"
            si = StepInfo(s, li.seq if li else None, li.parent_step if li else None, kind)
        si.tiers = [str(t.get("url")) for t in out.tiers
                    if isinstance(t.get("steps"), list) and s in t["steps"]]
        try:
            with StepReader(path, s, engine) as r:
                si.world_size = r.manifest.world_size
                si.mesh = mesh_text(r.values)
                si.tensors = len(r.logical)
                si.sharded = sum(1 for lg in r.logical.values() if len(lg.pieces) > 1)
                si.bytes = sum(e["nbytes"] for e in r.entries.values())
                mf = json.loads(r.manifest.to_json())
                si.stored_bytes = sum(sh["bytes"] for sh in mf["shards"])
                if verify:
                    r.verify()
                    si.verified = True
        except (CorruptCheckpointError, OSError) as e:
            si.verified = False if verify or isinstance(e, CorruptCheckpointError) else None
            si.error = _describe_error(e)
        out.steps.append(si)
        progress(i + 1, len(steps), "steps")
    if engine is not None:
        engine.close(None)
    return out


def _describe_error(e: BaseException) -> str:
    where = getattr(e, "path", None) or getattr(e, "filename", None)
    offset = getattr(e, "offset", None)
    msg = str(e)
    if where and str(where) not in msg:
        msg += f" (file {where}"
        msg += f", offset {offset})" if offset is not None else ")"
    elif offset is not None and f"offset {offset}" not in msg:
        msg += f" (offset {offset})"
    return msg


# -- show ----------------------------------------------------------------------------------
def describe_step(path: str, step: int | None = None, tensors: bool = False) -> dict[str, Any]:
    """One step: its place in the lineage, world size, meta, the state's top-level keys and
    kinds, sizes, and (tensors=True) every logical tensor."""
    with StepReader(path, step) as r:
        li = roots.read_lineage(path, r.step)
        mf = json.loads(r.manifest.to_json())
        doc = r.state_doc
        out: dict[str, Any] = {
            "root": os.path.abspath(path),
            "step": r.step,
            "lineage": li if li is None or li is roots.DAMAGED else asdict(li),
            "world_size": r.manifest.world_size,
            "mesh": mesh_text(r.values),
            "meta": json.loads(r.manifest.meta_json),
            "shards": mf["shards"],
            "bytes": sum(e["nbytes"] for e in r.entries.values()),
            "stored_bytes": sum(sh["bytes"] for sh in mf["shards"]),
            "tensor_count": len(r.logical),
            "state": _outline(doc),
            "rank_state": [_outline(d) for d in r.rank_docs()],
            "save_id": r.values.get("save_id"),
        }
        if tensors:
            out["tensors"] = [
                {"name": lg.name, "dtype": lg.dtype, "shape": list(lg.shape),
                 "nbytes": lg.nbytes, "pieces": len(lg.pieces), "grid": lg.grid,
                 "ranks": lg.ranks}
                for lg in r.logical.values()
            ]
        return out


def _outline(doc: Any) -> Any:
    """Top-level keys of a state document and what each holds (kind, tensor count, and the
    value itself for small plain values)."""
    if doc is None:
        return None
    items = codec.dict_items(doc) if isinstance(doc, dict) else None
    if items is None:
        return _kind(doc)
    return {str(k): _kind(v) for k, v in items}


def _kind(doc: Any) -> Any:
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    refs = len(codec.tensor_refs(doc))
    if isinstance(doc, dict):
        tag = codec.tag_of(doc)
        if tag == codec.STATEFUL:
            return f"state_dict ({refs} tensors)"
        if tag in (codec.TENSOR, codec.NDARRAY):
            return f"tensor {doc[tag]}"
        if tag not in (None, codec.DICT, codec.ODICT):
            return codec.decode(doc, placeholder) if refs == 0 else f"{tag[1:]} ({refs} tensors)"
        return f"dict ({refs} tensors)"
    return f"list ({refs} tensors)"
