"""The artifact compiled to Envoy configuration: which profiles the lane serves, and what it generates for them."""

from __future__ import annotations

from pathlib import Path

from egress_proxy.lane import envoy
from tests.egress_proxy import builders as b


def _artifact():
    rules = [b.rule("read", "api.example.dev", "/", ["GET"])]
    return b.artifact(
        connections=[b.connection("gh", rules, credential="h")],
        profiles=[
            b.profile("ci", [("pypi.org", 443), ("files.pythonhosted.org", 443), ("deb.debian.org", 80)]),
            b.profile("agent", [("pypi.org", 443)], brokers=["gh"]),
            b.profile("literal", [("93.184.216.34", 443)]),
            b.profile("offline"),
        ],
    )


def layout(tmp: Path, **kw) -> envoy.Layout:
    return envoy.Layout(listen=("127.0.0.1", 8081), envoy_admin=tmp / "envoy-admin.sock", authorizer=tmp / "authorizer.sock",
                        dns={"default": ("127.0.0.1", 5353)}, run_dir=tmp, trust_bundle=tmp / "bundle.pem", **kw)


def test_the_lane_serves_profiles_that_broker_nothing_are_enforced_and_name_hosts():
    served = envoy.served(_artifact())
    assert served.names() == {"ci", "offline"}
    assert set(served.refused) == {"agent", "literal"}
    assert "brokers" in served.refused["agent"] and "IP literal" in served.refused["literal"]
    assert envoy.hosts_needing_certificates(_artifact()) == ("deb.debian.org", "files.pythonhosted.org", "pypi.org")


def test_every_forwarding_route_is_one_profile_and_one_judged_authority_and_strips_the_lease(tmp_path):
    docs = envoy.generate(_artifact(), layout(tmp_path))
    routes = docs["rds"]["resources"][0]["virtual_hosts"]
    assert [vh["domains"] for vh in routes] == [["*"]]
    forwarding = [r for r in routes[0]["routes"] if "route" in r]
    assert len(forwarding) == 3 * 3  # three authorities of `ci`, each by CONNECT, http:// and https://
    for r in forwarding:
        names = {h["name"] for h in r["match"]["headers"]}
        assert {envoy.LANE_HEADER, envoy.AUTHORITY_HEADER} <= names
        assert set(envoy.STRIPPED) <= set(r["request_headers_to_remove"])
        assert r["route"]["timeout"] == "0s"
    refusals = [r for r in routes[0]["routes"] if "direct_response" in r]
    assert {r["name"] for r in refusals} == {"deny:lane-no-route"} and all(r["direct_response"]["status"] == 403 for r in refusals)
    listeners = {x["name"] for x in docs["lds"]["resources"]}
    assert listeners == {"front", "mitm|ci|pypi.org:443", "mitm|ci|files.pythonhosted.org:443", "mitm|ci|deb.debian.org:80"}


def test_test_routing_changes_only_the_dialled_port(tmp_path):
    docs = envoy.generate(_artifact(), layout(tmp_path, connect_to={("pypi.org", 443): ("127.0.0.1", 4443)}))
    clusters = {c["name"]: c for c in docs["cds"]["resources"]}
    ep = clusters["tls|ci|pypi.org:443"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert ep == {"socket_address": {"address": "pypi.org", "port_value": 4443}}
    tls = clusters["tls|ci|pypi.org:443"]["transport_socket"]["typed_config"]
    assert tls["sni"] == "pypi.org"


def test_write_replaces_each_xds_file_whole(tmp_path):
    docs = envoy.generate(_artifact(), layout(tmp_path))
    envoy.write(docs, tmp_path)
    assert sorted(p.name for p in (tmp_path / "xds").iterdir()) == ["cds.json", "lds.json", "rds.json"]
    assert not list(tmp_path.glob(".*.tmp"))


def test_inside_a_tunnel_each_request_is_checked_then_stripped_natively(tmp_path):
    """Every request inside a tunnel: the authorizer's check (a Lua filter naming the tunnel's id, which the CONNECT
    carried across as shared filter state), then a native header mutation that removes each stripped name and every
    name under a stripped prefix (`is_stripped`'s rule: after the check, so the decision saw every field), then the
    router. The one early mutation copies `Transfer-Encoding` (which Envoy removes before any filter) for the check and
    removes nothing: an early removal would hide `Trailer` or `Proxy-Authorization` from the decision."""
    docs = envoy.generate(_artifact(), layout(tmp_path))
    inner = [x for x in docs["lds"]["resources"] if x["name"].startswith("mitm|")]
    assert inner
    for listener in inner:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.lua", "envoy.filters.http.header_mutation",
                                                            "envoy.filters.http.router"]
        [early] = hcm["early_header_mutation_extensions"]
        assert early["typed_config"]["mutations"] == [
            {"remove": envoy.FRAMING_HEADER},
            {"append": {"header": {"key": envoy.FRAMING_HEADER, "value": "%REQ(transfer-encoding)%"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}}]
        lua = hcm["http_filters"][0]["typed_config"]["default_source_code"]["inline_string"]
        assert f'filterState():get("{envoy.TUNNEL_STATE}")' in lua and '["x-egresslaw-tunnel"] = tunnel' in lua
        mutations = hcm["http_filters"][1]["typed_config"]["mutations"]["request_mutations"]
        assert {m["remove"] for m in mutations if "remove" in m} == set(envoy.STRIPPED_NAMES)
        assert {m["remove_on_match"]["key_matcher"]["prefix"] for m in mutations if "remove_on_match" in m} == set(envoy.STRIPPED_PREFIXES)
        assert all(set(m) <= {"remove", "remove_on_match"} for m in mutations)
    front = next(x for x in docs["lds"]["resources"] if x["name"] == "front")
    carry = front["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
    assert carry["typed_config"]["on_request_headers"] == [{
        "object_key": envoy.TUNNEL_STATE, "factory_key": "envoy.hashable_string", "shared_with_upstream": "ONCE",
        "format_string": {"text_format_source": {"inline_string": "%REQ(X-REQUEST-ID)%"}}}]
    for cluster in docs["cds"]["resources"]:
        if cluster["name"].startswith("mitm|"):
            assert cluster["transport_socket"]["name"] == "envoy.transport_sockets.internal_upstream"


def test_an_access_log_line_holds_only_what_the_reader_reads(tmp_path):
    """Each field is formatted by Envoy and parsed by the reader on every request: none it never reads."""
    docs = envoy.generate(_artifact(), layout(tmp_path))
    for listener in docs["lds"]["resources"]:
        chain = listener["filter_chains"][0]["filters"][0]["typed_config"]
        logs = [*chain["access_log"], *listener.get("access_log", [])]
        for log in logs:
            fields = set(log["typed_config"]["log_format"]["json_format"])
            assert not fields & {"start", "peer", "upstream", "listener"}, (listener["name"], fields)
