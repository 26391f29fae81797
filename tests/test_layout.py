"""The layout holds: the import contracts, tests that mirror the source, no private names across modules.

Like mitmproxy's `test/filename_matching.py`: every product module has `tests/<its path>/test_<its name>.py`,
or an entry in EXCEPTIONS saying where it is tested instead. A new module without either fails here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("catalog", "compiler", "proofs", "egress_proxy", "egresslaw")

# module (path from the root) -> where its tests are, when not at the mirrored path
EXCEPTIONS = {
    "catalog/model.py": "tests/catalog/test_catalog.py",
    "catalog/errors.py": "tests/test_layout.py (every error derives from its package's root)",
    "compiler/errors.py": "tests/test_layout.py",
    "proofs/errors.py": "tests/test_layout.py",
    "egress_proxy/errors.py": "tests/test_layout.py",
    "compiler/artifact.py": "tests/compiler/test_golden.py (every golden artifact), tests/egresslaw/test_compiler_cli.py",
    "compiler/cma.py": "tests/egresslaw/test_import_cma.py",
    "compiler/codes.py": "tests/compiler/test_golden.py (one broken fixture per code), tests/egresslaw/test_messages.py",
    "compiler/compile.py": "tests/compiler/test_golden.py, tests/compiler/test_front_end.py",
    "compiler/constants.py": "tests/egress_proxy/decision/test_adapter.py (the header denylist), tests/compiler/test_golden.py",
    "compiler/diagnostics.py": "tests/egresslaw/test_messages.py, tests/egresslaw/test_sarif.py",
    "compiler/parser.py": "tests/compiler/test_front_end.py",
    "compiler/passes.py": "tests/compiler/test_golden.py, tests/compiler/test_brokers.py",
    "compiler/sarif.py": "tests/egresslaw/test_sarif.py",
    "compiler/secrets_scan.py": "tests/compiler/test_front_end.py",
    "compiler/syntax.py": "tests/compiler/test_front_end.py",
    "egress_proxy/edge/layers.py": "tests/conformance/test_responses.py, tests/conformance/test_limits.py, tests/conformance/test_bounds.py (real listeners)",
    "egress_proxy/edge/events.py": "tests/egress_proxy/edge/test_addon.py, tests/conformance/test_audit_faults.py",
    "egress_proxy/run/server.py": "tests/egress_proxy/test_proxy_e2e.py (the embedded Edge, end to end)",
    "proofs/decode.py": "tests/proofs/test_replay_cli.py, tests/proofs/test_refutations.py",
    "proofs/diff.py": "tests/egresslaw/test_compiler_cli.py (egresslaw diff), tests/proofs/test_refutations.py",
    "proofs/inputs.py": "tests/proofs/test_differential.py",
    "proofs/model.py": "tests/proofs/test_differential.py",
    "proofs/properties.py": "tests/proofs/test_refutations.py, tests/proofs/test_mutants.py",
    "proofs/signing.py": "tests/proofs/test_gate.py",
    "proofs/statements.py": "tests/proofs/test_docs.py",
    "proofs/spec/addresses.py": "tests/proofs/test_spec.py",
    "proofs/spec/requests.py": "tests/proofs/test_spec.py",
    "proofs/spec/switches.py": "tests/proofs/test_refutations.py (worker-switches proved, and refuted on a hole), tests/proofs/test_mutants.py",
    "egresslaw/cli.py": "tests/egresslaw/ (every command through main())",
    "egresslaw/common.py": "tests/egresslaw/test_cli_bad_input.py",
    "egresslaw/logs.py": "tests/egresslaw/test_proxy_ops.py",
    "egresslaw/render.py": "tests/egresslaw/test_sarif.py",
    "egresslaw/proxy_worker.py": "tests/egress_proxy/run/test_supervisor.py (the fleet's worker processes)",
    "egresslaw/__main__.py": "tests/egresslaw/test_cli_bad_input.py (python -m egresslaw)",
    # the credential kinds: through the broker that is their only caller, then end to end against independent stand-ins
    "egress_proxy/credentials/base.py": "tests/egress_proxy/credentials/test_broker.py (records, needles)",
    "egress_proxy/credentials/static.py": "tests/egress_proxy/credentials/test_broker.py, tests/egress_proxy/edge/test_addon.py",
    "egress_proxy/credentials/oauth2.py": "tests/egress_proxy/credentials/test_broker.py, tests/credentials/test_minted.py",
    "egress_proxy/credentials/github_app.py": "tests/egress_proxy/credentials/test_broker.py, tests/credentials/test_minted.py",
    "egress_proxy/credentials/aws_sigv4.py": "tests/egress_proxy/credentials/test_broker.py, tests/credentials/test_minted.py",
    # the Envoy lane's parts: through the real Envoy binary, end to end (their only caller is the runner)
    "egress_proxy/lane/dnsfront.py": "tests/egress_proxy/run/test_lane.py (private and rebound answers)",
    "egress_proxy/lane/certs.py": "tests/egress_proxy/lane/test_translate.py (the names read back), tests/egress_proxy/run/test_lane.py",
    "egress_proxy/credentials/exchange.py": "tests/credentials/test_minted.py (the edge's calls to real TLS stand-ins)",
}
# the CLI's commands are tested by what they do, one file per job rather than per module
for command in (ROOT / "egresslaw" / "commands").glob("*.py"):
    if command.name != "__init__.py":
        EXCEPTIONS.setdefault(f"egresslaw/commands/{command.name}", "tests/egresslaw/ (by job: compile, explain, custody, proxy ops, ...)")


def product_modules() -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "__init__.py":
                out.append(str(path.relative_to(ROOT)))
    return out


def packages() -> list[str]:
    """Every package under the product roots, discovered: a directory holding an `__init__.py`."""
    return sorted(str(init.parent.relative_to(ROOT)) for root in PACKAGES for init in (ROOT / root).rglob("__init__.py"))


# A map entry is a docstring line opening with `- ` and one or more names in backticks: `- \`core\` — …`,
# `- \`sqlite\`, \`postgres\` — …` (a subpackage may be written `spec/`), or one bare name and a colon: `- core: …`.
MAP_ENTRY = re.compile(r"^- (?:((?:`\w+/?`(?:, | and )?)+)|(\w+):)", re.M)


def module_map(package: Path) -> set[str]:
    """The names the map in a package's `__init__` docstring lists."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    named = set()
    for quoted, bare in MAP_ENTRY.findall(doc):
        named |= {name.rstrip("/") for name in re.findall(r"`(\w+/?)`", quoted)} | ({bare} if bare else set())
    return named


