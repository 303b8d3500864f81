"""Tiered persistence: the checkpoint root is the fast tier; committed steps drain in the
background to slower tiers (a shared file system path, an S3-compatible object store).

    ck = Checkpointer("/local_nvme/ckpt", tiers=["/lustre/run1/ckpt", "s3://bucket/run1"])

A save commits to the root as always (the save's durability is the root's). Rank 0 then copies
each committed step to every tier, on a thread per tier, newest first: when a tier falls behind,
the steps committed meanwhile are skipped and only the newest is copied, so a slow or failed tier
never holds up training or the root's commits. Local retention keeps a step while a tier still
copies it. A failed copy is retried with backoff (1 s doubling to 60 s) and shows in
``Checkpointer.tier_status()``, the root's ``tiers.json``, the metrics and ``resilient ckpt ls``.

Each tier is committed crash-consistently on its own:
- a file tier is a checkpoint root of its own (load it directly with ``Checkpointer(path)``):
  files are copied into ``.tmp-step-N``, fsynced, ``manifest.json`` last, then renamed into
  place, exactly like the root's own commit;
- an object-store tier holds ``<prefix>/step-N/<file>`` objects, uploaded with ``manifest.json``
  last: a step is committed when its manifest object exists. Large files go up as parallel
  multipart uploads that a later run resumes (parts whose MD5 matches are kept).

A tier's ``lineage.json`` names the tier's previous step as parent (a tier holds only the steps it
was given), so the tier's own lineage and retention work as the root's. ``load()`` takes the
fastest tier that verifies: the root, unless a tier holds a newer commit (a fresh node whose local
disk is empty) or the root's copy of a step fails verification; then that step is fetched from the
first tier that has it into the root, and loaded from there.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading
import time
from typing import Any

from resilient import settings
from resilient.checkpoint import root as roots
from resilient.errors import ResilientError

log = logging.getLogger("resilient.checkpoint.tiers")

MANIFEST = "manifest.json"
STATUS = "tiers.json"
_COPY_BYTES = 64 << 20


def _pause_point(stage: str) -> None:
    """Testing: RESILIENT_TIER_PAUSE_AT=<stage>:<path> stops this thread at `stage` of a copy,
    after creating <path>, so a test can kill -9 the process there."""
    spec = os.environ.get("RESILIENT_TIER_PAUSE_AT", "")
    want, _, marker = spec.partition(":")
    if want != stage:
        return
    with open(marker, "w") as f:
        f.write(stage)
    while True:
        time.sleep(3600)


def step_files(step_path: str) -> list[str]:
    """The files of a committed step directory in copy order: the manifest last."""
    names = sorted(n for n in os.listdir(step_path) if n != MANIFEST)
    if not os.path.exists(os.path.join(step_path, MANIFEST)):
        raise FileNotFoundError(f"{step_path} has no {MANIFEST} (not a committed step)")
    return [*names, MANIFEST]


class Tier:
    """A slower place that committed steps are copied to. `keep`: steps the tier keeps (its
    own retention; None: the checkpointer's keep; <= 0: all)."""

    url: str
    keep: int | None

    def steps(self) -> dict[int, Any]:
        """Committed steps and their lineage records (roots.Lineage, DAMAGED or None)."""
        raise NotImplementedError

    def push(self, src: str, step: int, lineage: str) -> int:
        """Copies committed step directory `src` as `step` with lineage record `lineage`;
        returns the bytes copied."""
        raise NotImplementedError

    def fetch(self, step: int, dest: str) -> int:
        """Copies the tier's `step` into the (new, empty) directory `dest`; returns bytes."""
        raise NotImplementedError

    def retain(self, keep: int, protect: frozenset[int] = frozenset()) -> list[int]:
        """Deletes the steps the tier no longer keeps; returns them."""
        raise NotImplementedError

    def open(self) -> None:
        """Called on the drain thread before its first copy: claims the tier for that
        drainer (a tier object that an earlier checkpointer's thread still copies to is
        refused until that copy ends; the new drainer retries)."""
        use = self.__dict__.setdefault("_in_use", threading.Lock())
        if not use.acquire(blocking=False):
            raise RuntimeError(f"tier {self.url} is still being copied to by an earlier "
                               "checkpointer of this process")

    def close(self) -> None:
        use = self.__dict__.get("_in_use")
        if use is not None and use.locked():
            use.release()


class FileTier(Tier):
    """A directory on another file system (say a parallel file system), kept as a checkpoint
    root of its own. The drainer holds its writer lock, so no other job writes into it."""

    def __init__(self, path: str | os.PathLike, keep: int | None = None):
        self.path = os.fspath(path)
        self.url = self.path
        self.keep = keep
        self._lock = roots.WriterLock(self.path)

    def open(self) -> None:
        super().open()
        try:
            self._check_parent()
            roots.ensure_root(self.path)
            self._lock.acquire()
        except BaseException:
            super().close()
            raise
        for stale in roots.stale_saves(self.path, time.time() + 1):  # a crashed drain's
            shutil.rmtree(stale, ignore_errors=True)
        roots.purge_trash(self.path)

    def close(self) -> None:
        self._lock.release()
        super().close()

    def steps(self) -> dict[int, Any]:
        from resilient import _C

        if not roots.is_root(self.path):
            self._check_parent()
            return {}
        return roots.history(self.path, list(_C.committed_steps(self.path)))[1]

    def push(self, src: str, step: int, lineage: str) -> int:
        tmp = roots.tmp_dir(self.path, step)
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
        total = 0
        names = step_files(src)
        roots.write_atomic(os.path.join(tmp, roots.LINEAGE), lineage, sync_dir=False,
                           in_step=True)
        for name in names:
            if name == MANIFEST:
                _pause_point("file-before-manifest")
            if name != roots.LINEAGE:
                total += _copy_file(os.path.join(src, name), os.path.join(tmp, name))
                _pause_point("file-data")
        _pause_point("file-before-rename")
        roots.install_step(self.path, step, tmp)
        _pause_point("file-after-rename")
        return total

    def _check_parent(self) -> None:
        """The tier's directory may be created, its parent must exist: a missing parent is an
        unmounted file system or a mistyped path, and creating it would put the "shared" copies
        on the local disk."""
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"tier {self.path}: {parent} does not exist (a file system "
                                    "that is not mounted?)")

    def fetch(self, step: int, dest: str) -> int:
        src = roots.step_dir(self.path, step)
        return sum(_copy_file(os.path.join(src, n), os.path.join(dest, n))
                   for n in step_files(src))

    def retain(self, keep: int, protect: frozenset[int] = frozenset()) -> list[int]:
        from resilient import _C

        deleted = roots.apply_retention(self.path, list(_C.committed_steps(self.path)), keep,
                                        protect)
        if deleted:
            roots.purge_trash(self.path)
        return deleted


