"""What `egresslaw proxy` loads and checks before anything listens: each failure is a `StartupError`
(message, help) and exit 2, nothing listening.

The artifact and its proof report (`proofs.gate`: z3-free), the keys, the custody store, the routing
options for tests and staging (`--resolve`, `--connect-to`), the response caps and the resolver.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mitmproxy.utils import human

from compiler.artifact import Artifact, ArtifactError, load_artifact
from compiler.constants import DEFAULT_WORKER
from compiler.normalize import HostError, normalize_host
from egress_proxy.custody.keys import KeyFileError, LeaseKeyFile, load_audit_key
from egress_proxy.custody.records import CustodyError, CustodyUnavailable
from egress_proxy.custody.stores import open_store
from egress_proxy.edge.resolver import AsyncResolver, ResolverConfigError
from egress_proxy.errors import EgressError
from proofs.gate import GateError, read_report

log = logging.getLogger("egresslaw.proxy")

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


class StartupError(EgressError):
    """The proxy cannot serve: bad artifact, proof, keys, store or options. The CLI exits 2."""


@dataclass(frozen=True, slots=True)
class Policy:
    """The artifact being enforced; replaced as a whole on reload (never mutated)."""

    artifact: Artifact
    proved: bool
    path: str
    stamp: tuple[int, int, int]  # (inode, size, mtime_ns) of the artifact file when loaded


def load_policy(artifact_path: str, proof_path: str, *, allow_unproven: bool, trust_proofs: str | None = None,
                allow_unsigned: bool = False, require_within: str | None = None) -> Policy:
    """Read and verify the artifact and its proof report; StartupError unless the gate accepts the report
    (`proofs.gate`: signed by `trust_proofs` — unsigned only with `allow_unsigned` —, every required check proved,
    same egresslaw and decision code; with `require_within`, `within` proved for every subject against that ceiling
    digest) or `allow_unproven`."""
    try:
        st = Path(artifact_path).stat()
        artifact = load_artifact(Path(artifact_path).read_bytes())
    except FileNotFoundError:
        raise StartupError(f"artifact `{artifact_path}` does not exist") from None
    except OSError as exc:
        raise StartupError(f"cannot read artifact `{artifact_path}`: {exc.strerror or exc.__class__.__name__}") from None
    except ArtifactError as exc:
        raise StartupError(f"artifact `{artifact_path}`: {exc}") from None
    if artifact.worker(DEFAULT_WORKER) is None:
        raise StartupError(f"artifact `{artifact_path}` has no `{DEFAULT_WORKER}` worker")
    try:
        report = read_report(proof_path, artifact, trusted_key=trust_proofs, allow_unsigned=allow_unsigned,
                             require_within=require_within)
        proved, why, help_ = True, "", None
        if report.signature is None:
            log.warning("serving with an unsigned proof report (--allow-unsigned-proofs, development only): `%s`", proof_path)
    except GateError as exc:
        proved, why, help_ = False, exc.message, exc.help
    if not proved and not allow_unproven:
        raise StartupError(why, help_ or "run `egresslaw prove` on this artifact")
    if not proved:
        log.warning("serving an unproven artifact (--allow-unproven): %s", why)
    return Policy(artifact, proved, artifact_path, (st.st_ino, st.st_size, st.st_mtime_ns))


def parse_resolve(entries: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """`HOST=IP[,IP…]` entries as a map from the normalized host to its answers (answers are judged later)."""
    out: dict[str, tuple[str, ...]] = {}
    for entry in entries:
        host, sep, ips = entry.partition("=")
        if not sep or not host or not ips:
            raise StartupError(f"--resolve `{entry}` is not HOST=IP[,IP...]")
        try:
            name = normalize_host(host).value
            answers = tuple(str(ipaddress.ip_address(ip.strip())) for ip in ips.split(","))
        except (HostError, ValueError):
            raise StartupError(f"--resolve `{entry}` is not HOST=IP[,IP...]") from None
        out[name] = out.get(name, ()) + answers
    return out


def parse_connect_to(entries: Sequence[str]) -> dict[tuple[str, int], tuple[str, int]]:
    """curl's `HOST:PORT:ADDR:APORT` entries as a map from (host, port) to the address actually dialled."""
    out: dict[tuple[str, int], tuple[str, int]] = {}
    for entry in entries:
        parts = entry.split(":")
        if len(parts) != 4:
            raise StartupError(f"--connect-to `{entry}` is not HOST:PORT:ADDR:APORT")
        host, port, addr, aport = parts
        try:
            key = (normalize_host(host).value, _port(port))
            out[key] = (str(ipaddress.ip_address(addr)), _port(aport))
        except (HostError, ValueError):
            raise StartupError(f"--connect-to `{entry}` is not HOST:PORT:ADDR:APORT (ADDR must be an IP address)") from None
    return out


def routing_record(resolve: Sequence[str], connect_to: Sequence[str], upstream_ca: str | None) -> dict[str, Any]:
    """The test routing in force, as every audit event records it (empty: none)."""
    routing: dict[str, Any] = {}
    if resolve:
        routing["resolve"] = list(resolve)
    if connect_to:
        routing["connect_to"] = list(connect_to)
    if upstream_ca:
        routing["upstream_ca"] = upstream_ca
    return routing


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError("port")
    return value