@pytest.mark.parametrize("package", packages())
def test_every_package_opens_with_a_map_of_its_modules(package: str) -> None:
    """docs/layout.md: each `__init__` opens with a map of its modules. Every module and subpackage is on the map,
    and everything on the map exists (a module moved or renamed takes its line with it)."""
    here = ROOT / package
    present = {p.stem for p in here.glob("*.py") if p.name != "__init__.py"}
    present |= {p.name for p in here.iterdir() if (p / "__init__.py").is_file()}
    named = module_map(here)
    assert named, f"{package}/__init__.py has no module map (lines `- \\`module\\` — what it is`)"
    assert not present - named, f"{package}/__init__.py: not on its map: {sorted(present - named)}"
    assert not named - present, f"{package}/__init__.py: on its map but not in the package: {sorted(named - present)}"


def test_the_module_maps_are_found() -> None:
    """The discovery the test above relies on sees the rooms (a pattern that matched nothing would pass it)."""
    found = set(packages())
    assert {"compiler", "proofs", "proofs/spec", "egress_proxy/decision", "egress_proxy/edge", "egresslaw/commands"} <= found
    assert {"core", "adapter"} <= module_map(ROOT / "egress_proxy" / "decision")


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize("module", product_modules())
def test_every_product_module_has_its_test_file(module: str) -> None:
    mirrored = ROOT / "tests" / Path(module).parent / f"test_{Path(module).name}"
    if module in EXCEPTIONS:
        assert not mirrored.exists(), f"{module} has {mirrored.relative_to(ROOT)}: drop its EXCEPTIONS entry"
        named = EXCEPTIONS[module].split(" ")[0].rstrip(",")
        assert (ROOT / named).exists(), f"{module}: its tests `{named}` do not exist"
    else:
        assert mirrored.exists(), f"{module} has no {mirrored.relative_to(ROOT)} (add it, or an EXCEPTIONS entry saying where it is tested)"


