"""The artifact compiled to Envoy configuration: the lane's listeners, routes and clusters, from the artifact alone.

Which profiles the lane serves (`served`): every sandbox profile that brokers nothing, is enforced (observe mode
forwards what its allowlist lacks: the mitmproxy edge's job) and names hosts only (an IP-literal entry stays on the
edge). A subject the lane does not serve is refused by the authorizer `lane-not-served`.

What Envoy gets (`generate`), for each served profile P and each `host:port` H of its allowlist:

- on the **front listener** (the one proxy URL): a Lua filter that asks the egresslaw authorizer about every request
  (once per CONNECT, once per plain-HTTP request) and, when it admits, sets `x-egresslaw-lane-profile: P` (a client's
  own is removed first) and `x-egresslaw-lane-authority: H` (the authority it judged, normalized), and re-picks the
  route. Routes match those two headers only, and exist only for (P, H): a CONNECT to H goes to the internal
  listener `mitm|P|H`; an absolute-form `http://H/...` to the plain cluster `http|P|H`; an absolute-form
  `https://H/...` to the verified TLS cluster `tls|P|H`. Anything else ends on a route that answers 403
  `lane-no-route` (the authorizer admitted what the compiled routes lack: a stale configuration, never forwarded);
- the **internal listener** `mitm|P|H`: TLS terminated with a leaf certificate for exactly `host`, signed by the
  proxy CA, on a filter chain that matches SNI `host` only (another SNI, or none, matches no chain: closed, and
  audited `sni-mismatch` / `sni-missing`); its routes admit `Host` `host:port` (and `host` on 443) only, anything
  else 403 `host-header-mismatch`;
- the **clusters** `tls|P|H` / `http|P|H`: `host` resolved through the lane's DNS front for P's worker (it answers
  only addresses the worker admits, `egress_proxy.lane.dnsfront`), upstream TLS verified against the trust store
  with SNI and subject-alt-name `host`.

Every header the edge never forwards from a sandbox, and every `x-envoy-*`, is removed by rule (`is_stripped`: the
front's Lua filter, an early header mutation on every internal listener) before anything goes upstream; hop-by-hop fields too. Every reply Envoy answers itself is
the proxy's JSON body with `X-Egresslaw-Deny` (a catch-all local-reply mapper: none lacks a reason). The configuration is four JSON documents: a bootstrap,
and LDS, CDS and RDS files Envoy watches (a reload rewrites them; unchanged listeners keep their connections).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.artifact import Artifact, SandboxProfile
from compiler.constants import DEFAULT_WORKER, HEADER_DENYLIST, HEADER_DENYLIST_PREFIXES
from egress_proxy.decision.answers import DENY_HEADER, denial_body

LANE_HEADER = "x-egresslaw-lane-profile"
AUTHORITY_HEADER = "x-egresslaw-lane-authority"  # the authority the authorizer judged, normalized: what routes match
AUTHORIZER_CLUSTER = "egresslaw_authorizer"
FRONT_ROUTES = "front"
# The filter-state object that carries a CONNECT's request id across the internal connection to the listener that
# terminates its tunnel (set on the front, shared with the upstream connection, read by the inner Lua filter).
TUNNEL_STATE = "egresslaw.tunnel"
LEAF_KEY = "leaf.key"
# Removed from every request before it goes upstream: the lease, hop-by-hop fields (RFC 9110 7.6.1; Envoy drops
# `Connection`, `Keep-Alive`, `Transfer-Encoding` and `Upgrade` itself), the lane's own routing header and what
# Envoy adds (`x-request-id` names the audit event; `x-forwarded-*`).
STRIPPED = ("proxy-authorization", "proxy-authenticate", "proxy-connection", "te", "trailer", LANE_HEADER, AUTHORITY_HEADER,
            "x-request-id", "x-forwarded-for", "x-forwarded-proto", "x-envoy-internal", "x-envoy-external-address")

_LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
_CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
_ROUTES = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = {"name": "envoy.filters.http.router", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router", "suppress_envoy_headers": True}}


@dataclass(frozen=True)
class Layout:
    """Where the lane's parts listen and keep their files (all chosen by the runner)."""

    listen: tuple[str, int]
    envoy_admin: Path  # Envoy's admin interface, a Unix socket in the 0700 run directory (it can drain or stop Envoy)
    authorizer: Path  # the authorizer's Unix socket (in the 0700 run directory: only the lane's user reaches it)
    dns: Mapping[str, tuple[str, int]]  # worker name -> the DNS front's address for that worker
    run_dir: Path  # bootstrap, xDS files, certificates, the access log
    trust_bundle: Path  # CA certificates upstream TLS is verified against
    connect_to: Mapping[tuple[str, int], tuple[str, int]] = field(default_factory=dict)  # test routing: (host, port) -> dialled port
    authorizer_timeout_ms: int = 5000
    max_connections: int = 8192
    idle_timeout: int = 300
    header_timeout: float = 10.0
    max_head_kib: int = 64
    max_headers: int = 100
    connection_buffer: int = 256 * 1024

    @property
    def access_log(self) -> Path:
        return self.run_dir / "access.log"

    @property
    def cert_dir(self) -> Path:
        return self.run_dir / "certs"


@dataclass(frozen=True)
class Served:
    """The profiles the lane serves and those it leaves to the mitmproxy edge (name -> why)."""

    profiles: tuple[SandboxProfile, ...]
    refused: Mapping[str, str]

    def names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.profiles)