def parse_response_caps(max_response: str, max_decoded: str, per_rule: Sequence[str]) -> tuple[int | None, int | None, dict[str, int | None]]:
    """The response caps: `SIZE` strings (`512k`, `1g`; empty = no cap) and `CONNECTION/RULE=SIZE` entries."""

    def size(text: str, what: str) -> int | None:
        try:
            value = human.parse_size(text.strip() or None)
        except ValueError:
            value = -1
        if value is not None and value < 0:
            raise StartupError(f"{what} `{text}` is not a size (e.g. 512m, 1g)")
        return value

    rules: dict[str, int | None] = {}
    for entry in per_rule:
        key, sep, value = entry.partition("=")
        if not sep or key.count("/") != 1 or not all(key.split("/")):
            raise StartupError(f"--rule-max-response `{entry}` is not CONNECTION/RULE=SIZE")
        rules[key.strip()] = size(value, "--rule-max-response")
    return size(max_response, "--max-response"), size(max_decoded, "--max-decoded"), rules


def check_rule_caps(caps: dict[str, int | None], artifact: Artifact) -> None:
    known = {f"{c.name}/{r.name}" for c in artifact.connections for r in c.rules}
    for key in caps:
        if key not in known:
            raise StartupError(f"--rule-max-response `{key}` names no rule of the artifact (CONNECTION/RULE)")


def file_stamps(*paths: str) -> tuple[tuple[int, int, int] | None, ...]:
    """(inode, size, mtime_ns) of each file, None where it cannot be read."""
    out = []
    for path in paths:
        try:
            st = Path(path).stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def load_audit_key_file(keys_dir: str):
    try:
        return load_audit_key(keys_dir)
    except KeyFileError as exc:
        raise StartupError(exc.message, exc.help) from None


def load_lease_key_file(keys_dir: str):
    try:
        return LeaseKeyFile(keys_dir)
    except KeyFileError as exc:
        raise StartupError(exc.message, exc.help) from None


def open_custody(store: str, keys_dir: str):
    if not store:
        raise StartupError("a custody store is required (`--store custody.db`)")
    try:
        return open_store(store, keys_dir, create=False)  # a file (SQLite) or a postgresql:// URL
    except (CustodyError, KeyFileError) as exc:
        raise StartupError(exc.message, exc.help) from None


def check_credentials_sealed(artifact: Artifact, store: Any, *, allow_missing: bool = False) -> None:
    """StartupError naming the first connection whose credential has no record in custody (a typo'd handle or
    connection, a credential never sealed): without it every credentialed request would be denied. A store that
    cannot answer now (a PostgreSQL server away) is not checked: the proxy starts and reports custody-unavailable."""
    try:
        sealed = {(r.address.workspace, r.address.connection, r.address.handle) for r in store.list()}
    except CustodyUnavailable:
        log.warning("custody store unreachable at start-up: the credentials of the artifact's connections were not checked")
        return
    except (CustodyError, OSError) as exc:
        raise StartupError(f"cannot list the custody store: {getattr(exc, 'message', None) or exc.__class__.__name__}") from None
    missing = [c for c in artifact.connections if (artifact.workspace, c.name, c.credential_handle) not in sealed]
    if missing and allow_missing:
        for c in missing:
            log.warning("--allow-missing-credentials: connection `%s` has no credential at `%s/%s/%s`; its requests are denied "
                        "credential-unavailable until one is sealed", c.name, artifact.workspace, c.name, c.credential_handle)
        return
    if missing:
        c = missing[0]
        more = f" (and {len(missing) - 1} more connection(s))" if len(missing) > 1 else ""
        same = sorted(h for w, n, h in sealed if w == artifact.workspace and n == c.name)
        near = f"; the store holds `{artifact.workspace}/{c.name}/{same[0]}` for it: is the handle a typo?" if same else ""
        raise StartupError(
            f"connection `{c.name}` has no credential in custody: nothing is sealed at "
            f"`{artifact.workspace}/{c.name}/{c.credential_handle}`{more}{near}",
            f"seal it: `egresslaw custody put --keys KEYS --store STORE --workspace {artifact.workspace} --connection {c.name} "
            f"--handle {c.credential_handle}{'' if c.kind == 'static' else ' --kind ' + c.kind}` (the secret on stdin), "
            "or fix the policy's `credential` handle (`--allow-missing-credentials` starts anyway and denies its requests)")


def make_resolver(opts: Any) -> tuple[Resolver, float]:
    """The proxy's asynchronous resolver from the egresslaw_nameservers / egresslaw_dns_* options, and its timeout."""

    try:
        dns = AsyncResolver(opts.egresslaw_nameservers, timeout=opts.egresslaw_dns_timeout, concurrency=opts.egresslaw_dns_concurrency)
    except ResolverConfigError as exc:
        raise StartupError(exc.message, exc.help) from None
    return dns, dns.timeout