def test_every_exception_names_a_module() -> None:
    assert set(EXCEPTIONS) <= set(product_modules())


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local |= {id(n) for n in ast.walk(node) if isinstance(n, ast.ImportFrom)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            yield node, id(node) in local


def test_no_private_name_is_imported_across_modules() -> None:
    found = [f"{m}:{node.lineno}: from {node.module} import {a.name}"
             for m in product_modules() for node, _ in _imports(ROOT / m)
             for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "a private name crosses a module boundary (make it public, or move the code):\n" + "\n".join(found)


def test_a_function_local_import_says_why() -> None:
    """Outside the CLI's commands (egresslaw/commands/__init__.py says why there), a function-local import of a
    project module is a cycle or an import cost, and the comment above it names which."""
    unexplained = []
    for m in product_modules():
        if m.startswith("egresslaw/commands/"):
            continue
        lines = (ROOT / m).read_text().splitlines()
        for node, local in _imports(ROOT / m):
            above = lines[max(0, node.lineno - 3): node.lineno - 1]
            if local and not any("Imported here" in line for line in above):
                unexplained.append(f"{m}:{node.lineno}: from {node.module} import …")
    assert not unexplained, "\n".join(unexplained)


def test_the_proxy_process_loads_neither_z3_nor_lark() -> None:
    """What `egresslaw proxy` (and each `--workers` process) imports, measured in a fresh interpreter."""
    code = ("import sys, egresslaw.cli, egresslaw.commands.proxy, egresslaw.proxy_worker, egress_proxy.run.server, "
            "egress_proxy.run.supervisor, egress_proxy.custody.stores\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'z3', 'lark'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


ROOTS = {
    "catalog": "catalog.errors.Problem",
    "compiler": "compiler.errors.CompilerError",
    "proofs": "proofs.errors.ProofError",
    "egress_proxy": "egress_proxy.errors.EgressError",
    "egresslaw": "egresslaw.common.CliError",
}


def test_every_error_derives_from_its_package_root_and_carries_message_and_help() -> None:
    """One root per package, all of them `catalog.errors.Problem` (message, help): no second error tree."""
    import importlib

    from catalog.errors import Problem

    strays = []
    for module in product_modules():
        name = module[:-3].replace("/", ".")
        if name.endswith("__main__"):
            continue  # importing it runs the CLI
        mod = importlib.import_module(name)
        package = name.split(".")[0]
        root_module, _, root_name = ROOTS[package].rpartition(".")
        root = getattr(importlib.import_module(root_module), root_name)
        for value in vars(mod).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name:
                if not issubclass(value, root if package != "catalog" else Problem):
                    strays.append(f"{name}.{value.__name__} does not derive from {ROOTS[package]}")
    assert not strays, "\n".join(strays)
    for root in ROOTS.values():
        module, _, cls = root.rpartition(".")
        err = getattr(importlib.import_module(module), cls)("a `thing` is wrong", "do this instead")
        assert isinstance(err, Problem) and (err.message, err.help) == ("a `thing` is wrong", "do this instead")