def served(artifact: Artifact) -> Served:
    """Which of the artifact's sandbox profiles the lane can serve exactly (the rest stay on the mitmproxy edge)."""
    ok: list[SandboxProfile] = []
    refused: dict[str, str] = {}
    for prof in artifact.sandbox_profiles:
        if prof.brokers:
            refused[prof.name] = "it brokers connections (credentials are attached on the mitmproxy edge only)"
        elif prof.enforce != "enforce":
            refused[prof.name] = "it is in observe mode (requests outside the allowlist are forwarded by the mitmproxy edge)"
        elif any(_is_ip(h.host) for h in prof.network.allowed_hosts):
            refused[prof.name] = "its allowlist names an IP literal (the lane terminates TLS for host names only)"
        elif artifact.worker(DEFAULT_WORKER) is None:
            refused[prof.name] = f"the worker that judges profiles (`{DEFAULT_WORKER}`) is not in the artifact"
        else:
            ok.append(prof)
    return Served(tuple(ok), refused)


def split_authority(authority: str, default_port: int) -> tuple[str, int]:
    """`host:port` as sent, lowercased, brackets dropped: `default_port` when it names no port, -1 when its port is
    not 1-5 digits. For events and routing names only; the decision reads the authority itself."""
    host, sep, port = authority.rpartition(":")
    if not sep or "]" in port:
        return authority.strip("[]").lower(), default_port
    return host.strip("[]").lower(), int(port) if port.isdigit() and len(port) <= 5 else -1


def authorities(prof: SandboxProfile) -> tuple[tuple[str, int], ...]:
    """The exact (host, port) pairs a served profile reaches, in a stable order."""
    if prof.network.mode != "allowlist":
        return ()
    return tuple(sorted({(h.host, h.port) for h in prof.network.allowed_hosts}))


def hosts_needing_certificates(artifact: Artifact) -> tuple[str, ...]:
    """Every host the lane terminates TLS for (one leaf certificate each)."""
    return tuple(sorted({host for prof in served(artifact).profiles for host, _ in authorities(prof)}))


def name(kind: str, profile: str, host: str, port: int) -> str:
    """A listener or cluster name: `mitm|P|host:port`, `tls|P|host:port`, `http|P|host:port`."""
    return f"{kind}|{profile}|{host}:{port}"


# -- the documents ------------------------------------------------------------------------------


def generate(artifact: Artifact, layout: Layout) -> dict[str, dict[str, Any]]:
    """`{"bootstrap": ..., "lds": ..., "cds": ..., "rds": ...}`: the whole Envoy configuration for this artifact."""
    profiles = served(artifact).profiles
    version = artifact.digest
    listeners = [_front(layout)] + [_inner(layout, p.name, h, port) for p in profiles for h, port in authorities(p)]
    clusters = [_authorizer_cluster(layout)]
    for prof in profiles:
        worker = artifact.worker(DEFAULT_WORKER)  # a profile's answers are judged by the `default` worker
        assert worker is not None  # served() checked it
        for host, port in authorities(prof):
            clusters.append(_internal_cluster(name("mitm", prof.name, host, port)))
            for kind in ("tls", "http"):
                clusters.append(_upstream_cluster(layout, kind, prof.name, host, port, worker.name, worker.ipv6))
    return {
        "bootstrap": _bootstrap(layout),
        "lds": {"version_info": version, "resources": [{"@type": _LISTENER, **x} for x in listeners]},
        "cds": {"version_info": version, "resources": [{"@type": _CLUSTER, **x} for x in clusters]},
        "rds": {"version_info": version, "resources": [{"@type": _ROUTES, **_front_routes(profiles)}]},
    }


def write(documents: Mapping[str, Mapping[str, Any]], run_dir: Path) -> None:
    """Write the documents: each xDS file replaced by a rename into the watched directory (Envoy never reads half a
    file); clusters first, then listeners, then routes, so a new route never names a cluster Envoy lacks."""
    (run_dir / "bootstrap.json").write_text(json.dumps(documents["bootstrap"], indent=1))
    for kind in ("cds", "lds", "rds"):
        write_one(kind, documents[kind], run_dir)


def write_one(kind: str, document: Mapping[str, Any], run_dir: Path) -> None:
    """One watched xDS file (`cds`, `lds` or `rds`), replaced by a rename. A running Envoy reads the three files in
    no fixed order, so a reload writes them one at a time and waits for each (`egress_proxy.run.lane`)."""
    xds = run_dir / "xds"
    xds.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = run_dir / f".{kind}.json.tmp"
    tmp.write_text(json.dumps(document, indent=1))
    tmp.replace(xds / f"{kind}.json")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _socket(addr: tuple[str, int]) -> dict[str, Any]:
    return {"socket_address": {"address": addr[0], "port_value": addr[1]}}


def _watched(run_dir: Path, kind: str) -> dict[str, Any]:
    xds = run_dir / "xds"
    return {"path_config_source": {"path": str(xds / f"{kind}.json"), "watched_directory": {"path": str(xds)}},
            "resource_api_version": "V3"}


def _bootstrap(layout: Layout) -> dict[str, Any]:
    return {
        "node": {"id": "egresslaw-lane", "cluster": "egresslaw"},
        "admin": {"address": {"pipe": {"path": str(layout.envoy_admin), "mode": 0o600}}},
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"}}],
        "dynamic_resources": {"lds_config": _watched(layout.run_dir, "lds"), "cds_config": _watched(layout.run_dir, "cds")},
        # The bound on client connections (the edge's --max-connections): past it, new ones are refused.
        "overload_manager": {"resource_monitors": [{"name": "envoy.resource_monitors.global_downstream_max_connections", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
            "max_active_downstream_connections": layout.max_connections}}]},
    }


