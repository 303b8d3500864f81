"""Converting checkpoints between resilient and other formats: safetensors (Hugging Face layout,
sharded with an index above a size), torch.save files and torch.distributed.checkpoint (DCP)
directories, both ways.

Two kinds of export. A *whole-state* export (no key) writes every tensor of the step by its
logical name ("model/fc1.weight", per-rank tensors "R<rank>/<name>") plus a small JSON record
(format "resilient-export/1": the step and the state's documents, docs/FORMAT.md) so that
import_checkpoint() rebuilds the same state, bit for bit, non-tensor values and Stateful
structure included. A *key* export (key="model") writes only that entry's state dict with its
own key names ("transformer.h.0.attn.c_attn.weight"): what `model.load_state_dict()` or, with
a Hugging Face config, `from_pretrained()` reads.

Import writes a one-rank checkpoint (any world size loads it: docs/STATE.md) holding exactly
what the source holds: sources.py reads it without running code from it (no pickle beyond
torch.load(weights_only=True) and two restricted unpicklers for DCP) and refuses, rather than
picks from, a source whose files disagree; a resilient export whose files hold a tensor its
record does not reference is refused too. The summary counts the tensors written.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections import OrderedDict
from typing import Any

import torch

from resilient.checkpoint import codec, hf, sources
from resilient.checkpoint import root as roots
from resilient.checkpoint.catalog import Progress, StepReader, no_progress
from resilient.checkpoint.sources import META_KEY
from resilient.errors import CheckpointNotFoundError

EXPORT_FORMAT = "resilient-export/1"
FORMATS = ("safetensors", "torch", "dcp")
DEFAULT_SHARD = "5GB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)



def _readable(path: str) -> None:
    """safetensors' save_file creates its file 0600; give it the permissions of any file this
    process makes (umask), like the index and config beside it, so other users of a shared file
    system can read an export."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def parse_size(text: str | int) -> int:
    """Bytes in "5GB" (decimal, as Hugging Face counts), "512MiB", "1000"."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if m is None:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 500MB, 1GiB, 1048576)")
    number, unit = float(m.group(1)), (m.group(2) or "B").upper()
    power = {"K": 1, "M": 2, "G": 3, "T": 4}.get(unit[0], 0)
    base = 1024 if "I" in unit else 1000
    size = int(number * base**power)
    if size <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return size


# -- export --------------------------------------------------------------------------------
def export_checkpoint(root: str, out: str, fmt: str, step: int | None = None,
                      key: str | None = None, max_shard_size: str | int = DEFAULT_SHARD,
                      hf_config: str | None = None, progress: Progress = no_progress) -> dict:
    """Writes `step` (default: the newest of the lineage) of `root` to `out` in `fmt`
    ("safetensors": a directory; "torch": a file; "dcp": a directory). `key` exports one entry
    of the state (its state dict, with its own key names); `hf_config`: a config.json, or a
    directory whose config, generation config and tokenizer files are copied beside the
    weights. Returns a summary (files, tensors, bytes, skipped non-tensor values)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if hf_config is not None and fmt != "safetensors":
        raise ValueError("--hf-config goes with --format safetensors")
    with StepReader(root, step) as r:
        if key is not None:
            names, skipped = _key_tensors(r, key)
        else:
            names, skipped = {n: n for n in r.logical}, []
        record = None if key is not None else _record(r)
        summary: dict[str, Any] = {"root": os.path.abspath(root), "step": r.step, "format": fmt,
                                   "key": key, "out": os.path.abspath(out),
                                   "tensors": len(names), "skipped": skipped}
        if fmt == "safetensors":
            summary.update(_export_safetensors(r, names, out, record, parse_size(max_shard_size),
                                               progress))
            if hf_config is not None:
                summary["hf_files"] = hf.copy_files(hf_config, out)
            return summary
        tensors = dict(r.iter_tensors(list(names.values()), progress))
        if key is not None:
            state: Any = OrderedDict((k, tensors[n]) for k, n in names.items())
            if fmt == "torch":
                state = _key_state(r, key, tensors)
        else:
            state = _plain(r.state_doc, tensors)
            if not isinstance(state, dict) or META_KEY in state:
                state = {"state": state, "wrapped": True}
            rank = {str(i): _plain(d, {n[len(f"R{i}/"):]: t for n, t in tensors.items()
                                       if n.startswith(f"R{i}/")})
                    for i, d in enumerate(r.rank_docs()) if d is not None}
            state = {**state, META_KEY: {"record": json.dumps(record), "rank_state": rank}}
        if fmt == "torch":
            if os.path.exists(out):
                raise FileExistsError(f"{out} already exists; export to a new file")
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            torch.save(state, out)
            summary["files"] = [os.path.abspath(out)]
        else:
            _dcp_save(state, out)
            summary["files"] = sorted(os.listdir(out))
        summary["bytes"] = sum(t.nbytes for t in tensors.values())
        return summary


