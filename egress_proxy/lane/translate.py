"""The translation check: read Envoy's configuration back, as generated and as Envoy loaded it, and require that it
admits exactly what the artifact's served profiles allow, nothing beyond.

What each profile may reach (the expected side) comes from `egress_proxy.lane.reach`, which reads the artifact
alone and imports nothing of the generator; this module calls no function of `egress_proxy.lane.envoy` either (a
test replaces every one of them with one that fails), taking from it only the wire names the authorizer shares
(its two headers, its cluster) and the `Layout` the runner chose. A generator bug therefore cannot move the
expected side with it.

The actual side is walked twice: the documents before Envoy sees them (`check`), and what Envoy loaded, read from
its admin `/config_dump` after start and after every reload (`confirm_loaded`: the same walk over the loaded
listeners, clusters and route tables, once Envoy has taken the artifact's version and nothing is warming).

The walk does not trust the generator's structure: it goes as Envoy would (a route's match, the cluster it names,
the endpoint that cluster dials, the internal listener behind a CONNECT, that listener's SNI match, its certificate's
names, its own routes and clusters) and collects, per profile, the (host, port) pairs reachable by each transport
(CONNECT + TLS, absolute-form `http://`, absolute-form `https://`). Each set must equal the profile's reach; every
route that does not forward must be a 403 refusal; every forwarding route must strip the lease and hop-by-hop fields;
upstream TLS must be verified with the host's own name; every name must resolve through the DNS front; and the front
listener must listen on the lane's address and ask the authorizer (failing closed) before routing, with nothing but
header removals between it and the router; every listener must speak HTTP/1 only (its codec HTTP1, a tunnel's ALPN
`http/1.1` alone: a request's body is framed in the head the authorizer judges). `check` returns the problems found
(empty: the translation is exact).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509

from compiler.artifact import Artifact
from egress_proxy.errors import EgressError
from egress_proxy.lane.envoy import AUTHORITY_HEADER, AUTHORIZER_CLUSTER, FRAMING_HEADER, LANE_HEADER, Layout
from egress_proxy.lane.reach import reach

Pairs = set[tuple[str, int]]

# What must never go upstream, stated here rather than taken from the generator's list (docs/lane.md): the lease,
# the proxy's hop-by-hop fields, the lane's own routing headers, the request id that names the audit event, and
# what Envoy adds about the client.
NEVER_UPSTREAM = ("proxy-authorization", "proxy-authenticate", "proxy-connection", "te", "trailer", LANE_HEADER, AUTHORITY_HEADER,
                  "x-request-id", "x-forwarded-for", "x-forwarded-proto")


def read(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The documents as written (`envoy.write`)."""
    docs = {"bootstrap": json.loads((run_dir / "bootstrap.json").read_text())}
    for kind in ("lds", "cds", "rds"):
        docs[kind] = json.loads((run_dir / "xds" / f"{kind}.json").read_text())
    return docs


def _hcm(listener: Mapping[str, Any]) -> Mapping[str, Any]:
    chains = listener.get("filter_chains") or []
    if len(chains) != 1 or len(chains[0].get("filters") or []) != 1:
        raise _Problem(f"listener `{listener.get('name')}` must have one filter chain with one filter")
    return chains[0]["filters"][0]["typed_config"]


class _Problem(EgressError):
    """The configuration is not shaped as the check can read (reported as a problem, never raised out of `check`)."""


# What a Lua filter between the authorizer and the router may not do: answer, call out, re-pick the route or set a
# header (it could rewrite the routing headers the authorizer's answer set). Removing headers is all it may do.
_LUA_EFFECTS = ("respond(", "httpCall(", "clearRouteCache", ":add(", ":replace(", ":setCopy(", "setUpstreamOverrideHost", "body(")


