"""Fault mechanics used by the chaos runner: signals, duty-cycle slowdown, a small tmpfs for
ENOSPC, trigger files for the engine's file-fault hook (RESILIENT_FAULT_*), checkpoint
corruption, and a network-namespace partition. Each needs only what it names; the ones that
need root or iproute2 say why they cannot run (``unavailable()``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, NoReturn


def signal_group(pid: int, sig: int) -> None:
    """Sends `sig` to the rank's process group (the rank and any children); ignores the dead."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class DutyCycle:
    """Slows a process: SIGSTOP for stop_ms, SIGCONT for run_ms, until stop() or `duration`."""

    def __init__(self, pid: int, stop_ms: float, run_ms: float, duration: float):
        self._pid, self._stop_s, self._run_s = pid, stop_ms / 1000, run_ms / 1000
        self._end = time.monotonic() + duration
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-slow", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._quit.is_set() and time.monotonic() < self._end:
            signal_group(self._pid, signal.SIGSTOP)
            self._quit.wait(self._stop_s)
            signal_group(self._pid, signal.SIGCONT)
            self._quit.wait(self._run_s)

    def stop(self) -> None:
        self._quit.set()
        self._thread.join(timeout=2)
        signal_group(self._pid, signal.SIGCONT)


def lose_device(device: Any) -> NoReturn:
    """Makes this process's device unusable, as a GPU fault does, and raises its error. On a
    CUDA device for real: an out-of-bounds index in a kernel, a device-side assert, which
    poisons the CUDA context (every later CUDA call fails). On a CPU device (tests without a
    GPU) emulated: the same torch.AcceleratorError, and resilient.recovery.device's probe of
    the device fails from now on."""
    import torch

    import resilient.recovery.device as device_state

    if torch.device(device).type == "cuda":
        x = torch.zeros(1, device=device)
        x[torch.tensor([1 << 20], device=device)] = 1.0
        torch.cuda.synchronize(device)  # raises: CUDA error: device-side assert triggered
        raise AssertionError("an out-of-bounds index did not fail the device")
    error = torch.AcceleratorError("CUDA error: device-side assert triggered (emulated)")
    error.error_code = 710  # cudaErrorAssert

    def probe(_device: Any) -> None:
        raise error

    device_state.probe = probe
    raise error


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories (step-N holding manifest.json), ascending."""
    out = []
    for p in Path(root).glob("step-*"):
        try:
            step = int(p.name[5:])
        except ValueError:
            continue
        if (p / "manifest.json").exists():
            out.append((step, p))
    return sorted(out)


def corrupt_newest(root: str | Path) -> int | None:
    """Flips 64 bytes in the middle of the newest committed step's largest data file.
    Returns the step damaged, or None when nothing is committed."""
    dirs = step_dirs(root)
    if not dirs:
        return None
    step, d = dirs[-1]
    files = sorted(d.glob("*.data"), key=lambda p: p.stat().st_size)
    if not files:
        return None
    victim = files[-1]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        off = max(0, size // 2 - 32)
        f.seek(off)
        data = f.read(64)
        f.seek(off)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())
    return step


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=20)


class SmallDisk:
    """A tmpfs of `size` mounted at `path` (root only), so the checkpoint disk can be filled."""

    def __init__(self, path: Path, size: str = "16m"):
        self.path = path
        self.mounted = False
        self._filler = path / ".chaos-filler"
        self._size = size

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "filling a disk needs root (a private tmpfs mount)"
        if shutil.which("mount") is None:
            return "mount(8) not found"
        return None

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={self._size}", "chaos-ckpt", str(self.path))
        self.mounted = True

    def fill(self) -> int:
        """Writes a filler file until the file system is full; returns the bytes written."""
        written = 0
        chunk = b"\0" * (1 << 16)
        with open(self._filler, "wb", buffering=0) as f:
            while True:
                try:
                    written += f.write(chunk)
                except OSError:
                    break
        return written

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            _run("umount", "-l", str(self.path), check=False)
            self.mounted = False


class FileFault:
    """The RESILIENT_FAULT_* environment for one rank and its trigger file: the engine's file
    hook fails (or, with error 0, delays) checkpoint file operations while the file exists."""

    def __init__(self, trigger: Path, ckpt_dir: Path, ops: str, error: str, delay_ms: float = 0):
        self.trigger = trigger
        self.env = {
            "RESILIENT_FAULT_OPS": ops,
            "RESILIENT_FAULT_ERRNO": error,
            "RESILIENT_FAULT_PATH": str(ckpt_dir),
            "RESILIENT_FAULT_TRIGGER": str(trigger),
            "RESILIENT_FAULT_DELAY_MS": str(delay_ms),
        }

    def arm(self) -> None:
        self.trigger.touch()

    def disarm(self) -> None:
        self.trigger.unlink(missing_ok=True)


class NetnsPartition:
    """Puts one rank in its own network namespace joined to the host by a veth pair; the
    partition takes the host end down, the heal brings it back."""

    def __init__(self, tag: str):
        sub = 200 + os.getpid() % 50
        self.ns, self.vh, self.vn = f"rsc{tag}", f"rch{tag}", f"rcn{tag}"
        self.host_ip, self.ns_ip = f"10.{sub}.78.1", f"10.{sub}.78.2"
        self.up = False

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "a partition needs root (network namespaces)"
        if shutil.which("ip") is None:
            return "iproute2 (ip) not found"
        return None

    def setup(self) -> None:
        if _run("ip", "netns", "add", self.ns, check=False).returncode != 0:
            raise OSError(f"ip netns add {self.ns} failed")
        self.up = True
        _run("ip", "link", "add", self.vh, "type", "veth", "peer", "name", self.vn)
        _run("ip", "link", "set", self.vn, "netns", self.ns)
        _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.vh)
        _run("ip", "link", "set", self.vh, "up")
        in_ns = ("ip", "netns", "exec", self.ns)
        _run(*in_ns, "ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.vn)
        _run("ip", "netns", "exec", self.ns, "ip", "link", "set", self.vn, "up")
        _run("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def cut(self) -> None:
        _run("ip", "link", "set", self.vh, "down")

    def heal(self) -> None:
        _run("ip", "link", "set", self.vh, "up", check=False)

    def teardown(self) -> None:
        if self.up:
            _run("ip", "link", "del", self.vh, check=False)
            _run("ip", "netns", "del", self.ns, check=False)
            self.up = False
