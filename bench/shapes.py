"""Request shapes at the edge: the proxy's CPU per request for a 4 KiB MCP `tools/call` judged by an `mcp` rule, against
the same request under a plain rule, in one run.

One real in-process edge (`tests.proxy_harness.start_proxy`) in front of one upstream stand-in (a TLS HTTP/1.1
keep-alive server on 127.0.0.1, in its own process, that answers every POST with a small JSON-RPC result). The
artifact is the harness's (`build_artifact`, the `github` connection and its canary credential) plus two rules on the
stand-in's name, built with the artifact's models (`compiler.artifact`, `tests/egress_proxy/builders.py`) and proved
by the prover (`proof_for`: shapes are free inputs of the prover):

  plain   POST /plain   no shape: the body streams upstream as it comes
  tools   POST /mcp     `mcp = { methods = [...], tools = { create_comment = { arguments = { repo = ["acme/app",
                        "acme/web"], body = {max_length = 8192} }, required = [...] }, get_issue = {...} } }`:
                        the body is held whole and judged (`egress_proxy.decision.adapter.judge_body`) before it goes
                        upstream

Rows, all measured in this run, interleaved when `--rounds` > 1:

  direct              no proxy: the client POSTs the body to the stand-in itself (the upstream's own cost)
  plain rule          through the edge, the rule without a shape
  mcp rule            through the edge, the `mcp` rule that admits the body

Every request is the same 4,096-byte JSON-RPC 2.0 `tools/call` of `create_comment` (a `repo` from the enum and a
`body` string of about 4,000 characters). Each row: `--clients` (default 8) threads, each with its own keep-alive
`requests.Session` through the proxy (CONNECT tunnel, lease as proxy Basic credentials); one untimed warm-up request
per session, then `--requests` (default 2000) POSTs timed. The clients run in their own process, so the load generator
does not share the proxy's GIL; the proxy's CPU per request is this process's (`time.process_time()`: it runs only the
proxy while a row is timed). On a 2-core machine the clients, the proxy and the stand-in compete for the cores (the
load average is printed before and after). Nothing timed is asserted; the requests must answer 200 (errors are
counted and printed). Before the rows, untimed: a body the `mcp` rule refuses (a tool it does not list) must be
refused by the edge with `mcp-tool-not-allowed` and never reach the stand-in; otherwise the `mcp` row does not judge
and the script says so. The judgement alone (`judge_body` on the same body, in this process, no proxy) is timed too.
Every address is loopback.

Usage: `.venv/bin/python bench/shapes.py [--requests N] [--clients N] [--rounds N] [--quick] [--profile FILE]`.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOST = "mcp.acme-test.dev"
PUBLIC_IP = "93.184.216.81"  # what the scripted resolver answers; never dialled (--connect-to sends it to 127.0.0.1)
PLAIN_PATH = "/plain"
MCP_PATH = "/mcp"
BODY_BYTES = 4096
CLIENTS = 8
REQUESTS = 2000
QUICK_REQUESTS = 200
ROUNDS = 3
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
ANSWER = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": "comment 1 created"}],
                                                            "isError": False}}, separators=(",", ":")).encode()


def tool_call(size: int = BODY_BYTES, tool: str = "create_comment") -> bytes:
    """A JSON-RPC `tools/call` of exactly `size` bytes: `repo` from the enum and a `body` of words padded to fit."""
    def encode(text: str) -> bytes:
        return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                           "params": {"name": tool, "arguments": {"repo": "acme/app", "body": text}}},
                          separators=(",", ":")).encode()

    words = "The build on agent/fix-flaky passes again; the flaky test waited on a port it never opened. "
    overhead = len(encode(""))
    text = (words * (size // len(words) + 1))[: size - overhead]
    body = encode(text)
    assert len(body) == size, len(body)
    return body


# -- the upstream stand-in, in its own process ------------------------------------------------------------------------


def _upstream(cert: str, key: str, credential: str, pipe) -> None:
    """A TLS HTTP/1.1 keep-alive server on 127.0.0.1 that reads each request's body (Content-Length or chunked) and
    answers ANSWER; counts requests per path and those that carried the edge's credential. Commands: stats, stop."""
    import asyncio
    import ssl
    import threading

    counts: dict[str, int] = {}
    authorized = [0]
    bearer = f"bearer {credential}".lower().encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.split(b"\r\n")
                path = lines[0].split(b" ")[1].decode("latin-1") if len(lines[0].split(b" ")) > 2 else "?"
                fields = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(b":")
                    if sep:
                        fields[name.strip().lower()] = value.strip()
                if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        await reader.readexactly(size + 2) if size else None
                        if not size:
                            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                                pass
                            break
                else:
                    await reader.readexactly(int(fields.get(b"content-length", b"0")))
                counts[path] = counts.get(path, 0) + 1
                if fields.get(b"authorization", b"").lower() == bearer:
                    authorized[0] += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            writer.close()

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0, ssl=context, backlog=256))
    port = server.sockets[0].getsockname()[1]
    threading.Thread(target=loop.run_forever, daemon=True).start()
    pipe.send({"port": port})
    try:
        while True:
            command = pipe.recv()
            if command == "stop":
                break
            pipe.send({"cpu": time.process_time(), "counts": dict(counts), "authorized": authorized[0]})
    except EOFError:
        pass
    finally:
        loop.call_soon_threadsafe(loop.stop)


