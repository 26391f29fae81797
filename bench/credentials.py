"""Credential kinds through the egress proxy: requests/s and added latency per kind, against `static`, in one run.

One real in-process proxy (`tests.proxy_harness.start_proxy`, the same one for every row) in front of the independent
provider stand-ins (`tests/credentials/providers.py`, on one TLS server, in their own process). Rows, all measured in
this run, interleaved when `--rounds` > 1:

  direct /echo             no proxy: the client sends `Authorization: Bearer <the static value>` to the stand-in itself
                           (the baseline the proxy rows are relative to)
  static /echo             the custody value pasted into `Authorization` (`Bearer {secret}`)
  oauth2 /echo             an access token minted from a refresh token at the RFC 6749 token endpoint
                           (`oauth2.googleapis.com/token`) and cached: tokens live `--oauth-lifetime` s (default 60;
                           the broker refreshes a quarter of the life, at most 60 s, before expiry), so the one mint
                           is amortized over the token's life (it comes before the timed requests: none among them)
  oauth2 /echo, 2 s        the same with `--short-lifetime` (default 2 s) tokens, so refreshes happen during the
                           run (it lasts at least `--short-min-seconds`); a refresh holds the requests that find the
                           token due until the mint answers (single-flight)
  github_app /echo         an installation token minted with an RS256 App JWT, cached for its life (an hour)
  direct S3 (signed)       no proxy: the client signs every request with botocore (S3SigV4Auth) itself
  aws_sigv4 S3             the edge re-signs every request (SigV4: an HMAC-SHA256 chain per request)

Every bearer kind GETs `www.googleapis.com/echo`, which answers 200 and the received `Authorization` whatever it is:
the upstream work is the same for each, and the proxy redacts the echoed value in each response. S3 refuses unsigned
requests, so there is no static row to S3: the aws_sigv4 row is compared with static-to-/echo, and the upstream of
that row (and of the direct S3 row) also recomputes every SigV4 with botocore (`ListObjectsV2` of an empty bucket).
The stand-ins' CPU per request is printed for every row (their process is measured from /proc), and so are the
proxy's (this process: it only runs the proxy while a row is timed) and the client's.

Each row: `--clients` (default 8) threads, each with its own keep-alive `requests.Session` through the proxy
(CONNECT tunnel, lease as proxy Basic credentials); one untimed warm-up request per session (TLS handshakes, the
proxy's leaf certificate, the first mint), then `--requests` (default 2000) GETs timed. The clients run in their own
process, so the load generator is not sharing the proxy's GIL; on a 2-core machine the clients, the proxy and the
stand-ins still compete for the cores (the load average is printed before and after). Latency is per request under
that load (p50/p99 over the timed requests). The mints each row caused are counted by the stand-in. Nothing timed is
asserted; the requests must answer 200 (errors are counted and printed), and an untimed check before the rows makes
sure each minted credential is one the provider accepts (`/drive/v3/files`, `/installation/repositories`, S3).
Every address is loopback.

Usage: `.venv/bin/python bench/credentials.py [--requests N] [--clients N] [--rounds N] [--oauth-lifetime S] [--quick]`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import loadgen  # noqa: E402 - bench/loadgen.py (this script's folder is first on sys.path)
from loadgen import g as _g, signed as _signed  # noqa: E402

ECHO_HOST = "www.googleapis.com"
S3_HOST = "s3.us-east-1.amazonaws.com"
BUCKET = "acme-artifacts"
S3_PATH = f"/{BUCKET}?list-type=2"
CLIENTS = 8
REQUESTS = 2000
QUICK_REQUESTS = 200

POLICY = """egresslaw 1
workspace "acme"
catalog "2026.11"

connection "static" {
  credential = "echo-static"
  egress "echo" { host = "www.googleapis.com" path_prefix = "/echo" methods = ["GET"] }
}

