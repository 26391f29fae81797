"""The translation check reads the generated configuration back and refuses anything beyond the allowlists.

Each mutation below is one way a generator bug (or a hand edit) could widen what Envoy admits; the check must name
it. The unmutated configuration must pass."""

from __future__ import annotations

import copy

import pytest

from egress_proxy.front.ca import ca_certificate
from egress_proxy.lane import envoy, translate
from egress_proxy.lane.certs import write_leaves
from tests.egress_proxy import builders as b
from tests.egress_proxy.lane.test_envoy import layout


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("translate")
    art = b.artifact(profiles=[b.profile("ci", [("pypi.org", 443), ("deb.debian.org", 80)]), b.profile("docs", [("pypi.org", 443)])])
    lay = layout(tmp)
    write_leaves(ca_certificate(tmp / "conf").with_name("mitmproxy-ca.pem"), envoy.hosts_needing_certificates(art), lay.cert_dir)
    return art, lay


def _docs(setup):
    art, lay = setup
    return art, lay, envoy.generate(art, lay)


def test_the_generated_configuration_is_exact(setup):
    art, lay, docs = _docs(setup)
    assert translate.check(art, docs, lay) == []


def _front_routes(docs):
    return docs["rds"]["resources"][0]["virtual_hosts"][0]["routes"]


def _cluster(docs, name):
    return next(c for c in docs["cds"]["resources"] if c["name"] == name)


def _listener(docs, name):
    return next(x for x in docs["lds"]["resources"] if x["name"] == name)


MUTATIONS = {
    "a route for another host": lambda d: _front_routes(d).insert(0, copy.deepcopy(_front_routes(d)[0]) | {"match": {
        "connect_matcher": {}, "headers": [{"name": envoy.LANE_HEADER, "string_match": {"exact": "ci"}},
                                           {"name": envoy.AUTHORITY_HEADER, "string_match": {"exact": "evil.example:443"}}]}}),
    "a route matching by prefix regex": lambda d: _front_routes(d)[0]["match"]["headers"][1].update(string_match={"prefix": "pypi"}),
    "a route without the profile": lambda d: _front_routes(d)[0]["match"].update(headers=_front_routes(d)[0]["match"]["headers"][1:]),
    "the lease left in": lambda d: _front_routes(d)[1]["request_headers_to_remove"].remove("proxy-authorization"),
    "a cluster dialling another port": lambda d: _cluster(d, "tls|ci|pypi.org:443")["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"].update(port_value=8443),
    "upstream TLS without the name check": lambda d: _cluster(d, "tls|ci|pypi.org:443")["transport_socket"]["typed_config"][
        "common_tls_context"]["validation_context"].pop("match_typed_subject_alt_names"),
    "a resolver beside the DNS front": lambda d: _cluster(d, "http|ci|deb.debian.org:80")["typed_dns_resolver_config"]["typed_config"].update(
        use_resolvers_as_fallback=True),
    "a tunnel taking any SNI": lambda d: _listener(d, "mitm|ci|pypi.org:443")["filter_chains"][0].pop("filter_chain_match"),
    "a tunnel admitting any Host": lambda d: _listener(d, "mitm|ci|pypi.org:443")["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["domains"].append("*"),
    "a refusal answering 200": lambda d: _front_routes(d)[-1]["direct_response"].update(status=200),
    "a certificate for another name": lambda d: _listener(d, "mitm|ci|pypi.org:443")["filter_chains"][0]["transport_socket"][
        "typed_config"]["common_tls_context"]["tls_certificates"][0]["certificate_chain"].update(
        filename=_listener(d, "mitm|ci|deb.debian.org:80")["filter_chains"][0]["transport_socket"]["typed_config"][
            "common_tls_context"]["tls_certificates"][0]["certificate_chain"]["filename"]),
    "no authorizer": lambda d: _listener(d, "front")["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"].pop(0),
    "a lost route": lambda d: _front_routes(d).pop(0),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_widening_is_named(setup, mutation):
    art, lay, docs = _docs(setup)
    MUTATIONS[mutation](docs)
    problems = translate.check(art, docs, lay)
    assert problems, f"the check missed: {mutation}"