def _json_log(path: Path, fields: Mapping[str, str], only_flags: tuple[str, ...] = ()) -> dict[str, Any]:
    log: dict[str, Any] = {"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog", "path": str(path),
        "log_format": {"json_format": dict(fields)}}}
    if only_flags:
        log["filter"] = {"response_flag_filter": {"flags": list(only_flags)}}
    return log


# What an access-log line holds: what the reader (`egress_proxy.lane.ingest`) makes events of, nothing more (each
# field is formatted by Envoy and parsed by the reader on every request); never a header value, a lease or a query
# string (the path is logged without it). A line inside a tunnel needs no authority or scheme: its listener's static
# tag says which `host:port` it is for, and it is https.
_INNER_FIELDS = {
    "id": "%STREAM_ID%", "method": "%REQ(:METHOD)%", "path": "%PATH(NQ)%", "status": "%RESPONSE_CODE%", "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%", "route": "%ROUTE_NAME%", "bytes_up": "%BYTES_RECEIVED%", "bytes_down": "%BYTES_SENT%",
    "duration_ms": "%DURATION%",
}
_REQUEST_FIELDS = {**_INNER_FIELDS, "authority": "%REQ(:AUTHORITY)%", "scheme": "%REQ(:SCHEME)%"}
# Inside a tunnel too, whether the authorizer decided the request (its event is written) and the reason Envoy told.
_INNER_DECIDED = {"decided": "%DYNAMIC_METADATA(egresslaw:decided)%", "deny": "%RESP(X-EGRESSLAW-DENY)%",
                  "id": "%DYNAMIC_METADATA(egresslaw:id)%"}  # the id the check named (set by the inner Lua filter)


# Every listener speaks HTTP/1 only (HTTP/1.0 and 1.1), the tunnel's TLS offering only `http/1.1` in ALPN: a request's
# body is then always framed in its head (`Content-Length`, or the `Transfer-Encoding` the early mutation copies), so
# the authorizer knows whether it has one and how long it is. An HTTP/2 request's head does not say: a HEADERS frame
# without END_STREAM is followed by DATA of any length, and no filter before the router sees end-of-stream with the
# head (the Lua filter judges the head alone), so under HTTP/2 a body of undeclared length was charged nothing under a
# bytes cap and a GET could carry one. A client that sends the HTTP/2 preface anyway (prior knowledge, on the front
# or in a tunnel) meets the HTTP/1 codec: 400, nothing forwarded. The translation check requires both (`translate.py`).
CODEC = "HTTP1"
ALPN = ["http/1.1"]


def _hcm(stat: str, layout: Layout, log: dict[str, Any], filters: list[dict[str, Any]], routes: dict[str, Any],
         connect: bool, early: Sequence[dict[str, Any]] = (), replies: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    hcm: dict[str, Any] = {
        "@type": _HCM, "stat_prefix": stat, "codec_type": CODEC,
        "use_remote_address": True, "skip_xff_append": True, "generate_request_id": True,
        # Envoy's HTTP/1 codec refuses an absolute-form `https://` URL on a plaintext connection (403, before any
        # filter) only while it counts no trusted hop (`validate_scheme`). One trusted hop turns that check off; no
        # address is internal (`internal_address_config` names none), so a client's `X-Forwarded-For` only ever
        # changes `%DOWNSTREAM_REMOTE_ADDRESS%`, which the access log does not read, every
        # request stays an edge request (Envoy makes its own `x-request-id` and drops the `x-envoy-*` it honours),
        # and the client's `X-Forwarded-*` are removed by rule below.
        "xff_num_trusted_hops": 1, "internal_address_config": {"cidr_ranges": [], "unix_sockets": False},
        "server_header_transformation": "PASS_THROUGH",
        "max_request_headers_kb": layout.max_head_kib,
        "request_headers_timeout": f"{layout.header_timeout:g}s",
        "common_http_protocol_options": {"idle_timeout": f"{layout.idle_timeout}s", "max_headers_count": layout.max_headers},
        # HTTP/1.0 served as the edge serves it (Python's http.client opens a proxy tunnel with `CONNECT … HTTP/1.0`).
        "http_protocol_options": {"accept_http_10": True},
        "access_log": [log], "http_filters": [*filters, _ROUTER], **routes,
        "local_reply_config": {"mappers": [*replies, *_LOCAL_REPLIES]},
    }
    if connect:
        hcm["upgrade_configs"] = [{"upgrade_type": "CONNECT"}]
    if early:
        hcm["early_header_mutation_extensions"] = list(early)
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}


