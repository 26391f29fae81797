"""One real proxy per test module, with the shared harness (tests/proxy_harness.py): test CA, counting
loopback upstreams (TLS and plain HTTP), keys, custody holding the canary, a scripted resolver that
answers every name of the corpus, and `--connect-to` routing of every name to a loopback upstream (so
even a wrongly allowed request could only ever reach the counting upstream, never the network).
"""

from __future__ import annotations

import pytest

from tests.conformance.cases import CASES
from tests.egress_proxy import builders as b
from tests.proxy_harness import (
    HOSTS,
    PUBLIC,
    RunningProxy,
    ScriptedResolver,
    build_artifact,
    free_port,
    make_env,
    start_proxy,
    stop_proxy,
)

API = "api.acme-test.dev"


def conformance_artifact(more_rules=()):
    """The e2e artifact plus a `/` rule for every name the corpus resolves, and the response-test paths (and `more_rules`)."""
    names = sorted({c.resolve_host for c in CASES if c.resolve_host} | {"empty.acme-test.dev", "slow.acme-test.dev", "broken.acme-test.dev", "refused.acme-test.dev"})
    names = [n for n in names if n not in HOSTS]
    extra = [
        b.rule("leak", API, "/leak", ["GET"], ["accept-encoding"]),
        b.rule("status", API, "/status", ["GET"]),
        b.rule("fault", API, "/fault", ["GET", "POST"], ["content-type"]),
        *(b.rule(f"r{i}", n, "/", ["GET"]) for i, n in enumerate(names)),
        *more_rules,
    ]
    return build_artifact(extra)


def resolver_for_corpus() -> ScriptedResolver:
    table = {c.resolve_host: [list(c.resolve)] for c in CASES if c.resolve_host and c.resolve_host != "rebind.acme-test.dev"}
    table["rebind.acme-test.dev"] = [["93.184.216.36"], ["127.0.0.1"]]
    return ScriptedResolver(table)


def routing(listen: int, tls_port: int, http_port: int, artifact, tls_to: dict[str, int] | None = None) -> list[str]:
    """`--connect-to` for every name: TLS to the TLS upstream (or `tls_to[name]`), port 80 to the plain one."""
    names = {r.host for c in artifact.connections for r in c.rules} | set(PUBLIC) | {h.host for p in artifact.sandbox_profiles for h in p.network.allowed_hosts}
    out = []
    for name in sorted(names):
        if name in (tls_to or {}):
            out.append(f"{name}:443:127.0.0.1:{tls_to[name]}")
        elif name == "self.acme-test.dev":
            out.append(f"{name}:443:127.0.0.1:{listen}")
        else:
            out.append(f"{name}:443:127.0.0.1:{tls_port}")
        out.append(f"{name}:80:127.0.0.1:{http_port}")
    return out


def launch(tmp_path_factory, pki, tls_upstream, http_upstream, *, name: str, resolver=None, custody=None, extra_options=None, log_level=None, artifact=None,
           config=None, tls_to: dict[str, int] | None = None) -> RunningProxy:
    art = artifact or conformance_artifact()
    env = make_env(tmp_path_factory.mktemp(name), art)
    listen = free_port()
    kw = {} if log_level is None else {"log_level": log_level}
    return start_proxy(env, pki, (tls_upstream, http_upstream), routing(listen, tls_upstream.port, http_upstream.port, art, tls_to),
                       resolver=resolver or resolver_for_corpus(), listen=listen, custody=custody, extra_options=extra_options, config=config, **kw)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, tls_upstream, http_upstream) -> RunningProxy:
    p = launch(tmp_path_factory, pki, tls_upstream, http_upstream, name="conformance")
    yield p
    try:
        p.assert_nothing_leaked()  # whatever subset of the module ran here (xdist splits modules)
    finally:
        stop_proxy(p)
