"""Parser and passes: bad input is the normal case; it yields diagnostics, never an exception."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.compile import compile_paths, compile_text
from compiler.diagnostics import render_json, render_sarif, render_text
from compiler.parser import lark_parser

ROOT = Path(__file__).resolve().parents[2]
DEMO = sorted((ROOT / "policies" / "demo").glob("*.egress"))
SEEDS = [p.read_text() for p in DEMO] + [p.read_text() for p in sorted((ROOT / "policies" / "examples").glob("*.egress"))]


def test_grammar_has_no_terminal_collisions():
    # strict mode makes lark refuse a grammar whose terminals can match the same text
    lark_parser(strict=True)


def _all_renderings(result) -> None:
    render_text(result.diagnostics, result.sources)
    render_json(result.diagnostics)
    render_sarif(result.diagnostics, result.sources, "test")


@given(st.text(max_size=300))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_random_text_yields_only_diagnostics(text):
    result = compile_text(text, "fuzz.egress")
    assert result.ok or result.diagnostics
    _all_renderings(result)


@st.composite
def mutated(draw):
    source = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["delete", "insert", "duplicate", "swap"]))
        if not source:
            break
        i = draw(st.integers(0, len(source) - 1))
        j = draw(st.integers(i, min(len(source), i + 20)))
        if op == "delete":
            source = source[:i] + source[j:]
        elif op == "insert":
            piece = draw(st.sampled_from(['"', "{", "}", "[", "]", ",", "=", ":", "#", "\n", "*", "..", "%2e", "null", "1e9", "\\u0000", "\x00", "ü", "egress \"x\" {", "worker"]))
            source = source[:i] + piece + source[i:]
        elif op == "duplicate":
            source = source[:j] + source[i:j] + source[j:]
        else:
            source = source[i:j] + source[:i] + source[j:]
    return source


@given(mutated())
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_policies_yield_only_diagnostics(text):
    result = compile_text(text, "mutant.egress")
    assert result.ok or any(d.severity == "error" for d in result.diagnostics)
    _all_renderings(result)
    for d in result.diagnostics:
        assert d.message and d.code.startswith(("EL", "W"))
        assert d.span.line >= 0


def test_all_errors_of_a_run_are_reported_together():
    result = compile_paths([ROOT / "tests" / "golden" / "many-errors" / "input.egress"])
    codes = [d.code for d in result.diagnostics]
    assert len(codes) >= 8
    assert {"EL0008", "EL0023", "EL0024", "EL0025", "EL0026", "EL0006", "EL0013"} <= set(codes)


def test_identical_input_gives_byte_identical_artifact():
    first = compile_paths([ROOT / "policies" / "demo"]).artifact.to_json()
    second = compile_paths([ROOT / "policies" / "demo"]).artifact.to_json()
    assert first == second


def test_names_are_unique_across_files(tmp_path):
    (tmp_path / "a.egress").write_text('egresslaw 1\nworkspace "w"\ncatalog "2026.11"\nworker "x" {\n}\n')
    (tmp_path / "b.egress").write_text('egresslaw 1\nsandbox_profile "x" {\n  provider = "gvisor@2026.10.1"\n  network = {"type": "none"}\n}\n')
    result = compile_paths([tmp_path])
    [dup] = [d for d in result.diagnostics if d.code == "EL0006"]
    assert dup.span.path.endswith("b.egress") and "a.egress" in dup.message


def test_secret_never_appears_in_any_rendering():
    canary = "ghp_CanaryCanary0123456789abcdefABCDEF"
    text = (
        'egresslaw 1\nworkspace "w"\ncatalog "2026.11"\n'
        f'# old token: {canary}\n'
        f'connection "c" {{\n  credential = "{canary}"\n  egress "r" {{\n    host = "{canary}.com"\n    methods = ["GET"]\n  }}\n}}\n'
    )
    result = compile_text(text, "leak.egress")
    assert {d.code for d in result.diagnostics} >= {"EL0029"}
    for rendered in (render_text(result.diagnostics, result.sources), render_json(result.diagnostics), render_sarif(result.diagnostics, result.sources, "t")):
        assert canary not in rendered
        assert canary[4:20] not in rendered


def test_package_manager_expansion_is_host_by_host_with_granted_by():
    result = compile_paths([ROOT / "tests" / "golden" / "package-managers" / "input.egress"])
    [profile] = result.artifact.sandbox_profiles
    grants = {(h.host, h.port, h.granted_by) for h in profile.network.allowed_hosts}
    assert ("deb.debian.org", 80, "allow_package_managers:apt") in grants
    assert ("pypi.org", 443, "allow_package_managers:pip") in grants and ("pypi.org", 443, "allowed_hosts") in grants
    assert ("xn--bcher-kva.de", 8443, "allowed_hosts") in grants
    assert not any(g.endswith((":npm", ":go", ":gem")) for _, _, g in grants)


def test_mcp_flag_expands_to_no_host():
    result = compile_paths([ROOT / "tests" / "golden" / "cma-paste" / "input.egress"])
    [profile] = result.artifact.sandbox_profiles
    assert profile.network.allow_mcp_servers
    assert {h.host for h in profile.network.allowed_hosts} == {"api.semanticscholar.org", "export.arxiv.org"}


def test_a_header_name_with_a_trailing_newline_is_no_token():
    """`^…$` let a final LF through: an inject header `X-Api-Key\\n` would have split the upstream request's head."""
    base = ('egresslaw 1\nworkspace "acme"\ncatalog "2026.11"\nconnection "c" {{\n  credential = "h"\n  inject = {{"header": {header}}}\n'
            '  egress "r" {{\n    host = "api.example.com"\n    methods = ["GET"]\n    headers = [{listed}]\n  }}\n}}\n')
    ok = compile_text(base.format(header='"X-Api-Key"', listed='"Accept"'))
    assert ok.ok, [d.message for d in ok.diagnostics]
    for header, listed, code in (('"X-Api-Key\\n"', '"Accept"', "EL0028"), ('"X-Api-Key"', '"Accept\\n"', "EL0034")):
        result = compile_text(base.format(header=header, listed=listed))
        assert [d.code for d in result.diagnostics if d.severity == "error"] == [code], [d.message for d in result.diagnostics]