def _mapper(reason: str, status: int, flt: dict[str, Any], error: str = "egress_denied",
            extra: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    headers = [{"header": {"key": DENY_HEADER.lower(), "value": reason}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    headers += [{"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"} for k, v in extra]
    return {"filter": flt, "status_code": status, "headers_to_add": headers,
            "body_format_override": {"json_format": {"error": error, "reason": reason, "rule": None}}}


def _details_are(details: str) -> dict[str, Any]:
    """Matches a reply whose `%RESPONSE_CODE_DETAILS%` is `details` (a CEL filter: local replies only, never a forward)."""
    return {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": f"response.code_details == '{details}'"}}}


def _without_lease() -> dict[str, Any]:
    """Matches a request that carries no `Proxy-Authorization` at all (the edge's `lease-missing`, its first check)."""
    return {"header_filter": {"header": {"name": "proxy-authorization", "present_match": True, "invert_match": True}}}


def _status_is(code: int, op: str = "EQ") -> dict[str, Any]:
    return {"status_code_filter": {"comparison": {"op": op, "value": {"default_value": code, "runtime_key": "egresslaw.unused"}}}}


def _reason_unless_named(reason: str, flt: dict[str, Any]) -> dict[str, Any]:
    """A catch-all: the reply keeps the reason it names (the authorizer's refusals, the refusal routes) and gets
    `reason` when it names none; the body is the proxy's JSON for whichever reason the reply ends with."""
    return {"filter": flt,
            "headers_to_add": [{"header": {"key": DENY_HEADER.lower(), "value": reason}, "append_action": "ADD_IF_ABSENT"}],
            "body_format_override": {"json_format": {"error": "egress_denied", "reason": f"%RESP({DENY_HEADER.upper()})%", "rule": None}}}


# Envoy's own refusals (its HTTP codec, its limits, an upstream it cannot reach) answered as the proxy's are: JSON
# naming the reason, with X-Egresslaw-Deny, each as the mitmproxy edge answers the same head. The first mapper that
# matches a reply rewrites it; the last two match every reply, so no reply Envoy makes ever lacks a reason (the
# authorizer's refusals and the refusal routes keep theirs).
_LOCAL_REPLIES = [
    # The authorizer's budget-exceeded (429, `Retry-After`) keeps its body whole: the edge's JSON with the `detail`
    # naming the subject, the cap and the window (the catch-all below would rewrite it without the detail).
    {"filter": {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": "response.headers['x-egresslaw-deny'] == 'budget-exceeded'"}}}},
    _mapper("resolve-failed", 502, {"response_flag_filter": {"flags": ["UH"]}}, "upstream_error"),
    _mapper("upstream-error", 502, {"response_flag_filter": {"flags": ["UF", "URX", "UC", "UR", "UPE", "UT"]}}, "upstream_error"),
    _mapper("proxy-at-capacity", 503, {"response_flag_filter": {"flags": ["UO", "OM"]}}),
    # A CONNECT with a body (Content-Length): Envoy's codec refuses it before any filter, and before the request's
    # headers exist for a mapper to read; the edge decides `body-on-bodyless-method` once the lease verifies.
    _mapper("body-on-bodyless-method", 403, _details_are("http1.body_disallowed")),
    # A `Transfer-Encoding` other than `chunked` (Envoy's 501, before any filter): the edge's `smuggling`. A CONNECT
    # with a chunked body gets the same from Envoy (its method is not known to a mapper), where the edge decides
    # `body-on-bodyless-method`: both refuse it with a reason.
    _mapper("smuggling", 400, _details_are("http1.invalid_transfer_encoding")),
    # An upgrade (`Connection: Upgrade` + `Upgrade: X`) the front does not configure: Envoy's 403 `upgrade_failed`
    # before any filter. The edge checks the lease first (no Proxy-Authorization: 407 `lease-missing`), then refuses
    # the upgrade `upgrade-denied` (a lease or destination the edge refuses first cannot be judged here).
    _mapper("lease-missing", 407, {"and_filter": {"filters": [_details_are("upgrade_failed"), _without_lease()]}},
            extra=(("proxy-authenticate", 'Basic realm="egresslaw"'),)),
    _mapper("upgrade-denied", 403, _details_are("upgrade_failed")),
    _mapper("malformed-request", 400, _status_is(400)),
    _mapper("malformed-request", 400, _status_is(426)),  # a version Envoy does not speak (HTTP/0.9, HTTP/2.5): the edge's 400
    # `OPTIONS *` (a target that is not a path: Envoy refuses it before any filter, headers read). The edge checks the
    # lease first: without one, 407 `lease-missing`; with one, `path-not-absolute` (a lease the edge would refuse
    # cannot be verified here: documented in docs/lane.md).
    _mapper("lease-missing", 407, {"and_filter": {"filters": [_status_is(404), _without_lease()]}},
            extra=(("proxy-authenticate", 'Basic realm="egresslaw"'),)),
    _mapper("path-not-absolute", 403, _status_is(404)),
    _mapper("head-too-large", 431, _status_is(431)),
    _mapper("header-timeout", 408, _status_is(408)),
    _mapper("body-too-large", 413, _status_is(413)),
    _reason_unless_named("internal-error", _status_is(500, "GE")),
    _reason_unless_named("malformed-request", _status_is(0, "GE")),
]


# Removed from every request on every listener before the router sees it, by rule (on the front, a Lua filter reads
# every name once the authorizer admitted; inside a tunnel, an early header mutation matches names and prefixes):
# what the edge never forwards from a sandbox (`compiler.constants.header_is_denylisted`: `Forwarded`, `Via`,
# `X-Real-Ip`, the method-override and URL-rewrite headers, `Cookie`, `Authorization`, every `X-Forwarded-*`,
# `Proxy-*`, `X-Egresslaw-*`) and every `x-envoy-*` (Envoy's own: its routing and retry controls, and what it adds).
# Framing (`Host`, `Content-Length`, `Transfer-Encoding`, `Connection`, `Upgrade`, `Keep-Alive`) is Envoy's codec's
# to check and rewrite; the lane's two routing headers (set by the authorizer's answer) are removed by the route.
_FRAMING = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade", "keep-alive"})
STRIPPED_NAMES = tuple(sorted((HEADER_DENYLIST - _FRAMING) | {"x-request-id"}))
STRIPPED_PREFIXES = (*HEADER_DENYLIST_PREFIXES, "x-envoy-")
# Kept by the filter: the lane's two routing headers (set from the authorizer's answer) and the `X-Forwarded-Proto`
# Envoy writes (its route match reads the scheme through it); each route removes them (`STRIPPED`).
_KEPT = (LANE_HEADER, AUTHORITY_HEADER, "x-forwarded-proto")


def is_stripped(name: str) -> bool:
    """True when the lane never forwards the request header `name` (the rule the Lua filter below runs)."""
    lowered = name.lower()
    return lowered not in _KEPT and (lowered in STRIPPED_NAMES or lowered.startswith(STRIPPED_PREFIXES))


def _lua_set(names: Sequence[str]) -> str:
    return "{" + ", ".join(f'["{n}"] = true' for n in names) + "}"


_STRIP_LUA = """
local strip_names = NAMES
local strip_kept = KEPT
local strip_prefixes = PREFIXES
function egresslaw_strip(hd)
  local drop = {}
  for k, _ in pairs(hd) do
    if not strip_kept[k] and string.sub(k, 1, 1) ~= ":" then
      if strip_names[k] then
        drop[#drop + 1] = k
      else
        for _, p in ipairs(strip_prefixes) do
          if string.sub(k, 1, #p) == p then drop[#drop + 1] = k break end
        end
      end
    end
  end
  for _, k in ipairs(drop) do hd:remove(k) end
end
"""


def _strip_source() -> str:
    """The Lua function `egresslaw_strip(headers)`: the front's filter calls it once the authorizer admitted (the
    authorizer saw every field the client sent, as the edge's decision does). Inside a tunnel the same rule runs
    natively (`_early_strip`)."""
    return (_STRIP_LUA.replace("NAMES", _lua_set(STRIPPED_NAMES)).replace("KEPT", _lua_set(_KEPT))
            .replace("PREFIXES", "{" + ", ".join(f'"{p}"' for p in STRIPPED_PREFIXES) + "}"))


def _lua_filter(code: str) -> dict[str, Any]:
    return {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua", "default_source_code": {"inline_string": code}}}


EARLY_STRIP = "envoy.http.early_header_mutation.header_mutation"


def _early_strip() -> dict[str, Any]:
    """The same rule, native, for the internal listeners (every request inside a tunnel): an early header mutation
    the connection manager applies as it takes the head, before anything reads it, removing each stripped name and
    every name under a stripped prefix. No filter runs per request for it (a Lua call on every request in a tunnel
    was a third of Envoy's CPU per request). Nothing inside a tunnel is kept: the inner routes match `Host` and
    the path only, and each removes what Envoy adds afterwards (`STRIPPED`)."""
    mutations: list[dict[str, Any]] = [{"remove": n} for n in STRIPPED_NAMES]
    mutations += [{"remove_on_match": {"key_matcher": {"prefix": p}}} for p in STRIPPED_PREFIXES]
    return {"name": EARLY_STRIP, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
        "mutations": mutations}}


# Envoy's connection manager removes `Transfer-Encoding` from a request before any filter sees it (a hop-by-hop
# field), so the check would read a chunked body as no body: a bodyless method carrying one, or a body of undeclared
# length under a bytes cap (`budget-length-required`), would pass. An early header mutation, which runs before that
# removal, copies the field under a lane-private name (the client's own spelling of that name removed first); the
# authorizer reads it back as `transfer-encoding` (`authorize.parse_check`), and the stripping rule removes it (an
# `x-egresslaw-` name) before anything goes upstream.
FRAMING_HEADER = "x-egresslaw-transfer-encoding"


def _keep_framing() -> dict[str, Any]:
    return {"name": "envoy.http.early_header_mutation.header_mutation.framing", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
        "mutations": [{"remove": FRAMING_HEADER},
                      {"append": {"header": {"key": FRAMING_HEADER, "value": "%REQ(transfer-encoding)%"},
                                  "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}}]}}


def _front(layout: Layout) -> dict[str, Any]:
    log = _json_log(layout.access_log, {"lane": "front", **_REQUEST_FIELDS, "id": "%DYNAMIC_METADATA(egresslaw:id)%",
                                        "decided": "%DYNAMIC_METADATA(egresslaw:decided)%",
                                        "deny": "%RESP(X-EGRESSLAW-DENY)%"})
    lua = {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": _strip_source() + _LUA.replace("TIMEOUT_MS", str(layout.authorizer_timeout_ms))}}}
    rds = {"rds": {"route_config_name": FRONT_ROUTES, "config_source": _watched(layout.run_dir, "rds")}}
    return {
        "name": "front", "address": _socket(layout.listen), "per_connection_buffer_limit_bytes": layout.connection_buffer,
        "filter_chains": [{"filters": [_hcm("front", layout, log, [_carry_tunnel_id(), lua], rds, connect=True,
                                            early=[_keep_framing()])]}],
    }


# The factory of the tunnel's id object. A hashable string: a shared object that is hashable is part of the upstream
# connection pool's key, so each CONNECT gets a pool of its own and its internal connection can serve no other CONNECT.
# With `envoy.string` (not hashable) every CONNECT to one `mitm|P|H` cluster shared a pool, and a connection made
# with one CONNECT's id (its transport socket options) went to whichever CONNECT of the pool was waiting when it was
# ready: under concurrent CONNECTs the requests of one tunnel were judged with another tunnel's lease, and refused
# `internal-error` once that other tunnel closed (tests/egress_proxy/run/test_lane_tunnels_concurrent.py).
TUNNEL_STATE_FACTORY = "envoy.hashable_string"


def _carry_tunnel_id() -> dict[str, Any]:
    """The request's id as a filter-state object shared with the upstream connection: a CONNECT's upstream
    connection is the internal one to `mitm|P|H` (its cluster's internal upstream transport passes the object
    across), so every request inside the tunnel reads its CONNECT's id there (`_INNER_LUA`). Hashable, so the id
    keys the connection pool: the internal connection made for a CONNECT is only ever that CONNECT's."""
    return {"name": "envoy.filters.http.set_filter_state", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config",
        "on_request_headers": [{"object_key": TUNNEL_STATE, "factory_key": TUNNEL_STATE_FACTORY,
                                "format_string": {"text_format_source": {"inline_string": "%REQ(X-REQUEST-ID)%"}},
                                "shared_with_upstream": "ONCE"}]}}


def _strip_filter() -> dict[str, Any]:
    """The stripping rule inside a tunnel as a native filter after the check (the authorizer sees every field the
    client sent, as the edge's decision does): the same removals as `_early_strip`, no script."""
    mutations = _early_strip()["typed_config"]["mutations"]
    return {"name": "envoy.filters.http.header_mutation", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": mutations}}}


def _deny_route(reason: str, match: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": f"deny:{reason}", "match": match,
        "direct_response": {"status": 403, "body": {"inline_string": denial_body(reason).decode("ascii")}},
        "response_headers_to_add": [
            {"header": {"key": "content-type", "value": "application/json"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
            {"header": {"key": DENY_HEADER.lower(), "value": reason}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }


def _exact(header: str, value: str) -> dict[str, Any]:
    return {"name": header, "string_match": {"exact": value, "ignore_case": True}}


def _forward(route_name: str, match: dict[str, Any], cluster: str, *, connect: bool = False) -> dict[str, Any]:
    action: dict[str, Any] = {"cluster": cluster, "timeout": "0s"}  # no whole-response timeout: a 300 MiB download runs on
    if connect:
        action["upgrade_configs"] = [{"upgrade_type": "CONNECT", "connect_config": {}}]  # terminate: the tunnel's bytes go to the internal listener
    return {"name": route_name, "match": match, "route": action, "request_headers_to_remove": list(STRIPPED)}


def _authority_spellings(host: str, port: int, scheme: str) -> tuple[str, ...]:
    """The `Host` values a request inside a tunnel to `host:port` may carry (the port is optional on the default)."""
    default = {"http": 80, "https": 443}[scheme]
    return (f"{host}:{port}", host) if port == default else (f"{host}:{port}",)


def _front_routes(profiles: tuple[SandboxProfile, ...]) -> dict[str, Any]:
    """One virtual host for every name: routes match the two headers the Lua filter set from the authorizer's answer
    (the profile, and the `host:port` it judged, normalized), never the client's own spelling of the authority; a
    route per (profile, host:port, transport), then the refusals."""
    routes = []
    for prof in profiles:
        who = _exact(LANE_HEADER, prof.name)
        for host, port in authorities(prof):
            where = _exact(AUTHORITY_HEADER, f"{host}:{port}")
            routes.append(_forward(f"allow:{prof.name}", {"connect_matcher": {}, "headers": [who, where]},
                                   name("mitm", prof.name, host, port), connect=True))
            for scheme, kind in (("http", "http"), ("https", "tls")):
                routes.append(_forward(f"allow:{prof.name}", {"prefix": "/", "headers": [who, where, _exact(":scheme", scheme)]},
                                       name(kind, prof.name, host, port)))
    refusals = [_deny_route("lane-no-route", {"connect_matcher": {}}), _deny_route("lane-no-route", {"prefix": "/"})]
    return {"name": FRONT_ROUTES, "virtual_hosts": [{"name": "lane", "domains": ["*"], "routes": routes + refusals}]}


def _inner(layout: Layout, profile: str, host: str, port: int) -> dict[str, Any]:
    listener = name("mitm", profile, host, port)
    tag = {"lane": "inner", "profile": profile, "connect": f"{host}:{port}"}
    routes = {"route_config": {"name": listener, "virtual_hosts": [
        {"name": host, "domains": list(_authority_spellings(host, port, "https")),
         "routes": [_forward(f"allow:{profile}", {"prefix": "/"}, name("tls", profile, host, port))]},
        {"name": "other", "domains": ["*"], "routes": [_deny_route("host-header-mismatch", {"prefix": "/"})]},
    ]}}
    tls = {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "common_tls_context": {"alpn_protocols": ALPN, "tls_certificates": [{
            "certificate_chain": {"filename": str(layout.cert_dir / f"{host}.pem")},
            "private_key": {"filename": str(layout.cert_dir / LEAF_KEY)}}]}}}
    return {
        "name": listener, "internal_listener": {}, "per_connection_buffer_limit_bytes": layout.connection_buffer,
        "listener_filters": [{"name": "envoy.filters.listener.tls_inspector", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"}}],
        "filter_chains": [{"filter_chain_match": {"server_names": [host]}, "transport_socket": tls,
                           "filters": [_hcm("inner", layout, _json_log(layout.access_log, {**tag, **_INNER_FIELDS, **_INNER_DECIDED}),
                                            [_inner_lua(layout), _strip_filter()], routes, connect=False,
                                            early=[_keep_framing()], replies=_INNER_REPLIES)]}],
        # A connection no filter chain takes (another SNI, or none): one line, audited sni-mismatch / sni-missing.
        "access_log": [_json_log(layout.access_log, {"lane": "tls", "profile": profile, "connect": f"{host}:{port}",
                                                     "sni": "%REQUESTED_SERVER_NAME%", "flags": "%RESPONSE_FLAGS%",
                                                     "duration_ms": "%DURATION%"}, only_flags=("NR",))],
    }


def _authorizer_cluster(layout: Layout) -> dict[str, Any]:
    return {"name": AUTHORIZER_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": AUTHORIZER_CLUSTER, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": str(layout.authorizer)}}}}]}]}}


def _internal_upstream() -> dict[str, Any]:
    """The internal upstream transport: it passes the CONNECT's shared filter state (its id) to the internal listener."""
    return {"name": "envoy.transport_sockets.internal_upstream", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport",
        "transport_socket": {"name": "envoy.transport_sockets.raw_buffer", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}}}}


def _internal_cluster(listener: str) -> dict[str, Any]:
    return {"name": listener, "connect_timeout": "1s", "transport_socket": _internal_upstream(),
            "load_assignment": {"cluster_name": listener, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"envoy_internal_address": {"server_listener_name": listener}}}}]}]}}


