"""A checkpoint root on disk: recognising one, creating it, its lineage and its retention.

A root is a directory that resilient initialised: it holds ``resilient-root.json`` (written when
the root is created: by the first save, or by ``Checkpointer(..., create=True)``), or, for roots
written before that file existed, at least one ``step-*`` directory. Anything else - a missing
path, a step directory, a DCP or torch.save directory - is not a root, and loading from it raises
CheckpointNotFoundError saying what it is, so a mistyped path never reads as "no checkpoint yet".

Lineage. Every commit writes ``lineage.json`` (``seq``: a commit sequence number, larger than
every earlier commit's in the root; ``parent``: the step and seq the writer had resumed from or
last committed) into its step directory before the directory is renamed into place, so it is
committed atomically with the step. The *current lineage* is the chain of parents from the
commit with the largest seq. ``load()`` without a step walks that chain, newest first; after
``load(step=k)`` the next commit names k as its parent, so it starts a new branch and the steps
saved after k on the old branch are no longer in the lineage: retention deletes them, and a crash
after that first commit resumes the new branch. Saving a step the writer's position already
reached (re-saving the step one resumed from, or a DCP save that replaces ``root/step-N``)
replaces that step: the new commit's parent is the nearest ancestor older than it
(parent_for()), and the native commit exchanges the two directories, so the old copy stays
loadable until the new one is committed. Steps without ``lineage.json`` (older roots) are
ancestors of each other in step order.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass

from resilient import _C
from resilient.errors import CheckpointNotFoundError, RootInUseError

MARKER = "resilient-root.json"
LOCK = ".writer.lock"
LINEAGE = "lineage.json"
_STEP_DIR = re.compile(r"^step-(\d{12}|[1-9]\d{12,18})$")
_MAX_LINEAGE_BYTES = 4096


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:012d}")


def tmp_dir(root: str, step: int) -> str:
    return os.path.join(root, f".tmp-step-{step:012d}")


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_root(path: str) -> bool:
    """True for a directory resilient initialised (a marker, a step or a save in progress)."""
    return _holds_root(_names(path))


def _holds_root(names: list[str]) -> bool:
    """A directory listing of a root (its marker, or one being written; a step)."""
    return any(_STEP_DIR.match(n) or n.startswith((MARKER, ".tmp-step-")) for n in names)


def why_not_root(path: str) -> str:
    """Says what `path` is, for a path that is not a checkpoint root."""
    if not os.path.exists(path):
        return (f"checkpoint root {path} does not exist (for a run that may start fresh, "
                "pass create=True, or save first)")
    if not os.path.isdir(path):
        return f"{path} is a file, not a checkpoint root directory"
    names = set(_names(path))
    if "manifest.json" in names and _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        return (f"{path} is one step of a resilient checkpoint; pass its parent directory "
                f"as the root and step={int(os.path.basename(os.path.normpath(path))[5:])}")
    if ".metadata" in names:
        return f"{path} is a torch.distributed.checkpoint (DCP) directory, not a resilient root"
    saved = sorted(n for n in names if n.endswith((".pt", ".pth", ".bin", ".safetensors")))
    if saved:
        return (f"{path} holds {', '.join(saved[:3])} (torch.save / safetensors files), not a "
                "resilient checkpoint root")
    if not names:
        return (f"{path} is an empty directory that resilient did not initialise (pass "
                "create=True to start a new run there)")
    return (f"{path} is not a resilient checkpoint root (no {MARKER}, no step-* directories; "
            f"it holds {', '.join(sorted(names)[:3])}{'...' if len(names) > 3 else ''})")


def ensure_root(path: str) -> tuple[bool, str | None]:
    """Makes `path` a checkpoint root: creates it (and its parents) and the marker, made
    durable. A directory holding anything that is not a resilient root is refused. Safe
    when several processes create the same root at once (one listing decides: a marker that
    another process is writing makes it a root). Returns (whether this call made a new root,
    the highest directory it had to create above the root, if any: a mistyped path?)."""
    names = _names(path)
    if _holds_root(names):
        if not os.path.exists(os.path.join(path, MARKER)):
            _write_marker(path)
        return False, None
    if os.path.isdir(path) and names:
        raise CheckpointNotFoundError(
            why_not_root(path) + "; refusing to create a checkpoint root there", path)
    parent = os.path.dirname(os.path.abspath(path))
    missing = None
    p = parent
    while p and not os.path.isdir(p) and p != os.path.dirname(p):
        missing, p = p, os.path.dirname(p)
    os.makedirs(path, exist_ok=True)
    _write_marker(path)
    _fsync_dir(parent)
    return True, missing


def _write_marker(path: str) -> None:
    body = json.dumps({"format": "resilient-root", "version": 1}) + "\n"
    write_atomic(os.path.join(path, MARKER), body)


def write_atomic(path: str, text: str, sync_dir: bool = True, in_step: bool = False) -> None:
    """Writes `path` through a temporary file, fsync and rename, then fsyncs the directory
    (unless the caller fsyncs it later, as the commit does for a step's directory). Everything
    happens relative to one descriptor of the directory; `in_step`: the directory is a step's
    (below the root), which must not be a symbolic link (ENOTDIR), so nothing is ever written
    outside the root."""
    directory, name = os.path.split(path)
    flags = os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if in_step else 0)
    dir_fd = os.open(directory or ".", flags)
    try:
        tmp = f"{name}.tmp.{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                     dir_fd=dir_fd)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if sync_dir:
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read(64)
    except OSError:
        return None


@dataclass(frozen=True)
class Lineage:
    """One commit's place in the root's history."""

    seq: int
    parent_step: int | None
    parent_seq: int | None
    id: str | None = None  # random per commit (absent in older roots): seqs of two roots differ


#: The lineage record of a step exists but fails its checksum or does not parse.
DAMAGED = "damaged"


def read_lineage(root: str, step: int) -> Lineage | str | None:
    """The lineage record of committed `step`: a Lineage, None for a step written without one
    (older roots), or DAMAGED. Raises OSError for any other read error (which may be passing:
    it must not change what counts as the lineage)."""
    path = os.path.join(step_dir(root, step), LINEAGE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return DAMAGED
        raise
    try:
        raw = os.read(fd, _MAX_LINEAGE_BYTES + 1)
    finally:
        os.close(fd)
    return parse_lineage(raw, step)


def parse_lineage(raw: bytes, step: int) -> Lineage | str:
    """A lineage record's bytes (as lineage.json holds them) as a Lineage, or DAMAGED."""
    if len(raw) > _MAX_LINEAGE_BYTES:
        return DAMAGED
    try:
        body, digest = raw.decode().rstrip("\n").split("\n")
        if _C.xxh3_hex(body.encode()) != digest:
            return DAMAGED
        doc = json.loads(body)
        seq, parent, ident = doc["seq"], doc.get("parent"), doc.get("id")
        if not isinstance(seq, int) or isinstance(seq, bool) or doc.get("step") != step:
            return DAMAGED
        if ident is not None and not isinstance(ident, str):
            return DAMAGED
        if parent is None:
            return Lineage(seq, None, None, ident)
        ps, pq = parent["step"], parent.get("seq")
        if not isinstance(ps, int) or (pq is not None and not isinstance(pq, int)):
            return DAMAGED
        return Lineage(seq, ps, pq, ident)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return DAMAGED


def lineage_record(step: int, seq: int, parent: tuple[int, int | None] | None,
                   ident: str | None = None) -> str:
    """The text of a lineage record: one line of JSON, then its XXH3-64 (hex)."""
    doc: dict = {"seq": seq, "step": step, "parent": None if parent is None else {
        "step": parent[0], "seq": parent[1]}}
    if ident is not None:
        doc["id"] = ident
    body = json.dumps(doc, separators=(",", ":"))
    return f"{body}\n{_C.xxh3_hex(body.encode())}\n"


def write_lineage(directory: str, step: int, seq: int,
                  parent: tuple[int, int | None] | None) -> None:
    """Writes a step's lineage record into its (temporary) directory."""
    # The commit fsyncs the step's directory after its manifest, and renames it last.
    write_atomic(os.path.join(directory, LINEAGE),
                 lineage_record(step, seq, parent, uuid.uuid4().hex[:16]),
                 sync_dir=False, in_step=True)


def history(root: str, steps: list[int]) -> tuple[list[int], dict[int, Lineage | str | None]]:
    """The current lineage (newest first) among committed `steps`, and each step's record. A
    DAMAGED record ends the walk (its parent is unknown); it is never chosen as the head."""
    info = missing_as_damaged({s: read_lineage(root, s) for s in steps}, root)
    return chain_of(info), info


def missing_as_damaged(info: dict[int, Lineage | str | None],
                       root: str | None = None) -> dict[int, Lineage | str | None]:
    """A step without a lineage record committed after the first commit that has one lost its
    record: DAMAGED, so that it is never taken for an ancestor, the head is not decided without
    it, and retention deletes nothing until it is repaired. Roots written before lineage records
    existed have steps without one, committed before the first step with one (their manifests
    are older): those stay steps of an older root (None), also when a rollback left them off
    the lineage (retention then deletes them as before). Without `root` (no manifest times),
    every step without a record newer than the first step with one is DAMAGED."""
    recorded = [s for s, li in info.items() if isinstance(li, Lineage)]
    if not recorded:
        return info
    first = min(recorded, key=lambda s: info[s].seq)  # type: ignore[union-attr]
    records_began = _committed_at(root, first) if root is not None else None

    def lost(step: int) -> bool:
        if records_began is None:
            return step > min(recorded)
        at = _committed_at(root, step)  # type: ignore[arg-type]
        return at is None or at >= records_began

    return {s: (DAMAGED if li is None and lost(s) else li) for s, li in info.items()}


def _committed_at(root: str, step: int) -> int | None:
    """When `step` was committed (its manifest's mtime, ns), or None."""
    try:
        return os.stat(os.path.join(step_dir(root, step), "manifest.json")).st_mtime_ns
    except OSError:
        return None


def chain_of(info: dict[int, Lineage | str | None]) -> list[int]:
    """The current lineage (newest first) of steps with these lineage records."""
    steps = sorted(info)
    recorded = [s for s in steps if isinstance(info[s], Lineage)]
    if not recorded:
        return sorted((s for s in steps if info[s] is None), reverse=True)
    head = max(recorded, key=lambda s: (info[s].seq, s))  # type: ignore[union-attr]
    chain, seen, cur = [head], {head}, head
    while True:
        li = info[cur]
        if li is None:  # an older root's steps: ancestors in step order
            chain += [s for s in sorted(steps, reverse=True) if s < cur and info[s] is None]
            break
        if li == DAMAGED:
            break
        p = li.parent_step
        if p is None or p not in info or p in seen:
            break
        pl = info[p]
        if pl != DAMAGED and (pl.seq if pl is not None else None) != li.parent_seq:
            break  # the parent's directory was replaced by a later commit of that step
        chain.append(p)
        seen.add(p)
        cur = p
    return chain


def parent_for(info: dict[int, Lineage | str | None], head: tuple[int, int | None] | None,
               step: int) -> tuple[int, int | None] | None:
    """The parent of a new commit of `step` by a writer positioned at `head` (the step and seq
    it resumed from or last committed): `head` itself when `step` is newer; otherwise `head`'s
    nearest ancestor older than `step`. Re-saving the step one resumed from (or an older one)
    replaces that step in the lineage instead of making it its own parent, so the steps before
    it stay in the lineage and retention keeps them. None when the walk cannot go on (a record
    damaged, replaced or deleted): the new commit then starts a lineage of its own."""
    cur = head
    seen: set[int] = set()
    while cur is not None and cur[0] >= step:
        if cur[0] in seen:
            return None
        seen.add(cur[0])
        li = info.get(cur[0], DAMAGED)
        if li is None:  # an older root's steps: ancestors of each other in step order
            older = [s for s, r in info.items() if s < step and r is None]
            return (max(older), None) if older else None
        if li == DAMAGED or (cur[1] is not None and li.seq != cur[1]):  # type: ignore[union-attr]
            return None
        if li.parent_step is None:  # type: ignore[union-attr]
            return None
        cur = (li.parent_step, li.parent_seq)  # type: ignore[union-attr]
    return cur


def max_seq(info: dict[int, Lineage | str | None]) -> int:
    """The largest seq recorded, plus one for every damaged record (whose seq is unknown)."""
    damaged = sum(1 for li in info.values() if li == DAMAGED)
    return max((li.seq for li in info.values() if isinstance(li, Lineage)), default=0) + damaged


def apply_retention(root: str, steps: list[int], keep: int,
                    protect: frozenset[int] = frozenset()) -> list[int]:
    """Deletes every committed step outside the newest `keep` of the current lineage (all of
    the lineage when keep <= 0, but always the abandoned branches) by renaming it to a
    `.trash-step-*` directory (purge_trash() frees the space), and points `latest` at the head.
    Steps in `protect` (still being copied to a slower tier) stay. Returns the deleted steps."""
    chain, info = history(root, steps)
    kept = set(chain if keep <= 0 else chain[:keep]) | protect
    damaged = [s for s in steps if info[s] == DAMAGED]
    if damaged:  # the lineage is not known for sure: delete nothing
        import logging

        logging.getLogger("resilient.checkpoint").warning(
            "retention skipped in %s: the lineage records (lineage.json) of steps %s are "
            "damaged or missing, so which steps the current run still needs is unknown; "
            "nothing is deleted until they are repaired or those steps removed", root, damaged)
        return []
    deleted = []
    for s in steps:
        if s in kept:
            continue
        try:  # renamed first: a half-deleted step never looks committed
            os.rename(step_dir(root, s), trash_path(root, s))
        except FileNotFoundError:
            continue
        deleted.append(s)
    if deleted:
        _fsync_dir(root)
    latest = os.path.join(root, "latest")
    if chain and _read(latest) != f"step-{chain[0]:012d}\n":  # after a rollback
        write_atomic(latest, f"step-{chain[0]:012d}\n")
    return deleted


def trash_path(root: str, step: int) -> str:
    """A new `.trash-step-*` name for a step directory that is being deleted or replaced."""
    return os.path.join(root, f".trash-step-{step:012d}-{uuid.uuid4().hex[:8]}")  # any width


def install_step(root: str, step: int, tmp: str) -> None:
    """Makes the complete directory `tmp` (of `root`) the committed `step`: fsyncs it, moves
    any older directory of that step to the trash, renames `tmp` into place, fsyncs `root`."""
    _fsync_dir(tmp)
    final = step_dir(root, step)
    if os.path.lexists(final):  # a step of an abandoned branch, or an older copy
        os.rename(final, trash_path(root, step))
    os.rename(tmp, final)
    _fsync_dir(root)


def purge_trash(root: str) -> None:
    """Removes the `.trash-step-*` directories retention (or a crash during it) left."""
    for name in _names(root):
        if name.startswith(".trash-step-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def stale_saves(root: str, before: float) -> list[str]:
    """`.tmp-step-*` directories not touched since `before` (a wall-clock time): saves that a
    crashed earlier writer left (the writer lock excludes a live one; a save of this writer
    touches its directory after it started)."""
    out = []
    for name in _names(root):
        if name.startswith(".tmp-step-"):
            path = os.path.join(root, name)
            try:
                if os.lstat(path).st_mtime < before:
                    out.append(path)
            except FileNotFoundError:
                continue
    return out


_LOCKED: set[str] = set()  # roots this process writes to (POSIX locks do not exclude a process)


class WriterLock:
    """One writer per root: an advisory POSIX lock (fcntl, which NFS and Lustre honour) on
    `root/.writer.lock`, held while a checkpointer saves; the kernel drops it when the process
    dies, so a crashed writer never blocks the next one. The file names its holder and its
    job (a token the job's ranks share).

    Takeover: after in-process recovery removed the job's writer, that process may still be
    alive (frozen, cut off) and hold the lock. The new group's writer may then take the root
    over (``takeover=True``, only when the holder names the same job: a removed member; never
    another job's writer), writes without the OS lock, and takes it as soon as the removed
    process is gone (``reclaim()``, at each save)."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        self.fd: int | None = None
        self.job: str | None = None  # the job's token, written into the file
        self.taken_over: str | None = None  # the removed holder while the OS lock is theirs

    def acquire(self, job: str | None = None, takeover: bool = False) -> None:
        if self.fd is not None:
            return
        if self.root in _LOCKED:
            raise RootInUseError(f"another Checkpointer of this process is saving to {self.root}; "
                                 "close it first (one writer per root)")
        path = os.path.join(self.root, LOCK)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        self.job = job or self.job
        if not self._lock(fd):
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            if takeover and job is not None and holder.endswith(f" job {job}"):
                import logging

                logging.getLogger("resilient.checkpoint").warning(
                    "%s: taking over from the job's removed writer (%s), which still holds the "
                    "root's lock; the lock is taken back once that process is gone", self.root,
                    holder)
                self.fd, self.taken_over = fd, holder
                _LOCKED.add(self.root)
                return
            os.close(fd)
            raise RootInUseError(
                f"{self.root} is being written by another process ({holder}); one writer per "
                "root: use another root, or stop that job")
        self.fd = fd
        _LOCKED.add(self.root)

    def _lock(self, fd: int) -> bool:
        """Takes the OS lock on `fd` (not waiting) and names this process in the file."""
        import fcntl
        import socket

        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        os.ftruncate(fd, 0)
        job = f" job {self.job}" if self.job else ""
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}{job}\n".encode(), 0)
        return True

    def reclaim(self) -> None:
        """After a takeover: takes the OS lock once the removed holder is gone. RootInUseError
        when by then a process of another job holds it (two jobs must never write one root)."""
        if self.fd is None or self.taken_over is None:
            return
        if self._lock(self.fd):
            self.taken_over = None
            return
        holder = os.pread(self.fd, 256, 0).decode(errors="replace").strip() or "unknown"
        if not (self.job and holder.endswith(f" job {self.job}")):
            raise RootInUseError(
                f"{self.root} was taken over from this job's removed writer, and is now held "
                f"by another job's process ({holder}); one writer per root: stop that job")

    def release(self) -> None:
        if self.fd is None:
            return
        _LOCKED.discard(self.root)
        fd, self.fd, self.taken_over = self.fd, None, None
        os.close(fd)  # drops the lock
