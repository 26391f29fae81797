"""`egresslaw sandbox-run`: egress only through the proxy, as a structural fact, shown on the real system.

The stand-ins listen on an address that exists only on this machine: a veth the test creates on the host
(10.213.X.Y/32, removed at teardown), never an address beyond it. Three of them count what reaches them:
an HTTP server, a TCP server and a DNS server. As a control, from outside the namespace, each is reached
(Node 20's `fetch` reaches its server directly although HTTPS_PROXY/HTTP_PROXY name the proxy: the bypass
this command closes). Inside `egresslaw sandbox-run` the same clients fail closed (no route), the counters
stand still and the proxy saw nothing; curl, configured only by the environment sandbox-run gives it,
reaches the TLS stand-in through the real proxy (in-process, tests/proxy_harness.py) with a 200, and the
proxy's audit log has the event. The relay's own rules (one destination, a connection limit, the proxy
going away) are shown against an echo server standing in for the proxy.

A stand-in's counter is read after a fence: one more connection (or query) from outside, waited for, so
every earlier one has been counted; no sleep is a synchronisation here.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from egresslaw.commands.sandbox_env import wgetrc_path
from tests.proxy_harness import (
    HOSTS,
    free_port,
    make_env,
    start_proxy,
    stop_proxy,
    wait_for,
)

pytestmark = pytest.mark.slow

EGRESSLAW = str(Path(sys.executable).with_name("egresslaw"))
TOOLS = {name: shutil.which(name) for name in ("ip", "node", "curl", "bash", "setpriv")}
API = "api.acme-test.dev"
TIMEOUT = 60  # seconds any one sandboxed command may take on a loaded machine (they take well under one)
NODE_FETCH = ("fetch(process.argv[1]).then(async r => console.log('status', r.status, await r.text()),"
              " e => { console.log('failed', (e.cause && e.cause.code) || e.message); process.exit(3); })")
RAW_TCP = 'exec 3<>"/dev/tcp/$0/$1" && echo connected'
DNS_QUERY = """
import sys, dns.message, dns.query
try:
    answer = dns.query.udp(dns.message.make_query("probe.acme-test.dev", "A"), sys.argv[1], port=int(sys.argv[2]), timeout=10)
    print("answer", answer.answer[0][0].address)
except OSError as exc:
    print("failed", exc.__class__.__name__, exc.errno)
    sys.exit(3)
"""


def _netns_problem() -> str | None:
    """Why no network namespace can be made here (neither as root nor in a user namespace), or None."""
    code = ("import os\ntry:\n    os.unshare(os.CLONE_NEWNET)\nexcept PermissionError:\n"
            "    os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET)\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=TIMEOUT)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["unshare failed"])[-1]


@pytest.fixture(scope="module", autouse=True)
def namespaces():
    problem = _netns_problem()
    if problem is not None:
        pytest.skip(f"network namespaces cannot be created here (not root and no user namespaces): {problem}")


# ---------------------------------------------------------------------------------------------
# Stand-ins on an address of this machine only
# ---------------------------------------------------------------------------------------------


class TcpStandin:
    """Counts accepted TCP connections on (address, port); with `http`, answers one request `200 reached`."""

    def __init__(self, address: str, http: bool = False, echo: bool = False) -> None:
        self.sock = socket.create_server((address, 0))
        self.address, self.port = address, self.sock.getsockname()[1]
        self.http, self.echo = http, echo
        self.hits = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True, name=f"standin-{self.port}").start()

    def count(self) -> int:
        with self.lock:
            return self.hits

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.hits += 1  # counted before a byte is read or answered
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TIMEOUT)
            try:
                if self.echo:
                    while data := conn.recv(65536):
                        conn.sendall(data)
                elif self.http:
                    head = b""
                    while b"\r\n\r\n" not in head and len(head) < 65536:
                        chunk = conn.recv(4096)
                        if not chunk:
                            return
                        head += chunk
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 7\r\nConnection: close\r\n\r\nreached")
            except OSError:
                pass

    def fence(self, expected: int) -> bool:
        """Connect once more from outside and wait until it is counted as `expected`: every earlier accept is counted."""
        with socket.create_connection((self.address, self.port), timeout=TIMEOUT):
            return wait_for(lambda: self.count() >= expected, timeout=TIMEOUT) and self.count() == expected

    def stop(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self.sock.close()


class DnsStandin:
    """A UDP DNS server on (address, port): counts every datagram, answers A queries with its own address."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 0))
        self.sock.settimeout(0.2)
        self.address, self.port = address, self.sock.getsockname()[1]
        self.hits = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        threading.Thread(target=self._serve, daemon=True, name=f"dns-standin-{self.port}").start()

    def count(self) -> int:
        with self.lock:
            return self.hits

    def _serve(self) -> None:
        import dns.exception
        import dns.message
        import dns.rrset

        while not self.stopping.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                self.hits += 1  # counted before it is answered
            try:
                query = dns.message.from_wire(data)
            except dns.exception.DNSException:
                continue  # not a DNS message: counted, not answered
            answer = dns.message.make_response(query)
            answer.answer.append(dns.rrset.from_text(query.question[0].name, 60, "IN", "A", self.address))
            self.sock.sendto(answer.to_wire(), peer)

    def fence(self, expected: int) -> bool:
        """One more query from outside, answered: every earlier datagram has been counted."""
        import dns.message
        import dns.query

        dns.query.udp(dns.message.make_query("fence.acme-test.dev", "A"), self.address, port=self.port, timeout=TIMEOUT)
        return self.count() == expected

    def stop(self) -> None:
        self.stopping.set()
        self.sock.close()


