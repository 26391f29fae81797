"""Credential kinds in policy text: `kind = "oauth2" | "github_app" | "aws_sigv4"` and the kind's settings object
compile to `Connection.mint` (a `Mint`); a `static` connection compiles exactly as it did before kinds existed; every
mistake is one diagnostic with its code and a help text, and no secret written into a setting gets through."""

from __future__ import annotations

import hashlib
import json

import pytest

from compiler.artifact import Inject, Mint, canonical_json, load_artifact
from compiler.compile import compile_text
from compiler.diagnostics import render_text

HEAD = 'egresslaw 1\nworkspace "acme"\ncatalog "2026.11"\n\n'
TOKEN = "ghp_Kinds0Canary0123456789abcdefABCDEF"  # a GitHub token's shape: the secret scan's `ghp_` prefix
OAUTH = 'kind = "oauth2"\n  oauth2 = {{ token_url: "{url}", grant: "refresh_token" }}'
GITHUB = 'kind = "github_app"\n  github_app = {{ token_url: "{url}" }}'
SIGV4 = 'kind = "aws_sigv4"\n  aws_sigv4 = { region: "us-east-1", service: "s3" }'


def policy(settings: str = "", rule: str = "") -> str:
    """One connection `c` with `settings` in its body and `rule` inside its one egress rule."""
    return (HEAD + 'connection "c" {\n  credential = "c-cred"\n  ' + settings + '\n'
            '  egress "r" {\n    host = "api.example.com"\n    methods = ["GET", "POST"]\n    ' + rule + '\n  }\n}\n')


def mint_of(text: str) -> Mint | None:
    result = compile_text(text)
    assert result.ok, [(d.code, d.message) for d in result.diagnostics]
    return result.artifact.connection("c").mint


def only_error(text: str, code: str, *, helped: bool = True):
    """The one error of `text`, which has `code` and (unless `helped` is False) a help text."""
    result = compile_text(text)
    assert not result.ok
    errors = [d for d in result.diagnostics if d.severity == "error"]
    assert [d.code for d in errors] == [code], [(d.code, d.message) for d in errors]
    assert errors[0].help or not helped
    return errors[0]


# -- what each kind compiles to ---------------------------------------------------------------------------------------


def test_oauth2_compiles_to_a_mint_with_the_endpoint_normalized_and_the_scopes_in_written_order():
    text = policy('kind = "oauth2"\n  oauth2 = { token_url: "HTTPS://AUTH.Example.COM:443/oauth/token", '
                  'grant: "refresh_token", scopes: ["read:files", "openid"], audience: "https://api.example.com" }')
    assert mint_of(text) == Mint(kind="oauth2", token_url="https://auth.example.com/oauth/token",
                                 token_host="auth.example.com", token_port=443, token_path="/oauth/token",
                                 grant="refresh_token", scopes=("read:files", "openid"), audience="https://api.example.com")


def test_oauth2_keeps_a_port_other_than_443_and_takes_client_credentials():
    text = policy('kind = "oauth2"\n  oauth2 = { token_url: "https://auth.example.com:8443/token", grant: "client_credentials" }')
    assert mint_of(text) == Mint(kind="oauth2", token_url="https://auth.example.com:8443/token",
                                 token_host="auth.example.com", token_port=8443, token_path="/token",
                                 grant="client_credentials")


def test_github_app_compiles_with_repositories_and_permissions_sorted():
    text = policy('kind = "github_app"\n  github_app = { token_url: "https://api.github.com/app/installations/4242/access_tokens", '
                  'repositories: ["web", "api", "web"], permissions: { issues: "write", contents: "read", actions: "admin" } }')
    assert mint_of(text) == Mint(kind="github_app", token_url="https://api.github.com/app/installations/4242/access_tokens",
                                 token_host="api.github.com", token_port=443, token_path="/app/installations/4242/access_tokens",
                                 repositories=("api", "web"),
                                 permissions=(("actions", "admin"), ("contents", "read"), ("issues", "write")))


def test_github_app_takes_a_github_enterprise_endpoint():
    mint = mint_of(policy(GITHUB.format(url="https://ghe.example.com/api/v3/app/installations/7/access_tokens")))
    assert (mint.token_host, mint.token_path) == ("ghe.example.com", "/api/v3/app/installations/7/access_tokens")
    assert mint.repositories == () and mint.permissions == ()


def test_aws_sigv4_compiles_to_region_and_service_and_the_edge_writes_authorization():
    result = compile_text(policy('kind = "aws_sigv4"\n  aws_sigv4 = { region: "eu-west-3", service: "execute-api" }'))
    assert result.ok
    conn = result.artifact.connection("c")
    assert conn.mint == Mint(kind="aws_sigv4", region="eu-west-3", service="execute-api")
    assert conn.kind == "aws_sigv4"
    assert conn.inject == Inject(header="Authorization", format="{secret}")