def _only_removes_then_routes(filters: list[Mapping[str, Any]]) -> bool:
    """`filters` is Lua filters that only remove headers, then Envoy's router, last."""
    if [f.get("name") for f in filters[-1:]] != ["envoy.filters.http.router"]:
        return False
    for f in filters[:-1]:
        config = f.get("typed_config") or {}
        code = (config.get("default_source_code") or {}).get("inline_string")
        if not config.get("@type", "").endswith(".lua.v3.Lua") or code is None or set(config) - {"@type", "default_source_code"}:
            return False
        if "envoy_on_response" in code or any(effect in code for effect in _LUA_EFFECTS):
            return False
    return True


_EARLY_MUTATION = "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
_SET_FILTER_STATE = "type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config"
_HEADER_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
_INTERNAL_UPSTREAM = "type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport"
TUNNEL_OBJECT = "egresslaw.tunnel"  # the one filter-state object the front may set: the request's id, for its tunnel
# Its factory: a hashable string, so the id keys the upstream connection pool (one pool per CONNECT). Not hashable
# (`envoy.string`), CONNECTs share a pool and a tunnel can be handed another CONNECT's connection, and so its id.
TUNNEL_FACTORY = "envoy.hashable_string"


def _carries_tunnel_id(f: Mapping[str, Any]) -> bool:
    """The front's first filter sets exactly one filter-state string, the request's id, shared with the upstream
    connection (the internal one behind a CONNECT) and nothing else: no well-known key that steers Envoy."""
    config = f.get("typed_config") or {}
    if f.get("name") != "envoy.filters.http.set_filter_state" or config.get("@type") != _SET_FILTER_STATE or set(config) - {"@type", "on_request_headers"}:
        return False
    return config.get("on_request_headers") == [{"object_key": TUNNEL_OBJECT, "factory_key": TUNNEL_FACTORY, "shared_with_upstream": "ONCE",
                                                  "format_string": {"text_format_source": {"inline_string": "%REQ(X-REQUEST-ID)%"}}}]


def _only_removals(mutations: Any) -> bool:
    """Header mutations that only remove: a name, or names under a prefix."""
    for m in mutations or []:
        if set(m) == {"remove"} and isinstance(m["remove"], str):
            continue
        key = (m.get("remove_on_match") or {}).get("key_matcher") or {}
        if set(m) != {"remove_on_match"} or set(m["remove_on_match"]) != {"key_matcher"} or set(key) != {"prefix"}:
            return False
    return True


# The inner listener's check may answer (a refusal) and call the authorizer; nothing else its front counterpart
# may not do: it sets no header, re-picks no route, reads no body.
_INNER_LUA_EFFECTS = ("clearRouteCache", ":add(", ":replace(", ":setCopy(", "setUpstreamOverrideHost", "body(", "envoy_on_response")


def _checks_then_removes_then_routes(filters: list[Mapping[str, Any]]) -> bool:
    """An internal listener's filters: the authorizer's check (a Lua filter that asks it, naming the tunnel, and
    fails closed), one native filter that only removes request headers, then the router."""
    if [f.get("name") for f in filters] != ["envoy.filters.http.lua", "envoy.filters.http.header_mutation", "envoy.filters.http.router"]:
        return False
    lua, strip = (f.get("typed_config") or {} for f in filters[:2])
    code = (lua.get("default_source_code") or {}).get("inline_string")
    if not lua.get("@type", "").endswith(".lua.v3.Lua") or code is None or set(lua) - {"@type", "default_source_code"}:
        return False
    needles = (f'h:httpCall("{AUTHORIZER_CLUSTER}"', f'filterState():get("{TUNNEL_OBJECT}")', '"authorizer-unavailable"')
    if any(effect in code for effect in _INNER_LUA_EFFECTS) or not all(n in code for n in needles):
        return False
    mutations = strip.get("mutations") or {}
    return strip.get("@type") == _HEADER_MUTATION and set(strip) == {"@type", "mutations"} and set(mutations) == {"request_mutations"} \
        and _only_removals(mutations["request_mutations"])