def _record(r: StepReader) -> dict[str, Any]:
    return {"format": EXPORT_FORMAT, "step": r.step, "state": r.state_doc,
            "rank_state": r.rank_docs()}


def _key_doc(r: StepReader, key: str) -> Any:
    doc = r.state_doc
    items = codec.dict_items(doc) if isinstance(doc, dict) else None
    keys = [str(k) for k, _ in items or ()]
    for k, v in items or ():
        if str(k) == key:
            return v
    raise ValueError(f"step {r.step} of {r.root} has no state entry {key!r} (it has "
                     f"{', '.join(keys) or 'none'})")


def _key_tensors(r: StepReader, key: str) -> tuple[dict[str, str], list[str]]:
    """{state-dict key: logical tensor name} of entry `key`, and the non-tensor values skipped
    (nested dicts are flattened with dots, as module state dicts are)."""
    names: dict[str, str] = {}
    skipped: list[str] = []

    def walk(doc: Any, prefix: str) -> None:
        doc = codec.unwrap(doc)
        if isinstance(doc, dict):
            tag = codec.tag_of(doc)
            if tag in (codec.TENSOR, codec.NDARRAY):
                names[prefix] = doc[tag]
                return
            items = codec.dict_items(doc)
            if items is not None:
                for k, v in items:
                    walk(v, f"{prefix}.{k}" if prefix else str(k))
                return
        skipped.append(prefix or key)

    walk(_key_doc(r, key), "")
    if not names:
        raise ValueError(f"state entry {key!r} of step {r.step} holds no tensors")
    return names, skipped


