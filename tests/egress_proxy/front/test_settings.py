"""Every default is spelled once (`edge/settings.py`): the CLI's flags, `EdgeConfig`, the limits and the addon's
mitmproxy options all start from it, so `egresslaw proxy --help` says what actually runs."""

from __future__ import annotations

import argparse
import dataclasses

from mitmproxy.test import taddons

from egress_proxy.edge.addon import EgressLaw
from egress_proxy.edge.limits import LimitConfig
from egress_proxy.front.settings import DEFAULTS
from egress_proxy.run.server import EdgeConfig
from egresslaw.commands import proxy as proxy_command

LIMITS = ("max_head_bytes", "max_headers", "max_request_line", "max_body", "max_connections_per_client", "max_connections",
          "header_timeout")


def _cli_defaults() -> dict:
    parser = argparse.ArgumentParser()
    proxy_command.register(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["proxy"]  # type: ignore[union-attr]
    return {a.dest: a.default for a in sub._actions}


def test_edge_config_and_the_limits_start_from_the_defaults() -> None:
    config = {f.name: f.default for f in dataclasses.fields(EdgeConfig)}
    for name in ("confdir", "dns_timeout", "dns_concurrency", "audit_max_bytes", "audit_max_age", "audit_sync", "drain_grace",
                 "idle_timeout", *LIMITS):
        assert config[name] == getattr(DEFAULTS, name), name
    limits = LimitConfig()
    for name in LIMITS:
        assert getattr(limits, name) == getattr(DEFAULTS, name), name


def test_the_cli_shows_and_passes_the_same_defaults() -> None:
    cli = _cli_defaults()
    for name in ("store", "listen", "admin", "confdir", "audit_log", "audit_max_bytes", "audit_max_age", "audit_sync", "drain_grace",
                 "dns_timeout", "dns_concurrency", "max_response", "max_decoded"):
        assert cli[name] == getattr(DEFAULTS, name), name
    for name in (*LIMITS, "idle_timeout"):
        assert cli[name] is None, name  # unset flags leave EdgeConfig's default (DEFAULTS) in force


def test_the_addon_options_start_from_the_defaults() -> None:
    addon = EgressLaw()
    with taddons.context(addon) as tctx:
        opts = tctx.options
        for name in ("audit_max_bytes", "audit_max_age", "audit_sync", "dns_timeout", "dns_concurrency", "max_response",
                     "max_decoded", *LIMITS):
            assert getattr(opts, f"egresslaw_{name}") == getattr(DEFAULTS, name), name