def _copy_file(src: str, dst: str) -> int:
    """Copies one file (copy_file_range where the kernel has it), fsyncs it; returns bytes."""
    fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fin)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{src} is not a regular file (refused)")
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            size, done, plain = st.st_size, 0, False
            while done < size:
                want = min(_COPY_BYTES, size - done)
                n = -1
                if not plain:
                    try:
                        n = os.copy_file_range(fin, fout, want, done, done)
                    except OSError:  # across file systems on older kernels: plain copies
                        plain = True
                if plain:
                    n = os.pwrite(fout, os.pread(fin, want, done), done)
                if n == 0:
                    raise OSError(f"{src} shrank while being copied")
                done += n
            os.fsync(fout)
            return done
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def make_tier(spec: Any, keep: int) -> Tier:
    """A Tier from a Tier, a path, or an "s3://bucket/prefix" URL."""
    if isinstance(spec, Tier):
        if spec.keep is None:
            spec.keep = keep
        return spec
    text = os.fspath(spec)
    if not isinstance(text, str) or not text:
        raise ValueError(f"a tier is a path, an s3:// URL or a Tier, not {spec!r}")
    if text.startswith("s3://"):
        from resilient.checkpoint.s3 import S3Tier

        return S3Tier(text, keep=keep)
    if "://" in text:
        raise ValueError(f"unsupported tier URL {text!r} (a path or s3://bucket/prefix)")
    return FileTier(text, keep=keep)


