"""proofs.capacity: each worked case against a count written out by hand, the witness replayed, and soundness by
enumeration (the count is never below the distinct requests a rule admits)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.artifact import Artifact, Budget, Param, Rule, Segment, Value
from compiler.compile import compile_sources
from egress_proxy.decision.adapter import decide, judge_body
from egress_proxy.decision.types import Lease, Request
from egress_proxy.front.settings import DEFAULTS
from proofs.capacity import (
    CLOCK_RESOLUTION,
    CapacityError,
    HeadLimits,
    capacities,
    capacity,
    format_bits,
    witness,
)
from tests.egress_proxy.builders import artifact, connection, profile

HEADER = 'egresslaw 1\n\nworkspace "acme"\ncatalog "2026.11"\n'
IPS = ["93.184.216.34"]
ROOM_GET = 8192 - len("GET") - 1  # the target's room on a GET's request line: `GET` and a space


def compiled(body: str) -> Artifact:
    result = compile_sources({"p/policy.egress": HEADER + body}, [])
    assert result.ok, result.diagnostics
    return result.artifact


def conn_text(name: str, *rules: str) -> str:
    return f'connection "{name}" {{\n  credential = "{name}-cred"\n' + "".join(rules) + "}\n"


def egress(name: str, **keys: str) -> str:
    lines = [f'  egress "{name}" {{', '    host = "api.example.com"'] + [f"    {k} = {v}" for k, v in keys.items()]
    return "\n".join(lines) + "\n  }\n"


def with_budget(art: Artifact, name: str, budget: Budget) -> Artifact:
    conns = tuple(c.model_copy(update={"budget": budget}) if c.name == name else c for c in art.connections)
    return art.model_copy(update={"connections": conns}).sealed()


def near(x: float, hand: float) -> bool:
    """`x` is the hand count, never below it (rounded up by at most a hair)."""
    return hand <= x <= hand + 1e-6 * max(1.0, abs(hand))


def test_head_limits_are_the_front_ends_defaults():
    assert HeadLimits() == HeadLimits(DEFAULTS.max_head_bytes, DEFAULTS.max_request_line, DEFAULTS.max_headers)
    assert CLOCK_RESOLUTION == 0.001


def test_one_exact_request_carries_nothing():
    art = compiled(conn_text("c", egress("one", path='"/a/b"', methods='["GET"]', query="{}")))
    cap = capacity(art, "connection", "c")
    route = cap.routes[0]
    assert [(f.name, f.bits) for f in route.fields] == [("method", 0.0), ("path", 0.0), ("query", 0.0), ("headers", 0.0)]
    assert cap.bits == 0.0 and "0 bits" in cap.text()
    # `/a/b?` and `/a/b?&&` would be other requests upstream: the judge refuses them, so nothing is left to count
    lease = Lease("s", None, "c", 2**40)
    for target in ("/a/b?", "/a/b?&", "/a/b?&&&"):
        req = Request(method="GET", scheme="https", host="api.example.com", port=443, target=target)
        assert decide(art, lease, req, IPS).reason == "query-parameter-not-allowed"
    with pytest.raises(CapacityError, match="0 bits"):
        witness(art, cap)


def test_listed_parameters_count_their_subsets_orders_and_spellings():
    art = compiled(conn_text("c", egress("q", path='"/a"', methods='["GET"]',
                                         query='{ s = ["p", "q"], t = ["x"] }')))
    route = capacity(art, "connection", "c").routes[0]
    # by hand, per pair: the name's spellings (`s`, `%73`: 2; `t`, `%74`: 2) x (`name`, `name=`, `name=v` in its
    # spellings: `p` `%70`, `q` `%71`; `x` `%78`: 4 and 2): s 2 x (1 + 1 + 4) = 12, t 2 x (1 + 1 + 2) = 8.
    # Absent 1; one pair 12 + 8; both 12 x 8 in 2 orders joined by one `&`: 1 + 20 + 192 = 213
    assert near(route.field("query").bits, math.log2(213))
    assert near(route.bits, math.log2(213))
    w = witness(art, capacity(art, "connection", "c"))
    assert w.field.name == "query" and all(d.allowed for d in w.decisions)
    assert all("&&" not in r.target and not r.target.endswith(("?", "&")) for r in w.requests)


def test_two_methods_add_one_bit():
    art = compiled(conn_text("c", egress("two", path='"/a/b"', methods='["GET", "HEAD"]', query="{}")))
    cap = capacity(art, "connection", "c")
    assert cap.routes[0].field("method").bits == 1.0
    assert near(cap.bits, 1.0)


def test_a_segment_from_a_set_and_an_integer_range():
    art = compiled(conn_text("c",
                             egress("set", path='"/r/{repo:app|web|cli}"', methods='["GET"]', query="{}"),
                             egress("int", path='"/n/{n:int(1..1000)}"', methods='["GET"]', query="{}")))
    cap = capacity(art, "connection", "c")
    a, b = cap.routes
    assert near(a.field("path").bits, math.log2(3)) and near(a.bits, math.log2(3))
    assert near(b.field("path").bits, math.log2(1000)) and near(b.bits, math.log2(1000))
    # two rules: log2(2^a + 2^b), by hand: 3 + 1000 requests
    assert near(cap.bits, math.log2(1003))
    assert format_bits(cap.routes[0].field("path").bits) == "1.59 bits"


def test_a_range_holding_zero_counts_minus_zero():
    art = compiled(conn_text("c", egress("z", path='"/n/{n:int(0..9)}"', methods='["GET"]', query="{}")))
    assert near(capacity(art, "connection", "c").routes[0].field("path").bits, math.log2(11))  # 0..9 and `-0`


def test_a_free_suffix_under_a_prefix_is_what_the_request_line_leaves():
    art = compiled(conn_text("c", egress("files", path_prefix='"/files"', methods='["GET"]')))
    cap = capacity(art, "connection", "c")
    # path and query below `/files`: any bytes, at most ROOM_GET - len("/files") of them, after the prefix
    left = ROOM_GET - len("/files")
    hand = math.log2((256 ** (left + 1) - 1) // 255)
    assert near(cap.routes[0].field("path").bits, hand)
    assert near(cap.bits, hand)


def test_a_post_without_a_budget_is_unbounded_and_names_the_body_and_the_rule():
    art = compiled(conn_text("c", egress("upload", path_prefix='"/u"', methods='["POST"]')))
    cap = capacity(art, "connection", "c")
    assert math.isinf(cap.bits) and format_bits(cap.bits) == "unbounded"
    assert cap.unbounded == "body of rule `upload` (POST; declare budget.bytes)"
    assert cap.to_dict()["bits"] == "unbounded"
    assert "unbounded per request: body of rule `upload`" in cap.text()
    route, top = cap.top
    assert (route.rule, top.name) == ("upload", "body")
    w = witness(art, cap)
    assert w.bodies == (b"a", b"b") and all(d.allowed for d in w.decisions)


def test_a_bytes_cap_bounds_the_post():
    art = with_budget(compiled(conn_text("c", egress("upload", path_prefix='"/u"', methods='["POST"]'))),
                      "c", Budget(window=3600, bytes=1024))
    cap = capacity(art, "connection", "c")
    whole = math.log2((256**1025 - 1) // 255)  # a window's bytes bound the whole request, body and head
    assert near(cap.routes[0].field("body").bits, whole)
    assert near(cap.bits, whole)
    assert near(cap.window_bits(), 8 * 1024 + 0.01) and cap.unbounded is None


def test_mcp_arguments_are_the_sum_over_tools_of_their_choices():
    tools = ('{ methods = ["initialize", "ping", "tools/call"], tools = {'
             ' get_issue = { arguments = { repo = ["acme/app", "acme/web"], number = {type = "integer", minimum = 1, maximum = 100} },'
             ' required = ["repo", "number"] },'
             ' search = { arguments = { q = {enum = ["a", "b", "c"]} } },'
             ' noop = { arguments = {} } } }')
    art = compiled(conn_text("m", egress("tools", path='"/mcp"', methods='["POST"]', headers='["Content-Type"]', mcp=tools)))
    cap = capacity(art, "connection", "m")
    route = cap.routes[0]
    # get_issue 2 x 100 (both required); search 3 + 1 (absent); noop 1 (no argument): 205
    assert near(route.field("mcp.arguments").bits, math.log2(2 * 100 + (3 + 1) + 1))
    body = math.log2((256 ** (2**20 + 1) - 1) // 255)  # free bytes up to the 1 MiB read
    assert near(route.field("body").bits, body)
    # not added twice: the route is its head and its body
    every_head = 8 * 65536 + math.log2(256 / 255)  # the head's 64 KiB bound it (its free header values would not)
    assert sum(f.bits for f in route.fields if f.name in ("path", "query", "headers")) > every_head
    assert near(route.bits, every_head + route.field("body").bits)
    w = witness(art, cap)
    assert w.field.name in ("body", "headers") and all(d.allowed for d in w.decisions)


def test_per_window_timing_and_any_interval():
    art = compiled(conn_text("c", egress("two", path='"/a/b"', methods='["GET", "HEAD"]', query="{}")))
    bits = 1  # GET or HEAD, nothing else
    requests = with_budget(art, "c", Budget(window=3600, requests=10))
    cap = capacity(requests, "connection", "c")
    assert near(cap.window_bits(), 10 * bits + math.log2(11))
    assert near(cap.timing_bits(), 10 * math.log2(3600 * 1000 + 1))
    assert near(cap.over(7200), (10 * bits + math.log2(11)) * (2 + 1))
    both = capacity(with_budget(art, "c", Budget(window=60, requests=10, bytes=10)), "connection", "c")
    assert near(both.window_bits(), 10 * bits + math.log2(11))  # 13.46 bits: the requests win over 10 bytes' 80.01
    one_byte = capacity(with_budget(art, "c", Budget(window=60, requests=10, bytes=1)), "connection", "c")
    assert near(one_byte.window_bits(), 8 * 1 + 0.01)  # the bytes win
    assert near(both.timing_bits(), 0)  # 10 bytes hold no request: R = 10 // 24 = 0
    assert "10 requests and 10 bytes per 1m" in both.text()
    free = capacity(art, "connection", "c")
    assert math.isinf(free.window_bits()) and math.isinf(free.over(3600)) and math.isinf(free.timing_bits())


def test_profiles_plain_none_and_observe():
    art = artifact([], [profile("none"), profile("pypi", [("pypi.org", 443)])])
    none, pypi = capacities(art)
    assert none.bits == 0 and none.routes == () and "admits no request" in none.text()
    with pytest.raises(CapacityError, match="0 bits"):
        witness(art, none)
    assert math.isinf(pypi.bits) and pypi.unbounded.startswith("body of `pypi.org:443`")
    observe = art.model_copy(update={"sandbox_profiles": (art.sandbox_profiles[1].model_copy(update={"enforce": "observe"}),)}).sealed()
    cap = capacity(observe, "profile", "pypi")
    assert cap.unbounded.startswith("destination") and cap.top[1].name == "destination"
    w = witness(observe, cap)
    assert w.requests[0].host != w.requests[1].host


def test_a_brokered_rule_counts_in_its_profile():
    rule = Rule(name="read", host="api.example.com", methods=("GET",), template=(Segment(literal="x"),), query=())
    art = artifact([connection("gh", [rule])], [profile("p", brokers=["gh"])])
    cap = capacity(art, "profile", "p")
    assert [(r.rule, r.owner) for r in cap.routes] == [("read", "gh")]
    assert cap.bits == 0.0
    with pytest.raises(CapacityError):
        capacity(art, "profile", "nope")


def test_the_witness_pair_is_admitted_and_differs_in_the_field_named():
    art = compiled(conn_text("c", egress("set", path='"/r/{repo:app|web}"', methods='["GET", "HEAD"]',
                                         headers='["Accept"]', header_values='{ "Accept" = ["a", "b"] }')))
    cap = capacity(art, "connection", "c")
    route, top = cap.top
    assert top.name == "query"  # free: no `query` key
    w = witness(art, cap)
    one, two = w.requests
    assert one.target.split("?")[0] == two.target.split("?")[0] and one.target != two.target
    assert (one.method, one.headers, one.host) == (two.method, two.headers, two.host)
    for req in w.requests:
        d = decide(art, w.lease, req, IPS)
        assert d.allowed and d.rule == "set"
    assert "differ in the query of rule `set`" in w.describe() and w.to_dict()["field"] == "query"


# -- soundness: the count is at least the distinct admitted requests found by enumeration ------------------------


def universe(methods: tuple[str, ...]) -> itertools.product:
    names = ["a", "b", "c", "d", "%3A", "%3a"]
    numbers = ["0", "-0", "1", "2", "3", "12", "01", "+1", "x"]
    queries = ["", "?", "?&", "?s=p", "?s=%70", "?%73=q", "?s=q&", "?&s=q", "?s=", "?s", "?t=p", "?s=p&s=q"]
    headers = [(), (("X-A", "1"),), (("x-a", "2"),), (("X-A", "3"),), (("X-B", "1"),)]
    return itertools.product(methods + ("POST",), names, numbers, queries, headers)


@settings(max_examples=12, deadline=None, derandomize=True, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    methods=st.sampled_from([("GET",), ("GET", "HEAD"), ("HEAD", "DELETE", "GET")]),
    first=st.lists(st.sampled_from(["a", "b", "c", "%3A"]), min_size=1, max_size=3, unique=True),
    hi=st.integers(min_value=0, max_value=12),
    query=st.booleans(),
    header=st.booleans(),
)
def test_the_count_is_never_below_the_admitted_requests(methods, first, hi, query, header):
    rule = Rule(name="r", host="api.example.com", methods=methods, headers=("x-a",) if header else (),
                template=(Segment(name="a", value=Value(enum=tuple(sorted(first)))),
                          Segment(name="n", value=Value(type="integer", minimum=0, maximum=hi))),
                query=(Param(name="s", value=Value(enum=("p", "q"))),) if query else (),
                header_values=(Param(name="x-a", value=Value(enum=("1", "2"))),) if header else ())
    art = artifact([connection("c", [rule])])
    lease = Lease("s", None, "c", 2**40)
    seen, paths, methods_seen, queries = set(), set(), set(), set()
    for method, a, n, q, h in universe(methods):
        req = Request(method=method, scheme="https", host="api.example.com", port=443, target=f"/{a}/{n}{q}", headers=h)
        d = decide(art, lease, req, IPS)
        if d.allowed:
            seen.add((method, req.target, d.forward_headers))
            paths.add(f"/{a}/{n}")
            methods_seen.add(method)
            queries.add(q)
    cap = capacity(art, "connection", "c")
    assert seen, "the universe holds admitted requests"
    assert 2**cap.bits >= len(seen)
    # field by field too, where the count is exact and the universe reaches it (`%3a` beside `%3A`, `-0` beside `0`)
    route = cap.routes[0]
    hand = sum(2 if x == "%3A" else 1 for x in first) * (hi + 2)
    assert near(route.field("path").bits, math.log2(hand))
    reached = sum(2 if x == "%3A" else 1 for x in first) * (sum(1 for v in (0, 1, 2, 3, 12) if v <= hi) + 1)
    assert len(paths) == reached <= 2 ** route.field("path").bits
    assert len(methods_seen) == len(methods) and near(route.field("method").bits, math.log2(len(methods)))
    # the query: no empty query and no empty `&` component is admitted, so none is counted. By hand: absent, or
    # `s` (2 spellings) as `s`, `s=` or `s=` one of `p` `%70` `q` `%71`: 1 + 2 x 6 = 13
    assert queries == ({"", "?s=p", "?s=%70", "?%73=q"} if query else {""})
    assert near(route.field("query").bits, math.log2(13) if query else 0.0)


def test_every_subject_of_a_body_shape_replays_through_judge_body():
    art = compiled(conn_text("g", egress("graph", path='"/graphql"', methods='["POST"]', headers='["Content-Type"]',
                                         graphql='{ query = ["viewer"] }')))
    cap = capacity(art, "connection", "g")
    w = witness(art, cap)
    for req, body, d in zip(w.requests, w.bodies, w.decisions):
        assert d.allowed and d.body_shape is None  # judged
        again = decide(art, w.lease, req, IPS)
        if again.body_shape is not None:
            assert judge_body(art, w.lease, req, again, body or b"").allowed


def test_an_unjudged_body_of_a_shaped_rule_is_unbounded_without_a_bytes_cap():
    # git's `git-upload-pack` body streams upstream unjudged; only a push (`git-receive-pack`) is read to `max_body`
    fetch = compiled(conn_text("g", egress("fetch", path_prefix='"/acme/app.git"', methods='["GET", "POST"]',
                                           git="{ fetch = true }")))
    cap = capacity(fetch, "connection", "g")
    assert cap.unbounded == "body of rule `fetch` (POST; declare budget.bytes)"
    w = witness(fetch, cap)
    assert all(r.target.endswith("/git-upload-pack") for r in w.requests) and all(d.allowed for d in w.decisions)
    push = compiled(conn_text("g", egress("push", path_prefix='"/acme/app.git"', methods='["GET", "POST"]',
                                          git='{ push = ["refs/heads/agent/*"] }', max_body="4096")))
    body = capacity(push, "connection", "g").routes[0].field("body")
    assert near(body.bits, math.log2((256**4097 - 1) // 255))


def test_no_request_carries_more_than_a_windows_bytes_whatever_its_route():
    hosts = [("a.example.org", 443), ("b.example.org", 443), ("c.example.org", 443)]
    art = artifact([], [profile("p", hosts)])
    prof = art.sandbox_profiles[0].model_copy(update={"budget": Budget(window=60, bytes=100)})
    art = art.model_copy(update={"sandbox_profiles": (prof,)}).sealed()
    cap = capacity(art, "profile", "p")
    whole = math.log2((256**101 - 1) // 255)
    assert all(near(r.bits, whole) for r in cap.routes)
    assert near(cap.bits, whole)  # not log2(3) more: each request is one of the strings of at most 100 bytes


def test_an_s3_connection_counts_the_payload_marker_the_client_picks():
    """The edge re-signs an S3 request with the payload mode the client's own `x-amz-content-sha256` names (unsigned,
    or streaming-unsigned with a trailer): one more bit per request on a rule that is otherwise exact; another
    service's payload is the body's hash, which the body already counts."""
    from egress_proxy.credentials.aws_sigv4 import UNSIGNED_SERVICES
    from proofs.capacity import UNSIGNED_PAYLOAD_SERVICES

    assert UNSIGNED_PAYLOAD_SERVICES == UNSIGNED_SERVICES
    text = ('connection "s3" {\n  credential = "s3-cred"\n  kind = "aws_sigv4"\n'
            '  aws_sigv4 = { region: "us-east-1", service: "s3" }\n'
            + egress("obj", path='"/bucket/key"', methods='["GET"]', query="{}") + "}\n")
    cap = capacity(compiled(text), "connection", "s3")
    assert cap.routes[0].field("payload-mode").bits == 1.0 and near(cap.bits, 1.0)
    other = capacity(compiled(text.replace('service: "s3"', 'service: "execute-api"')), "connection", "s3")
    assert other.routes[0].field("payload-mode") is None and other.bits == 0.0
