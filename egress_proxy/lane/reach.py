"""What each sandbox profile may reach through the lane, from the artifact alone: the specification the
translation check (`egress_proxy.lane.translate`) holds Envoy's configuration to.

Stated apart from the generator (`egress_proxy.lane.envoy`) and importing nothing of it (an import contract in
pyproject.toml): a generator bug cannot move what it is judged against. The rules, as docs/lane.md states them:

- the lane serves a sandbox profile when it brokers nothing (credentials are attached on the mitmproxy edge only),
  is enforced (observe mode forwards what the allowlist lacks, which is the edge's job), every allowlist entry names
  a host rather than an IP literal (the lane terminates TLS for host names only), and the artifact has the worker
  that judges profiles (`default`);
- a served profile reaches exactly the `(host, port)` entries of its allowlist, each by the three transports
  (CONNECT then TLS, absolute-form `http://`, absolute-form `https://`), and nothing else; a profile without network
  reaches nothing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from compiler.artifact import Artifact, SandboxProfile
from compiler.constants import DEFAULT_WORKER

Pair = tuple[str, int]


@dataclass(frozen=True)
class Reach:
    """Served profile -> the exact `(host, port)` set it may reach; and the profiles left to the edge, with why."""

    profiles: Mapping[str, frozenset[Pair]]
    left: Mapping[str, str]

    def hosts(self) -> frozenset[str]:
        """Every host some served profile may reach (the lane holds one leaf certificate for each)."""
        return frozenset(host for pairs in self.profiles.values() for host, _ in pairs)


def reach(artifact: Artifact) -> Reach:
    """The lane's whole reach for `artifact`."""
    profiles: dict[str, frozenset[Pair]] = {}
    left: dict[str, str] = {}
    for prof in artifact.sandbox_profiles:
        why = _left_to_the_edge(artifact, prof)
        if why is None:
            profiles[prof.name] = _allowlist(prof)
        else:
            left[prof.name] = why
    return Reach(profiles, left)


def _left_to_the_edge(artifact: Artifact, prof: SandboxProfile) -> str | None:
    if prof.brokers:
        return "it brokers connections (credentials are attached on the mitmproxy edge only)"
    if prof.enforce != "enforce":
        return "it is in observe mode (requests outside the allowlist are forwarded by the mitmproxy edge)"
    if prof.network.mode == "allowlist" and any(_ip_literal(entry.host) for entry in prof.network.allowed_hosts):
        return "its allowlist names an IP literal (the lane terminates TLS for host names only)"
    if all(w.name != DEFAULT_WORKER for w in artifact.workers):
        return f"the worker that judges profiles (`{DEFAULT_WORKER}`) is not in the artifact"
    return None


def _allowlist(prof: SandboxProfile) -> frozenset[Pair]:
    if prof.network.mode != "allowlist":
        return frozenset()
    return frozenset((entry.host, entry.port) for entry in prof.network.allowed_hosts)


def _ip_literal(host: str) -> bool:
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