@pytest.fixture(scope="module")
def host_address():
    """An IPv4 address only this machine has: on the host end of a veth pair the test creates (and removes)."""
    if os.geteuid() != 0 or TOOLS["ip"] is None:
        pytest.skip("the stand-ins' host-only address needs root and `ip` (ip link add … type veth)")
    pid = os.getpid()
    name, address = f"elt{pid % 100000}", f"10.213.{(pid >> 8) % 250}.{pid % 250 + 2}"
    ip = TOOLS["ip"]
    subprocess.run([ip, "link", "add", name, "type", "veth", "peer", "name", f"{name}p"], check=True, capture_output=True, timeout=TIMEOUT)
    try:
        for argv in (["addr", "add", f"{address}/32", "dev", name], ["link", "set", f"{name}p", "up"], ["link", "set", name, "up"]):
            subprocess.run([ip, *argv], check=True, capture_output=True, timeout=TIMEOUT)
        yield address
    finally:
        subprocess.run([ip, "link", "del", name], check=False, capture_output=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def standins(host_address):
    found = {"http": TcpStandin(host_address, http=True), "tcp": TcpStandin(host_address), "dns": DnsStandin(host_address)}
    yield found
    for standin in found.values():
        standin.stop()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, tls_upstream):
    env = make_env(tmp_path_factory.mktemp("sandbox-run-edge"))
    p = start_proxy(env, pki, (tls_upstream,), [f"{h}:443:127.0.0.1:{tls_upstream.port}" for h in HOSTS])
    p.tokens = []  # every lease handed to a sandbox: none may appear in a log line or an event
    yield p
    stop_proxy(p)
    p.assert_nothing_leaked()
    text = p.logs.text() + p.audit_bytes().decode()
    assert not any(t in text for t in p.tokens), "a lease is in the proxy's logs or audit log"


@pytest.fixture
def echo_proxy():
    """An echo server on the host's loopback, standing in for the proxy where the relay itself is tested."""
    standin = TcpStandin("127.0.0.1", echo=True)
    yield standin
    standin.stop()


def host_environment(**extra: str) -> dict[str, str]:
    """This environment without proxy or EGRESSLAW_* variables (sandbox-run's own), plus `extra`."""
    base = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("EGRESSLAW_")}
    return {**base, **extra}