def _passes_only_filter_state(ts: Mapping[str, Any] | None) -> bool:
    """A CONNECT cluster's transport: none, or the internal upstream transport over raw bytes passing no metadata."""
    if ts is None:
        return True
    config = ts.get("typed_config") or {}
    inner = (config.get("transport_socket") or {}).get("typed_config") or {}
    return config.get("@type") == _INTERNAL_UPSTREAM and set(config) <= {"@type", "transport_socket"} \
        and inner.get("@type") == "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer" and set(inner) == {"@type"}


# The one header an early mutation may write: the client's `Transfer-Encoding` copied under the lane's private name
# (Envoy removes the field itself before any filter), for the authorizer's check; no other name, no other value.
def _framing_copy(m: Mapping[str, Any]) -> bool:
    """`m` writes FRAMING_HEADER from the request's `Transfer-Encoding` and nothing else (as generated, or as Envoy
    reports it back, its defaults left out)."""
    append = m.get("append") if set(m) == {"append"} else None
    if not isinstance(append, Mapping) or set(append) - {"header", "append_action", "keep_empty_value"}:
        return False
    return (append.get("header") == {"key": FRAMING_HEADER, "value": "%REQ(transfer-encoding)%"}
            and append.get("append_action") == "OVERWRITE_IF_EXISTS_OR_ADD" and not append.get("keep_empty_value"))


def _early_only_removes(hcm: Mapping[str, Any]) -> bool:
    """The connection manager's early header mutations (applied to every head before anything reads it) only remove
    headers: a name, or names under a prefix; besides, exactly the copy of `Transfer-Encoding` under FRAMING_HEADER.
    One that sets any other header could rewrite `Host` or the lane's routing headers before the routes read them."""
    for ext in hcm.get("early_header_mutation_extensions") or []:
        config = ext.get("typed_config") or {}
        if config.get("@type") != _EARLY_MUTATION or set(config) - {"@type", "mutations"}:
            return False
        if not _only_removals([m for m in config.get("mutations") or [] if not _framing_copy(m)]):
            return False
    return True


# HTTP/1 only, on every listener: a request's body is framed in its head, which the authorizer judges (and charges)
# alone. HTTP/2 says nothing of a body in its HEADERS frame, so a codec that may speak it (AUTO, HTTP2), or a tunnel
# offering `h2` in ALPN, would let a body of undeclared length past a bytes cap and a body onto a GET.
def _http1_only(hcm: Mapping[str, Any]) -> bool:
    return hcm.get("codec_type") == "HTTP1"


