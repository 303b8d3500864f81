"""Looking at a checkpoint root without loading it into a model: its steps and lineage
(list_root), one step's contents (describe_step), a full re-check of every checksum
(verify_step) and a tensor-by-tensor comparison of two steps (diff_steps).

Everything here reads through the native engine (manifest parsing with its seal check, chunk
checksums, O_NOFOLLOW below the root) and never takes the writer lock, so it is safe to run
while a job is saving to the root. StepReader is the reading primitive the converters
(convert.py) share: it assembles each logical tensor to its global shape, a batch at a time.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from resilient import _C
from resilient.checkpoint import codec
from resilient.checkpoint import root as roots
from resilient.checkpoint.plan import Saved, split_piece_name
from resilient.checkpoint.reader import Reader
from resilient.errors import CheckpointNotFoundError, CorruptCheckpointError

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

    @property
    def nbytes(self) -> int:
        size = codec.dtype_from_name(self.dtype).itemsize
        return math.prod(self.shape) * size


class StepReader:
    """One committed step of a root, opened for reading (this process alone)."""

    def __init__(self, root: str, step: int | None = None):
        self.root = check_root(root)
        opts = _C.CheckpointOptions(self.root)
        opts.keep = 0
        self._engine = _C.Checkpointer(opts)
        steps = list(_C.committed_steps(self.root))
        if not steps:
            raise CheckpointNotFoundError(f"{self.root} holds no committed step", self.root)
        if step is None:
            chain, info = roots.history(self.root, steps)
            good = [s for s in chain if info.get(s) is not roots.DAMAGED]
            step = good[0] if good else steps[-1]
        elif step not in steps:
            raise CheckpointNotFoundError(
                f"{self.root} has no committed step {step} (it has {_ranges(steps)})", self.root)
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
            codec.decode(r.get("state"), _placeholder)
            codec.decode(r.get("rank_state"), _placeholder)
        return values
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"malformed checkpoint values: {e}",
                                     path=os.path.join(step_path, "manifest.json")) from None


def _placeholder(kind: str, name: str) -> Any:
    if not isinstance(name, str):
        raise ValueError("a tensor name is not a string")
    return torch.empty(0)


def _logical(entries: dict[str, dict]) -> dict[str, Logical]:
    out: dict[str, Logical] = {}
    for e in entries.values():
        shape = tuple(e["shape"])
        split = split_piece_name(e["name"][2:]) if e["name"].startswith("S/") else None
        if split is None:  # a per-rank tensor: stored whole
            saved = Saved(e["name"], e["dtype"], shape, shape, tuple(0 for _ in shape))
            out[e["name"]] = Logical(e["name"], e["dtype"], shape, [saved], [e["rank"]])
            continue
        name, offset = split
        gshape = tuple(e.get("global_shape", shape))
        saved = Saved(e["name"], e["dtype"], shape, gshape, offset)
        lg = out.setdefault(name, Logical(name, e["dtype"], gshape, [], []))
        lg.pieces.append(saved)
        if e["rank"] not in lg.ranks:
            lg.ranks.append(e["rank"])
    return out


def _ranges(steps: list[int]) -> str:
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
    tensors: int | None = None
    sharded: int | None = None  # logical tensors stored as several pieces
    bytes: int | None = None  # tensor payload
    stored_bytes: int | None = None  # data files on disk
    verified: bool | None = None  # None: not checked (ls --verify checks)
    error: str | None = None


@dataclass
class RootInfo:
    root: str
    head: int | None
    latest_hint: str | None
    steps: list[StepInfo] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)  # .tmp-step-* directories

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    for i, s in enumerate(steps):
        li = info[s]
        if li is roots.DAMAGED:
            si = StepInfo(s, None, None, "damaged")
        else:
            kind = "current" if s in current else "abandoned"
            si = StepInfo(s, li.seq if li else None, li.parent_step if li else None, kind)
        try:
            with StepReader(path, s) as r:
                si.world_size = r.manifest.world_size
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
                 "nbytes": lg.nbytes, "pieces": len(lg.pieces), "ranks": lg.ranks}
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
            return codec.decode(doc, _placeholder) if refs == 0 else f"{tag[1:]} ({refs} tensors)"
        return f"dict ({refs} tensors)"
    return f"list ({refs} tensors)"


# -- verify --------------------------------------------------------------------------------
@dataclass
class Problem:
    """Something `verify` found wrong: the step, the file, the byte offset where known."""

    step: int
    file: str
    offset: int | None
    message: str


def verify_root(path: str, step: int | None = None, progress: Progress = no_progress
                ) -> tuple[list[int], list[Problem]]:
    """Re-checks `step` (default: every committed step): its lineage record's checksum, the
    manifest's seal and structure (values included), every chunk's checksum. Returns the steps
    checked and the problems found."""
    check_root(path)
    steps = list(_C.committed_steps(path))
    if step is not None:
        if step not in steps:
            raise CheckpointNotFoundError(
                f"{path} has no committed step {step} (it has {_ranges(steps)})", path)
        steps = [step]
    problems: list[Problem] = []
    for i, s in enumerate(steps):
        problems += verify_step(path, s)
        progress(i + 1, len(steps), "steps verified")
    return steps, problems


def verify_step(path: str, step: int) -> list[Problem]:
    sdir = roots.step_dir(path, step)
    problems = []
    try:
        if roots.read_lineage(path, step) is roots.DAMAGED:
            problems.append(Problem(step, os.path.join(sdir, roots.LINEAGE), None,
                                    "lineage record fails its checksum or does not parse"))
    except OSError as e:
        problems.append(Problem(step, os.path.join(sdir, roots.LINEAGE), None, str(e)))
    try:
        with StepReader(path, step) as r:
            r.verify()
    except CorruptCheckpointError as e:
        file = e.path or os.path.join(sdir, "manifest.json")
        offset = e.offset
        msg = str(e)
        if offset is None and os.path.basename(file) == "manifest.json":
            located = locate_manifest_damage(sdir)
            if located is not None:
                offset, where = located
                msg += f"; first difference from the rank manifests at {where}"
        problems.append(Problem(step, file, offset, msg))
    except OSError as e:
        problems.append(Problem(step, getattr(e, "filename", None) or sdir, None, str(e)))
    return problems


def locate_manifest_damage(step_path: str) -> tuple[int, str] | None:
    """For a manifest.json whose seal fails: the byte offset and JSON path of the first value
    that differs from the (separately sealed) rank-<r>.json manifests it was merged from, or
    None when that cannot be told."""
    try:
        with open(os.path.join(step_path, "manifest.json"), "rb") as f:
            text = f.read().decode()
        doc, where = _positions(text)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("values"), dict):
        return None
    ranks = doc["values"].get("ranks") or []
    tensors = doc.get("tensors") or []
    for r in range(len(ranks)):
        try:
            with open(os.path.join(step_path, f"rank-{r}.json")) as f:
                rank_text = f.read()
            _C.parse_manifest(rank_text, f"rank-{r}.json")  # its own seal must hold
            rank_doc = json.loads(rank_text)
        except (OSError, ValueError, CorruptCheckpointError):
            continue
        found = _first_difference(ranks[r], rank_doc.get("values"), ("values", "ranks", r))
        if found is None:
            mine = [(i, t) for i, t in enumerate(tensors)
                    if isinstance(t, dict) and t.get("name") in
                    {x.get("name") for x in rank_doc.get("tensors", [])}]
            theirs = {x.get("name"): x for x in rank_doc.get("tensors", [])}
            for i, t in mine:
                other = dict(theirs[t["name"]])
                other["shard"] = t.get("shard")  # renumbered by the merge
                found = _first_difference(t, other, ("tensors", i))
                if found is not None:
                    break
        if found is not None and found in where:
            return where[found], _path_str(found)
    return None


def _first_difference(a: Any, b: Any, path: tuple) -> tuple | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return path if k not in a else (*path, k)
            d = _first_difference(a[k], b[k], (*path, k))
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, (*path, i))
            if d is not None:
                return d
        return None
    return None if a == b and type(a) is type(b) else path


def _path_str(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _positions(text: str) -> tuple[Any, dict[tuple, int]]:
    """Parses JSON `text`, recording the byte offset at which each value starts by its path."""
    where: dict[tuple, int] = {}
    decoder = json.JSONDecoder()

    def skip(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def value(i: int, path: tuple) -> tuple[Any, int]:
        i = skip(i)
        where[path] = len(text[:i].encode())
        if text[i] == "{":
            out, i = {}, skip(i + 1)
            if text[i] == "}":
                return out, i + 1
            while True:
                key, i = decoder.raw_decode(text, skip(i))
                i = skip(i)
                if text[i] != ":":
                    raise ValueError("expected ':'")
                out[key], i = value(i + 1, (*path, key))
                i = skip(i)
                if text[i] == "}":
                    return out, i + 1
                if text[i] != ",":
                    raise ValueError("expected ','")
                i += 1
        if text[i] == "[":
            items, i = [], skip(i + 1)
            if text[i] == "]":
                return items, i + 1
            while True:
                v, i = value(i, (*path, len(items)))
                items.append(v)
                i = skip(i)
                if text[i] == "]":
                    return items, i + 1
                if text[i] != ",":
                    raise ValueError("expected ','")
                i += 1
        return decoder.raw_decode(text, i)

    doc, _ = value(0, ())
    return doc, where


# -- diff ----------------------------------------------------------------------------------
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
    return codec.decode(doc, _placeholder) if not isinstance(doc, list) else doc