# -- the clients, in their own process -------------------------------------------------------------------------------


def _each(n: int, fn) -> None:
    import threading

    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _post(session, url: str, headers: dict[str, str], body: bytes) -> object:
    """One POST, the whole answer read: its status (an int), or the name of the exception that ended it."""
    import requests

    try:
        r = session.post(url, data=body, headers=headers, timeout=60)
        r.content  # noqa: B018 - the whole body is read
        return r.status_code
    except requests.RequestException as exc:
        return type(exc).__name__


def _timed(sessions: list, url: str, headers: dict[str, str], body: bytes, n: int) -> dict:
    """`n` POSTs spread over the sessions (one thread each), started together: the latencies of the 200s, the other
    outcomes counted, wall and client CPU seconds."""
    import threading

    clients = len(sessions)
    shares = [n // clients + (1 if i < n % clients else 0) for i in range(clients)]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    others: dict[object, int] = {}
    lock = threading.Lock()
    gate = threading.Barrier(clients + 1)

    def worker(i: int) -> None:
        local = latencies[i]
        gate.wait()
        for _ in range(shares[i]):
            t0 = time.perf_counter()
            status = _post(sessions[i], url, headers, body)
            elapsed = time.perf_counter() - t0
            if status == 200:
                local.append(elapsed)
            else:
                with lock:
                    others[status] = others.get(status, 0) + 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    start = time.perf_counter()
    gate.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"lat": [x for lat in latencies for x in lat], "errors": others, "wall": wall, "cpu": time.process_time() - cpu0}


def _clients(pipe) -> None:
    """Answer jobs: `open` (sessions + one warm-up request each), `run` (the timed POSTs), `one` (a single POST of
    another body: status, headers, answer), `close`, `stop`."""
    import requests
    from requests.adapters import HTTPAdapter

    class Pinned(HTTPAdapter):
        """To the stand-in's 127.0.0.1 port, with SNI and the certificate check on the real name."""

        def __init__(self, name: str) -> None:
            self.name = name
            super().__init__()

        def init_poolmanager(self, *args, **kwargs):
            kwargs["server_hostname"] = self.name
            kwargs["assert_hostname"] = self.name
            super().init_poolmanager(*args, **kwargs)

    def session(job: dict) -> requests.Session:
        s = requests.Session()
        s.trust_env = False
        if job.get("proxy"):
            s.proxies = {"https": job["proxy"]}
            s.verify = job["proxy_ca"]
        else:
            s.verify = job["upstream_ca"]
            s.mount("https://127.0.0.1:", Pinned(HOST))
        return s

    def target(job: dict) -> tuple[str, dict[str, str]]:
        if job.get("proxy"):
            return f"https://{HOST}{job['path']}", dict(HEADERS)
        return f"https://127.0.0.1:{job['port']}{job['path']}", {"Host": HOST, **HEADERS}

    job: dict = {}
    sessions: list[requests.Session] = []
    try:
        while True:
            op, arg = pipe.recv()
            if op == "stop":
                break
            if op == "open":
                job, sessions = arg, [session(arg) for _ in range(arg["clients"])]
                warm: list[object] = []
                _each(len(sessions), lambda i: warm.append(_post(sessions[i], *target(job), job["body"])))
                pipe.send({"warm": warm})
            elif op == "run":
                pipe.send(_timed(sessions, *target(job), job["body"], arg["requests"]))
            elif op == "one":
                s = session(arg)
                url, headers = target(arg)
                try:
                    r = s.post(url, data=arg["body"], headers=headers, timeout=60)
                    pipe.send({"status": r.status_code, "deny": r.headers.get("x-egresslaw-deny"), "text": r.text[:300]})
                except requests.RequestException as exc:
                    pipe.send({"status": type(exc).__name__, "deny": None, "text": str(exc)[:300]})
                finally:
                    s.close()
            elif op == "close":
                for s in sessions:
                    s.close()
                sessions = []
                pipe.send({})
    except EOFError:
        pass


