"""A bounded loopback load through the real proxy: mixed allowed and denied requests over both
transports (absolute-form in the clear, CONNECT+TLS with keep-alive inside the tunnel), from N threads.

`run_load(proxy, total, concurrency)` returns the figures: requests sent, errors (an answer that is not
the expected status and reason, or a transport failure), audit events (one decision event per request and
per tunnel, one outcome event per allow, linked by `id`; `unlinked` counts an allow without its outcome or
an outcome without its allow), whether every line of the log verifies under the audit key, and leaks
(occurrences of the canary or any of its encodings in the audit log, the proxy's log output and every
answer a client got).
Used by tests/conformance/test_load.py (short) and bench/soak.py (long).
"""

from __future__ import annotations

import collections
import json
import ssl
import threading
import time
from dataclasses import dataclass, field

from egress_proxy.audit.verify import verify_logs
from egress_proxy.custody.keys import load_audit_key
from tests.conformance.wire import open_socket, read_answer, tls_client
from tests.proxy_harness import canary_needles

API = "api.acme-test.dev"

# kind -> (method, path, lease, expected status, expected audit reason); absolute-only kinds are marked.
JOBS = {
    "allow": ("GET", "/repos/acme/load", "GH", 200, "allowed"),
    "echo": ("GET", "/echo", "GH", 200, "allowed"),  # the upstream echoes the credential: redacted
    "deny-path": ("GET", "/admin", "GH", 403, "path-not-allowed"),
    "deny-method": ("DELETE", "/repos/acme/x", "GH", 403, "method-not-allowed"),
    "deny-traversal": ("GET", "/repos/acme/../admin", "GH", 403, "path-dot-segment"),
    "deny-override": ("GET", "/repos/acme/x", "GH", 200, "allowed"),  # with X-HTTP-Method-Override: stripped
}
ABSOLUTE_ONLY = {
    "profile": ("GET", "/simple/pip/", "CI", 200, "allowed"),
    "lease-missing": ("GET", "/repos/acme/x", None, 407, "lease-missing"),
    "scheme": ("GET", "/repos/acme/x", "GH", 403, "scheme-not-allowed"),
}
TUNNEL_CYCLE = ["allow", "echo", "deny-path", "allow", "deny-method", "deny-traversal", "allow", "deny-override"]
ABSOLUTE_CYCLE = ["allow", "profile", "deny-path", "echo", "lease-missing", "allow", "scheme", "deny-traversal", "profile", "deny-method"]


@dataclass
class Figures:
    requests: int = 0
    errors: int = 0
    events: int = 0
    request_events: int = 0
    connect_events: int = 0
    outcome_events: int = 0
    unlinked: int = 0
    tunnels: int = 0
    leaks: int = 0
    chain_ok: bool = False
    seconds: float = 0.0
    sent: collections.Counter = field(default_factory=collections.Counter)  # expected audit reasons
    audited: collections.Counter = field(default_factory=collections.Counter)  # audited reasons (request events)
    error_samples: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"requests={self.requests} errors={self.errors} events={self.events} (request {self.request_events}, "
                f"connect {self.connect_events}, outcome {self.outcome_events}, unlinked {self.unlinked}) leaks={self.leaks} "
                f"chain={'ok' if self.chain_ok else 'BROKEN'} "
                f"seconds={self.seconds:.1f} req/s={self.requests / max(self.seconds, 1e-9):.0f}")