class _State:
    """What one tier's drain thread is doing and has done."""

    def __init__(self, tier: Tier):
        self.tier = tier
        self.wanted: int | None = None  # newest committed step not yet copied
        self.busy: int | None = None  # step being copied now
        self.steps: list[int] = []  # committed in the tier, after the last copy
        self.error: str | None = None
        self.failures = 0
        self.bytes = 0
        self.last_ok: float | None = None
        self.thread: threading.Thread | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.tier.url, "steps": self.steps, "pending": self.wanted,
                "copying": self.busy, "error": self.error, "failures": self.failures,
                "bytes": self.bytes, "last_ok": self.last_ok}


class Drainer:
    """Rank 0's background copies of the root's committed steps to each tier."""

    def __init__(self, root: str, tiers: list[Tier]):
        self.root = root
        self._cv = threading.Condition()
        self._stop = False
        self._states = [_State(t) for t in tiers]
        for st in self._states:
            st.thread = threading.Thread(target=self._run, args=(st,), daemon=True,
                                         name=f"resilient-tier-{st.tier.url}")
            st.thread.start()

    def offer(self, step: int) -> None:
        """A step was committed to the root: every tier copies it when free (the newest wins)."""
        with self._cv:
            for st in self._states:
                st.wanted = step
            self._cv.notify_all()

    def protected(self) -> frozenset[int]:
        """Steps the root must keep: wanted or being copied by some tier."""
        with self._cv:
            return frozenset(s for st in self._states for s in (st.wanted, st.busy)
                             if s is not None)

    def status(self) -> list[dict[str, Any]]:
        with self._cv:
            return [st.to_dict() for st in self._states]

    def idle(self) -> bool:
        with self._cv:
            return all(st.wanted is None and st.busy is None for st in self._states)

    def wait(self, timeout: float | None = None, failing_too: bool = True) -> bool:
        """Until no tier has a copy pending or running (failed copies keep retrying; without
        `failing_too`, a tier whose last attempt failed counts as done). False when `timeout`
        ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def busy(st: _State) -> bool:
            if st.busy is not None:
                return True
            return st.wanted is not None and (failing_too or st.error is None)

        with self._cv:
            while any(busy(st) for st in self._states):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(0.1 if left is None else min(0.1, left))
        return True

    def close(self, timeout: float | None) -> None:
        """Waits (bounded) for the copies in flight, except to tiers that are failing, then
        stops the threads; what is left is copied by the next run with these tiers."""
        from resilient.recovery.environment import busy  # `resilient run`'s finish grace waits

        bound = (float("inf") if timeout is None else timeout) + 1.0 * len(self._states)
        with busy("copying the newest checkpoint to its tiers", bound):  # + the joins below
            self.wait(timeout, failing_too=False)
            for st in self.status():
                if st["pending"] is not None or st["copying"] is not None:
                    log.warning(
                        "tier %s: step %s is not copied (%s); it stays committed in %s and the "
                        "next run with this tier copies it", st["url"],
                        st["copying"] if st["copying"] is not None else st["pending"],
                        st["error"] or "still copying at close", self.root)
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            for st in self._states:
                if st.thread is not threading.current_thread():
                    st.thread.join(1.0)  # type: ignore[union-attr]

    # -- the drain threads ----------------------------------------------------------------
    def _run(self, st: _State) -> None:
        backoff = 1.0
        opened = False
        while True:
            with self._cv:
                while not self._stop and st.wanted is None:
                    self._cv.wait()
                if self._stop:
                    break
                step, st.wanted, st.busy = st.wanted, None, st.wanted
            try:
                if not opened:
                    st.tier.open()
                    opened = True
                copied = self._copy(st, step)
                with self._cv:
                    st.error, st.last_ok = None, time.time()
                    st.bytes += copied
                backoff = 1.0
            except Exception as e:  # noqa: BLE001 -- a tier's failure never reaches training
                # A step the root no longer has (deleted meanwhile) is not retried.
                retry = os.path.isdir(roots.step_dir(self.root, step))
                self._failed(st, step, e, retry=retry)
                if not retry:
                    continue
                with self._cv:
                    st.busy = None
                    self._cv.notify_all()
                    self._cv.wait_for(lambda: self._stop, backoff)
                backoff = min(60.0, backoff * 2)
            finally:
                with self._cv:
                    st.busy = None
                    self._cv.notify_all()
            self._write_status()
        if opened:
            try:
                st.tier.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing tier %s: %s", st.tier.url, e)

    def _failed(self, st: _State, step: int, e: BaseException, retry: bool) -> None:
        msg = f"step {step}: {type(e).__name__}: {e}"
        log.warning("copying to tier %s failed: %s%s", st.tier.url, msg,
                    " (retrying)" if retry else "")
        with self._cv:
            st.error, st.failures = msg, st.failures + 1
            if retry and st.wanted is None:
                st.wanted = step

    def _copy(self, st: _State, step: int) -> int:
        """Copies `step` unless the tier already holds this commit of it; then the tier's
        retention. Returns the bytes copied."""
        li = roots.read_lineage(self.root, step)
        if not isinstance(li, roots.Lineage):
            raise ValueError(f"step {step} of {self.root} has no valid lineage record")
        have = st.tier.steps()
        copied = 0
        newest = max((t.seq for t in have.values() if isinstance(t, roots.Lineage)), default=-1)
        mine = have.get(step)
        if isinstance(mine, roots.Lineage) and (mine.seq, mine.id) == (li.seq, li.id):
            pass  # this commit is there already
        elif newest >= li.seq:  # the tier holds a newer commit (another root's): never go back
            raise RuntimeError(
                f"the tier holds a commit (seq {newest}) at least as new as step {step} of "
                f"{self.root} (seq {li.seq}): another root writes to this tier")
        else:
            parent = _tier_parent(self.root, step, li, have)
            src = roots.step_dir(self.root, step)
            copied = st.tier.push(src, step, roots.lineage_record(step, li.seq, parent, li.id))
            log.info("step %d copied to tier %s (%d bytes)", step, st.tier.url, copied)
        keep = st.tier.keep if st.tier.keep is not None else 0
        st.tier.retain(keep, frozenset({step}))
        with self._cv:
            st.steps = sorted(st.tier.steps())
        return copied

    def _write_status(self) -> None:
        try:
            doc = {"format": "resilient-tiers", "version": 1, "updated": time.time(),
                   "tiers": self.status()}
            roots.write_atomic(os.path.join(self.root, STATUS), json.dumps(doc) + "\n",
                               sync_dir=False)
        except OSError as e:
            log.debug("cannot write %s: %s", STATUS, e)


def _tier_parent(root: str, step: int, li: roots.Lineage, have: dict[int, Any]
                 ) -> tuple[int, int] | None:
    """The tier's parent of `step`: its nearest ancestor in the root's lineage that the tier
    holds (the same commit). When the root no longer has the records to walk further, the
    tier's newest commit older than the oldest ancestor reached (it can only be an ancestor
    or older); when the walk ended at the first commit, none (an abandoned branch's steps
    in the tier are not ancestors)."""
    cur: Any = li
    seen = {step}
    while isinstance(cur, roots.Lineage) and cur.parent_step is not None:
        p, pseq = cur.parent_step, cur.parent_seq
        t = have.get(p)
        if isinstance(t, roots.Lineage) and t.seq == pseq:
            return (p, t.seq)
        try:
            nxt = roots.read_lineage(root, p) if p not in seen else None
        except OSError:
            nxt = None
        seen.add(p)
        if not isinstance(nxt, roots.Lineage) or nxt.seq != pseq:
            # The record is gone (retention) or replaced: ancestors are older than pseq.
            if pseq is None:
                return None
            older = [(t.seq, s) for s, t in have.items()
                     if isinstance(t, roots.Lineage) and t.seq <= pseq]
            if not older:
                return None
            seq, s = max(older)
            return (s, seq)
        cur = nxt
    return None


def fetch_into_root(root: str, tiers: list[Tier], step: int, seq: int | None = None,
                    exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
    """Copies `step` (the commit with `seq`, when given; the root's own commit when the root
    has a record of it) from the first tier not in `exclude` that has it into `root`,
    replacing the root's copy (its lineage record is kept); returns the tier's URL, or None."""
    final = roots.step_dir(root, step)
    local: Any = None
    if os.path.isdir(final):
        try:
            local = roots.read_lineage(root, step)
        except OSError:
            local = None
    for t in tiers:
        if t.url in exclude:
            continue
        try:
            li = t.steps().get(step)
            if not isinstance(li, roots.Lineage) or (seq is not None and li.seq != seq):
                continue
            if isinstance(local, roots.Lineage) and (local.seq, local.id) != (li.seq, li.id):
                continue  # another commit of this step number
            roots.ensure_root(root)
            tmp = roots.tmp_dir(root, step)
            shutil.rmtree(tmp, ignore_errors=True)
            os.mkdir(tmp)
            try:
                n = t.fetch(step, tmp)
                if isinstance(local, roots.Lineage):  # the root's chain stays as it was
                    os.unlink(os.path.join(tmp, roots.LINEAGE))
                    _copy_file(os.path.join(final, roots.LINEAGE),
                               os.path.join(tmp, roots.LINEAGE))
                roots.install_step(root, step, tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            log.warning("step %d fetched from tier %s into %s (%d bytes)", step, t.url, root, n)
            return t.url
        except Exception as e:  # noqa: BLE001 -- the next tier may have it
            log.warning("cannot fetch step %d from tier %s: %s: %s", step, t.url,
                        type(e).__name__, e)
    return None


def newer_in_tiers(root: str, tiers: list[Tier]) -> tuple[tuple[int, int] | None, int]:
    """((step, seq) of the newest commit any tier holds when it is newer than every commit of
    `root` (a fresh node's empty root, or a root that lost its newest steps), else None; the
    largest seq the tiers hold). A tier that cannot be listed is skipped with a warning when
    the root has committed steps, and is an error when it has none: whether a checkpoint
    exists is then unknown, and starting afresh would be silently wrong."""
    from resilient import _C

    local = -1
    if roots.is_root(root):
        info = roots.history(root, list(_C.committed_steps(root)))[1]
        local = roots.max_seq(info) if info else -1
    best: tuple[int, int] | None = None
    top = 0
    for t in tiers:
        try:
            have = t.steps()
        except Exception as e:  # noqa: BLE001
            if local < 0:
                raise ResilientError(
                    f"{root} holds no checkpoint and tier {t.url} cannot be listed "
                    f"({type(e).__name__}: {e}): whether it holds one is unknown; fix the tier "
                    "or leave it out to start afresh") from e
            log.warning("cannot list tier %s: %s: %s", t.url, type(e).__name__, e)
            continue
        for s, li in have.items():
            if not isinstance(li, roots.Lineage):
                continue
            top = max(top, li.seq)
            if li.seq > local and (best is None or li.seq > best[1]):
                best = (s, li.seq)
    return best, top


def read_status(root: str) -> dict[str, Any] | None:
    """The root's tiers.json, or None."""
    try:
        with open(os.path.join(root, STATUS)) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) and isinstance(doc.get("tiers"), list) else None
    except (OSError, ValueError):
        return None


def close_timeout() -> float:
    return float(settings.get("RESILIENT_TIER_CLOSE_TIMEOUT_S"))
