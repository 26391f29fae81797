"""Messages that used to mislead, each driven through the real CLI; and `--help` for every command."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from egresslaw.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "policies" / "demo"


PROFILE = """egresslaw 1
workspace "w"
catalog "2026.11"

sandbox_profile "p" {
  trust = "trusted"
  provider = "gvisor@2026.10.1"
  network = {"type": "limited", "allowed_hosts": [%s]}
}
"""


@pytest.mark.parametrize(("host", "code", "message"), [
    ("https://api.github.com", "EL0011", "host `https://api.github.com` has a scheme"),
    ("https://api.github.com/repos", "EL0011", "host `https://api.github.com/repos` has a scheme"),
    ("user:pw@api.github.com", "EL0011", "host `user:pw@api.github.com` has userinfo"),
    ("api.github.com:https", "EL0023", "`api.github.com:https` has an invalid port"),
])
def test_a_url_in_allowed_hosts_says_what_is_wrong(cli, tmp_path, host, code, message):
    f = tmp_path / "p.egress"
    f.write_text(PROFILE % json.dumps(host))
    rc, _, err = cli("check", f)
    assert rc == 1 and f"error[{code}]: {message}" in err and "invalid port" not in err.replace(message, "")


@pytest.mark.parametrize(("host", "message"), [
    ("https://api.github.com", "in `allowed_hosts`: host `https://api.github.com` has a scheme"),
    ("localhost:8080", "in `allowed_hosts`: `localhost` is a special-use or internal name"),
    ("api.github.com:0", "`api.github.com:0` has an invalid port"),
])
def test_import_cma_refuses_what_the_compiler_refuses(cli, tmp_path, host, message):
    (tmp_path / "env.json").write_text(json.dumps({"networking": {"type": "limited", "allowed_hosts": [host]}}))
    rc, out, err = cli("import-cma", tmp_path / "env.json")
    assert (rc, out) == (1, "") and f"error: {message}" in err and "help:" in err


def test_explain_without_a_method_asks_for_one(cli, tmp_path):
    assert cli("compile", DEMO, "-o", tmp_path / "a.json")[0] == 0
    rc, out, err = cli("explain", tmp_path / "a.json", "--connection", "github", "https://api.github.com/repos/acme/app")
    assert (rc, out) == (2, "")
    assert err == ("error: `https://api.github.com/repos/acme/app` has no method\n"
                   "help: write the method first, e.g. 'GET https://api.github.com/repos/acme/app'\n")


@pytest.mark.parametrize("text", [
    json.dumps({"name": "crawler", "config": {"type": "cloud", "networking": {"type": "none"}}}, indent=2),
    "name: crawler\nconfig:\n  type: cloud\n  networking:\n    type: none\n",
])
def test_a_cma_environment_saved_as_egress_points_to_import_cma(cli, tmp_path, text):
    f = tmp_path / "crawler.egress"
    f.write_text(text)
    rc, _, err = cli("check", f)
    assert rc == 1
    assert f"{f}:1:1: error[EL0001]: this is a Claude Managed Agents environment (JSON or YAML), not egresslaw source" in err
    assert f"help: convert it: `egresslaw import-cma {f} > policy.egress`" in err and "egresslaw 1" not in err


@pytest.mark.parametrize(("tail", "where", "message"), [
    ('worker "a" {\n  ipv6 = true\n\nworker "b" {\n}\n', "4:12", "a block is not closed: the `{` opened at line 4, column 12 has no matching `}`"),
    ('worker "a" {\n  deny_cidrs = ["192.0.2.0/24"\n', "5:16", "a list is not closed: the `[` opened at line 5, column 16 has no matching `]`"),
    ('worker "a" {\n  deny_cidrs = ["192.0.2.0/24"\n}\n', "6:1",
     "a list is not closed; expected `]` (found `}`); the `[` opened at line 5, column 16"),
])
def test_an_unterminated_block_names_the_missing_brace_and_where_it_opened(cli, tmp_path, tail, where, message):
    f = tmp_path / "p.egress"
    f.write_text('egresslaw 1\nworkspace "w"\ncatalog "2026.11"\n' + tail)
    rc, _, err = cli("check", f)
    assert rc == 1 and f"{f}:{where}: error[EL0001]: {message}" in err
    assert "help: add the missing" in err or "help: separate items with `,` and close the list with `]`" in err


def _subcommands(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subcommands(sub, (*path, name))


def test_every_command_has_a_description_and_its_exit_codes():
    parser = build_parser()
    commands = list(_subcommands(parser))
    assert len(commands) >= 18
    for path, sub in commands:
        text = sub.format_help()
        assert sub.description, path
        assert "exit codes:" in text, path


def test_help_examples_name_subjects_the_demo_has(cli, tmp_path):
    cli("compile", DEMO, "-o", tmp_path / "a.json")
    artifact = json.loads((tmp_path / "a.json").read_text())
    profiles = {p["name"] for p in artifact["sandbox_profiles"]}
    connections = {c["name"] for c in artifact["connections"]}
    for path, sub in _subcommands(build_parser()):
        text = sub.format_help()
        for name in re.findall(r"--profile ([a-z][\w.-]+)", text):
            assert name in profiles, (path, name)
        for name in re.findall(r"--connection ([a-z][\w.-]+)", text):
            assert name in connections, (path, name)
    # and the explain example really runs on the demo
    rc, out, _ = cli("explain", tmp_path / "a.json", "--profile", "package-builder", "pypi.org:443")
    assert rc == 0 and out.startswith("decision: allow")