# -- the edge, in this process ---------------------------------------------------------------------------------------


def shaped_rules():
    """The two rules on the stand-in's name: `plain` (no shape) and `tools` (an `mcp` shape that admits the body)."""
    from compiler.artifact import Mcp, Param, Tool, Value
    from tests.egress_proxy import builders as b

    headers = ["accept", "content-type", "mcp-protocol-version", "mcp-session-id"]
    plain = b.rule("plain", HOST, PLAIN_PATH, ["POST"], headers)
    tools = b.rule("tools", HOST, MCP_PATH, ["POST"], headers)
    create_comment = Tool(
        name="create_comment",
        arguments=(Param(name="body", value=Value(max_length=8192)),
                   Param(name="repo", value=Value(enum=("acme/app", "acme/web")))),
        required=("body", "repo"),
    )
    get_issue = Tool(
        name="get_issue",
        arguments=(Param(name="number", value=Value(type="integer", minimum=1, maximum=1000000)),
                   Param(name="repo", value=Value(enum=("acme/app", "acme/web")))),
        required=("number", "repo"),
    )
    mcp = Mcp(methods=("initialize", "notifications/initialized", "ping", "tools/call", "tools/list"), tools=(create_comment, get_issue))
    return plain, tools.model_copy(update={"mcp": mcp})


def _judge_cost(artifact, body: bytes, n: int) -> tuple[float, str]:
    """Seconds per `adapter.judge_body` of `body` under the `tools` rule (this process, no proxy), and its verdict."""
    from egress_proxy.decision.adapter import decide_without_addresses, judge_body
    from egress_proxy.decision.types import Lease, Request

    lease = Lease(subject="bench", profile=None, connection="github", exp=2**40)
    ask = Request(method="POST", scheme="https", host=HOST, port=443, target=MCP_PATH,
                  headers=tuple(HEADERS.items()) + (("Content-Length", str(len(body))),), has_body=True)
    head = decide_without_addresses(artifact, lease, ask)
    if head.body_shape != "mcp":
        return float("nan"), f"the head decision has no mcp body shape ({head.reason})"
    verdict = judge_body(artifact, lease, ask, head, body)
    t0 = time.perf_counter()
    for _ in range(n):
        judge_body(artifact, lease, ask, head, body)
    return (time.perf_counter() - t0) / n, verdict.reason


def _g(x: float, digits: int = 3) -> str:
    """`x` with `digits` significant digits, never in exponent form."""
    if math.isnan(x) or math.isinf(x):
        return "nan"
    if x == 0:
        return "0"
    places = digits - 1 - math.floor(math.log10(abs(x)))
    if math.floor(math.log10(abs(round(x, places)))) > math.floor(math.log10(abs(x))):
        places -= 1  # 0.9996 rounds up to 1.00, not 1.000
    return f"{round(x, places):.{max(0, places)}f}"


