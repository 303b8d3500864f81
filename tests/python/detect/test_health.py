"""GPU health checks: NVML absent, forced on, the verdict, and a fake libnvidia-ml built here."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from resilient.detect import health
from resilient.detect.health import DeviceReading, HealthConfig

# A stand-in for libnvidia-ml.so.1 with the entry points health.py calls; FAKE_* variables pick
# what it reports for its 2 devices (device 1 is the sick one when FAKE_SICK=1).
FAKE_NVML = r"""
#include <stdlib.h>
static int sick(void) { const char* s = getenv("FAKE_SICK"); return s && *s == '1'; }
static long dev(void* h) { return (long)h - 0x100; }
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned* n) { *n = 2; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void** h) { *h = (void*)(0x100L + i); return 0; }
int nvmlDeviceGetTotalEccErrors(void* h, int type, int counter, unsigned long long* n) {
  *n = (sick() && dev(h) == 1 && type == 1 && counter == 0) ? 3 : 0; return 0; }
int nvmlDeviceGetRetiredPages(void* h, int cause, unsigned* n, void* addrs) {
  *n = (dev(h) == 1 && cause == 1) ? 2 : 0; return 0; }
int nvmlDeviceGetRetiredPagesPendingStatus(void* h, int* p) {
  *p = sick() && dev(h) == 1; return 0; }
int nvmlDeviceGetRemappedRows(void* h, unsigned* c, unsigned* u, unsigned* p, unsigned* f) {
  return 3; }
typedef struct { void* device; unsigned long long type, data; unsigned gi, ci; } ev_t;
static int queued = 0;
int nvmlEventSetCreate(void** s) { *s = (void*)1; queued = sick(); return 0; }
int nvmlDeviceRegisterEvents(void* h, unsigned long long types, void* s) { return 0; }
int nvmlEventSetWait_v2(void* s, ev_t* e, unsigned ms) {
  if (!queued) return 10;
  queued = 0; e->device = (void*)0x101; e->type = 8; e->data = 79; return 0; }
int nvmlEventSetFree(void* s) { return 0; }
"""


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the fake NVML")
    d = tmp_path_factory.mktemp("nvml")
    (d / "fake.c").write_text(FAKE_NVML)
    lib = d / "libnvidia-ml-fake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(d / "fake.c")], check=True,
                   timeout=60)
    return str(lib)


def test_absent_nvml_is_reported_and_not_fatal():
    r = health.check(HealthConfig(library="/nonexistent/libnvidia-ml.so.1"))
    assert not r.available and r.healthy
    assert "NVML not found" in r.reason


def test_forced_on_without_nvml_raises():
    with pytest.raises(RuntimeError, match="RESILIENT_NVML=on"):
        health.check(HealthConfig(nvml="on", library="/nonexistent/libnvidia-ml.so.1"))


def test_off_skips_the_checks():
    r = health.check(HealthConfig(nvml="off"))
    assert not r.available and r.healthy and "disabled" in r.reason


def test_settings_from_env_and_setter(monkeypatch):
    monkeypatch.setenv("RESILIENT_NVML", "OFF")
    monkeypatch.setenv("RESILIENT_HEALTH_XID_WATCH_MS", "250")
    c = HealthConfig.from_env()
    assert c.nvml == "off" and c.xid_watch_ms == 250
    monkeypatch.setenv("RESILIENT_NVML", "maybe")
    with pytest.raises(ValueError):
        HealthConfig.from_env()
    monkeypatch.delenv("RESILIENT_NVML")
    health.configure(xid_watch_ms=5)
    try:
        assert health.current_config().xid_watch_ms == 5
        with pytest.raises(TypeError):
            health.configure(bogus=1)
    finally:
        health._overrides.clear()


def test_judge():
    ok = DeviceReading(index=0, uncorrectable_ecc=0, retired_double_bit=4, retired_pending=False,
                       xids=[13, 31])  # application XIDs and old retirements are not fatal
    assert health.judge([ok]) == []
    bad = [DeviceReading(index=1, uncorrectable_ecc=2),
           DeviceReading(index=2, retired_pending=True),
           DeviceReading(index=3, remap_pending=True), DeviceReading(index=4, remap_failed=True),
           DeviceReading(index=5, xids=[79])]
    problems = health.judge(bad)
    assert len(problems) == 5
    assert "GPU 5" in problems[-1] and "79" in problems[-1]


def test_fake_nvml_healthy(fake_nvml, monkeypatch):
    monkeypatch.delenv("FAKE_SICK", raising=False)
    r = health.check(HealthConfig(library=fake_nvml, xid_watch_ms=10))
    assert r.available and r.healthy, r.problems
    assert [d.uncorrectable_ecc for d in r.devices] == [0, 0]
    assert r.devices[1].retired_double_bit == 2
    assert any("row remapping" in u for u in r.devices[0].unsupported)


def test_fake_nvml_sick_device_is_rejected(fake_nvml, monkeypatch):
    monkeypatch.setenv("FAKE_SICK", "1")
    r = health.check(HealthConfig(library=fake_nvml, xid_watch_ms=10))
    assert r.available and not r.healthy
    text = " ".join(r.problems)
    assert "GPU 1: 3 uncorrectable" in text and "pending" in text and "79" in text
    assert r.devices[0].xids == [] and r.devices[1].xids == [79]
