"""An S3-compatible object store as a checkpoint tier (see resilient.checkpoint.tiers).

Layout: ``<prefix>/step-<12 digits>/<file>``, the step directory's files as objects, with
``manifest.json`` uploaded last: a step is committed in the store when its manifest object
exists, so a crash mid-upload never leaves a step that looks committed. Every object carries
the commit's seq in its metadata (``resilient-seq``), so a resumed upload skips the files a
previous attempt finished.

Files larger than RESILIENT_S3_PART_BYTES go up as multipart uploads, RESILIENT_S3_THREADS parts
at once. An upload cut short (a crash, kill -9) is resumed by the next attempt: it finds the
upload with ListMultipartUploads, keeps each listed part whose ETag is the MD5 of the local
bytes at that place, and sends only the rest. Retention deletes a step's manifest first, then
its other objects, and aborts multipart uploads of steps no longer wanted.

Client: boto3 (the AWS SDK for Python: maintained by AWS, speaks to every S3-compatible
store, takes credentials and the endpoint from the standard AWS environment variables and
config files: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_ENDPOINT_URL...).
Credentials never appear in resilient's logs or errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from resilient import settings
from resilient.checkpoint import root as roots
from resilient.checkpoint.tiers import MANIFEST, Tier, _pause_point, step_files

_STEP = re.compile(r"^step-(\d{12}|[1-9]\d{12,18})$")
_SEQ = "resilient-seq"
_MIN_PART = 5 << 20


def _client(endpoint_url: str | None) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise ImportError("an s3:// tier needs boto3: pip install boto3") from e
    cfg = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5,
                 read_timeout=60, s3={"addressing_style": "path"},
                 max_pool_connections=max(10, 2 * settings.get("RESILIENT_S3_THREADS")),
                 request_checksum_calculation="when_required",
                 response_checksum_validation="when_required")
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=cfg)


class S3Tier(Tier):
    """``s3://bucket/prefix`` in an S3-compatible store.

    Args:
        url: ``s3://bucket`` or ``s3://bucket/some/prefix``.
        keep: steps kept in the store (None: the checkpointer's keep; <= 0: all).
        endpoint_url: the store's endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL,
            else AWS).
    """

    def __init__(self, url: str, keep: int | None = None, endpoint_url: str | None = None):
        m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(/.*)?", url)
        if not m:
            raise ValueError(f"not an S3 tier URL: {url!r} (s3://bucket[/prefix])")
        self.url, self.keep, self.bucket = url, keep, m.group(1)
        self.prefix = (m.group(2) or "").strip("/")
        if any(part in ("", ".", "..") for part in self.prefix.split("/")) and self.prefix:
            raise ValueError(f"S3 tier prefix {self.prefix!r} has an empty, . or .. part")
        self.endpoint_url = endpoint_url
        self.part_bytes = max(_MIN_PART, int(settings.get("RESILIENT_S3_PART_BYTES")))
        self.threads = max(1, int(settings.get("RESILIENT_S3_THREADS")))
        self._s3: Any = None
        self._lock = threading.Lock()

    @property
    def s3(self) -> Any:
        with self._lock:
            if self._s3 is None:
                self._s3 = _client(self.endpoint_url)
            return self._s3

    def _key(self, step: int, name: str = "") -> str:
        d = f"step-{step:012d}/{name}"
        return f"{self.prefix}/{d}" if self.prefix else d

    def _keys(self, prefix: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                        Prefix=prefix):
            out.extend(page.get("Contents", []))
        return out

    # -- Tier -----------------------------------------------------------------------------
    def steps(self) -> dict[int, Any]:
        base = f"{self.prefix}/" if self.prefix else ""
        committed = set()
        for obj in self._keys(base):
            rest = obj["Key"][len(base):].split("/")
            if len(rest) == 2 and rest[1] == MANIFEST and _STEP.match(rest[0]):
                committed.add(int(rest[0][5:]))
        info: dict[int, Any] = {}
        for s in committed:
            try:
                body = self.s3.get_object(Bucket=self.bucket,
                                          Key=self._key(s, roots.LINEAGE))["Body"].read()
                info[s] = roots.parse_lineage(body, s)
            except self.s3.exceptions.NoSuchKey:
                info[s] = None
        return info

    def push(self, src: str, step: int, lineage: str) -> int:
        doc = json.loads(lineage.split("\n", 1)[0])
        seq = f"{doc['seq']}:{doc.get('id') or ''}"  # which commit an object belongs to
        try:  # an older commit of this step: uncommitted before any of its objects changes
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(step, MANIFEST))
        except self.s3.exceptions.NoSuchKey:
            pass
        total = 0
        for name in step_files(src):
            key = self._key(step, name)
            if name == MANIFEST:
                self.s3.put_object(Bucket=self.bucket, Key=self._key(step, roots.LINEAGE),
                                   Body=lineage.encode(), Metadata={_SEQ: seq})
                _pause_point("s3-before-manifest")
            elif name == roots.LINEAGE:
                continue
            path = os.path.join(src, name)
            size = os.path.getsize(path)
            if name != MANIFEST and self._has(key, size, seq):
                continue
            if size > self.part_bytes:
                self._multipart(path, key, size, seq)
            else:
                with open(path, "rb") as f:
                    self.s3.put_object(Bucket=self.bucket, Key=key, Body=f.read(),
                                       Metadata={_SEQ: seq})
            total += size
        return total

    def _has(self, key: str, size: int, seq: str) -> bool:
        try:
            head = self.s3.head_object(Bucket=self.bucket, Key=key)
        except Exception:  # noqa: BLE001 -- absent (404) or unreadable: upload it
            return False
        return head.get("ContentLength") == size and head.get("Metadata", {}).get(_SEQ) == seq

    def _multipart(self, path: str, key: str, size: int, seq: str) -> None:
        part = self.part_bytes
        count = (size + part - 1) // part
        upload_id, listed = self._resumable(key)
        if upload_id is None:
            upload_id = self.s3.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                        Metadata={_SEQ: seq})["UploadId"]
        fd = os.open(path, os.O_RDONLY)
        first = threading.Event()

        def send(i: int) -> dict[str, Any]:
            off = (i - 1) * part
            body = os.pread(fd, min(part, size - off), off)
            old = listed.get(i)
            if old is not None and old[1] == len(body) and \
                    old[0].strip('"') == hashlib.md5(body, usedforsecurity=False).hexdigest():
                return {"PartNumber": i, "ETag": old[0]}
            etag = self.s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                       PartNumber=i, Body=body)["ETag"]
            if not first.is_set():
                first.set()
                _pause_point("s3-multipart")
            return {"PartNumber": i, "ETag": etag}

        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="resilient-s3") as pool:
                parts = list(pool.map(send, range(1, count + 1)))
        finally:
            os.close(fd)
        self.s3.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                          MultipartUpload={"Parts": parts})

    def _resumable(self, key: str) -> tuple[str | None, dict[int, tuple[str, int]]]:
        """The newest unfinished upload of `key` and its parts (others are aborted)."""
        uploads = [u for page in self.s3.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=key) for u in page.get("Uploads", []) if u["Key"] == key]
        if not uploads:
            return None, {}
        uploads.sort(key=lambda u: u["Initiated"])
        for u in uploads[:-1]:
            self._abort(key, u["UploadId"])
        upload_id = uploads[-1]["UploadId"]
        parts: dict[int, tuple[str, int]] = {}
        for page in self.s3.get_paginator("list_parts").paginate(
                Bucket=self.bucket, Key=key, UploadId=upload_id):
            for p in page.get("Parts", []):
                parts[p["PartNumber"]] = (p["ETag"], p["Size"])
        return upload_id, parts

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 -- already gone
            pass

    def fetch(self, step: int, dest: str) -> int:
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=self.part_bytes,
                             multipart_chunksize=self.part_bytes, max_concurrency=self.threads)
        base = self._key(step)
        objs = self._keys(base)
        names = {o["Key"][len(base):] for o in objs}
        if MANIFEST not in names:
            raise FileNotFoundError(f"{self.url}: step {step} is not committed")
        total = 0
        for o in objs:
            name = o["Key"][len(base):]
            if "/" in name or name in ("", ".", ".."):
                raise ValueError(f"{self.url}: unexpected object {o['Key']!r} in step {step}")
            path = os.path.join(dest, name)
            self.s3.download_file(self.bucket, o["Key"], path, Config=cfg)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            total += o["Size"]
        return total

    def retain(self, keep: int, protect: frozenset[int] = frozenset()) -> list[int]:
        info = self.steps()
        if any(li == roots.DAMAGED for li in info.values()):
            return []
        chain = roots.chain_of(info)
        kept = set(chain if keep <= 0 else chain[:keep]) | protect
        deleted = []
        for s in sorted(info):
            if s in kept:
                continue
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(s, MANIFEST))
            self._delete([{"Key": o["Key"]} for o in self._keys(self._key(s))])
            deleted.append(s)
        # What a copy that a crash cut short left of older steps that are not kept (objects
        # without a manifest, unfinished uploads) would cost storage forever: deleted.
        newest = max(kept, default=-1)
        base = f"{self.prefix}/" if self.prefix else ""

        def stale(key: str) -> bool:
            d = key[len(base):].split("/")[0]
            return bool(_STEP.match(d)) and int(d[5:]) not in kept and int(d[5:]) < newest

        orphans = [{"Key": o["Key"]} for o in self._keys(base) if stale(o["Key"])]
        self._delete(orphans)
        for page in self.s3.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=base):
            for u in page.get("Uploads", []):
                if stale(u["Key"]):
                    self._abort(u["Key"], u["UploadId"])
        return deleted

    def _delete(self, keys: list[dict[str, str]]) -> None:
        for i in range(0, len(keys), 1000):
            out = self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i:i + 1000]})
            if out.get("Errors"):
                e = out["Errors"][0]
                raise OSError(f"{self.url}: cannot delete {e.get('Key')}: {e.get('Code')} "
                              f"{e.get('Message')}")
