"""Build artifacts directly from compiler.artifact models (no parser): for decision, proxy and prover tests.

    art = artifact(
        connections=[connection("github", [rule("read", "api.github.com", "/repos/acme", ["GET"], ["accept"])])],
        profiles=[profile("ci", [("deb.debian.org", 80), ("pypi.org", 443)])],
        workers=[worker("edge", allow_cidrs=("100.64.0.0/10",))],
    )

The worker "default" is always present (added if not given), as in compiled artifacts. The result
is sealed (its digest is filled in), so `load_artifact(art.to_json())` accepts it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from catalog import load_catalog
from compiler.artifact import (
    AllowedHost,
    Artifact,
    CatalogRef,
    Connection,
    Inject,
    Mint,
    Network,
    Rule,
    SandboxProfile,
    Worker,
    network_policy_hash,
)

CATALOG_VERSION = "2026.11"


def worker(name: str = "default", **settings: object) -> Worker:
    """A worker with the language's defaults; pass any Worker field to override (tuples for lists)."""
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    return Worker(name=name, **fixed)  # type: ignore[arg-type]


def rule(
    name: str,
    host: str,
    path_prefix: str = "/",
    methods: Sequence[str] = ("GET",),
    headers: Sequence[str] = (),
    port: int = 443,
) -> Rule:
    """One egress rule; header names are lowercased and sorted as the compiler writes them."""
    return Rule(
        name=name,
        host=host,
        port=port,
        path_prefix=path_prefix,
        methods=tuple(methods),
        headers=tuple(sorted({h.lower() for h in headers})),
    )


def connection(
    name: str,
    rules: Iterable[Rule],
    worker: str = "default",
    inject_header: str = "Authorization",
    inject_format: str = "Bearer {secret}",
    credential: str | None = None,
    version: int = 1,
    mint: Mint | None = None,
) -> Connection:
    return Connection(
        name=name,
        version=version,
        credential_handle=credential or f"{name}-cred",
        inject=Inject(header=inject_header, format=inject_format),
        worker=worker,
        rules=tuple(rules),
        mint=mint,
    )


def oauth2(token_url: str = "https://oauth.example.com/token", grant: str = "refresh_token") -> Mint:
    """An `oauth2` kind's settings, as the compiler writes them."""
    host, _, path = token_url.removeprefix("https://").partition("/")
    return Mint(kind="oauth2", token_url=token_url, token_host=host, token_port=443, token_path="/" + path, grant=grant)


def sigv4(region: str = "us-east-1", service: str = "s3") -> Mint:
    return Mint(kind="aws_sigv4", region=region, service=service)


def profile(
    name: str,
    hosts: Iterable[tuple[str, int] | tuple[str, int, str]] = (),
    trust: str = "trusted",
    provider: str = "gvisor@2026.10.1",
    mode: str | None = None,
    version: int = 1,
    brokers: Sequence[str] = (),
) -> SandboxProfile:
    """A sandbox profile; `hosts` are (host, port) or (host, port, granted_by); no hosts means network none;
    `brokers` the connections it brokers, in precedence order."""
    allowed = tuple(
        sorted(
            (AllowedHost(host=h[0], port=h[1], granted_by=h[2] if len(h) > 2 else "allowed_hosts") for h in hosts),
            key=lambda a: (a.host, a.port, a.granted_by),
        )
    )
    net_mode = mode or ("allowlist" if allowed else "none")
    return SandboxProfile(
        name=name,
        version=version,
        trust=trust,  # type: ignore[arg-type]
        provider=provider,
        provider_certification="advisory_filter",
        provider_missing_axes=(),
        required_egress_certification="advisory_filter",
        catalog_version=CATALOG_VERSION,
        network=Network(mode=net_mode, allowed_hosts=allowed),  # type: ignore[arg-type]
        network_policy_hash=network_policy_hash(allowed),
        brokers=tuple(brokers),
    )


def artifact(
    connections: Iterable[Connection] = (),
    profiles: Iterable[SandboxProfile] = (),
    workers: Iterable[Worker] = (),
    workspace: str = "acme",
) -> Artifact:
    """A sealed artifact; the worker `default` is added unless given."""
    ws = list(workers)
    if not any(w.name == "default" for w in ws):
        ws.insert(0, Worker(name="default"))
    cat = load_catalog(CATALOG_VERSION)
    return Artifact(
        workspace=workspace,
        catalog=CatalogRef(
            version=CATALOG_VERSION, digest=cat.digest, special_purpose_date=cat.special_purpose.registry_date
        ),
        source_digest="0" * 64,
        workers=tuple(sorted(ws, key=lambda w: w.name)),
        sandbox_profiles=tuple(sorted(profiles, key=lambda p: p.name)),
        connections=tuple(sorted(connections, key=lambda c: c.name)),
    ).sealed()
