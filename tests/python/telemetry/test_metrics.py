"""Per-rank Prometheus metrics: checkpoint series, age with an injected clock, events feed,
other components' collectors, and the HTTP endpoint."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from resilient.telemetry import events  # noqa: E402
from resilient.telemetry.metrics import RankMetrics, metrics_port  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def value(m: RankMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {"rank": m.rank, **labels})


def test_checkpoint_series_and_age():
    clock = Clock()
    m = RankMetrics(3, clock=clock)
    assert value(m, "resilient_checkpoint_age_seconds") == -1.0
    m.record_save(True, stall_s=0.02, durable_s=2.0, nbytes=4096)
    clock.now += 30
    assert value(m, "resilient_checkpoint_age_seconds") == pytest.approx(30.0)
    assert value(m, "resilient_checkpoint_bytes_total") == 4096
    assert value(m, "resilient_checkpoint_throughput_bytes_per_second") == 2048
    assert value(m, "resilient_checkpoint_stall_seconds_count") == 1
    m.record_save(False)
    assert value(m, "resilient_checkpoint_saves_total", result="failed") == 1
    assert value(m, "resilient_checkpoint_saves_total", result="ok") == 1
    # a failed save does not refresh the age
    assert value(m, "resilient_checkpoint_age_seconds") == pytest.approx(30.0)


def test_fed_by_events(monkeypatch):
    monkeypatch.delenv(events.ENV_DIR, raising=False)
    m = RankMetrics(0)
    m.follow_events()
    try:
        events.emit("step", step=7)
        events.emit("save_end", step=5, ok=True, seconds=1.5, stall_s=0.01, bytes=300)
        events.emit("recovery_end", step=5, seconds=4.0, path="in-job")
    finally:
        events.remove_listener(m.on_event)
    assert value(m, "resilient_step") == 7
    assert value(m, "resilient_checkpoint_bytes_total") == 300
    assert value(m, "resilient_recoveries_total", path="in-job") == 1
    assert value(m, "resilient_recovery_seconds_sum") == 4.0


def test_save_handle_stats():
    class Handle:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def wait(self, timeout=None):
            if self.fail:
                raise OSError(5, "EIO")

        def stats(self):
            return {"snapshot_s": 0.03, "durable_s": 0.5, "bytes": 1000}

    m = RankMetrics(1)
    m.observe_save(Handle(False))
    m.observe_save(Handle(True))
    assert value(m, "resilient_checkpoint_durable_seconds_sum") == 0.5
    assert value(m, "resilient_checkpoint_saves_total", result="failed") == 1


def test_detector_collector_is_exported():
    from prometheus_client.core import GaugeMetricFamily

    class Collector:
        def collect(self):
            g = GaugeMetricFamily("resilient_detect_rtt_ms", "rtt", labels=["rank", "peer"])
            g.add_metric(["0", "1"], 0.25)
            yield g

    class Detector:
        def prometheus_collector(self):
            return Collector()

    m = RankMetrics(0)
    m.attach_detector(Detector())
    labels = {"rank": "0", "peer": "1"}
    assert m.registry.get_sample_value("resilient_detect_rtt_ms", labels) == 0.25


def test_endpoint_serves_and_port_setting(monkeypatch):
    monkeypatch.delenv("RESILIENT_METRICS_PORT", raising=False)
    assert metrics_port() == 0
    m = RankMetrics(0)
    assert m.serve() == 0  # disabled without the setting
    monkeypatch.setenv("RESILIENT_METRICS_PORT", "9400")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert metrics_port() == 9403
    port = m.serve(port=0)
    try:
        m.record_save(True, 0.01, 0.1, 10)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"resilient_checkpoint_bytes_total" in body
    finally:
        m.close()
