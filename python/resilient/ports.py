"""TCP ports for servers a process is about to start (a rendezvous store, a test's etcd)."""

from __future__ import annotations

import errno
import random
import socket

_LOWEST = 10000  #: below this, ports are often fixed by services (databases, exporters)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    """Free on every IPv4 address, and on every IPv6 one where the host has IPv6 (a store may
    listen on [::])."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    try:
        s6 = socket.socket(socket.AF_INET6)
    except OSError:  # no IPv6 here
        return True
    with s6:
        try:
            s6.bind(("::", port))
        except OSError as e:
            return e.errno != errno.EADDRINUSE  # another error: IPv6 is off, not the port taken
    return True


def free_ports(n: int = 1) -> list[int]:
    """`n` distinct TCP ports free on every address of this host now.

    They come from below the kernel's ephemeral range. A port from bind(0) is ephemeral, and
    the kernel also hands ephemeral ports to outgoing connections as their local ports, so any
    connection on the host can take it between the check and the server's bind (EADDRINUSE on
    a loaded host). A port below that range is only ever taken by an explicit bind.

    Raises:
        OSError: no free port was found in 1,000 tries.
    """
    high = _ephemeral_low() - 1
    if high - _LOWEST < 1000:  # a host whose ephemeral range starts low: take the OS's choice
        return _os_ports(n)
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(1000):
        port = rng.randint(_LOWEST, high)
        if port not in ports and _bindable(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise OSError(f"no free TCP port in {_LOWEST}..{high} after 1,000 tries")


def free_port() -> int:
    """One TCP port free now (see :func:`free_ports`)."""
    return free_ports(1)[0]


def _os_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
