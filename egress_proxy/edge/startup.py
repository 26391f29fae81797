"""What only `egresslaw proxy` loads and checks before anything listens (the rest, shared with the lane, is
`egress_proxy.front.startup`): the custody store and the credentials sealed in it, the response caps, and the
resolver from the addon's options. Each failure is a `StartupError` and exit 2.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mitmproxy.utils import human

from compiler.artifact import Artifact
from egress_proxy.custody.keys import KeyFileError
from egress_proxy.custody.records import CustodyError, CustodyUnavailable
from egress_proxy.custody.stores import is_database_url, open_store
from egress_proxy.front.resolver import AsyncResolver, ResolverConfigError
from egress_proxy.front.startup import Resolver, StartupError

log = logging.getLogger("egresslaw.proxy")


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


def open_custody(store: str, keys_dir: str, artifact: Artifact | None = None):
    """The custody store; for an artifact without a connection whose SQLite store does not exist, an `AbsentStore`
    (a profiles-only proxy needs no store)."""
    if artifact is not None and not artifact.connections and not is_database_url(store) and not (store and Path(store).exists()):
        log.info("the artifact has no connection: starting without a custody store (`%s` does not exist)", store or "-")
        return AbsentStore(store, keys_dir)
    if not store:
        raise StartupError("a custody store is required (`--store custody.db`)")
    try:
        return open_store(store, keys_dir, create=False)  # a file (SQLite) or a postgresql:// URL
    except (CustodyError, KeyFileError) as exc:
        raise StartupError(exc.message, exc.help) from None


class AbsentStore:
    """The store of a proxy that started without one (its artifact had no connection). Nothing is read until a reloaded
    artifact's connection asks for a credential: the store is opened then if it exists by then, and until it does such
    a request is denied `credential-unavailable` (fail closed, audited)."""

    def __init__(self, store: str, keys_dir: str) -> None:
        self.path, self.keys_dir, self._opened = store, keys_dir, None

    def _store(self):
        if self._opened is None:
            if not (self.path and Path(self.path).exists()):
                raise CustodyError(f"no custody store: `{self.path or '-'}` does not exist (the proxy started without one: its "
                                   "artifact had no connection)", "create it (`egresslaw custody init`), seal the credential, "
                                   "and restart the proxy or let it open the store at the next request")
            self._opened = open_store(self.path, self.keys_dir, create=False)
        return self._opened

    def open(self, address):
        return self._store().open(address)

    def list(self):
        return [] if self._opened is None and not (self.path and Path(self.path).exists()) else self._store().list()

    def __getattr__(self, name: str):  # put, try_mint_lock, …: the opened store's, else absent (read-only, no lock)
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(self._store(), name)
        except (CustodyError, KeyFileError):
            raise AttributeError(name) from None

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()


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