def test_a_kind_is_in_the_artifact_json_and_survives_loading_it():
    result = compile_text(policy(OAUTH.format(url="https://auth.example.com/token")))
    doc = json.loads(result.artifact.to_json())
    [conn] = doc["connections"]
    assert conn["mint"]["kind"] == "oauth2" and conn["mint"]["token_host"] == "auth.example.com"
    loaded = load_artifact(result.artifact.to_json())
    assert loaded.connection("c").mint == result.artifact.connection("c").mint
    assert loaded.connection("c").kind == "oauth2"


# -- a static connection is what it was --------------------------------------------------------------------------------

STATIC = HEAD + '''connection "github" {
  credential = "gh-read"
  inject = { header: "Authorization", format: "token {secret}" }
  egress "refs" {
    host = "api.github.com"
    path_prefix = "/repos/acme/"
    methods = ["GET", "POST"]
    headers = ["x-amz-date", "Accept"]
  }
}
'''
# Computed with the compiler of the commit before credential kinds (83edbe4) from the policy above.
STATIC_CONNECTION_JSON = (
    '{"credential_handle":"gh-read","inject":{"format":"token {secret}","header":"Authorization"},"name":"github",'
    '"rules":[{"headers":["accept","x-amz-date"],"host":"api.github.com","methods":["GET","POST"],"name":"refs",'
    '"path_prefix":"/repos/acme","port":443}],"version":1,"worker":"default"}'
)
STATIC_ARTIFACT_DIGEST = "0f47957a2aec18a0ac173cf258df920310c34e97a41e9ca2eca9bf61171ec74a"


def test_a_static_connection_has_no_mint_and_its_json_and_digest_are_those_from_before_kinds():
    result = compile_text(STATIC)
    assert result.ok
    conn = result.artifact.connection("github")
    assert conn.mint is None and conn.kind == "static"
    [doc] = json.loads(result.artifact.to_json())["connections"]
    assert set(doc) == {"name", "version", "credential_handle", "inject", "worker", "rules"}  # no `mint`, not even null
    assert canonical_json(conn.model_dump(mode="json")) == STATIC_CONNECTION_JSON
    assert result.artifact.body_digest() == STATIC_ARTIFACT_DIGEST
    assert hashlib.sha256(STATIC_CONNECTION_JSON.encode()).hexdigest() == (
        "79f7bb3a48271a4e28ecf4d7da9cb562bce8fbcd3621d8f2bcd8e3d65fe77112")


def test_writing_kind_static_compiles_the_same_connection_as_leaving_it_out():
    explicit = compile_text(STATIC.replace('credential = "gh-read"', 'credential = "gh-read"\n  kind = "static"'))
    assert explicit.ok
    conn = explicit.artifact.connection("github")
    assert conn.mint is None
    assert canonical_json(conn.model_dump(mode="json")) == STATIC_CONNECTION_JSON


# -- the kind and its settings ---------------------------------------------------------------------------------------


def test_an_unknown_kind_suggests_the_nearest():
    diag = only_error(policy('kind = "oauth"'), "EL0041")
    assert diag.message == "credential kind `oauth` is unknown"
    assert diag.help == "did you mean `oauth2`?"


def test_an_unknown_kind_far_from_any_lists_them():
    diag = only_error(policy('kind = "kerberos"'), "EL0041")
    assert diag.help == "one of: static, oauth2, github_app, aws_sigv4"


def test_settings_of_another_kind_are_refused():
    text = policy(OAUTH.format(url="https://auth.example.com/token") + '\n  aws_sigv4 = { region: "us-east-1", service: "s3" }')
    diag = only_error(text, "EL0041")
    assert diag.message == "`aws_sigv4` settings belong to a connection of kind `aws_sigv4`, and connection `c` is `oauth2`"
    assert diag.help == 'write `kind = "aws_sigv4"`, or remove `aws_sigv4`'


def test_kind_settings_on_a_static_connection_are_refused():
    diag = only_error(policy('oauth2 = { token_url: "https://auth.example.com/token", grant: "refresh_token" }'), "EL0041")
    assert "connection `c` is `static`" in diag.message


@pytest.mark.parametrize(("kind", "example"), [
    ("oauth2", 'oauth2 = { token_url: "https://auth.example.com/oauth/token", grant: "refresh_token" }'),
    ("github_app", 'github_app = { token_url: "https://api.github.com/app/installations/<id>/access_tokens" }'),
    ("aws_sigv4", 'aws_sigv4 = { region: "us-east-1", service: "s3" }'),
])
def test_a_kind_without_its_settings_object_shows_an_example(kind, example):
    diag = only_error(policy(f'kind = "{kind}"'), "EL0009")
    assert diag.message == f"connection `c` is of kind `{kind}` and is missing its `{kind}` settings"
    assert diag.help == f"add `{example}`"