# What an upstream answered, as the edge passes it on (`edge.responses.mark_response_headers`): every `X-Egresslaw-*`
# it sent removed (they are the proxy's to set) and a 3xx marked `X-Egresslaw-Redirect: not-followed`. A native
# header mutation as an upstream filter of each forwarding cluster: it sees the upstream's own answers only, never a
# refusal the lane made itself, and runs no script per request.
_UPSTREAM_FILTERS = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "explicit_http_config": {"http_protocol_options": {}},
    "http_filters": [
        {"name": "envoy.filters.http.header_mutation", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"response_mutations": [
                {"remove_on_match": {"key_matcher": {"prefix": "x-egresslaw-"}}},
                {"append": {"header": {"key": "x-egresslaw-redirect",
                                       "value": "%CEL(response.headers[':status'].startsWith('3') ? 'not-followed' : '')%"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}}]}}},
        {"name": "envoy.filters.http.upstream_codec", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"}}]}}


def _upstream_cluster(layout: Layout, kind: str, profile: str, host: str, port: int, worker: str, ipv6: bool) -> dict[str, Any]:
    cluster_name = name(kind, profile, host, port)
    dial_port = layout.connect_to.get((host, port), (host, port))[1]
    cluster: dict[str, Any] = {
        "name": cluster_name, "type": "STRICT_DNS", "connect_timeout": "10s",
        "dns_lookup_family": "V4_PREFERRED" if ipv6 else "V4_ONLY",
        "respect_dns_ttl": True, "dns_refresh_rate": "5s", "dns_failure_refresh_rate": {"base_interval": "1s", "max_interval": "10s"},
        "per_connection_buffer_limit_bytes": layout.connection_buffer,
        "typed_dns_resolver_config": {"name": "envoy.network.dns_resolver.cares", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
            "resolvers": [_socket(layout.dns[worker])], "use_resolvers_as_fallback": False,
            "dns_resolver_options": {"no_default_search_domain": True, "use_tcp_for_dns_lookups": False}}},
        "load_assignment": {"cluster_name": cluster_name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": dial_port}}}}]}]},
    }
    cluster["typed_extension_protocol_options"] = _UPSTREAM_FILTERS
    if kind == "tls":
        cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext", "sni": host,
            "common_tls_context": {"validation_context": {
                "trusted_ca": {"filename": str(layout.trust_bundle)},
                "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": host}}]}}}}
    return cluster


