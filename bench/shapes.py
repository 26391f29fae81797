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

import loadgen  # noqa: E402 - bench/loadgen.py (this script's folder is first on sys.path)
from loadgen import g as _g  # noqa: E402

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


# -- the clients, in their own process (bench/loadgen.py) -----------------------------------------------------------


def _poster(job: dict):
    """`job`'s POST of its `body`."""
    url, headers = loadgen.target(job)
    return lambda session: loadgen.outcome(lambda: session.post(url, data=job["body"], headers=headers, timeout=60))


def _one(job: dict) -> dict:
    """A single POST of `job`'s body on a session of its own: status, the deny reason, the start of the answer."""
    import requests

    s = loadgen.session(job)
    url, headers = loadgen.target(job)
    try:
        r = s.post(url, data=job["body"], headers=headers, timeout=60)
        return {"status": r.status_code, "deny": r.headers.get("x-egresslaw-deny"), "text": r.text[:300]}
    except requests.RequestException as exc:
        return {"status": type(exc).__name__, "deny": None, "text": str(exc)[:300]}
    finally:
        s.close()


def _clients(pipe) -> None:
    """Answer jobs (`loadgen.serve`): `open` (sessions + one warm-up request each), `run` (the timed POSTs), `one` (a
    single POST of another body: status, headers, answer), `close`, `stop`."""
    loadgen.serve(pipe, _poster, {"one": _one})


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
    pki = _issue(tmp / "pki", (HOST,))
    upstream = loadgen.Peer(spawn, _upstream, (str(pki.cert_pem), str(pki.key_pem), CANARY), "bench-upstream")
    clients = loadgen.Peer(spawn, _clients, (), "bench-clients")
    proxy = None
    rows: dict[str, list[dict]] = {}
    judges = True
    try:
        upstream.start()
        clients.start()
        if not upstream.pipe.poll(120):
            raise SystemExit("the upstream stand-in did not start")
        port = upstream.pipe.recv()["port"]

        def stats() -> dict:
            return upstream.ask("stats")

        def client(op: str, arg=None) -> dict:
            return clients.ask((op, arg))

        t0 = time.perf_counter()
        artifact = build_artifact(extra_rules=shaped_rules())
        env = make_env(tmp / "edge", artifact=artifact)  # proves the artifact (cached in the temp directory)
        print(f"artifact built and proved in {_g(time.perf_counter() - t0)} s", flush=True)
        judge_s, judge_verdict = _judge_cost(artifact, body, 500 if args.quick else 3000)
        resolver = ScriptedResolver({HOST: [[PUBLIC_IP]]})
        proxy = start_proxy(env, Pki(pki.ca_pem, pki.ca_pem, pki.ca_pem, pki.ca_pem), (), [f"{HOST}:443:127.0.0.1:{port}"],
                            resolver=resolver, log_level=logging.WARNING)
        lease = env.lease(connection="github", subject="bench-shapes", ttl=24 * 3600)
        via = {"proxy": f"http://agent:{lease}@{proxy.host}:{proxy.port}", "proxy_ca": str(proxy.ca), "host": HOST, "headers": HEADERS}

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
            "direct (no proxy)": {"port": port, "upstream_ca": str(pki.ca_pem), "host": HOST, "headers": HEADERS, "path": MCP_PATH, "body": body},
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
                row = loadgen.row(result, warm, proxy_cpu if "proxy" in job else None)
                row.update({
                    "up_cpu": (after["cpu"] - before["cpu"]) / max(1, row["done"]),
                    "upstream": after["counts"].get(job["path"], 0) - before["counts"].get(job["path"], 0),
                    "authorized": after["authorized"] - before["authorized"],
                })
                rows.setdefault(name, []).append(row)
                cpu = f"  proxy CPU {_g(row['proxy_cpu'] * 1000)} ms/request" if row["proxy_cpu"] is not None else ""
                print(f"  round {_round + 1}: {name:18s} {_g(row['rps']):>6} req/s  p50 {_g(row['p50'] * 1000):>5} ms  "
                      f"p99 {_g(row['p99'] * 1000):>5} ms{cpu}  ({row['n']} ok in {_g(row['wall'])} s)", flush=True)
        for name, profiler in profilers.items():
            out = f"{args.profile}.{'mcp' if name == MCP else 'plain'}"
            profiler.dump_stats(out)  # type: ignore[attr-defined]
            print(f"profile of the proxy's thread during the {name} rows: {out} (its CPU figures include the profiler's cost)")
    finally:
        clients.stop(("stop", None))
        if proxy is not None:
            stop_proxy(proxy)
        upstream.stop("stop")
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
