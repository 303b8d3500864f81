"""resilient.ports: ports for servers we start come from below the ephemeral range, are free on
every address, distinct, and a port already bound is never handed out."""

from __future__ import annotations

import socket

import pytest

from resilient import ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    low = ports._ephemeral_low()
    for port in got:
        assert 10000 <= port < low
        with socket.socket() as s:
            s.bind(("", port))  # free on every address


def test_a_bound_port_is_skipped(monkeypatch):
    busy, free = ports.free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))  # a listener on one address blocks the port
        taken.listen()
        picks = iter([busy, busy, free])

        class Scripted:
            def randint(self, lo, hi):
                return next(picks)

        monkeypatch.setattr(ports.random, "SystemRandom", Scripted)
        assert ports.free_ports(1) == [free]


def test_gives_up_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(ports, "_bindable", lambda p: False)
    with pytest.raises(OSError, match="no free TCP port"):
        ports.free_port()


def test_a_host_whose_ephemeral_range_starts_low_gets_the_os_choice(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1024)
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(p > 0 for p in got)


def test_bindable_sees_a_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not ports._bindable(s.getsockname()[1])