# Runs on the front listener for every request. It asks the authorizer (one POST carrying the request's header
# fields, pseudo-headers included) and either routes the request as the profile the authorizer names or answers
# the authorizer's refusal. An authorizer that does not answer, or answers without a reason, is a refusal
# (`authorizer-unavailable`, 503): the lane fails closed. `decided` tells the access-log reader the authorizer has
# already written this request's decision event.
_LUA = """
function envoy_on_request(h)
  local hd = h:headers()
  hd:remove("x-egresslaw-lane-profile")
  hd:remove("x-egresslaw-lane-authority")
  h:streamInfo():dynamicMetadata():set("egresslaw", "id", hd:get("x-request-id") or "")
  local lines = {}
  for k, v in pairs(hd) do lines[#lines + 1] = k .. ": " .. v end
  -- the check's deadline (unix ms): 500 ms before this call times out, so an allow written after it never lands
  -- on a request already refused authorizer-unavailable (h:timestamp() is the wall clock in ms)
  local deadline = string.format("%.0f", h:timestamp() + TIMEOUT_MS - 500)
  local rh, body = h:httpCall("egresslaw_authorizer",
    {[":method"] = "POST", [":path"] = "/check", [":authority"] = "egresslaw-authorizer", ["content-type"] = "text/plain",
     ["x-egresslaw-deadline"] = deadline},
    table.concat(lines, "\\r\\n"), TIMEOUT_MS, false)
  if rh ~= nil and rh[":status"] == "200" and rh["x-egresslaw-lane-profile"] ~= nil and rh["x-egresslaw-lane-authority"] ~= nil then
    h:streamInfo():dynamicMetadata():set("egresslaw", "decided", "allow")
    h:headers():replace("x-egresslaw-lane-profile", rh["x-egresslaw-lane-profile"])
    h:headers():replace("x-egresslaw-lane-authority", rh["x-egresslaw-lane-authority"])
    egresslaw_strip(h:headers())
    h:clearRouteCache()
    return
  end
  if rh == nil or rh["x-egresslaw-deny"] == nil then
    h:respond({[":status"] = "503", ["x-egresslaw-deny"] = "authorizer-unavailable", ["content-type"] = "application/json",
               ["retry-after"] = "1"}, '{"error": "egress_denied", "reason": "authorizer-unavailable", "rule": null}')
    return
  end
  h:streamInfo():dynamicMetadata():set("egresslaw", "decided", "deny")
  local out = {[":status"] = rh[":status"], ["x-egresslaw-deny"] = rh["x-egresslaw-deny"], ["content-type"] = "application/json"}
  if rh["proxy-authenticate"] ~= nil then out["proxy-authenticate"] = rh["proxy-authenticate"] end
  if rh["retry-after"] ~= nil then out["retry-after"] = rh["retry-after"] end
  h:respond(out, body)
end
"""