def _header_matches(match: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for h in match.get("headers") or []:
        sm = h.get("string_match") or {}
        if set(sm) - {"exact", "ignore_case"} or "exact" not in sm:
            raise _Problem(f"a route matches header `{h.get('name')}` other than exactly")
        out[h["name"]] = sm["exact"].lower()
    return out


def _split(authority: str, default_port: int) -> tuple[str, int]:
    """`host:port` as a route matches it (the authorizer's normalized form); a port that is not 1-5 digits is -1."""
    host, sep, port = authority.rpartition(":")
    if not sep or "]" in port:
        return authority, default_port
    return host, int(port) if port.isdigit() and len(port) <= 5 else -1


def check(artifact: Artifact, docs: Mapping[str, Mapping[str, Any]], layout: Layout) -> list[str]:
    """The problems of `docs` (`lds`, `cds`, `rds`, each `{"resources": [...]}`) against the artifact's reach."""
    problems: list[str] = []
    try:
        _check(artifact, docs, layout, problems)
    except (_Problem, KeyError, TypeError, ValueError, IndexError) as exc:
        problems.append(f"the configuration cannot be read back: {exc.__class__.__name__}: {exc}")
    return problems


def _check(artifact: Artifact, docs: Mapping[str, Mapping[str, Any]], layout: Layout, problems: list[str]) -> None:
    listeners = {x["name"]: x for x in docs["lds"]["resources"]}
    clusters = {x["name"]: x for x in docs["cds"]["resources"]}
    routes = {x["name"]: x for x in docs["rds"]["resources"]}
    want = {name: set(pairs) for name, pairs in reach(artifact).profiles.items()}
    seen: dict[str, dict[str, Pairs]] = {p: {"connect": set(), "http": set(), "https": set()} for p in want}
    used_clusters = {AUTHORIZER_CLUSTER}
    used_listeners = {"front"}
    cert_hosts: set[str] = set()

    front = listeners.get("front")
    if front is None:
        raise _Problem("no front listener")
    if front.get("address") != {"socket_address": {"address": layout.listen[0], "port_value": layout.listen[1]}}:
        problems.append(f"the front listener is not on {layout.listen[0]}:{layout.listen[1]}")
    hcm = _hcm(front)
    filters = [f["name"] for f in hcm.get("http_filters") or []]
    if filters[1:2] != ["envoy.filters.http.lua"] or not _carries_tunnel_id(hcm["http_filters"][0]) \
            or not _only_removes_then_routes(hcm["http_filters"][2:]):
        problems.append(f"the front listener's filters are {filters}, not the tunnel id, the authorizer's Lua filter, header removals, "
                        "then the router")
    elif not _early_only_removes(hcm):
        problems.append("the front listener's early header mutations do more than remove headers")
    if not _http1_only(hcm):
        problems.append(f"the front listener's codec is {hcm.get('codec_type', 'AUTO')}, not HTTP1 (a body's length must be in the head)")
    else:
        lua = hcm["http_filters"][1]["typed_config"]["default_source_code"]["inline_string"]
        for needle in (f'hd:remove("{LANE_HEADER}")', f'hd:remove("{AUTHORITY_HEADER}")', f'h:httpCall("{AUTHORIZER_CLUSTER}"', '"authorizer-unavailable"', "clearRouteCache"):
            if needle not in lua:
                problems.append(f"the front listener's Lua filter lacks `{needle}`")
    auth = clusters.get(AUTHORIZER_CLUSTER)
    if auth is None or auth["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"].get("pipe", {}).get("path") != str(layout.authorizer):
        problems.append("the authorizer cluster does not dial the authorizer's socket")
    rds_name = hcm.get("rds", {}).get("route_config_name")
    table = routes.get(rds_name or "")
    if table is None:
        raise _Problem("the front listener's route table is missing")

    def deny_or(route: Mapping[str, Any], where: str) -> str | None:
        """The forwarding cluster of `route`; None for a refusal (checked to be a 403)."""
        if "direct_response" in route:
            if route["direct_response"].get("status") != 403:
                problems.append(f"{where}: a direct response that is not a 403 refusal")
            return None
        action = route.get("route")
        if not action or set(action) - {"cluster", "timeout", "upgrade_configs"}:
            problems.append(f"{where}: a route that neither refuses nor forwards to one named cluster")
            return None
        missing = set(NEVER_UPSTREAM) - set(route.get("request_headers_to_remove") or [])
        if missing:
            problems.append(f"{where}: forwards without removing {sorted(missing)}")
        return action["cluster"]

    def upstream(cluster_name: str, host: str, port: int, tls: bool, where: str) -> None:
        used_clusters.add(cluster_name)
        c = clusters.get(cluster_name)
        if c is None:
            problems.append(f"{where}: cluster `{cluster_name}` is missing")
            return
        eps = [e["endpoint"]["address"] for g in c["load_assignment"]["endpoints"] for e in g["lb_endpoints"]]
        dial_port = layout.connect_to.get((host, port), (host, port))[1]
        if eps != [{"socket_address": {"address": host, "port_value": dial_port}}]:
            problems.append(f"{where}: cluster `{cluster_name}` dials {eps}, not {host}:{dial_port}")
        resolver = c.get("typed_dns_resolver_config", {}).get("typed_config", {})
        fronts = {f"{a[0]}:{a[1]}" for a in layout.dns.values()}
        dialled = {f"{r['socket_address']['address']}:{r['socket_address']['port_value']}" for r in resolver.get("resolvers", [])}
        if c.get("type") != "STRICT_DNS" or not dialled or not dialled <= fronts or resolver.get("use_resolvers_as_fallback", False) is not False:  # absent is false: Envoy's dump omits proto3 defaults
            problems.append(f"{where}: cluster `{cluster_name}` does not resolve through the DNS front only")
        ts = c.get("transport_socket")
        if tls:
            ctx = (ts or {}).get("typed_config", {})
            vc = ctx.get("common_tls_context", {}).get("validation_context", {})
            sans = vc.get("match_typed_subject_alt_names")
            if ctx.get("sni") != host or sans != [{"san_type": "DNS", "matcher": {"exact": host}}] or not vc.get("trusted_ca"):
                problems.append(f"{where}: cluster `{cluster_name}` does not verify the upstream as `{host}`")
        elif ts is not None:
            problems.append(f"{where}: plain cluster `{cluster_name}` has a transport socket")

    def tunnel(cluster_name: str, profile: str, host: str, port: int, where: str) -> bool:
        used_clusters.add(cluster_name)
        c = clusters.get(cluster_name)
        eps = [e["endpoint"]["address"] for g in c["load_assignment"]["endpoints"] for e in g["lb_endpoints"]] if c else []
        if len(eps) != 1 or "envoy_internal_address" not in eps[0]:
            problems.append(f"{where}: CONNECT cluster `{cluster_name}` is not one internal listener")
            return False
        if not _passes_only_filter_state(c.get("transport_socket") if c else None):
            problems.append(f"{where}: CONNECT cluster `{cluster_name}` has a transport other than the internal upstream one")
        lname = eps[0]["envoy_internal_address"]["server_listener_name"]
        used_listeners.add(lname)
        inner = listeners.get(lname)
        if inner is None:
            problems.append(f"{where}: internal listener `{lname}` is missing")
            return False
        chains = inner.get("filter_chains") or []
        if "default_filter_chain" in inner or len(chains) != 1 or chains[0].get("filter_chain_match") != {"server_names": [host]}:
            problems.append(f"{where}: internal listener `{lname}` takes another SNI than `{host}`")
        tls_ctx = chains[0].get("transport_socket", {}).get("typed_config", {}).get("common_tls_context", {}) if chains else {}
        for cert in tls_ctx.get("tls_certificates", []):
            path = Path(cert["certificate_chain"]["filename"])
            try:
                leaf = x509.load_pem_x509_certificate(path.read_bytes())
                names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
            except (OSError, ValueError, x509.ExtensionNotFound):
                problems.append(f"{where}: certificate `{path}` cannot be read")
                continue
            if names != [host]:
                problems.append(f"{where}: certificate `{path}` names {names}, not [`{host}`]")
            cert_hosts.add(host)
        if tls_ctx.get("alpn_protocols") != ["http/1.1"]:
            problems.append(f"{where}: internal listener `{lname}` offers {tls_ctx.get('alpn_protocols')} in ALPN, not only http/1.1")
        inner_hcm = _hcm(inner)
        if not _http1_only(inner_hcm):
            problems.append(f"{where}: internal listener `{lname}` has codec {inner_hcm.get('codec_type', 'AUTO')}, not HTTP1 "
                            "(a body's length must be in the head)")
        if not _checks_then_removes_then_routes(inner_hcm.get("http_filters") or []) or not _early_only_removes(inner_hcm):
            problems.append(f"{where}: internal listener `{lname}` runs filters other than the authorizer's check, header removals "
                            "and the router")
        for vh in inner_hcm["route_config"]["virtual_hosts"]:
            for r in vh["routes"]:
                target = deny_or(r, f"{where} inside the tunnel")
                if target is None:
                    continue
                if r.get("match") != {"prefix": "/"}:
                    problems.append(f"{where}: an inner route matches more than the path prefix `/`")
                allowed = {f"{host}:{port}"} | ({host} if port == 443 else set())
                if "*" in vh["domains"] or not set(vh["domains"]) <= allowed:
                    problems.append(f"{where}: the tunnel admits Host {sorted(set(vh['domains']) - allowed)} beyond {host}:{port}")
                upstream(target, host, port, True, where)
        return True

    for vh in table["virtual_hosts"]:
        for i, r in enumerate(vh["routes"]):
            where = f"front route {vh['name']}#{i}"
            target = deny_or(r, where)
            if target is None:
                continue
            match = r["match"]
            headers = _header_matches(match)
            profile = headers.get(LANE_HEADER)
            authority = headers.get(AUTHORITY_HEADER)
            if profile is None or authority is None or profile not in seen:
                problems.append(f"{where}: forwards without matching one served profile and one authority")
                continue
            if "connect_matcher" in match:
                host, port = _split(authority, -1)
                if set(match) != {"connect_matcher", "headers"} or set(headers) != {LANE_HEADER, AUTHORITY_HEADER}:
                    problems.append(f"{where}: a CONNECT route with other conditions")
                if tunnel(target, profile, host, port, where):
                    seen[profile]["connect"].add((host, port))
            else:
                scheme = headers.get(":scheme")
                if match.get("prefix") != "/" or scheme not in ("http", "https") or set(headers) != {LANE_HEADER, AUTHORITY_HEADER, ":scheme"}:
                    problems.append(f"{where}: a plain route with other conditions")
                    continue
                host, port = _split(authority, 80 if scheme == "http" else 443)
                upstream(target, host, port, scheme == "https", where)
                seen[profile]["https" if scheme == "https" else "http"].add((host, port))

    for profile, pairs in want.items():
        for transport, got in seen[profile].items():
            if got != pairs:
                extra, lacking = sorted(got - pairs), sorted(pairs - got)
                problems.append(f"profile `{profile}` ({transport}): admits {extra} beyond its allowlist" if extra else
                                f"profile `{profile}` ({transport}): lacks {lacking} of its allowlist")
    if set(listeners) - used_listeners:
        problems.append(f"listeners no route reaches: {sorted(set(listeners) - used_listeners)}")
    if set(clusters) - used_clusters:
        problems.append(f"clusters no route reaches: {sorted(set(clusters) - used_clusters)}")
    need = {h for pairs in want.values() for h, _ in pairs}
    if cert_hosts != need:
        problems.append(f"certificates for {sorted(cert_hosts)}, the allowlists name {sorted(need)}")


# -- what Envoy loaded -----------------------------------------------------------------------------

DUMP_LIMIT = 64 * 1024 * 1024  # a config dump larger than this is refused (ours are tens of KiB per profile entry)
_DUMP = "type.googleapis.com/envoy.admin.v3."


@dataclass(frozen=True)
class Loaded:
    """Envoy's loaded configuration, from one admin `/config_dump`: the LDS and CDS versions it accepted, the route
    tables' versions, what is still warming or was rejected, and the documents as `check` reads them."""

    versions: tuple[str, str]
    route_versions: Mapping[str, str]
    warming: tuple[str, ...]
    rejected: tuple[str, ...]
    docs: Mapping[str, Mapping[str, Any]]

    def settled(self, version: str) -> bool:
        """Envoy took `version` for listeners and clusters and nothing is warming."""
        return self.versions == (version, version) and not self.warming


def loaded(dump: Mapping[str, Any]) -> Loaded:
    """The parts of a `/config_dump` the check reads (a draining listener is on its way out: not served anew)."""
    configs = {c.get("@type", "").removeprefix(_DUMP): c for c in dump.get("configs") or []}
    lds = configs.get("ListenersConfigDump", {})
    cds = configs.get("ClustersConfigDump", {})
    rds = configs.get("RoutesConfigDump", {})
    dynamic = lds.get("dynamic_listeners") or []
    listeners = [x["listener"] for x in lds.get("static_listeners") or []] + [x["active_state"]["listener"] for x in dynamic if "active_state" in x]
    clusters = [x["cluster"] for x in (cds.get("static_clusters") or []) + (cds.get("dynamic_active_clusters") or [])]
    warming = [f"listener `{x.get('name')}`" for x in dynamic if "warming_state" in x]
    warming += [f"cluster `{x['cluster'].get('name')}`" for x in cds.get("dynamic_warming_clusters") or []]
    rejected = [f"listener `{x.get('name')}`: {x['error_state'].get('details', '')}" for x in dynamic if "error_state" in x]
    # Inner listeners carry their route tables inline (Envoy lists those as static); the front's comes by RDS.
    tables = rds.get("dynamic_route_configs") or []
    return Loaded(versions=(lds.get("version_info", ""), cds.get("version_info", "")),
                  route_versions={x["route_config"].get("name", ""): x.get("version_info", "") for x in tables},
                  warming=tuple(warming), rejected=tuple(rejected),
                  docs={"lds": {"resources": listeners}, "cds": {"resources": clusters}, "rds": {"resources": [x["route_config"] for x in tables]}})


def check_loaded(artifact: Artifact, loaded: Loaded, layout: Layout) -> list[str]:
    """The problems of what Envoy loaded: rejected listeners, and the same walk as `check` over the loaded documents."""
    return [f"envoy rejected {r}" for r in loaded.rejected] + check(artifact, loaded.docs, layout)


async def config_dump(admin: Path, timeout: float = 10.0) -> dict[str, Any]:
    """`GET /config_dump` on Envoy's admin Unix socket, decoded (Envoy answers it chunked)."""
    async def whole() -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(admin))
        try:
            writer.write(b"GET /config_dump HTTP/1.1\r\nHost: envoy-admin\r\nConnection: close\r\n\r\n")
            await writer.drain()
            data = bytearray()
            while chunk := await reader.read(1 << 16):
                data += chunk
                if len(data) > DUMP_LIMIT:
                    raise OSError("envoy's /config_dump is larger than the lane reads")
            return bytes(data)
        finally:
            writer.close()

    data = await asyncio.wait_for(whole(), timeout)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1.1 200"):
        raise OSError(f"envoy answered /config_dump with `{lines[0]}`")
    if any(ln.lower().replace(" ", "") == "transfer-encoding:chunked" for ln in lines[1:]):
        body = _unchunk(body)
    return json.loads(body)


