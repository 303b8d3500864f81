"""`ckpt verify`: re-checks committed steps (lineage record, manifest seal and values, every
chunk's checksum) and says where the damage is: the file and byte offset. A data chunk's
damage is located by the native reader (the chunk's offset); a manifest's seal covers the whole
file, so a damaged manifest is compared with the separately sealed rank-<r>.json manifests it
was merged from (commit.cpp), which locates the first value that differs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from resilient import _C
from resilient.checkpoint import root as roots
from resilient.checkpoint.catalog import (
    Progress,
    StepReader,
    check_root,
    no_progress,
    open_engine,
    step_list,
)
from resilient.errors import CheckpointNotFoundError, CorruptCheckpointError

#: dcp_metadata.FILE, named here because that module imports torch (a test holds them equal).
DCP_METADATA = "dcp-metadata.json"


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
                f"{path} has no committed step {step} (it has {step_list(steps)})", path)
        steps = [step]
    problems: list[Problem] = []
    engine = open_engine(path)
    lineage = roots.history(path, list(_C.committed_steps(path)))[1]  # once, not per step
    try:
        for i, s in enumerate(steps):
            problems += verify_step(path, s, engine, lineage)
            progress(i + 1, len(steps), "steps verified")
    finally:
        engine.close(None)
    return steps, problems


def verify_step(path: str, step: int, engine: Any = None,
                lineage: dict[int, Any] | None = None) -> list[Problem]:
    """The problems of one committed step (`engine`: a shared open_engine(); `lineage`: the
    root's records as root.history gives them, read once for a verify of many steps)."""
    sdir = roots.step_dir(path, step)
    problems = []
    try:
        li = roots.read_lineage(path, step)
        if li is roots.DAMAGED:
            problems.append(Problem(step, os.path.join(sdir, roots.LINEAGE), None,
                                    "lineage record fails its checksum or does not parse"))
        elif li is None and (lineage if lineage is not None else roots.history(
                path, list(_C.committed_steps(path)))[1]).get(step) is roots.DAMAGED:
            problems.append(Problem(step, os.path.join(sdir, roots.LINEAGE), None,
                                    "lineage record is missing (older steps have one)"))
    except OSError as e:
        problems.append(Problem(step, os.path.join(sdir, roots.LINEAGE), None, str(e)))
    try:
        with StepReader(path, step, engine) as r:
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
    meta = os.path.join(sdir, DCP_METADATA)  # a step written through resilient.dcp
    if os.path.lexists(meta):
        from resilient.checkpoint import dcp_metadata  # imports torch: only for such a step

        try:
            with open(meta, encoding="utf-8", errors="surrogateescape") as f:
                dcp_metadata.decode(f.read(), meta)
        except CorruptCheckpointError as e:
            problems.append(Problem(step, meta, None, str(e)))
        except (OSError, UnicodeError) as e:
            problems.append(Problem(step, meta, None, f"{meta}: {e}"))
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
            theirs = {x.get("name"): x for x in rank_doc.get("tensors", [])
                      if isinstance(x, dict)}
            mine = [(i, t) for i, t in enumerate(tensors)
                    if isinstance(t, dict) and t.get("name") in theirs]
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
    """Parses JSON `text`, recording the byte offset at which each value starts by its path
    (in one pass: values are met in file order, so each offset extends the previous one)."""
    where: dict[tuple, int] = {}
    decoder = json.JSONDecoder()
    ascii_only = text.isascii()
    last = [0, 0]  # a character index and its byte offset

    def byte_offset(i: int) -> int:
        if ascii_only:
            return i
        last[1] += len(text[last[0]:i].encode())
        last[0] = i
        return last[1]

    def skip(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def value(i: int, path: tuple) -> tuple[Any, int]:
        i = skip(i)
        where[path] = byte_offset(i)
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