# Runs on every internal listener (every request inside a tunnel): asks the authorizer about the request, naming its
# tunnel (the CONNECT's id, from the filter state Envoy carried across), and either lets it on to the routes (which
# match `Host`) or answers the authorizer's refusal. Fails closed like the front's filter. It sets no header and
# re-picks no route: what goes upstream is decided by the inner routes and the stripping filter after it.
_INNER_LUA = """
function egresslaw_check(h)
  local hd = h:headers()
  local id = hd:get("x-request-id") or ""
  h:streamInfo():dynamicMetadata():set("egresslaw", "id", id)
  local tunnel = h:streamInfo():filterState():get("TUNNEL_STATE") or ""
  local lines = {}
  for k, v in pairs(hd) do lines[#lines + 1] = k .. ": " .. v end
  local deadline = string.format("%.0f", h:timestamp() + TIMEOUT_MS - 500)
  local rh, body = h:httpCall("egresslaw_authorizer",
    {[":method"] = "POST", [":path"] = "/check", [":authority"] = "egresslaw-authorizer", ["content-type"] = "text/plain",
     ["x-egresslaw-deadline"] = deadline, ["x-egresslaw-tunnel"] = tunnel},
    table.concat(lines, "\\r\\n"), TIMEOUT_MS, false)
  if rh ~= nil and rh[":status"] == "200" and rh["x-egresslaw-lane-profile"] ~= nil then
    h:streamInfo():dynamicMetadata():set("egresslaw", "decided", "allow")
    return
  end
  if rh == nil or rh["x-egresslaw-deny"] == nil then
    h:respond({[":status"] = "503", ["x-egresslaw-deny"] = "authorizer-unavailable", ["content-type"] = "application/json",
               ["retry-after"] = "1"}, '{"error": "egress_denied", "reason": "authorizer-unavailable", "rule": null}')
    return
  end
  h:streamInfo():dynamicMetadata():set("egresslaw", "decided", "deny")
  local out = {[":status"] = rh[":status"], ["x-egresslaw-deny"] = rh["x-egresslaw-deny"], ["content-type"] = "application/json"}
  if rh["proxy-authenticate"] ~= nil then out["proxy-authenticate"] = rh["proxy-authenticate"] end
  if rh["retry-after"] ~= nil then out["retry-after"] = rh["retry-after"] end
  h:respond(out, body)
end

-- A script error would let the request on (Envoy continues past a failed Lua filter): fail closed instead.
function envoy_on_request(h)
  if not pcall(egresslaw_check, h) then
    h:respond({[":status"] = "403", ["x-egresslaw-deny"] = "internal-error", ["content-type"] = "application/json"},
              '{"error": "egress_denied", "reason": "internal-error", "rule": null}')
  end
end
"""