def _p99(lat: list[float]) -> float:
    return lat[max(0, math.ceil(len(lat) * 0.99) - 1)] if lat else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help=f"timed POSTs per row (default {REQUESTS}; {QUICK_REQUESTS} with --quick)")
    parser.add_argument("--clients", type=int, default=CLIENTS, help=f"client threads, one keep-alive session each (default {CLIENTS})")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved repetitions of every row; medians reported (default {ROUNDS}; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK_REQUESTS} requests per row, one round")
    parser.add_argument("--profile", metavar="FILE", default=None,
                        help="cProfile the proxy's thread during the proxied rows: stats in FILE.plain and FILE.mcp (slows them)")
    args = parser.parse_args()
    n = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    for var in ("EGRESSLAW_TEST_WORKERS", "EGRESSLAW_TEST_STORE"):  # the in-process proxy on SQLite custody, always
        os.environ.pop(var, None)

    import logging

    from tests.proxy_harness import CANARY, Pki, ScriptedResolver, _issue, build_artifact, make_env, start_proxy, stop_proxy

    body = tool_call()
    refused_body = tool_call(tool="delete_repo")
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores, shared by the clients, the proxy and the stand-in)")
    print(f"{n} timed POSTs of a {len(body)}-byte tools/call per row, {args.clients} keep-alive clients, {rounds} round(s)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="egresslaw-bench-shapes-"))
    spawn = multiprocessing.get_context("spawn")
    up_pipe, up_child = spawn.Pipe()
    client_pipe, client_child = spawn.Pipe()
    pki = _issue(tmp / "pki", (HOST,))
    upstream = spawn.Process(target=_upstream, args=(str(pki.cert_pem), str(pki.key_pem), CANARY, up_child), daemon=True, name="bench-upstream")
    clients = spawn.Process(target=_clients, args=(client_child,), daemon=True, name="bench-clients")
    proxy = None
    rows: dict[str, list[dict]] = {}
    judges = True
    try:
        upstream.start()
        clients.start()
        if not up_pipe.poll(120):
            raise SystemExit("the upstream stand-in did not start")
        port = up_pipe.recv()["port"]

        def stats() -> dict:
            up_pipe.send("stats")
            return up_pipe.recv()

        def client(op: str, arg=None) -> dict:
            client_pipe.send((op, arg))
            return client_pipe.recv()

        t0 = time.perf_counter()
        artifact = build_artifact(extra_rules=shaped_rules())
        env = make_env(tmp / "edge", artifact=artifact)  # proves the artifact (cached in the temp directory)
        print(f"artifact built and proved in {_g(time.perf_counter() - t0)} s", flush=True)
        judge_s, judge_verdict = _judge_cost(artifact, body, 500 if args.quick else 3000)
        resolver = ScriptedResolver({HOST: [[PUBLIC_IP]]})
        proxy = start_proxy(env, Pki(pki.ca_pem, pki.ca_pem, pki.ca_pem, pki.ca_pem), (), [f"{HOST}:443:127.0.0.1:{port}"],
                            resolver=resolver, log_level=logging.WARNING)
        lease = env.lease(connection="github", subject="bench-shapes", ttl=24 * 3600)
        via = {"proxy": f"http://agent:{lease}@{proxy.host}:{proxy.port}", "proxy_ca": str(proxy.ca)}

        # Untimed: the mcp rule judges (a tool it does not list is refused and never reaches the stand-in).
        before = stats()
        refused = client("one", {**via, "path": MCP_PATH, "body": refused_body})
        after = stats()
        reached = after["counts"].get(MCP_PATH, 0) - before["counts"].get(MCP_PATH, 0)
        if refused["deny"] == "mcp-tool-not-allowed" and not reached:
            print(f"check: a tools/call of an unlisted tool is refused {refused['status']} mcp-tool-not-allowed, never upstream")
        else:
            judges = False
            print(f"WARNING: the mcp rule does not judge bodies in this tree: an unlisted tool answered {refused['status']} "
                  f"(deny {refused['deny']!r}), reached the stand-in {reached} time(s); the mcp row measures an unjudged request")

        scenarios = {
            "direct (no proxy)": {"port": port, "upstream_ca": str(pki.ca_pem), "path": MCP_PATH, "body": body},
            "plain rule": {**via, "path": PLAIN_PATH, "body": body},
            "mcp rule": {**via, "path": MCP_PATH, "body": body},
        }
        names = list(scenarios)
        DIRECT, PLAIN, MCP = names
        profilers: dict[str, object] = {}
        for _round in range(rounds):
            for name, job in scenarios.items():
                warm = client("open", {**job, "clients": args.clients})["warm"]
                before = stats()
                profiler = None
                if args.profile and name != DIRECT:
                    import cProfile  # Imported here: only with --profile

                    profiler = profilers.setdefault(name, cProfile.Profile())
                    proxy.threaded.call(profiler.enable)  # on the proxy's own thread: it profiles that thread
                cpu0 = time.process_time()
                result = client("run", {"requests": n})
                proxy_cpu = time.process_time() - cpu0
                if profiler is not None:
                    proxy.threaded.call(profiler.disable)
                after = stats()
                client("close")
                lat = sorted(result["lat"])
                done = len(lat) + sum(result["errors"].values())
                row = {
                    "rps": len(lat) / result["wall"], "p50": statistics.median(lat) if lat else float("nan"), "p99": _p99(lat),
                    "n": len(lat), "done": done, "errors": dict(result["errors"]), "bad_warm": [w for w in warm if w != 200],
                    "wall": result["wall"], "proxy_cpu": proxy_cpu / max(1, done) if "proxy" in job else None,
                    "up_cpu": (after["cpu"] - before["cpu"]) / max(1, done), "client_cpu": result["cpu"] / max(1, done),
                    "upstream": after["counts"].get(job["path"], 0) - before["counts"].get(job["path"], 0),
                    "authorized": after["authorized"] - before["authorized"],
                }
                rows.setdefault(name, []).append(row)
                cpu = f"  proxy CPU {_g(row['proxy_cpu'] * 1000)} ms/request" if row["proxy_cpu"] is not None else ""
                print(f"  round {_round + 1}: {name:18s} {_g(row['rps']):>6} req/s  p50 {_g(row['p50'] * 1000):>5} ms  "
                      f"p99 {_g(row['p99'] * 1000):>5} ms{cpu}  ({row['n']} ok in {_g(row['wall'])} s)", flush=True)
        for name, profiler in profilers.items():
            out = f"{args.profile}.{'mcp' if name == MCP else 'plain'}"
            profiler.dump_stats(out)  # type: ignore[attr-defined]
            print(f"profile of the proxy's thread during the {name} rows: {out} (its CPU figures include the profiler's cost)")
    finally:
        if clients.is_alive():
            try:
                client_pipe.send(("stop", None))
            except OSError:
                pass
            clients.join(10)
            if clients.is_alive():
                clients.terminate()
        if proxy is not None:
            stop_proxy(proxy)
        if upstream.is_alive():
            try:
                up_pipe.send("stop")
            except OSError:
                pass
            upstream.join(10)
            if upstream.is_alive():
                upstream.terminate()
        shutil.rmtree(tmp, ignore_errors=True)

    # -- the report ------------------------------------------------------------------------------------------------
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    print()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print()
    head = (f"{'row':18s} {'req/s':>6} {'p50 ms':>7} {'p99 ms':>7} {'CPU ms/request: proxy':>21} {'upstream':>9} {'client':>7} "
            f"{'errors':>6} {'credential upstream':>19}")
    print(head)
    print("-" * len(head))
    for name in names:
        errors = sum(sum(r["errors"].values()) + len(r["bad_warm"]) for r in rows[name])
        proxied = rows[name][0]["proxy_cpu"] is not None
        carried = f"{sum(r['authorized'] for r in rows[name])}/{sum(r['upstream'] for r in rows[name])}" if proxied else "-"
        print(f"{name:18s} {_g(med(name, 'rps')):>6} {_g(med(name, 'p50') * 1000):>7} {_g(med(name, 'p99') * 1000):>7} "
              f"{(_g(med(name, 'proxy_cpu') * 1000) if proxied else '-'):>21} {_g(med(name, 'up_cpu') * 1000):>9} "
              f"{_g(med(name, 'client_cpu') * 1000):>7} {errors:>6} {carried:>19}")
    print()
    print("p50/p99: latency per request with all the clients running; CPU per request: proxy = this process (it runs only "
          "the proxy while a row is timed), upstream and client from their own processes; credential upstream: requests "
          "the stand-in received with the edge's credential / all it received (timed).")
    for name in names:
        for r in rows[name]:
            if r["errors"] or r["bad_warm"]:
                print(f"  {name}: errors {r['errors']}, warm-up {r['bad_warm']}")

    per_round = [m["proxy_cpu"] / p["proxy_cpu"] for m, p in zip(rows[MCP], rows[PLAIN])]
    ratio = statistics.median(per_round)
    added = med(MCP, "proxy_cpu") - med(PLAIN, "proxy_cpu")
    print()
    print("summary (medians over rounds, same run):")
    print(f"  plain rule: {_g(med(PLAIN, 'rps'))} req/s = {_g(statistics.median(r['rps'] / d['rps'] for r, d in zip(rows[PLAIN], rows[DIRECT])))}x "
          f"direct ({_g(med(DIRECT, 'rps'))} req/s); proxy CPU {_g(med(PLAIN, 'proxy_cpu') * 1000)} ms/request")
    print(f"  mcp rule  : {_g(med(MCP, 'rps'))} req/s = {_g(statistics.median(m['rps'] / p['rps'] for m, p in zip(rows[MCP], rows[PLAIN])))}x plain; "
          f"p50 {_g(med(MCP, 'p50') * 1000)} ms vs {_g(med(PLAIN, 'p50') * 1000)} ms; proxy CPU {_g(med(MCP, 'proxy_cpu') * 1000)} ms/request "
          f"({'+' if added >= 0 else '-'}{_g(abs(added) * 1e6)} us)")
    print(f"  judge_body alone on this body (this process, no proxy): {_g(judge_s * 1e6)} us per judgement, verdict {judge_verdict}")
    verdict = "met" if ratio <= 1.10 else "NOT met"
    print(f"  proxy CPU per request, mcp/plain: {_g(ratio)}x (rounds {' '.join(_g(x) for x in per_round)}); target <= 1.10x: {verdict}"
          + ("" if judges else " (but the mcp rule did not judge: see the WARNING above)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
