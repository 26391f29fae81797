"""GraphQL through the real edge: the stock `gql` client (RequestsHTTPTransport, the edge as its https proxy, the edge's CA
trusted) and raw httpx, against graphql-core behind a TLS handler. The rule admits queries selecting `repository` and
`viewer` only: no mutation, no introspection. Each refusal names its reason, is one audit event, and the server never
sees a byte of it (and `deleteRepository` never runs).
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

import pytest
from gql import Client, gql
from gql.transport.exceptions import TransportServerError
from gql.transport.requests import RequestsHTTPTransport

from tests.proxy_harness import assert_no_canary
from tests.shapes import servers
from tests.shapes.world import BEARER, GRAPHQL, assert_denied_answer, serving, settle

pytestmark = pytest.mark.slow

URL = f"https://{GRAPHQL}/graphql"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("shapes-graphql"), GRAPHQL, servers.start_graphql, ("graphql",)) as world:
        yield world
    assert servers.DELETED == [], "a refused mutation ran on the server"


def _gql(world) -> tuple[Client, list]:
    """A gql client through the edge; the list collects every answer it got (requests' response hook)."""
    answers: list = []

    def keep(response, *args, **kwargs):
        answers.append(response)
        world.proxy.record(repr((response.status_code, list(response.headers.items()))).encode() + response.content)

    proxy = world.proxy.lease_url()
    transport = RequestsHTTPTransport(url=URL, verify=str(world.proxy.ca), timeout=30, retries=0,
                                      proxies={"https": proxy, "http": proxy}, hooks={"response": [keep]})
    return Client(transport=transport, fetch_schema_from_transport=False), answers


ALLOWED = 'query Repo($n: String!) { repository(name: $n) { name private } viewer { login } __typename }'
ALLOWED_GET = '{ repository(name: "app") { name private } viewer { login } __typename }'
ALLOWED_RESULT = {"repository": {"name": "app", "private": True}, "viewer": {"login": "acme-bot"}, "__typename": "Query"}


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_an_allowed_query_works_and_carries_the_credential(world, method):
    mark, seen = world.proxy.mark(), world.server.mark()
    if method == "POST":  # gql's own client
        client, _ = _gql(world)
        result = client.execute(gql(ALLOWED), variable_values={"n": "app"})
    else:  # GET ?query= (gql's GET sends a body as well, which the edge refuses on a GET whatever the rule)
        with world.proxy.client() as client:
            response = client.get(URL, params={"query": ALLOWED_GET})
        world.proxy.record(response.content)
        result = response.json()["data"]
    assert result == ALLOWED_RESULT
    assert_no_canary(json.dumps(result), "the query's result")
    [arrived] = world.server.since(seen)
    assert arrived.method == method and arrived.all("Authorization") == [BEARER]
    decided = world.proxy.decisions(mark)
    assert [(e["decision"], e["rule"]) for e in decided] == [("allow", "graphql")], decided


REFUSED = [
    ('mutation { deleteRepository(name: "app") }', "graphql-operation-not-allowed", None),
    ('mutation { r: deleteRepository(name: "app") }', "graphql-operation-not-allowed", None),
    ('query { viewer: deleteRepository(name: "app") }', "graphql-field-not-allowed", "deleteRepository"),
    ('query { ...F } fragment F on Query { viewer { login } secret: deleteRepository(name: "app") }',
     "graphql-field-not-allowed", "deleteRepository"),
    ('query { viewer { login } ... on Query { deleteRepository(name: "app") } }', "graphql-field-not-allowed", "deleteRepository"),
    ('query A { viewer { login } } mutation B { deleteRepository(name: "app") }', "graphql-multiple-operations", None),
    ("query { __schema { types { name } } }", "graphql-introspection-refused", None),
    ('query { viewer { login } t: __type(name: "Query") { name } }', "graphql-introspection-refused", None),
]
IDS = ["mutation", "aliased-mutation", "alias-hides-field", "fragment-smuggled", "inline-fragment", "two-operations",
       "introspection-schema", "introspection-type"]


@pytest.mark.parametrize(("document", "reason", "field"), REFUSED, ids=IDS)
def test_gql_client_refused(world, document, reason, field):
    mark, seen = world.proxy.mark(), world.server.mark()
    client, answers = _gql(world)
    with pytest.raises(TransportServerError) as caught:
        # gql parses but does not validate without a schema: it sends what it was given, as any client library would
        client.execute(gql(document), **({"operation_name": "B"} if reason == "graphql-multiple-operations" else {}))
    assert caught.value.code == 403
    answer = answers[-1]
    assert_denied_answer(answer.status_code, answer.headers, answer.content, reason)
    event = world.proxy.refused(mark, reason)
    if field is not None:
        assert field in (event.get("detail") or ""), event
    settle([world.server])
    assert world.server.since(seen) == [], "the server saw a refused GraphQL request"


def _post(world, body: bytes, content_type: str = "application/json"):
    with world.proxy.client() as client:
        response = client.post(URL, content=body, headers={"Content-Type": content_type})
    world.proxy.record(response.content)
    return response


@pytest.mark.parametrize(
    ("body", "reason"),
    [({"query": "query A { viewer { login } }", "operationName": "B"}, "graphql-multiple-operations"),
     ([{"query": "{ viewer { login } }"}, {"query": 'mutation { deleteRepository(name: "app") }'}], "graphql-operation-not-allowed")],
    ids=["operation-name-elsewhere", "batch-with-a-mutation"],
)
def test_raw_posts(world, body, reason):
    mark, seen = world.proxy.mark(), world.server.mark()
    response = _post(world, json.dumps(body).encode())
    assert_denied_answer(response.status_code, response.headers, response.content, reason)
    world.proxy.refused(mark, reason)
    settle([world.server])
    assert world.server.since(seen) == []


def test_duplicate_query_key_is_malformed(world):
    mark, seen = world.proxy.mark(), world.server.mark()
    body = b'{"query": "{ viewer { login } }", "query": "mutation { deleteRepository(name: \\"app\\") }"}'
    response = _post(world, body)
    assert_denied_answer(response.status_code, response.headers, response.content, "body-malformed")
    world.proxy.refused(mark, "body-malformed")
    settle([world.server])
    assert world.server.since(seen) == []


def test_get_with_a_mutation_is_refused(world):
    mark, seen = world.proxy.mark(), world.server.mark()
    with world.proxy.client() as client:
        response = client.get(URL + "?" + urlencode({"query": 'mutation { deleteRepository(name: "app") }'}))
    world.proxy.record(response.content)
    assert_denied_answer(response.status_code, response.headers, response.content, "graphql-operation-not-allowed")
    world.proxy.refused(mark, "graphql-operation-not-allowed")
    settle([world.server])
    assert world.server.since(seen) == []


def test_a_form_body_is_not_graphql(world):
    mark, seen = world.proxy.mark(), world.server.mark()
    response = _post(world, b"query=%7B+viewer+%7B+login+%7D+%7D", "application/x-www-form-urlencoded")
    assert_denied_answer(response.status_code, response.headers, response.content, "content-type-mismatch")
    world.proxy.refused(mark, "content-type-mismatch")
    settle([world.server])
    assert world.server.since(seen) == []
