"""The translation check: read the generated Envoy configuration back and require that it admits exactly what the
artifact's served profiles allow, nothing beyond.

It does not trust the generator's structure: it walks the documents as Envoy would (a route's match, the cluster it
names, the endpoint that cluster dials, the internal listener behind a CONNECT, that listener's SNI match, its
certificate's names, its own routes and clusters) and collects, per profile, the (host, port) pairs reachable by each
transport (CONNECT + TLS, absolute-form `http://`, absolute-form `https://`). Each set must equal the profile's
allowlist; every route that does not forward must be a 403 refusal; every forwarding route must strip the lease and
hop-by-hop fields; upstream TLS must be verified with the host's own name; every name must resolve through the DNS
front; and the front listener must ask the authorizer (failing closed) before routing. `check` returns the problems
found (empty: the translation is exact).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography import x509

from compiler.artifact import Artifact
from egress_proxy.errors import EgressError
from egress_proxy.lane.envoy import AUTHORITY_HEADER, AUTHORIZER_CLUSTER, LANE_HEADER, STRIPPED, Layout, authorities, served, split_authority

Pairs = set[tuple[str, int]]


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


def _header_matches(match: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for h in match.get("headers") or []:
        sm = h.get("string_match") or {}
        if set(sm) - {"exact", "ignore_case"} or "exact" not in sm:
            raise _Problem(f"a route matches header `{h.get('name')}` other than exactly")
        out[h["name"]] = sm["exact"].lower()
    return out


def check(artifact: Artifact, docs: Mapping[str, Mapping[str, Any]], layout: Layout) -> list[str]:
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
    want = {p.name: set(authorities(p)) for p in served(artifact).profiles}
    seen: dict[str, dict[str, Pairs]] = {p: {"connect": set(), "http": set(), "https": set()} for p in want}
    used_clusters = {AUTHORIZER_CLUSTER}
    used_listeners = {"front"}
    cert_hosts: set[str] = set()

    front = listeners.get("front")
    if front is None:
        raise _Problem("no front listener")
    hcm = _hcm(front)
    filters = [f["name"] for f in hcm.get("http_filters") or []]
    if filters != ["envoy.filters.http.lua", "envoy.filters.http.router"]:
        problems.append(f"the front listener's filters are {filters}, not the authorizer's Lua filter then the router")
    else:
        lua = hcm["http_filters"][0]["typed_config"]["default_source_code"]["inline_string"]
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
        missing = set(STRIPPED) - set(route.get("request_headers_to_remove") or [])
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
        if c.get("type") != "STRICT_DNS" or not dialled or not dialled <= fronts or resolver.get("use_resolvers_as_fallback") is not False:
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
        inner_hcm = _hcm(inner)
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
                host, port = split_authority(authority, -1)
                if set(match) != {"connect_matcher", "headers"} or set(headers) != {LANE_HEADER, AUTHORITY_HEADER}:
                    problems.append(f"{where}: a CONNECT route with other conditions")
                if tunnel(target, profile, host, port, where):
                    seen[profile]["connect"].add((host, port))
            else:
                scheme = headers.get(":scheme")
                if match.get("prefix") != "/" or scheme not in ("http", "https") or set(headers) != {LANE_HEADER, AUTHORITY_HEADER, ":scheme"}:
                    problems.append(f"{where}: a plain route with other conditions")
                    continue
                host, port = split_authority(authority, 80 if scheme == "http" else 443)
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