def _key_state(r: StepReader, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Entry `key` as plain Python (its state dict, with non-tensor values) for torch.save."""
    return _plain(_key_doc(r, key), tensors)


def _plain(doc: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state a document describes as torch-only Python (numpy arrays as tensors, numpy
    scalars as Python numbers), which torch.load(weights_only=True) reads back; the export
    record keeps the exact types."""

    def torch_only(d: Any) -> Any:
        if isinstance(d, list):
            return [torch_only(v) for v in d]
        if not isinstance(d, dict):
            return d
        tag = codec.tag_of(d)
        if tag == codec.NDARRAY:
            return {codec.TENSOR: d[tag]}
        if tag == codec.NPSCALAR:
            return torch_only(d["value"])
        return {k: torch_only(v) for k, v in d.items()}

    return codec.decode(torch_only(doc), lambda kind, name: tensors[name])


def _shards(r: StepReader, names: dict[str, str], limit: int) -> list[list[str]]:
    """Keys grouped into files of at most `limit` bytes (a larger tensor alone), in order."""
    groups: list[list[str]] = [[]]
    size = 0
    for k, n in names.items():
        nb = r.logical[n].nbytes
        if groups[-1] and size + nb > limit:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nb
    return groups


def _export_safetensors(r: StepReader, names: dict[str, str], out: str, record: Any,
                        limit: int, progress: Progress) -> dict:
    from safetensors.torch import save_file

    _prepare_dir(out)
    groups = _shards(r, names, limit)
    metadata = {"format": "pt"}
    if record is not None:
        metadata[META_KEY] = json.dumps(record)
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total, done = {}, 0, 0
    for i, (file, group) in enumerate(zip(files, groups)):
        read = r.read([names[k] for k in group])
        tensors = {k: read[names[k]].contiguous() for k in group}
        save_file(tensors, os.path.join(out, file), metadata=metadata if i == 0 else
                  {"format": "pt"})
        _readable(os.path.join(out, file))
        for k, t in tensors.items():
            weight_map[k] = file
            total += t.nbytes
        done += len(group)
        progress(done, len(names), "tensors")
        del read, tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        if record is not None:
            index["metadata"][META_KEY] = json.dumps(record)
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        files.append("model.safetensors.index.json")
    return {"files": files, "bytes": total}


def _prepare_dir(out: str) -> None:
    if os.path.isfile(out):
        raise FileExistsError(f"{out} is a file; the export writes a directory there")
    os.makedirs(out, exist_ok=True)
    stale = [n for n in os.listdir(out) if n.endswith(".safetensors") or n == ".metadata"
             or n.endswith(".distcp") or n == "model.safetensors.index.json"]
    if stale:
        raise FileExistsError(f"{out} already holds {', '.join(sorted(stale)[:3])}; export "
                              "into an empty or new directory")


def _dcp_save(state: dict, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    _prepare_dir(out)
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save(state, checkpoint_id=out, no_dist=True)


# -- import --------------------------------------------------------------------------------
class SavedState:
    """A Stateful stand-in for an imported state dict: saved as `{"$stateful": ...}` exactly
    as the module or optimizer it came from was, so load() into that object works."""

    def __init__(self, state: Any):
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def detect_format(src: str) -> str:
    """"safetensors", "torch" or "dcp" for a source path; ValueError saying what it is not."""
    if os.path.isdir(src):
        names = os.listdir(src)
        if ".metadata" in names:
            return "dcp"
        if any(n.endswith(".safetensors") for n in names):
            return "safetensors"
        if roots.is_root(src):
            raise ValueError(f"{src} is already a resilient checkpoint root")
        raise ValueError(f"{src} holds neither a DCP checkpoint (.metadata) nor .safetensors "
                         "files")
    if not os.path.exists(src):
        raise FileNotFoundError(f"{src} does not exist")
    if src.endswith(".safetensors"):
        return "safetensors"
    with open(src, "rb") as f:
        head = f.read(8)
    if head[:2] == b"PK" or head[:1] == b"\x80":  # a zip (torch >= 1.6) or a legacy pickle
        return "torch"
    raise ValueError(f"{src} is neither a torch.save file nor a .safetensors file")


def import_checkpoint(src: str, root: str, step: int | None = None, key: str | None = None,
                      fmt: str | None = None, progress: Progress = no_progress,
                      as_head: bool = False) -> dict:
    """Writes the checkpoint at `src` (a torch.save file, a safetensors file or directory, a DCP
    directory) as a committed step of resilient root `root` (created if needed). A resilient
    export is rebuilt exactly (its step unless `step` is given); anything else becomes the
    state as loaded, under `key` when given (key="model": load({"model": model}) restores it),
    at `step` (default 0); a Hugging Face model directory, or a safetensors file with the
    directory's config.json beside it, gets back the tied weights its files leave out (hf.py).
    ValueError for a source that is malformed or whose files disagree (sources.py).

    A root that already has committed steps (a training run's) is refused: the imported step
    would become the newest, which the run's next load() resumes from and after which its
    retention deletes training steps. With `as_head` the import is meant to be the new head:
    `step` must then be greater than the root's newest step, and the imported step continues
    the lineage after it (RootInUseError while a job writes there)."""
    from resilient.checkpoint.checkpointer import Checkpointer

    fmt = fmt or detect_format(src)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be a whole number >= 0, not {step!r}")
    progress(0, 2, "reading")
    source = sources.read(src, fmt)
    progress(1, 2, "reading")
    rank_state = None
    dropped = 0
    tied: list[str] = []
    if source.record is not None:
        record = _check_record(src, source.record)
        used: set[str] = set()
        state = _rebuild(src, record["state"], source.tensors, "", used)
        rank_docs = record["rank_state"]
        if rank_docs and rank_docs[0] is not None:
            rank_state = _rebuild(src, rank_docs[0], source.tensors, "R0/", used)
        beyond = tuple(f"R{i}/" for i, d in enumerate(rank_docs) if i > 0 and d is not None)
        dropped = len(beyond)
        unused = [n for n in source.tensors if n not in used and not n.startswith(beyond)]
        if unused:
            raise ValueError(
                f"{src} holds {len(unused)} tensor(s) that its export record does not reference "
                f"({', '.join(map(repr, unused[:3]))}{', ...' if len(unused) > 3 else ''}): the "
                "files were changed after the export; refusing to drop them (export again, or "
                "remove them)")
        step = record["step"] if step is None else step
    else:
        loaded = source.loaded
        if fmt == "safetensors":  # a model directory, or a file of one (config.json beside it)
            tied = hf.add_tied_weights(
                src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src)), loaded)
        state = loaded if key is None else {key: loaded}
        if not isinstance(state, dict):
            raise ValueError(f"{src} holds a {type(state).__name__}; pass --key to store it "
                             "under a name")
        step = 0 if step is None else step
    if os.path.exists(root) and not roots.is_root(root) and os.listdir(root):
        raise CheckpointNotFoundError(roots.why_not_root(root).split(" (pass")[0] +
                                      "; refusing to import into it", root)
    with Checkpointer(root, keep=0, create=True, distributed=False, tiers=[]) as ck:
        have = ck.steps()
        head = ck.latest_step()
        if have and not as_head:
            raise FileExistsError(
                f"{root} already holds committed steps {have[:5]}{' ...' if len(have) > 5 else ''}"
                f" (the newest: {head}): importing there would make the imported step the "
                "newest, which a job on that root resumes from, and its retention would then "
                "delete training steps. Import into a new root, or pass --as-head with a --step "
                "greater than the newest to make the import the head on purpose")
        if have and step <= max(have):  # every committed step, not only the lineage's
            raise ValueError(f"--as-head needs a --step greater than the newest step of {root} "
                             f"({max(have)}), not {step}")
        ck.save(step, state, rank_state).wait()
    progress(2, 2, "written")
    count = len(codec.encode(state).tensors) + (  # as written: a tied tensor once
        0 if rank_state is None else len(codec.encode(rank_state).tensors))
    return {"src": os.path.abspath(src), "format": fmt, "root": os.path.abspath(root),
            "step": step, "exact": source.record is not None, "tensors": count,
            "tied": tied, "dropped_rank_states": dropped}


