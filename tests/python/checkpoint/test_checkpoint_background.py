"""The checkpoint engine's background threads: names (what a crash report or `top -H` shows),
CPUs (background_cpus) and bad settings."""

from __future__ import annotations

import gc
import os
import time

import pytest

from resilient import Checkpointer


def _threads() -> dict[str, set[str]]:
    """Thread name -> the CPU lists its threads may run on."""
    out: dict[str, set[str]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        out.setdefault(fields["Name"], set()).add(fields["Cpus_allowed_list"])
    return out


def _wait_for(names: set[str]) -> dict[str, set[str]]:
    deadline = time.monotonic() + 10  # each thread sets itself up once it runs
    while not names <= set(threads := _threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads


def test_threads_carry_names_and_run_anywhere_by_default(tmp_path):
    names = {"rs-ckpt-writer", "rs-ckpt-copy", "rs-ckpt-hash"}
    with Checkpointer(tmp_path, keep=1):
        threads = _wait_for(names)
    assert names <= set(threads), threads
    with open("/proc/self/status") as f:  # the main thread's CPUs
        main = next(line.split(":\t", 1)[1].strip() for line in f
                    if line.startswith("Cpus_allowed_list"))
    assert threads["rs-ckpt-writer"] == {main}


def test_background_threads_run_on_the_given_cpus(tmp_path):
    gc.collect()  # engines of earlier tests' unclosed checkpointers, and their threads, go
    last = max(os.sched_getaffinity(0))
    with Checkpointer(tmp_path, keep=1, background_cpus=str(last)) as ck:
        ck.save(1, {"x": list(range(10))}).wait(30)
        threads = _wait_for({"rs-ckpt-writer", "rs-ckpt-hash", "rs-ckpt-copy"})
    assert threads["rs-ckpt-writer"] == {str(last)}
    assert threads["rs-ckpt-hash"] == {str(last)}
    # the snapshot copies are on the critical path and stay wherever the process may run
    assert threads["rs-ckpt-copy"] != {str(last)} or len(os.sched_getaffinity(0)) == 1


@pytest.mark.parametrize("bad", ["8-2", "x", "1,,2"])
def test_bad_cpu_list_is_a_clear_error(tmp_path, bad):
    msg = r"background_cpus \(RESILIENT_BACKGROUND_CPUS\): CPU list"
    with pytest.raises(ValueError, match=msg):
        Checkpointer(tmp_path, background_cpus=bad)


def test_bad_cpu_list_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_BACKGROUND_CPUS", "0-")
    with pytest.raises(ValueError, match="RESILIENT_BACKGROUND_CPUS.*bad part '0-'"):
        Checkpointer(tmp_path)


def test_wait_cleanup_returns_once_retention_deleted_the_old_steps(tmp_path):
    import torch

    import resilient

    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    with resilient.Checkpointer(tmp_path / "c", keep=1) as ck:
        for step in range(4):
            ck.save(step, state)
        ck.wait_cleanup(timeout=60)
        names = sorted(p.name for p in (tmp_path / "c").iterdir() if "step" in p.name)
        assert names == ["step-000000000003"], names
