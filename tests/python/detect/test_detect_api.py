"""In-process tests of resilient.detect: two or three detectors sharing a TCPStore in one process
(each agent has its own threads and UDP socket), hostile packets, the hang watchdog, settings."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
from resilient._C import detect as native

from resilient.detect import FailureDetector

dist = pytest.importorskip("torch.distributed")


_SERVERS: list = []


class _Stores:
    """A TCPStore server plus one client per rank (a torch store client is not meant to be
    shared by threads that block in wait())."""

    def __init__(self, world: int) -> None:
        self.server = dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                                    timeout=datetime.timedelta(seconds=10),
                                    wait_for_workers=False)
        _SERVERS.append(self.server)

    def __getitem__(self, rank: int):
        return dist.TCPStore("127.0.0.1", self.server.port, is_master=False,
                             timeout=datetime.timedelta(seconds=10))


def _store(world: int) -> _Stores:
    return _Stores(world)


def _start_all(dets):
    threads = [threading.Thread(target=d.start) for d in dets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def _wait(pred, timeout):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_hostile_packets_are_dropped_and_counted():
    store = _store(2)
    dets = [FailureDetector(store[r], r, 2, job="api", host="127.0.0.1", hang_watchdog=False)
            for r in range(2)]
    _start_all(dets)
    try:
        addr = ("127.0.0.1", dets[0]._agent.port)
        good_other_job = native.encode_for_test("k" * 32, "another-job", 1, 0)
        forged = native.encode_for_test("not-the-job-key!" * 2, "api", 1, 0, run=dets[0].run_id)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for payload in (b"", b"x" * 10, b"\xff" * 2000, good_other_job, forged):
                s.sendto(payload, addr)
        assert _wait(lambda: dets[0].metrics()["dropped_malformed"] >= 2
                     and dets[0].metrics()["dropped_other_job"] >= 1
                     and dets[0].metrics()["dropped_bad_mac"] >= 1, 5), dets[0].metrics()
        time.sleep(0.5)
        m = dets[0].metrics()
        assert m["generation"] == 0 and m["live"] == 2  # nothing acted on the garbage
        assert m["acks_received"] > 0
        assert all(p["rtt_ms"] >= 0 and not p["suspected"] for p in m["peers"])
    finally:
        for d in dets:
            d.stop()


def test_hang_watchdog_reaches_every_rank(tmp_path):
    store = _store(3)
    hangs: list[tuple[int, str]] = []
    failures: list[tuple[list, int]] = []
    dets = [FailureDetector(store[r], r, 3, job="hang", host="127.0.0.1",
                            on_hang=lambda rank, sec: hangs.append((rank, sec)),
                            on_failure=lambda ranks, gen: failures.append((ranks, gen)),
                            event_log=str(tmp_path / f"r{r}.jsonl"),
                            watchdog_options={"min_step_limit_s": 0.5, "safety_factor": 3.0,
                                              "startup_limit_s": 30.0})
            for r in range(3)]
    _start_all(dets)
    try:
        t_stall = None
        for step in range(1, 200):
            for r, d in enumerate(dets):
                if r != 2 or step < 20:
                    d.step(step)
            if step == 20:
                t_stall = time.time()
            if len(hangs) >= 2:
                break
            time.sleep(0.02)
        assert _wait(lambda: len(hangs) >= 3, 5), hangs
        dt = time.time() - t_stall
        assert sorted(hangs) == [(2, "step")] * 3  # every rank, rank 2 included, agrees
        assert all(f == ([2], 1) for f in failures)
        assert 0.4 <= dt < 3.0  # limit 0.5 s counted from the last step, ~20 ms before t_stall
        assert dets[0].generation == (1, [0, 1])
        assert dets[0].metrics()["hang_limit_s"] >= 0.5
    finally:
        for d in dets:
            d.stop()
    log = (tmp_path / "r0.jsonl").read_text()
    assert '"kind": "generation"' in log and '"reason": "hang"' in log


def test_checkpoint_section_has_its_own_limit():
    store = _store(2)
    hangs: list = []
    dets = [FailureDetector(store[r], r, 2, job="sec", host="127.0.0.1",
                            on_hang=lambda rank, sec: hangs.append((rank, sec)),
                            watchdog_options={"min_step_limit_s": 0.3, "startup_limit_s": 30.0,
                                              "checkpoint_section_limit_s": 0.8})
            for r in range(2)]
    _start_all(dets)
    try:
        stop = threading.Event()

        def keep_stepping(d: FailureDetector) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                d.step(n)
                time.sleep(0.02)

        t = threading.Thread(target=keep_stepping, args=(dets[0],))
        t.start()
        for step in range(1, 10):
            dets[1].step(step)
            time.sleep(0.02)
        try:
            with dets[1].section("checkpoint"):
                time.sleep(0.5)  # over the step limit, under the checkpoint limit
                assert dets[1].metrics()["section"] == "checkpoint"
                assert not hangs
                assert _wait(lambda: len(hangs) >= 2, 3)  # ...until the checkpoint limit passes
        finally:
            stop.set()
            t.join()
        assert set(hangs) == {(1, "checkpoint")}
    finally:
        for d in dets:
            d.stop()


def test_settings_validate_and_env_overrides(monkeypatch):
    store = _store(1)
    monkeypatch.setenv("RESILIENT_DETECT_HEARTBEAT_MS", "50")
    d = FailureDetector(store[0], 0, 1, job="cfg", host="127.0.0.1")
    assert d._opts.core.heartbeat_interval_s == pytest.approx(0.05)
    d.set_option("watch_count", 4)
    assert d._opts.core.watch_count == 4
    with pytest.raises(ValueError):
        d.set_option("no_such_option", 1)
    with pytest.raises(ValueError):
        FailureDetector(store[0], 3, 2)
    monkeypatch.setenv("RESILIENT_DETECT_PHI_THRESHOLD", "abc")
    with pytest.raises(ValueError):
        FailureDetector(store[0], 0, 1, job="cfg2", host="127.0.0.1")


def test_prometheus_collector():
    prometheus_client = pytest.importorskip("prometheus_client")
    store = _store(2)
    dets = [FailureDetector(store[r], r, 2, job="prom", host="127.0.0.1", hang_watchdog=False)
            for r in range(2)]
    _start_all(dets)
    try:
        time.sleep(0.4)
        reg = prometheus_client.CollectorRegistry()
        reg.register(dets[0].prometheus_collector())
        text = prometheus_client.generate_latest(reg).decode()
        assert "resilient_detect_pings_sent_total" in text
        assert 'resilient_detect_rtt_ms{peer="1",rank="0"}' in text
    finally:
        for d in dets:
            d.stop()


@pytest.mark.parametrize("run_ids", [(None, None), ("run-a", "run-b")])
def test_a_store_and_job_name_reused_by_the_next_run_evict_nobody(run_ids):
    """Finding 2: a launcher's store outlives its workers. Run A leaves its addresses, key and a
    generation without rank 2 in it; run B, same store and job name, rank 2 starting late, must
    read none of it (run ids from the caller, or agreed through the store)."""
    store = _store(3)
    a = [FailureDetector(store[r], r, 3, job="reuse", run_id=run_ids[0], host="127.0.0.1",
                         hang_watchdog=False) for r in range(3)]
    _start_all(a)
    try:
        a[2].stop()
        assert _wait(lambda: a[0].generation == (1, [0, 1]), 5), a[0].generation
    finally:
        for d in a:
            d.stop()
    b = [FailureDetector(store[r], r, 3, job="reuse", run_id=run_ids[1], host="127.0.0.1",
                         hang_watchdog=False) for r in range(3)]
    early = [threading.Thread(target=d.start) for d in b[:2]]
    for t in early:
        t.start()
    time.sleep(1.0)  # ranks 0 and 1 would read run A's addr/2 now
    b[2].start()
    for t in early:
        t.join(30)
    try:
        assert len({d.run_id for d in b}) == 1 and b[0].run_id != a[0].run_id
        time.sleep(1.5)
        for d in b:
            m = d.metrics()
            assert d.generation == (0, [0, 1, 2]), (d.rank, d.generation)
            assert m["live"] == 3 and m["confirmations"] == 0, m
            assert m["acks_received"] > 0 and not any(p["suspected"] for p in m["peers"])
    finally:
        for d in b:
            d.stop()


def test_run_id_comes_from_the_launcher(monkeypatch):
    from resilient.detect import launcher_run_id

    monkeypatch.delenv("RESILIENT_DETECT_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launcher_run_id() is None  # torchrun's default id names no run
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert launcher_run_id() == "job7.2"  # each restart is a run of its own
    monkeypatch.setenv("RESILIENT_DETECT_RUN_ID", "explicit")
    assert launcher_run_id() == "explicit"
    store = _store(1)
    d = FailureDetector(store[0], 0, 1, job="rid", host="127.0.0.1")
    assert d.run_id == "explicit"


def test_pings_from_elsewhere_or_replayed_get_no_answer():
    """Finding 3: a valid ping (right key and run) from another IP, or a replayed one from the
    sender's IP, is not answered and does not move the address acks go to."""
    store = _store(2)
    dets = [FailureDetector(store[r], r, 2, job="ping", host="127.0.0.1", hang_watchdog=False)
            for r in range(2)]
    _start_all(dets)
    try:
        time.sleep(0.5)
        key, run = bytes(dets[0]._opts.key), dets[0].run_id
        target = ("127.0.0.1", dets[0]._agent.port)
        fresh = native.encode_for_test(key, "ping", 1, 0, run=run, to=0, seq=1 << 40,
                                       time_ns=native.monotonic_ns())
        replayed = native.encode_for_test(key, "ping", 1, 0, run=run, to=0, seq=1,
                                          time_ns=native.monotonic_ns())
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as elsewhere, \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as same_ip:
            elsewhere.bind(("127.0.0.2", 0))
            same_ip.bind(("127.0.0.1", 0))
            for _ in range(20):
                elsewhere.sendto(fresh, target)
                same_ip.sendto(replayed, target)
                time.sleep(0.02)
            for s in (elsewhere, same_ip):
                s.settimeout(0.5)
                with pytest.raises(TimeoutError):
                    s.recvfrom(2048)  # no ack, no state
        m = dets[0].metrics()
        assert m["dropped_unknown_source"] >= 20 and m["dropped_replay"] >= 20, m
        time.sleep(0.5)
        m1 = dets[1].metrics()  # rank 1 still gets its acks: the reply address did not move
        assert m1["generation"] == 0 and not any(p["suspected"] for p in m1["peers"]), m1
        acks = m1["acks_received"]
        assert _wait(lambda: dets[1].metrics()["acks_received"] >= acks + 3, 2)
    finally:
        for d in dets:
            d.stop()


def test_a_bad_detector_setting_is_a_value_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_DETECT_HEARTBEAT_MS", "0")
    with pytest.raises(ValueError, match="RESILIENT_DETECT_HEARTBEAT_MS"):
        native.CoreOptions.from_env(0, 2)
    monkeypatch.delenv("RESILIENT_DETECT_HEARTBEAT_MS")
    monkeypatch.setenv("RESILIENT_DETECT_HANG_SAFETY_FACTOR", "lots")
    with pytest.raises(ValueError, match="RESILIENT_DETECT_HANG_SAFETY_FACTOR='lots'"):
        native.WatchdogOptions.from_env()
    monkeypatch.delenv("RESILIENT_DETECT_HANG_SAFETY_FACTOR")
    core = native.CoreOptions.from_env(0, 2)
    core.watch_count = 0
    with pytest.raises(ValueError, match="watch_count"):
        core.validate()