connection "oauth2" {
  credential = "drive-oauth"
  kind       = "oauth2"
  oauth2     = { token_url: "https://oauth2.googleapis.com/token", grant: "refresh_token",
                 scopes: ["https://www.googleapis.com/auth/drive.readonly"] }
  egress "echo"  { host = "www.googleapis.com" path_prefix = "/echo" methods = ["GET"] }
  egress "files" { host = "www.googleapis.com" path_prefix = "/drive/v3" methods = ["GET"] }
}

connection "oauth2-short" {
  credential = "drive-oauth-short"
  kind       = "oauth2"
  oauth2     = { token_url: "https://oauth2.googleapis.com/token", grant: "refresh_token",
                 scopes: ["https://www.googleapis.com/auth/drive.readonly"] }
  egress "echo"  { host = "www.googleapis.com" path_prefix = "/echo" methods = ["GET"] }
  egress "files" { host = "www.googleapis.com" path_prefix = "/drive/v3" methods = ["GET"] }
}

connection "app" {
  credential = "gh-app"
  kind       = "github_app"
  github_app = { token_url: "https://api.github.com/app/installations/987654/access_tokens" }
  egress "echo" { host = "www.googleapis.com" path_prefix = "/echo" methods = ["GET"] }
  egress "api"  { host = "api.github.com" path_prefix = "/installation" methods = ["GET"] }
}

