"""What both front ends (`egresslaw proxy` and `egresslaw lane`) load and check before anything listens: each failure
is a `StartupError` (message, help) and exit 2, nothing listening.

The artifact and its proof report (`proofs.gate`: z3-free) as a `Policy`, the keys, the routing options for tests
and staging (`--resolve`, `--connect-to`, `--upstream-ca`), and the listen address's bind error in the operating
system's words. What only the edge loads (the custody store, the response caps) is in `egress_proxy.edge.startup`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiler.artifact import Artifact, ArtifactError, load_artifact
from compiler.constants import DEFAULT_WORKER
from compiler.normalize import HostError, normalize_host
from egress_proxy.custody.keys import KeyFileError, LeaseKeyFile, load_audit_key
from egress_proxy.errors import EgressError
from egress_proxy.front.budget import LazyLedger, LedgerError, has_budget
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
    # The head limits the proof's capacity figures assumed (docs/budget.md; None: an older report, or none accepted)
    assumed: tuple[tuple[str, int], ...] | None = None


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
        limits = (report.capacity or {}).get("limits")
        assumed = tuple(sorted((k, v) for k, v in limits.items() if isinstance(v, int))) if isinstance(limits, dict) else None
        if report.signature is None:
            log.warning("serving with an unsigned proof report (--allow-unsigned-proofs, development only): `%s`", proof_path)
    except GateError as exc:
        proved, why, help_, assumed = False, exc.message, exc.help, None
    if not proved and not allow_unproven:
        raise StartupError(why, help_ or "run `egresslaw prove` on this artifact")
    if not proved:
        log.warning("serving an unproven artifact (--allow-unproven): %s", why)
    return Policy(artifact, proved, artifact_path, (st.st_ino, st.st_size, st.st_mtime_ns), assumed)


def gate(cfg: Any, artifact: str | None = None, proof: str | None = None, trust_proofs: str | None = None) -> Policy:
    """`load_policy` with a front end's own gate settings (a `FrontConfig`): every front end passes its policy
    through here, at start and at every reload (`artifact`/`proof`/`trust_proofs`: other copies of the same files)."""
    policy = load_policy(artifact or cfg.artifact, proof or cfg.proof, allow_unproven=cfg.allow_unproven,
                         trust_proofs=trust_proofs if trust_proofs is not None else cfg.trust_proofs,
                         allow_unsigned=cfg.allow_unsigned_proofs, require_within=cfg.require_within)
    check_assumed_limits(policy, cfg)
    return policy


def check_assumed_limits(policy: Policy, cfg: Any) -> None:
    """The proof's capacity figures (docs/budget.md) count the heads the limits it assumed admit: a front end whose own
    head limits (`--max-head-bytes`, `--max-headers`, the edge's `--max-request-line`) admit more would carry more than
    the report says, so it does not start (StartupError naming the limit and both values)."""
    if policy.assumed is None:
        return
    for name, proved in policy.assumed:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > proved:
            flag = "--" + name.replace("_", "-")
            raise StartupError(f"{flag} {value:,} admits more than the proof's capacity figures assumed ({proved:,}): the "
                               "report would understate what one request can carry (docs/budget.md)",
                               f"pass {flag} {proved} or less")


def open_budget(address: str, artifact: Artifact, kept: LazyLedger | None = None) -> LazyLedger:
    """The budget ledger (`--budget-store`) a front end charges: `kept` if it names the same address (a reload keeps
    its ledger), else a new one; opened now when `artifact` declares a budget (StartupError naming the file and a
    fix), else at its first charge."""
    ledger = kept if kept is not None and os.fspath(kept.address) == os.fspath(address) else LazyLedger(address)
    if has_budget(artifact):
        try:
            ledger.open()
        except LedgerError as exc:
            raise StartupError(f"{exc.message} (the artifact declares a budget)",
                               exc.help or "pass a usable `--budget-store` (a SQLite file path or a postgresql:// URL)") from None
    if kept is not None and ledger is not kept:
        kept.close()
    return ledger


def check_budget_store(address: str, artifact: Artifact) -> None:
    """Start-up: the ledger can be opened when `artifact` declares a budget (StartupError otherwise); closed again."""
    if has_budget(artifact):
        open_budget(address, artifact).close()


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


def bind_error(address: tuple[str, int]) -> str:
    """Why mitmproxy could not listen on `address`, in the operating system's words (it only logs its own advice)."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(address)
    except OSError as exc:
        return (exc.strerror or exc.__class__.__name__).lower()
    return "address in use or not permitted"


def upstream_bundle(confdir: Path, extra_ca: str) -> str:
    """The default trust store plus `extra_ca`, written to `<confdir>/upstream-ca-bundle.pem`."""
    import certifi

    try:
        extra = Path(extra_ca).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise StartupError(f"cannot read --upstream-ca `{extra_ca}`: {exc.__class__.__name__}") from None
    if "-----BEGIN CERTIFICATE-----" not in extra:
        raise StartupError(f"--upstream-ca `{extra_ca}` holds no PEM certificate")
    bundle = confdir / "upstream-ca-bundle.pem"
    staged = confdir / f".upstream-ca-bundle.pem.{os.getpid()}"  # workers starting together never read half a bundle
    staged.write_text(Path(certifi.where()).read_text(encoding="ascii") + "\n" + extra, encoding="ascii")
    staged.replace(bundle)
    return str(bundle)
