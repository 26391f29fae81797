"""Loopback ports for a server that binds after the test picked its port (a child process, Envoy, a proxy whose
routing must name the port before it starts).

Binding port 0 and letting it go leaves a window in which anything else on the machine may take that port: on a
busy run, another xdist worker's upstream (every `bind(0)` draws from the kernel's ephemeral range) or the source
port of an outgoing connection. So the ports handed out here come from below the ephemeral range (32768 and up by
default, `net.ipv4.ip_local_port_range`), where neither can land, split into one slice per xdist worker, and each
is handed out once per process, in turn: no other worker of this run picks it, and no test of this one gets a port
a previous test's server may still hold. A candidate is still tried with a bind, so a port something else on the
machine uses (or one a closed server left in TIME_WAIT) is skipped.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

LOW, HIGH = 20000, 32000  # below the ephemeral range


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), index + 1)
    high = min(HIGH, _ephemeral_low())
    span = (high - LOW) // count
    assert span >= 100, f"no room for ports below the ephemeral range ({high}) for {count} workers"
    start = LOW + index * span
    return range(start, start + span)


def _turn() -> itertools.cycle:
    """The slice in turn, from a point this process's id picks (two runs on one machine start apart)."""
    ports = _slice()
    at = os.getpid() % len(ports)
    return itertools.cycle([*ports[at:], *ports[:at]])


_LOCK = threading.Lock()
_NEXT = _turn()


def free_port() -> int:
    """A loopback port nothing listens on now and no other test of this run is handed."""
    with _LOCK:
        for _ in range(2000):
            port = next(_NEXT)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free loopback port in this worker's slice")