connection "artifacts" {
  credential = "aws-ci"
  kind       = "aws_sigv4"
  aws_sigv4  = { region: "us-east-1", service: "s3" }
  egress "bucket" { host = "s3.us-east-1.amazonaws.com" path_prefix = "/acme-artifacts" methods = ["GET"] }
}
"""


# -- the stand-ins, in their own process -----------------------------------------------------------------------------


def _standins(root: str, lifetime: float, rotate: bool, pipe) -> None:
    """Start the provider stand-ins, send what the edge needs to know, then answer commands until `stop`."""
    from tests.credentials.providers import start_providers

    p = start_providers(Path(root), oauth_lifetime=lifetime, rotate_refresh=rotate)
    short_secret = "GOCSPX-" + secrets.token_urlsafe(21)
    short_client = "bench-short-standin.apps.googleusercontent.com"
    short_refresh = p.oauth.add_client(short_client, short_secret)  # its own grant: rotation of one never kills the other
    pipe.send({
        "port": p.port, "ca_pem": str(p.ca_pem), "connect_to": p.connect_to(), "public": dict(p.public),
        "oauth": {"client_id": p.oauth.client_id, "client_secret": p.oauth.client_secret, "refresh_token": p.oauth.initial_refresh_token},
        "oauth_short": {"client_id": short_client, "client_secret": short_secret, "refresh_token": short_refresh},
        "github": {"app_id": str(p.github.app_id), "private_key": p.github.app_private_key_pem},
        "s3": {"access_key_id": p.s3.access_key_id, "secret_access_key": p.s3.secret_access_key},
    })
    try:
        while True:
            command, *arg = pipe.recv()
            if command == "stop":
                break
            if command == "lifetime":
                with p.oauth.lock:
                    p.oauth.lifetime = float(arg[0])
            with p.lock:
                p.hits.clear()  # keep the request record from growing over the run (nothing here reads it)
            pipe.send({
                "cpu": time.process_time(),
                "oauth_mints": p.oauth.mints, "oauth_refused": p.oauth.api_refused,
                "github_mints": p.github.installation_mints, "github_refused": p.github.api_refused,
                "jwt_failures": len(p.github.jwt_failures),
                "sigv4_ok": p.s3.sigv4_ok, "sigv4_failed": p.s3.sigv4_failed, "sigv4_failures": p.s3.failures[-1:],
                "errors": p.errors[-1:], "n_errors": len(p.errors),
            })
    except EOFError:
        pass
    finally:
        p.stop()


# -- the clients, in their own process (bench/loadgen.py) -----------------------------------------------------------


def _getter(job: dict):
    """`job`'s GET: through the proxy, or direct to the stand-in (with the job's headers, or signed with its `sign` keys
    afresh for every request, as an SDK does)."""
    url, headers = loadgen.target(job)
    keys = job.get("sign")
    if keys:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        auth = S3SigV4Auth(Credentials(keys["access_key_id"], keys["secret_access_key"]), "s3", "us-east-1")
        signed_url = f"https://{job['host']}{job['path']}"

        def sign() -> dict[str, str]:
            request = AWSRequest(method="GET", url=signed_url)
            auth.add_auth(request)
            return {k: v for k, v in request.headers.items() if k.lower() != "host"}

        return lambda session: loadgen.outcome(lambda: session.get(url, headers={**headers, **sign()}, timeout=60))
    return lambda session: loadgen.outcome(lambda: session.get(url, headers=headers, timeout=60))


def _clients(pipe) -> None:
    """Answer jobs (`loadgen.serve`): `open` (sessions + one warm-up request each), `run` (the timed GETs), `close`, `stop`."""
    loadgen.serve(pipe, _getter)


# -- the edge, in this process ---------------------------------------------------------------------------------------


def _seal(env, connection: str, handle: str, value: bytes) -> None:
    from egress_proxy.custody.records import Address
    from egress_proxy.custody.stores import open_store

    with open_store(env.store, env.keys, create=True) as store:
        store.put(Address("acme", connection, handle), value)


def _sigv4_sign_cost(keys: dict[str, str], n: int = 2000) -> float:
    """Seconds per botocore S3SigV4Auth signature of the benchmark's GET (what the S3 stand-in recomputes per request)."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    auth = S3SigV4Auth(Credentials(keys["access_key_id"], keys["secret_access_key"]), "s3", "us-east-1")
    t0 = time.perf_counter()
    for _ in range(n):
        auth.add_auth(AWSRequest(method="GET", url=f"https://{S3_HOST}{S3_PATH}"))
    return (time.perf_counter() - t0) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help=f"timed GETs per row (default {REQUESTS}; {QUICK_REQUESTS} with --quick)")
    parser.add_argument("--clients", type=int, default=CLIENTS, help=f"client threads, one keep-alive session each (default {CLIENTS})")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions of every row; medians reported (default 1)")
    parser.add_argument("--oauth-lifetime", type=float, default=60.0, help="seconds an oauth2 access token lives (default 60)")
    parser.add_argument("--short-lifetime", type=float, default=2.0, help="the token life of the refreshing oauth2 row (default 2)")
    parser.add_argument("--short-min-seconds", type=float, default=None,
                        help="the refreshing oauth2 row runs at least this long (default 3 lifetimes; 1.5 with --quick)")
    parser.add_argument("--rotate-refresh", action="store_true", help="the token endpoint rotates refresh tokens (custody write-back per mint)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK_REQUESTS} requests per row")
    args = parser.parse_args()
    n = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    short_min = args.short_min_seconds if args.short_min_seconds is not None else args.short_lifetime * (1.5 if args.quick else 3)
    for var in ("EGRESSLAW_TEST_WORKERS", "EGRESSLAW_TEST_STORE"):  # the in-process proxy on SQLite custody, always
        os.environ.pop(var, None)

    import logging

    from compiler.compile import compile_paths
    from egress_proxy.custody.records import encode_fields
    from tests.proxy_harness import (
        Pki,
        ScriptedResolver,
        make_env,
        start_proxy,
        stop_proxy,
    )

    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores, shared by the clients, the proxy and the stand-ins)")
    print(f"{n} timed GETs per row, {args.clients} keep-alive clients, {args.rounds} round(s); oauth2 tokens live "
          f"{_g(args.oauth_lifetime)} s (and {_g(args.short_lifetime)} s in the refreshing row, run >= {_g(short_min)} s)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="egresslaw-bench-credentials-"))
    spawn = multiprocessing.get_context("spawn")
    standins = loadgen.Peer(spawn, _standins, (str(tmp / "providers"), args.oauth_lifetime, args.rotate_refresh), "bench-standins")
    clients = loadgen.Peer(spawn, _clients, (), "bench-clients")
    proxy = None
    rows: dict[str, list[dict]] = {}
    try:
        standins.start()
        clients.start()
        if not standins.pipe.poll(120):
            raise SystemExit("the stand-ins did not start")
        info = standins.pipe.recv()

        def stats(*command) -> dict:
            return standins.ask(command or ("stats",))

        def client(op: str, arg=None) -> dict:
            return clients.ask((op, arg))

        sign_cost = _sigv4_sign_cost(info["s3"])

        # The policy, custody and the proxy.
        (tmp / "policy").mkdir()
        (tmp / "policy" / "main.egress").write_text(POLICY)
        compiled = compile_paths([tmp / "policy"])
        if compiled.artifact is None:
            raise SystemExit(f"the benchmark policy does not compile: {compiled.diagnostics}")
        env = make_env(tmp / "edge", artifact=compiled.artifact)
        static_value = "static-" + secrets.token_urlsafe(48)  # about as long as the minted tokens (`ya29.` + 64)
        _seal(env, "static", "echo-static", static_value.encode())
        _seal(env, "oauth2", "drive-oauth", encode_fields("oauth2", info["oauth"]))
        _seal(env, "oauth2-short", "drive-oauth-short", encode_fields("oauth2", info["oauth_short"]))
        _seal(env, "app", "gh-app", encode_fields("github_app", info["github"]))
        _seal(env, "artifacts", "aws-ci", encode_fields("aws_sigv4", info["s3"]))
        ca = Path(info["ca_pem"])
        resolver = ScriptedResolver({name: [[ip]] for name, ip in info["public"].items()})
        proxy = start_proxy(env, Pki(ca, ca, ca, ca), (), info["connect_to"], resolver=resolver, log_level=logging.WARNING)

        def via(connection: str, host: str, path: str) -> dict:
            lease = env.lease(connection=connection, subject=f"bench-{connection}", ttl=24 * 3600)
            return {"proxy": f"http://agent:{lease}@{proxy.host}:{proxy.port}", "proxy_ca": str(proxy.ca), "host": host, "path": path}

        direct = {"port": info["port"], "upstream_ca": str(ca)}
        scenarios = {  # name: (client job, oauth lifetime to set first, what it counts, minimum seconds)
            "direct /echo (no proxy)": ({**direct, "host": ECHO_HOST, "path": "/echo",
                                         "headers": {"Authorization": f"Bearer {static_value}"}}, None, None, 0.0),
            "static /echo": (via("static", ECHO_HOST, "/echo"), None, None, 0.0),
            f"oauth2 /echo, {_g(args.oauth_lifetime)} s tokens": (via("oauth2", ECHO_HOST, "/echo"), args.oauth_lifetime, "oauth_mints", 0.0),
            f"oauth2 /echo, {_g(args.short_lifetime)} s tokens": (via("oauth2-short", ECHO_HOST, "/echo"), args.short_lifetime, "oauth_mints", short_min),
            "github_app /echo": (via("app", ECHO_HOST, "/echo"), None, "github_mints", 0.0),
            "direct S3, botocore-signed (no proxy)": ({**direct, "host": S3_HOST, "path": S3_PATH, "sign": info["s3"]}, None, None, 0.0),
            "aws_sigv4 S3": (via("artifacts", S3_HOST, S3_PATH), None, None, 0.0),
        }
        names = list(scenarios)
        DIRECT, STATIC, OAUTH, SHORT, GITHUB, S3_DIRECT, SIGV4 = names

        # Untimed: each credential is one the provider accepts (the /echo rows cannot tell). These are the first
        # requests of the oauth2 (long-lived tokens) and github_app connections: their first mint happens here.
        first = stats()
        for connection, host, path, lifetime in (("oauth2", ECHO_HOST, "/drive/v3/files", args.oauth_lifetime),
                                                 ("app", "api.github.com", "/installation/repositories", None),
                                                 ("artifacts", S3_HOST, S3_PATH, None)):
            if lifetime is not None:
                stats("lifetime", lifetime)
            warm = client("open", {**via(connection, host, path), "clients": 1})["warm"]
            client("close")
            if warm != [200]:
                raise SystemExit(f"{connection}: {host}{path} through the proxy answered {warm}: {stats()}")
        checked = stats()
        early = {OAUTH: checked["oauth_mints"] - first["oauth_mints"], GITHUB: checked["github_mints"] - first["github_mints"]}

        for _round in range(args.rounds):
            for name, (job, lifetime, counter, min_seconds) in scenarios.items():
                if lifetime is not None:
                    stats("lifetime", lifetime)
                before_warm = stats()
                warm = client("open", {**job, "clients": args.clients})["warm"]
                before = stats()
                cpu0 = time.process_time()
                result = client("run", {"requests": n, "min_seconds": min_seconds})
                proxy_cpu = time.process_time() - cpu0
                after = stats()
                client("close")
                row = loadgen.row(result, warm, proxy_cpu if "proxy" in job else None)
                row.update({
                    "stand_cpu": (after["cpu"] - before["cpu"]) / max(1, row["done"]),
                    "mints": (after[counter] - before[counter]) if counter else None,
                    "warm_mints": (before[counter] - before_warm[counter]) if counter else None,
                    "sigv4_failed": after["sigv4_failed"] - before_warm["sigv4_failed"],
                    "standin_errors": after["n_errors"] - before_warm["n_errors"], "last_error": after["errors"] or after["sigv4_failures"],
                })
                rows.setdefault(name, []).append(row)
                print(f"  round {_round + 1}: {name:40s} {_g(row['rps']):>6} req/s  p50 {_g(row['p50'] * 1000):>5} ms  "
                      f"p99 {_g(row['p99'] * 1000):>5} ms  ({row['n']} ok in {_g(row['wall'])} s)", flush=True)
        final = stats()
        if final["oauth_refused"] or final["github_refused"]:
            print(f"the stand-ins refused {final['oauth_refused']} Drive and {final['github_refused']} GitHub API requests")
    finally:
        clients.stop(("stop", None))
        if proxy is not None:
            stop_proxy(proxy)
        standins.stop(("stop",))
        shutil.rmtree(tmp, ignore_errors=True)

    # -- the report ------------------------------------------------------------------------------------------------
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    def ratios(name: str, base: str, key: str) -> list[float]:
        return [r[key] / b[key] for r, b in zip(rows[name], rows[base])]

    print()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print()
    head = (f"{'row':40s} {'req/s':>6} {'p50 ms':>7} {'p99 ms':>7} {'rps/static':>10} {'p50/static':>10} {'+p50 ms':>8} "
            f"{'+p99 ms':>8} {'CPU ms/request: proxy':>21} {'stand-in':>9} {'client':>7} {'errors':>6}")
    print(head)
    print("-" * len(head))
    s_p50, s_p99 = med(STATIC, "p50"), med(STATIC, "p99")
    for name in names:
        rps, p50, p99 = med(name, "rps"), med(name, "p50"), med(name, "p99")
        proxy_cpu = rows[name][0]["proxy_cpu"]
        errors = sum(sum(r["errors"].values()) + len(r["bad_warm"]) for r in rows[name])
        print(f"{name:40s} {_g(rps):>6} {_g(p50 * 1000):>7} {_g(p99 * 1000):>7} "
              f"{_g(statistics.median(ratios(name, STATIC, 'rps'))) + 'x':>10} {_g(statistics.median(ratios(name, STATIC, 'p50'))) + 'x':>10} "
              f"{_signed((p50 - s_p50) * 1000):>8} {_signed((p99 - s_p99) * 1000):>8} "
              f"{(_g(med(name, 'proxy_cpu') * 1000) if proxy_cpu is not None else '-'):>21} "
              f"{_g(med(name, 'stand_cpu') * 1000):>9} {_g(med(name, 'client_cpu') * 1000):>7} {errors:>6}")
    print()
    print("p50/p99: latency per request with all the clients running; +p50/+p99: added to static's; CPU per request from "
          "/proc (proxy: this process, which runs only the proxy while a row is timed).")
    for name in names:
        for r in rows[name]:
            if r["errors"] or r["bad_warm"] or r["standin_errors"] or r["sigv4_failed"]:
                print(f"  {name}: errors {r['errors']}, warm-up {r['bad_warm']}, stand-in failures {r['standin_errors']}, "
                      f"SigV4 refused {r['sigv4_failed']} {r['last_error']}")

    print()
    print("mints the stand-ins saw, per connection (during the timed requests; and before them, untimed: the check's first")
    print("request, the warm-up):")
    for name, life in ((OAUTH, args.oauth_lifetime), (SHORT, args.short_lifetime), (GITHUB, 3600.0)):
        timed = sum(r["mints"] for r in rows[name])
        untimed = sum(r["warm_mints"] for r in rows[name]) + early.get(name, 0)
        done = sum(r["done"] for r in rows[name])
        refresh_every = life - min(60.0, life / 4)
        print(f"  {name:40s} {timed} mint{'s' if timed != 1 else ''} in {done} timed requests (+{untimed} untimed); "
              f"refreshed every {_g(refresh_every)} s: 1 mint per ~{_g(refresh_every * med(name, 'rps'))} requests at this rate")
    print("  static, aws_sigv4: nothing minted (aws_sigv4 signs every request: an HMAC-SHA256 key derivation and signature each)")
    print()
    print(f"botocore S3SigV4Auth, one signature of the benchmark's GET: {_g(sign_cost * 1e6)} us (in this process); the S3 "
          f"stand-in recomputes one per request it receives, the direct S3 client signs one per request it sends")

    print()
    print("summary (medians over rounds; ratios against static-to-/echo measured in this run):")
    direct_rps = med(DIRECT, "rps")
    print(f"  static        : {_g(med(STATIC, 'rps'))} req/s = {_g(statistics.median(ratios(STATIC, DIRECT, 'rps')))}x direct /echo "
          f"({_g(direct_rps)} req/s); p50 {_g(s_p50 * 1000)} ms vs {_g(med(DIRECT, 'p50') * 1000)} ms direct "
          f"(the proxy adds {_signed((s_p50 - med(DIRECT, 'p50')) * 1000)} ms)")
    for name, label, note in ((OAUTH, f"oauth2 {_g(args.oauth_lifetime)} s", ""),
                              (SHORT, f"oauth2 {_g(args.short_lifetime)} s", f", {sum(r['mints'] for r in rows[SHORT])} refreshes timed"),
                              (GITHUB, "github_app", "")):
        print(f"  {label:14s}: rps {_g(statistics.median(ratios(name, STATIC, 'rps')))}x static, p50 "
              f"{_g(statistics.median(ratios(name, STATIC, 'p50')))}x ({_signed((med(name, 'p50') - s_p50) * 1000)} ms), p99 "
              f"{_signed((med(name, 'p99') - s_p99) * 1000)} ms{note}")
    print(f"  aws_sigv4     : {_g(med(SIGV4, 'rps'))} req/s, rps {_g(statistics.median(ratios(SIGV4, STATIC, 'rps')))}x static-to-/echo, p50 "
          f"{_g(statistics.median(ratios(SIGV4, STATIC, 'p50')))}x ({_signed((med(SIGV4, 'p50') - s_p50) * 1000)} ms); the upstream of this "
          f"row verifies every SigV4 with botocore (stand-in CPU {_g(med(SIGV4, 'stand_cpu') * 1000)} ms/request vs "
          f"{_g(med(STATIC, 'stand_cpu') * 1000)} for /echo); against the direct botocore-signed S3 baseline: rps "
          f"{_g(statistics.median(ratios(SIGV4, S3_DIRECT, 'rps')))}x, p50 {_signed((med(SIGV4, 'p50') - med(S3_DIRECT, 'p50')) * 1000)} ms")
    if args.rounds > 1:
        for name in names[1:]:
            print(f"  rounds, {name} rps/static: {' '.join(_g(x) for x in ratios(name, STATIC, 'rps'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
