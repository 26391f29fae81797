"""The authorizer's record of admitted tunnels: bounded, forgotten with the CONNECT's line, no lease in a repr."""

from __future__ import annotations

from egress_proxy.decision.types import Lease
from egress_proxy.lane.ingest import Admissions
from egress_proxy.lane.tunnels import Tunnel, Tunnels


def _tunnel(exp: int = 2_000_000_000) -> Tunnel:
    return Tunnel(Lease("agent-1", "ci", None, exp), ("93.184.216.34",), "api.acme-test.dev", 443)


def test_the_record_is_bounded_oldest_first():
    tunnels = Tunnels(bound=3)
    for i in range(5):
        tunnels.open(f"t{i}", _tunnel())
    assert len(tunnels) == 3
    assert tunnels.get("t0") is None and tunnels.get("t1") is None and tunnels.get("t4") is not None
    assert tunnels.get(None) is None and tunnels.get("") is None


def test_a_tunnel_is_forgotten_when_the_reader_reads_its_connect_line():
    admissions = Admissions()
    admissions.tunnels.open("c1", _tunnel())
    admissions.forget("c1")  # the CONNECT's line, decided by the authorizer
    assert admissions.tunnels.get("c1") is None


def test_an_expired_tunnel_is_kept_so_its_requests_are_refused_lease_expired():
    tunnels = Tunnels()
    tunnels.open("c1", _tunnel(exp=1))
    assert tunnels.get("c1").lease.exp == 1  # the authorizer refuses `lease-expired`, not an unknown tunnel


def test_no_lease_in_a_repr():
    assert "agent-1" not in repr(_tunnel())