def _check_record(src: str, record: dict) -> dict:
    """The export record with its fields checked (ValueError naming `src` otherwise)."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{src}: export record: {what}")

    if record.get("format") != EXPORT_FORMAT:
        raise bad(f"format {record.get('format')!r}; this version reads {EXPORT_FORMAT!r}")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise bad(f"step {step!r} is not a whole number >= 0")
    if "state" not in record:
        raise bad("no state")
    rank_docs = [] if record.get("rank_state") is None else record["rank_state"]
    if not isinstance(rank_docs, list):
        raise bad("rank_state is not a list")
    return {**record, "rank_state": rank_docs}


def _rebuild(src: str, doc: Any, tensors: dict[str, torch.Tensor], prefix: str,
             used: set[str]) -> Any:
    """The state a document describes, with Stateful entries as SavedState (so saving it
    writes the same document) and tensors from `tensors` ("<prefix><name>"), whose names are
    added to `used`. ValueError naming `src` for a malformed document."""
    inner: list[Any] = []

    def mark(d: Any) -> Any:
        if isinstance(d, list):
            return [mark(v) for v in d]
        if isinstance(d, dict):
            if codec.tag_of(d) == codec.STATEFUL:
                inner.append(d[codec.STATEFUL])
                return {codec.TENSOR: ("stateful", len(inner) - 1)}
            return {k: mark(v) for k, v in d.items()}
        return d

    def tensor_for(kind: str, name: Any) -> Any:
        if isinstance(name, tuple):
            return SavedState(_rebuild(src, inner[name[1]], tensors, prefix, used))
        t = tensors.get(prefix + name) if isinstance(name, str) else None
        if t is None:
            raise ValueError(f"{src}: the export record references tensor {prefix}{name!r}, "
                             "which the files do not hold")
        used.add(prefix + name)
        return t

    try:
        return codec.decode(mark(doc), tensor_for)
    except (TypeError, KeyError, AttributeError, RecursionError) as e:
        raise ValueError(f"{src}: malformed export record ({type(e).__name__}: {e})") from None
