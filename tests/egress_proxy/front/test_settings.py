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


def test_the_front_ends_settings_are_declared_once_and_bound_to_one_environment(monkeypatch):
    """`egresslaw proxy` and `egresslaw lane` take the shared options from one table, into one FrontConfig both
    configurations extend, each from the same EGRESSLAW_* variable (the lane once read EGRESSLAW_LANE_* and ignored
    the proxy's test routing)."""
    import dataclasses

    from egress_proxy.front.settings import SHARED, FrontConfig
    from egress_proxy.run.lane import LaneConfig
    from egress_proxy.run.server import EdgeConfig
    from egresslaw.cli import build_parser

    front = {f.name for f in dataclasses.fields(FrontConfig)}
    assert issubclass(EdgeConfig, FrontConfig) and issubclass(LaneConfig, FrontConfig)
    for opt in SHARED:
        assert opt.dest in front or opt.dest + "s" in front, opt.flag  # --nameserver fills nameservers
    monkeypatch.setenv("EGRESSLAW_RESOLVE", "api.acme-test.dev=127.0.0.1")
    monkeypatch.setenv("EGRESSLAW_DNS_TIMEOUT", "7")
    monkeypatch.setenv("EGRESSLAW_LANE_RESOLVE", "ignored.test=127.0.0.2")
    for command in ("proxy", "lane"):
        args = build_parser().parse_args([command, "--artifact", "a.json", "--proof", "p.json", "--keys", "k"])
        assert args.resolve == ["api.acme-test.dev=127.0.0.1"] and args.dns_timeout == 7.0, command
    lane = build_parser().parse_args(["lane", "--artifact", "a", "--proof", "p", "--keys", "k"])
    proxy = build_parser().parse_args(["proxy", "--artifact", "a", "--proof", "p", "--keys", "k"])
    assert (lane.listen, proxy.listen) == ("127.0.0.1:8081", DEFAULTS.listen)  # one binding, the lane's own default port