def test_settings_that_are_not_an_object_are_refused():
    diag = only_error(policy('kind = "oauth2"\n  oauth2 = "https://auth.example.com/token"'), "EL0008", helped=False)
    assert diag.message == "`oauth2` must be an object `{ … }`"


def test_an_unknown_setting_lists_the_kinds_settings():
    diag = only_error(policy('kind = "aws_sigv4"\n  aws_sigv4 = { region: "us-east-1", service: "s3", endpoint: "x" }'),
                      "EL0007")
    assert "`endpoint`" in diag.message and "region" in diag.help and "service" in diag.help


def test_inject_on_aws_sigv4_is_refused():
    diag = only_error(policy(SIGV4 + '\n  inject = { header: "X-Api-Key" }'), "EL0041")
    assert diag.message == "connection `c` signs its requests with SigV4, which takes no `inject`"
    assert "X-Amz-" in diag.help


@pytest.mark.parametrize("setting", ["token_url", "grant"])
def test_oauth2_requires_token_url_and_grant(setting):
    settings = {"token_url": 'token_url: "https://auth.example.com/token"', "grant": 'grant: "refresh_token"'}
    del settings[setting]
    diag = only_error(policy('kind = "oauth2"\n  oauth2 = { ' + ", ".join(settings.values()) + " }"), "EL0009")
    assert f"missing `{setting}`" in diag.message


@pytest.mark.parametrize("setting", ["region", "service"])
def test_aws_sigv4_requires_region_and_service(setting):
    settings = {"region": 'region: "us-east-1"', "service": 'service: "s3"'}
    del settings[setting]
    diag = only_error(policy('kind = "aws_sigv4"\n  aws_sigv4 = { ' + ", ".join(settings.values()) + " }"), "EL0009")
    assert f"missing `{setting}`" in diag.message


# -- the token endpoint ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "wants"), [
    ("http://auth.example.com/token", "is not an https URL"),
    ("auth.example.com/token", "is not an https URL"),
    ("https://auth.example.com/token?audience=x", "no query, fragment or userinfo"),
    ("https://auth.example.com/token#frag", "no query, fragment or userinfo"),
    ("https://client@auth.example.com/token", "no query, fragment or userinfo"),
    ("https://auth.example.com", "with a path"),
])
def test_a_token_url_that_is_not_an_exact_https_url_is_refused(url, wants):
    diag = only_error(policy(OAUTH.format(url=url)), "EL0042")
    assert wants in diag.message
    assert "https://host/path" in diag.help


@pytest.mark.parametrize(("path", "wants"), [
    ("/oauth/token/", "write `/oauth/token`"),
    ("/oauth/../token", "normal form"),
    ("/oauth//token", "normal form"),
    ("/oauth/%7Etoken", "normal form"),
    ("/oauth%2ftoken", "normal form"),
])
def test_a_token_path_not_in_normal_form_is_refused(path, wants):
    diag = only_error(policy(OAUTH.format(url="https://auth.example.com" + path)), "EL0042")
    assert wants in diag.help


def test_a_token_url_with_a_bad_port_is_refused():
    diag = only_error(policy(OAUTH.format(url="https://auth.example.com:70000/token")), "EL0023")
    assert "invalid port" in diag.message


def test_a_token_url_host_goes_through_host_admission():
    assert only_error(policy(OAUTH.format(url="https://10.1.2.3/token")), "EL0012")


@pytest.mark.parametrize("path", [
    "/app/installations/abc/access_tokens",
    "/app/installations/12/access_tokens/extra",
    "/app/installations/12/tokens",
    "/api/v4/app/installations/12/access_tokens",
    "/oauth/token",
])
def test_a_github_app_token_url_must_be_an_installation_token_endpoint(path):
    diag = only_error(policy(GITHUB.format(url="https://api.github.com" + path)), "EL0042")
    assert diag.message == f"`{path}` is not a GitHub App installation-token endpoint"
    assert "/app/installations/<installation id>/access_tokens" in diag.help


# -- oauth2 and github_app settings ------------------------------------------------------------------------------------


def test_an_unsupported_grant_names_the_supported_ones():
    text = policy('kind = "oauth2"\n  oauth2 = { token_url: "https://auth.example.com/token", grant: "authorization_code" }')
    diag = only_error(text, "EL0021")
    assert diag.message == "OAuth 2.0 grant `authorization_code` is not supported"
    assert "refresh_token" in diag.help and "client_credentials" in diag.help


def test_a_misspelt_grant_suggests_the_nearest():
    text = policy('kind = "oauth2"\n  oauth2 = { token_url: "https://auth.example.com/token", grant: "client-credentials" }')
    assert only_error(text, "EL0021").help == "did you mean `client_credentials`?"


