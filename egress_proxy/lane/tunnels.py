"""The tunnels the lane's authorizer admitted, by the CONNECT's request id: what a request inside one is judged with.

The authorizer records each admitted CONNECT (`open`): its lease, the answers it judged, and the `host:port` it
judged. Envoy carries the CONNECT's id to the internal listener that terminates the tunnel (a filter-state object
shared with the upstream connection, `egress_proxy.lane.envoy`), and the inner listener's check names it; the
authorizer then admits each request inside the tunnel with the tunnel's lease and answers, as the edge does
(`egress_proxy.front.admit`, `lease=`, `answers=`). A request never resolves again inside a tunnel.

Bounded: at most `bound` tunnels (`TUNNELS_BOUND`; the oldest forgotten first, so a tunnel pushed out refuses
every later request inside it: fail closed). A tunnel is forgotten when the access-log reader reads the CONNECT's
line (Envoy writes it when the tunnel closes). A tunnel whose lease has expired is kept until then, so the requests
still sent inside it are refused `lease-expired` (the edge's answer), never admitted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from egress_proxy.decision.types import Lease

# Open tunnels are at most the front's connection bound (`--max-connections`, 8192 by default: a CONNECT takes its
# client connection); the rest are tunnels closed whose CONNECT line the reader has not read yet.
TUNNELS_BOUND = 65536


@dataclass(frozen=True, slots=True)
class Tunnel:
    """One admitted CONNECT: what every request inside it is judged with (the lease never in a repr)."""

    lease: Lease = field(repr=False)
    answers: tuple[str, ...]
    host: str
    port: int


class Tunnels:
    """Tunnel id (the CONNECT's request id) -> `Tunnel`, bounded (oldest first out)."""

    def __init__(self, bound: int = TUNNELS_BOUND) -> None:
        self.bound = bound
        self._open: OrderedDict[str, Tunnel] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def open(self, tid: str, tunnel: Tunnel) -> None:
        self._open[tid] = tunnel
        self._open.move_to_end(tid)
        while len(self._open) > self.bound:
            self._open.popitem(last=False)

    def get(self, tid: str | None) -> Tunnel | None:
        return self._open.get(tid) if tid else None

    def close(self, tid: str) -> None:
        """The tunnel's CONNECT line was read: it is closed, nothing more comes inside it."""
        self._open.pop(tid, None)