def sandbox_run(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """`egresslaw sandbox-run ARGS…` as a process of its own (it forks: never inside the test process)."""
    return subprocess.run([EGRESSLAW, "sandbox-run", *args], check=False, capture_output=True, text=True, timeout=TIMEOUT,
                          env=env or host_environment(), stdin=subprocess.DEVNULL, **kw)


def start_sandbox(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([EGRESSLAW, "sandbox-run", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or host_environment(), start_new_session=True)


def read_line(proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
    """The next line CMD printed, waiting at most `timeout` seconds (then the process is killed and the test fails)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        pytest.fail(f"no line from the sandbox within {timeout} s: {proc.communicate()[1]}")
    return proc.stdout.readline().strip()


def proxy_address(p) -> str:
    return f"{p.host}:{p.port}"


# ---------------------------------------------------------------------------------------------
# Clients that ignore the proxy: reached from outside, nothing from inside
# ---------------------------------------------------------------------------------------------


def _client(kind: str, standins) -> tuple[object, list[str], str]:
    """The stand-in, the client's argv, and what the client prints when it reaches it."""
    if kind == "node-fetch":
        s = standins["http"]
        return s, [TOOLS["node"], "-e", NODE_FETCH, f"http://{s.address}:{s.port}/"], "status 200 reached"
    if kind == "raw-tcp":
        s = standins["tcp"]
        return s, [TOOLS["bash"], "-c", RAW_TCP, s.address, str(s.port)], "connected"
    s = standins["dns"]
    return s, [sys.executable, "-c", DNS_QUERY, s.address, str(s.port)], f"answer {s.address}"


@pytest.mark.parametrize("kind", ["node-fetch", "raw-tcp", "dns"])
def test_a_client_that_ignores_the_proxy_reaches_nothing_from_inside(kind, standins, proxy):
    if kind == "node-fetch" and TOOLS["node"] is None:
        pytest.skip("node is not installed")
    standin, argv, reached = _client(kind, standins)
    start = standin.count()
    # The control: from this host, with the proxy named in every proxy variable, the client goes direct.
    url = f"http://{proxy_address(proxy)}"
    outside = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=TIMEOUT,
                             env=host_environment(HTTPS_PROXY=url, HTTP_PROXY=url, https_proxy=url, http_proxy=url))
    assert (outside.returncode, outside.stdout.strip()) == (0, reached), outside.stderr
    assert standin.fence(start + 2)  # the control's hit, then the fence's
    mark = proxy.mark()

    inside = sandbox_run("--proxy", proxy_address(proxy), "--", *argv)

    assert inside.returncode != 0 and reached not in inside.stdout, inside
    failure = inside.stdout + inside.stderr
    assert "ENETUNREACH" in failure or "Network is unreachable" in failure or " 101" in failure, failure  # no route: fails at once
    assert standin.fence(start + 3)  # only the fence: not one connection or query from inside
    assert proxy.new_events(mark) == []  # nor did the attempt reach the proxy
    assert "Traceback" not in inside.stderr


def test_inside_there_is_only_loopback_and_the_environment_names_the_inside_listener(standins, proxy):
    code = ("import json, os, socket\n"
            "print(json.dumps({'links': socket.if_nameindex(), 'routes': open('/proc/net/route').read().splitlines()[1:],"
            " 'routes6': [l.split()[-1] for l in open('/proc/net/ipv6_route')], 'resolv': open('/etc/resolv.conf').read(),"
            " 'env': {k: v for k, v in os.environ.items() if 'proxy' in k.lower() or k.startswith('EGRESSLAW_')}}))")
    stray = f"http://{standins['tcp'].address}:{standins['tcp'].port}"
    done = sandbox_run("--proxy", proxy_address(proxy), "--", sys.executable, "-c", code,
                       env=host_environment(HTTPS_PROXY=stray, ALL_PROXY=stray, EGRESSLAW_KEYS="/srv/keys"))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["links"] == [[1, "lo"]]  # no interface but loopback ...
    assert seen["routes"] == [] and set(seen["routes6"]) <= {"lo"}  # ... and no route leaves it
    inside = "http://127.0.0.1:3128"
    assert {k: seen["env"][k] for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")} == dict.fromkeys(
        ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"), inside)
    assert seen["env"]["NO_PROXY"] == "" and "EGRESSLAW_KEYS" not in seen["env"]  # the host's settings do not leak in
    assert stray not in json.dumps(seen["env"])


def test_curl_configured_only_by_sandbox_run_reaches_the_tls_standin_through_the_proxy(proxy, tls_upstream, tmp_path):
    if TOOLS["curl"] is None:
        pytest.skip("curl is not installed")
    lease = proxy.lease(connection="github", subject="sandboxed-curl")
    proxy.tokens.append(lease)
    (tmp_path / "lease.txt").write_text(lease + "\n")
    mark = proxy.mark()

    done = sandbox_run("--proxy", proxy_address(proxy), "--lease-file", str(tmp_path / "lease.txt"), "--ca", str(proxy.ca),
                       "--bundle", str(tmp_path / "bundle.pem"), "--", TOOLS["curl"], "-sS", "--max-time", "30",
                       f"https://{API}/repos/acme/sandbox-run")

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"method": "GET", "path": "/repos/acme/sandbox-run", "tls": True}
    assert tls_upstream.raw_requests()[-1].path == "/repos/acme/sandbox-run"
    events = [e for e in proxy.settled(mark, timeout=TIMEOUT) if e["kind"] == "request"]
    assert [(e["host"], e["path"], e["decision"], e["status"], e["subject"]) for e in events] == [
        (API, "/repos/acme/sandbox-run", "allow", 200, "sandboxed-curl")]
    assert lease not in done.stderr + done.stdout
    bundle = str((tmp_path / "bundle.pem").resolve())
    assert Path(wgetrc_path(bundle)).read_text().count(bundle) == 1  # wget's CA too, as sandbox-env writes it


# ---------------------------------------------------------------------------------------------
# Exit codes, signals, errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("script", "code"), [("exit 7", 7), ("exit 0", 0), ("kill -KILL $$", 128 + signal.SIGKILL)])
def test_the_exit_code_is_cmds(echo_proxy, script, code):
    done = sandbox_run("--proxy", f"127.0.0.1:{echo_proxy.port}", "--", "sh", "-c", script)
    assert done.returncode == code, done.stderr
    assert done.stderr == ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_egresslaw_is_forwarded_to_cmd(echo_proxy, sig):
    code = ("import signal, sys, time\n"
            "def got(n, _):\n    print('got', n, flush=True)\n    sys.exit(40 + n)\n"
            "signal.signal(signal.SIGTERM, got)\nsignal.signal(signal.SIGINT, got)\n"
            "print('ready', flush=True)\ntime.sleep(120)\n")
    proc = start_sandbox("--proxy", f"127.0.0.1:{echo_proxy.port}", "--", sys.executable, "-c", code)
    assert read_line(proc) == "ready"
    proc.send_signal(sig)  # to egresslaw, not to CMD
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 40 + sig, err
    assert out.split() == ["got", str(int(sig))] and "Traceback" not in err


def test_a_command_that_does_not_exist_is_an_error(echo_proxy):
    for name in ("no-such-command-egresslaw", "/no/such/command"):
        done = sandbox_run("--proxy", f"127.0.0.1:{echo_proxy.port}", "--", name, "--flag")
        assert done.returncode == 2
        assert done.stderr.startswith(f"error: command `{name}` not found\nhelp: ") and "Traceback" not in done.stderr
    done = sandbox_run("--proxy", f"127.0.0.1:{echo_proxy.port}")
    assert (done.returncode, done.stderr.splitlines()[0]) == (2, "error: no command given")


def test_a_proxy_that_is_down_at_start_is_an_error_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    port = free_port()
    done = sandbox_run("--proxy", f"127.0.0.1:{port}", "--", "touch", str(marker))
    assert done.returncode == 2 and not marker.exists()
    assert done.stderr.splitlines() == [
        f"error: the proxy `127.0.0.1:{port}` is not reachable (connection refused); nothing was run",
        "help: start it (`egresslaw proxy`), or point --proxy or EGRESSLAW_PROXY at it",
    ]


def test_a_proxy_that_goes_away_resets_the_sandboxs_connections(echo_proxy):
    code = ("import socket, sys\n"
            "def attempt():\n"
            "    try:\n"  # a reset may come before create_connection() has returned
            "        with socket.create_connection(('127.0.0.1', 3128), timeout=30) as c:\n"
            "            c.sendall(b'ping')\n            return c.recv(4) or 'closed'\n"
            "    except (ConnectionResetError, BrokenPipeError):\n        return 'reset'\n"
            "print(attempt(), flush=True)\nsys.stdin.readline()\nprint(attempt(), flush=True)\n")
    proc = start_sandbox("--proxy", f"127.0.0.1:{echo_proxy.port}", "--", sys.executable, "-c", code)
    assert read_line(proc) == "b'ping'"  # relayed to the (echoing) proxy
    echo_proxy.stop()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert read_line(proc) in ("reset", "closed")
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert f"warning: the proxy `127.0.0.1:{echo_proxy.port}` is not reachable (connection refused)" in err


# ---------------------------------------------------------------------------------------------
# The relay: one destination, bounded
# ---------------------------------------------------------------------------------------------


def test_the_relay_only_ever_dials_the_proxy_and_holds_at_most_max_connections(echo_proxy, standins):
    tcp = standins["tcp"]
    start = tcp.count()
    code = (
        "import socket, sys, time\n"
        "def connect():\n    return socket.create_connection(('127.0.0.1', 3128), timeout=30)\n"
        "def echo(c, data):\n    c.sendall(data)\n    got = b''\n"
        "    while len(got) < len(data) and (chunk := c.recv(65536)):\n        got += chunk\n    return got\n"
        f"ask = b'CONNECT {tcp.address}:{tcp.port} HTTP/1.1\\r\\nHost: {tcp.address}:{tcp.port}\\r\\n\\r\\n'\n"
        "a, b = connect(), connect()\n"
        "print(echo(a, ask) == ask, echo(b, b'x' * 300000) == b'x' * 300000)\n"  # verbatim to the proxy, not obeyed
        "try:\n    third = connect().recv(1) or 'closed'\n"  # the reset may come before connect() has returned
        "except ConnectionResetError:\n    third = 'reset'\n"
        "print(third)\n"
        "a.close()\n"
        "deadline = time.monotonic() + 30\n"
        "while time.monotonic() < deadline:\n"  # the slot frees once the relay has seen `a` close
        "    try:\n        if echo(connect(), b'fourth') == b'fourth':\n            print('fourth relayed')\n            break\n"
        "    except OSError:\n        pass\n"
        "    time.sleep(0.02)\n"
    )
    done = sandbox_run("--max-connections", "2", "--", sys.executable, "-c", code,
                       env=host_environment(EGRESSLAW_PROXY=f"127.0.0.1:{echo_proxy.port}"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["True True", "reset", "fourth relayed"]
    assert echo_proxy.count() == 1 + 3  # the start-up check, then a, b and the fourth: the third never left the relay
    assert "warning: 2 connections are relayed already (--max-connections); a new one was reset" in done.stderr
    assert tcp.fence(start + 1)  # the CONNECT named it; nothing dialled it


def test_an_unprivileged_caller_gets_a_user_namespace_and_cmd_holds_no_capability(echo_proxy):
    system_python = "/usr/bin/python3"
    if os.geteuid() != 0 or TOOLS["setpriv"] is None or not os.access(system_python, os.X_OK):
        pytest.skip("needs root (to become `nobody` with setpriv) and /usr/bin/python3 for CMD")
    code = ("import json, os, socket\n"
            "c = socket.create_connection(('127.0.0.1', 3128), timeout=30)\nc.sendall(b'ping')\n"
            "status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if l.startswith('Cap'))\n"
            "print(json.dumps({'uid': os.getuid(), 'uid_map': open('/proc/self/uid_map').read().split(),"
            " 'eff': status['CapEff'], 'links': socket.if_nameindex(), 'echo': c.recv(4).decode()}))\n")
    # `nobody`, keeping only the right to read (this interpreter lives under /root): not CAP_SYS_ADMIN, so no plain
    # network namespace; sandbox-run makes a user namespace too.
    become = [TOOLS["setpriv"], "--reuid", "65534", "--regid", "65534", "--clear-groups",
              "--inh-caps", "+dac_read_search", "--ambient-caps", "+dac_read_search"]
    done = subprocess.run([*become, EGRESSLAW, "sandbox-run", "--proxy", f"127.0.0.1:{echo_proxy.port}", "--", system_python, "-c", code],
                          check=False, capture_output=True, text=True, timeout=TIMEOUT, env=host_environment(), cwd="/", stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert (seen["uid"], seen["uid_map"]) == (65534, ["65534", "65534", "1"])  # itself, in a user namespace of its own
    assert int(seen["eff"], 16) == 0  # no CAP_NET_ADMIN to add a route, no CAP_SYS_ADMIN to leave
    assert seen["links"] == [[1, "lo"]] and seen["echo"] == "ping"