@pytest.mark.parametrize("scope", ["read write", 'say\\"hi', "back\\\\slash", ""])
def test_a_scope_that_is_not_one_scope_token_is_refused(scope):
    text = policy('kind = "oauth2"\n  oauth2 = { token_url: "https://auth.example.com/token", grant: "refresh_token", '
                  f'scopes: ["ok", "{scope}"] }}')
    diag = only_error(text, "EL0041")
    assert "is not an RFC 6749 scope token" in diag.message
    assert "one scope per list item" in diag.help


def test_a_permission_level_that_is_not_read_write_or_admin_is_refused():
    text = policy('kind = "github_app"\n  github_app = { token_url: "https://api.github.com/app/installations/1/access_tokens", '
                  'permissions: { contents: "owner" } }')
    diag = only_error(text, "EL0021")
    assert diag.message == "permission `contents` must be one of read, write, admin"


def test_a_permission_name_that_is_not_githubs_is_refused():
    text = policy('kind = "github_app"\n  github_app = { token_url: "https://api.github.com/app/installations/1/access_tokens", '
                  'permissions: { Contents: "read" } }')
    assert "not a GitHub permission name" in only_error(text, "EL0041").message


def test_a_repository_with_its_owner_is_refused():
    text = policy('kind = "github_app"\n  github_app = { token_url: "https://api.github.com/app/installations/1/access_tokens", '
                  'repositories: ["acme/app"] }')
    assert "(`app`, not `acme/app`)" in only_error(text, "EL0041").help


# -- SigV4 ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", ["x-amz-date", "X-Amz-Content-Sha256", "x-amz-security-token"])
def test_a_sigv4_signing_header_cannot_be_allowlisted_but_is_fine_on_a_static_connection(header):
    diag = only_error(policy(SIGV4, f'headers = ["{header}"]'), "EL0026")
    assert diag.message == f"header `{header}` is written by the edge when it signs (aws_sigv4) and can never be allowlisted"
    static = compile_text(policy("", f'headers = ["{header}"]'))
    assert static.ok
    assert static.artifact.connection("c").rules[0].headers == (header.lower(),)


def test_other_amz_headers_may_be_allowlisted_on_sigv4_but_authorization_may_not():
    result = compile_text(policy(SIGV4, 'headers = ["x-amz-meta-owner", "Content-Type"]'))
    assert result.ok and result.artifact.connection("c").rules[0].headers == ("content-type", "x-amz-meta-owner")
    assert "carries the credential" in only_error(policy(SIGV4, 'headers = ["authorization"]'), "EL0026").message


@pytest.mark.parametrize(("key", "value"), [("region", "US-EAST-1"), ("region", "us_east_1"), ("region", "-us"),
                                            ("service", "s3/x"), ("service", "")])
def test_a_bad_region_or_service_is_refused(key, value):
    settings = {"region": "us-east-1", "service": "s3", key: value}
    text = policy('kind = "aws_sigv4"\n  aws_sigv4 = { ' + ", ".join(f'{k}: "{v}"' for k, v in settings.items()) + " }")
    diag = only_error(text, "EL0041")
    assert diag.message.startswith(f"`{key}` ") and f"is not an AWS {key} name" in diag.message
    assert "us-east-1" in diag.help


# -- secrets in kind settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [
    'kind = "oauth2"\n  oauth2 = { token_url: "https://auth.example.com/token", grant: "refresh_token", audience: "%s" }',
    'kind = "oauth2"\n  oauth2 = { token_url: "https://auth.example.com/token", grant: "refresh_token", scopes: ["%s"] }',
    'kind = "github_app"\n  github_app = { token_url: "https://api.github.com/app/installations/1/access_tokens", '
    'repositories: ["%s"] }',
    'kind = "aws_sigv4"\n  aws_sigv4 = { region: "us-east-1", service: "%s" }',
])
def test_a_secret_in_a_kind_setting_is_refused_by_the_secret_scan_and_never_shown(settings):
    result = compile_text(policy(settings % TOKEN))
    assert not result.ok
    assert "EL0029" in {d.code for d in result.diagnostics}
    rendered = render_text(result.diagnostics, result.sources)
    assert TOKEN not in rendered and TOKEN[4:20] not in rendered


@pytest.mark.parametrize("url", [
    f"https://x-access-token:{TOKEN}@auth.example.com/token",
    f"https://auth.example.com/token?access_token={TOKEN}",
    f"https://auth.example.com/{TOKEN}/token",
])
def test_a_secret_inside_a_token_url_is_refused_and_never_shown(url):
    result = compile_text(policy(OAUTH.format(url=url)))
    assert not result.ok
    assert "EL0029" in {d.code for d in result.diagnostics}
    rendered = render_text(result.diagnostics, result.sources)
    assert TOKEN[4:20] not in rendered
