"""Credential kinds under the prover: a minting connection's token endpoint is a destination of its worker (public-only
and deny-cidrs cover it, refuted with a counterexample that replays through the edge's own judgement), and SigV4's
signing headers are part of header-safety; hand-written artifacts the compiler would refuse are refuted."""

from __future__ import annotations

from compiler.artifact import load_artifact
from egress_proxy.decision.adapter import artifact_index, decide, judge_token_answers
from egress_proxy.decision.types import Lease, Request
from proofs.decode import request_from_dict
from tests.egress_proxy.builders import (
    artifact,
    connection,
    oauth2,
    profile,
    rule,
    sigv4,
    worker,
)
from tests.proofs.helpers import only, prove_one
from tests.proofs.mutants import artifact_json

DRIVE = rule("files", "www.googleapis.com", "/drive/v3", ["GET"], ["accept"])
BUCKET = rule("bucket", "s3.us-east-1.amazonaws.com", "/acme-artifacts", ["GET", "PUT"], ["content-type"])


def test_a_minting_connection_proves_its_token_endpoint_too():
    report = prove_one(load_artifact(artifact_json("minted")))
    assert report.exit_code() == 0, report.render_text()
    for prop in ("public-only", "deny-cidrs"):
        assert "the token endpoint `oauth2.googleapis.com:443` too" in only(report, "connection:drive", prop).detail
        assert "token endpoint" not in only(report, "connection:artifacts", prop).detail  # SigV4 mints nothing


def test_a_worker_that_lets_the_token_endpoint_reach_a_private_address_is_refuted():
    """The token endpoint is judged by the connection's worker, as its requests are: a hole in `allow_cidrs` is refuted
    (at the requests first; the same answer would be dialled for a mint, as the edge's own judgement shows). Refuted on
    the token endpoint alone: the `mint-answers-unjudged` mutant (tests/proofs/mutants.py)."""
    hole = worker("edge", allow_cidrs=("10.0.0.0/8",))
    art = artifact(connections=[connection("drive", [DRIVE], worker="edge", mint=oauth2("https://oauth2.googleapis.com/token"))],
                   workers=[hole])
    res = only(prove_one(art), "connection:drive", "public-only")
    assert res.verdict == "refuted"
    cex = res.counterexample
    d = decide(art, Lease("s", None, "drive", 0), request_from_dict(cex["request"]), cex["resolved_ips"])
    assert d.allowed and cex["resolved_ips"][0].startswith("10.")
    assert judge_token_answers(art, "drive", cex["resolved_ips"]).allowed


def test_the_edge_judges_token_answers_with_the_connections_worker_not_the_requesters():
    """A profile brokering a minting connection: the mint is judged by the connection's worker (`edge` denies 8.8.8.0/24),
    whoever's request made the edge mint."""
    edge = worker("edge", deny_cidrs=("8.8.8.0/24",))
    conn = connection("drive", [DRIVE], worker="edge", mint=oauth2("https://oauth2.googleapis.com/token"))
    art = artifact(connections=[conn], profiles=[profile("ci", [("www.googleapis.com", 443)], brokers=("drive",))], workers=[edge])
    assert judge_token_answers(art, "drive", ["8.8.8.8"]).reason == "address-denied"
    assert judge_token_answers(art, "drive", ["93.184.216.34"]).allowed
    assert judge_token_answers(art, "drive", ["10.0.0.1"]).reason == "address-not-public"
    assert judge_token_answers(art, "missing", ["93.184.216.34"]).reason == "worker-unknown"


def test_a_sigv4_rule_that_allowlists_a_signing_header_is_refuted():
    """By hand (the compiler refuses it, EL0026): the allowlist asks for `x-amz-date`; the core drops it anyway."""
    bad = BUCKET.model_copy(update={"headers": ("content-type", "x-amz-date")})
    art = artifact(connections=[connection("artifacts", [bad], inject_format="{secret}", mint=sigv4())])
    res = only(prove_one(art), "connection:artifacts", "header-safety")
    assert res.verdict == "refuted" and res.counterexample["header"] == "x-amz-date"
    req = request_from_dict(res.counterexample["request"])
    d = decide(art, Lease("s", None, "artifacts", 0), req, res.counterexample["resolved_ips"])
    assert d.allowed and "x-amz-date" not in {k.lower() for k, _ in d.forward_headers}  # dropped at run time


def test_the_signing_headers_a_sandbox_sends_are_never_forwarded():
    art = artifact(connections=[connection("artifacts", [BUCKET], inject_format="{secret}", mint=sigv4())])
    headers = (("Content-Type", "text/plain"), ("X-Amz-Date", "20200101T000000Z"), ("X-Amz-Content-Sha256", "UNSIGNED-PAYLOAD"),
               ("X-Amz-Security-Token", "forged"), ("Authorization", "AWS4-HMAC-SHA256 Credential=AKIAFORGED/…"))
    d = decide(art, Lease("s", None, "artifacts", 0),
               Request("GET", "https", "s3.us-east-1.amazonaws.com", 443, "/acme-artifacts/k", headers), ["93.184.216.34"])
    assert d.allowed and [k for k, _ in d.forward_headers] == ["Content-Type"] and d.inject_header == "Authorization"
    assert only(prove_one(art), "connection:artifacts", "header-safety").verdict == "proved"


def test_an_adversarial_profile_brokering_a_minting_connection_is_refuted_and_never_carries_its_token():
    """By hand (the compiler refuses it, EL0039): the minted token would ride on requests the adversary makes."""
    conn = connection("drive", [DRIVE], mint=oauth2("https://oauth2.googleapis.com/token"))
    adv = profile("runner", [("www.googleapis.com", 443)], trust="adversarial", brokers=("drive",))
    art = artifact(connections=[conn], profiles=[adv])
    res = only(prove_one(art), "profile:runner", "trust-lane")
    assert res.verdict == "refuted" and "brokers `drive`" in res.counterexample["summary"]
    d = decide(art, Lease("s", "runner", None, 0), Request("GET", "https", "www.googleapis.com", 443, "/drive/v3/files"),
               ["93.184.216.34"])
    assert d.allowed and d.broker is None and d.inject_header is None  # plain traffic: the core never brokers for it


def test_the_token_endpoint_is_judged_on_the_table_the_prover_evaluates():
    """`judge_token_answers` and the prover both take the endpoint's table from `ArtifactIndex.token_view`: the
    connection's own (worker `edge`), whoever asks; a wrong one there is refuted (mutant `token-endpoint-default-worker`)."""
    conn = connection("drive", [DRIVE], worker="edge", mint=oauth2("https://oauth2.googleapis.com/token"))
    art = artifact(connections=[conn], profiles=[profile("ci", [("www.googleapis.com", 443)], brokers=("drive",))],
                   workers=[worker("edge", deny_cidrs=("8.8.8.0/24",))])
    view = artifact_index(art).token_view("drive")
    assert view is not None and view.subject.kind == "connection" and view.subject.worker.name == "edge"
    assert artifact_index(art).token_view("missing") is None
    assert "the token endpoint `oauth2.googleapis.com:443` too" in only(prove_one(art), "connection:drive", "deny-cidrs").detail