def _unchunk(body: bytes) -> bytes:
    out, at = bytearray(), 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2: end + 2 + size]
        at = end + 2 + size + 2


async def confirm_loaded(artifact: Artifact, layout: Layout, timeout: float = 30.0, interval: float = 0.2,
                         grace: float = 2.0) -> list[str]:
    """Wait until Envoy has loaded the configuration for `artifact`, then check what it loaded against the artifact's
    reach: the problems, empty when exact.

    Loaded means one of two things. Either Envoy reports the artifact's digest as the version of its listeners,
    clusters and route tables, with nothing warming and nothing rejected: what it holds is then judged at once. Or
    what it holds is exact and has not changed for `grace` seconds: Envoy keeps the old version of a resource whose
    content did not change, and the three files are read in no fixed order (a listener naming a cluster not read yet
    is rejected for a moment). At the deadline the last problems found count."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    digest = artifact.digest
    last: object = None
    since = loop.time()
    problems: list[str] = []
    while True:
        try:
            now = loaded(await config_dump(layout.envoy_admin))
        except (OSError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
            problems, last = [f"envoy's loaded configuration cannot be read: {exc.__class__.__name__}: {exc}"], None
        else:
            problems = check_loaded(artifact, now, layout)
            if now.settled(digest) and not now.rejected and set(now.route_versions.values()) == {digest}:
                return problems
            seen = (now.versions, sorted(now.route_versions.items()), now.warming, now.rejected, json.dumps(now.docs, sort_keys=True))
            if seen != last:
                last, since = seen, loop.time()
            elif not problems and not now.warming and loop.time() - since >= grace:
                return []
            if now.versions != (digest, digest):
                problems = [f"envoy holds listeners version {now.versions[0][:12] or '-'} and clusters version "
                            f"{now.versions[1][:12] or '-'}, not {digest[:12]}"] + problems
        if loop.time() >= deadline:
            return problems or [f"envoy's configuration did not settle within {timeout:g} s"]
        await asyncio.sleep(interval)