def _inner_lua(layout: Layout) -> dict[str, Any]:
    return _lua_filter(_INNER_LUA.replace("TUNNEL_STATE", TUNNEL_STATE).replace("TIMEOUT_MS", str(layout.authorizer_timeout_ms)))


# Inside a tunnel, a CONNECT is the edge's `connect-in-tunnel`, 400: the authorizer's refusal keeps its reason (the
# catch-all mappers would name a 400 `malformed-request`), and one Envoy's codec refuses before any filter
# (`upgrade_failed`: no CONNECT upgrade is configured there) gets it.
_INNER_REPLIES = [
    # The authorizer's own 400 (a CONNECT inside a tunnel that reached the check) keeps its reason.
    {"filter": {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": "response.headers['x-egresslaw-deny'] == 'connect-in-tunnel'"}}}},
    {"filter": {"and_filter": {"filters": [_details_are("upgrade_failed"), {"header_filter": {"header": {
        "name": ":method", "string_match": {"exact": "CONNECT"}}}}]}}, "status_code": 400,
     "headers_to_add": [{"header": {"key": DENY_HEADER.lower(), "value": "connect-in-tunnel"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
     "body_format_override": {"json_format": {"error": "egress_denied", "reason": "connect-in-tunnel", "rule": None}}},
]