class _Worker(threading.Thread):
    def __init__(self, proxy, index: int, budget, figures: Figures, lock: threading.Lock, shown: list[bytes]) -> None:
        super().__init__(daemon=True, name=f"load-{index}")
        self.proxy, self.index, self.budget, self.figures, self.lock, self.shown = proxy, index, budget, figures, lock, shown
        self.tunnel = index % 2 == 1
        self.conn = None
        self.bound: str | None = None  # the lease the open connection is bound to (absolute-form)
        self.leases = {"GH": proxy.lease(connection="github", ttl=3600), "CI": proxy.lease(profile="ci", ttl=3600)}
        self.local_shown: list[bytes] = []
        self.local_sent: collections.Counter = collections.Counter()
        self.local_errors: list[str] = []
        self.local_tunnels = 0

    def _open(self):
        sock = open_socket(self.proxy.host, self.proxy.port, 60)  # a budget: 20 threads share one loaded machine
        if not self.tunnel:
            return sock
        sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {self.leases['GH']}\r\n\r\n".encode())
        answer = read_answer(sock, "CONNECT")
        if answer.status != 200:
            sock.close()
            raise ConnectionError(f"CONNECT answered {answer.status}")
        self.local_tunnels += 1
        return tls_client(sock, self.proxy.ca, API)

    def _wire(self, kind: str, n: int) -> bytes:
        method, path, lease, _, _ = JOBS.get(kind) or ABSOLUTE_ONLY[kind]
        path = f"{path}/{n}" if kind == "allow" else path
        extra = "X-HTTP-Method-Override: DELETE\r\n" if kind == "deny-override" else ""
        extra += f"Authorization: Bearer client-load-{n}\r\nAccept: application/json\r\n"
        if self.tunnel:
            return f"{method} {path} HTTP/1.1\r\nHost: {API}\r\n{extra}\r\n".encode()
        scheme, host = ("http", "pkgs.acme-test.dev") if kind in ("profile", "scheme") else ("https", API)
        if lease is not None:
            extra += f"Proxy-Authorization: Bearer {self.leases[lease]}\r\n"
        return f"{method} {scheme}://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()

    def run(self) -> None:
        cycle = TUNNEL_CYCLE if self.tunnel else ABSOLUTE_CYCLE
        i = self.index
        while True:
            n = self.budget()
            if n is None:
                break
            kind = cycle[i % len(cycle)]
            i += 1
            _, _, lease, status, reason = JOBS.get(kind) or ABSOLUTE_ONLY[kind]
            self.local_sent[reason] += 1
            if not self.tunnel and lease is not None and self.bound not in (None, lease):
                self._close()  # one client connection, one subject: another lease needs another connection
            try:
                if self.conn is None:
                    self.conn, self.bound = self._open(), None
                if lease is not None:
                    self.bound = lease
                self.conn.sendall(self._wire(kind, n))
                answer = read_answer(self.conn, JOBS.get(kind, ABSOLUTE_ONLY.get(kind))[0])
            except (OSError, ssl.SSLError, ConnectionError) as exc:
                self.local_errors.append(f"{kind}: {exc.__class__.__name__}: {exc}")
                self._close()
                continue
            self.local_shown.append(answer.raw)
            if answer.status is None:
                self.local_errors.append(f"{kind}: no answer ({answer.error})")
                self._close()
                continue
            ok = answer.status == status
            if status >= 400:
                ok = ok and answer.header("x-egresslaw-deny") == reason
            if kind == "echo":
                ok = ok and b"[REDACTED]" in answer.body
            if not ok:
                self.local_errors.append(f"{kind}: {answer.status} {answer.header('x-egresslaw-deny')}")
            if (answer.header("connection") or "").lower() == "close":
                self._close()
        self._close()

    def _close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
            self.conn = None


def run_load(proxy, total: int, concurrency: int, *, settle: float = 10.0) -> Figures:
    """Send `total` requests from `concurrency` threads; then count events, verify the chain, scan for leaks."""
    figures = Figures()
    lock = threading.Lock()
    counter = iter(range(total))

    def budget():
        with lock:
            return next(counter, None)

    shown: list[bytes] = []
    start_events = len(proxy.events())
    workers = [_Worker(proxy, i, budget, figures, lock, shown) for i in range(concurrency)]
    started = time.time()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    figures.seconds = time.time() - started
    figures.requests = total
    for w in workers:
        figures.sent.update(w.local_sent)
        figures.errors += len(w.local_errors)
        figures.error_samples += w.local_errors[:3]
        figures.tunnels += w.local_tunnels
        shown += w.local_shown
    # A decision event is written before its request goes upstream; the outcome once the flow finishes (some
    # after the client closed): wait for them.
    deadline = time.time() + settle
    while True:
        events = proxy.events()[start_events:]
        request_events = [e for e in events if e["kind"] == "request"]
        allows = {e["id"] for e in events if e["kind"] in ("request", "connect") and e["decision"] == "allow"}
        outcomes = [e["id"] for e in events if e["kind"] == "outcome"]
        unlinked = len(allows ^ set(outcomes)) + len(outcomes) - len(set(outcomes))
        if (len(request_events) >= total and not unlinked) or time.time() > deadline:
            break
        time.sleep(0.5)
    figures.events = len(events)
    figures.request_events = len(request_events)
    figures.connect_events = sum(1 for e in events if e["kind"] == "connect")
    figures.outcome_events = len(outcomes)
    figures.unlinked = unlinked
    figures.audited = collections.Counter(e["reason"] for e in request_events)
    # Every line verifies, MACs included; the log is still open (the proxy runs), so no closing checkpoint yet.
    figures.chain_ok = all(r.status in ("intact", "open") for _, r in verify_logs(proxy.env.audit.parent, key=load_audit_key(proxy.env.keys)))
    needles = canary_needles()
    blobs = [proxy.audit_bytes(), proxy.logs.text().encode("utf-8", "surrogateescape"), b"\n".join(shown)]
    figures.leaks = sum(blob.count(needle) for blob in blobs for needle in needles)
    return figures


def summary(figures: Figures) -> str:
    return figures.line() + "\n" + json.dumps({"sent": figures.sent, "audited": figures.audited}, sort_keys=True)
