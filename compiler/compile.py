"""The compiler driver: paths -> sources -> syntax trees -> passes -> artifact (+ lock versions)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from compiler.artifact import (
    Artifact,
    CatalogRef,
    SourceMap,
    canonical_json,
    sha256_hex,
)
from compiler.diagnostics import Diagnostic, error, has_errors, sorted_diagnostics
from compiler.parser import parse_source
from compiler.passes import Policy, run_passes
from compiler.syntax import NO_SPAN, SourceFile, Span, plain

SUFFIX = ".egress"


@dataclass
class CompileResult:
    artifact: Artifact | None
    diagnostics: list[Diagnostic]
    sources: dict[str, str] = field(default_factory=dict)  # display path -> text, for rendering
    files: tuple[SourceFile, ...] = ()

    @property
    def ok(self) -> bool:
        return self.artifact is not None and not has_errors(self.diagnostics)


def policy_files(path: str | Path) -> tuple[list[Path], list[Diagnostic]]:
    """The `.egress` files of a policy path (a directory, recursively, in name order; or one file)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob(f"*{SUFFIX}") if f.is_file())
        if not files:
            return [], [error("EL0035", f"`{path}` contains no `{SUFFIX}` files", Span(str(path), 0, 0, 0, 0))]
        return files, []
    if p.is_file():
        return [p], []
    if p.exists():
        return [], [error("EL0035", f"`{path}` is not a regular file or directory", Span(str(path), 0, 0, 0, 0), "pass a policy file or directory")]
    return [], [error("EL0035", f"`{path}` does not exist", Span(str(path), 0, 0, 0, 0), "pass a policy file or directory")]


# `workspace "…"` outside strings and comments: enough to tell which directories hold a policy
# without parsing (a miss only makes a file its own policy, which then reports its real errors).
_WORKSPACE_DECL = re.compile(r'^(?:[^#"\n]|"(?:[^"\\\n]|\\.)*")*?\bworkspace\s*"', re.M)
_REPO_MARKERS = (".git", ".hg", ".jj")


@dataclass(frozen=True)
class PolicyRoot:
    """One policy: a directory (its `.egress` files compiled as one) or a single file."""

    path: Path
    files: tuple[Path, ...]

    @property
    def is_dir(self) -> bool:
        return self.path.is_dir()


def _workspaces_in(directory: Path, cache: dict[Path, int]) -> int:
    """How many `.egress` files directly in `directory` declare a workspace (counting stops at 2)."""
    if directory not in cache:
        count = 0
        for f in sorted(directory.glob(f"*{SUFFIX}")):
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            count += bool(_WORKSPACE_DECL.search(text))
            if count >= 2:
                break
        cache[directory] = count
    return cache[directory]


def _walk_bound(file: Path) -> Path:
    """How far up a file given on its own may look for its policy: the repository root, else its own directory.
    (A relative path stops at the working directory anyway: `Path("x").parent` is `.`.)"""
    if not file.is_absolute():
        return Path(".")
    for d in file.parents:
        if any((d / m).exists() for m in _REPO_MARKERS):
            return d
    return file.parent


def policy_root(file: Path, bound: Path, cache: dict[Path, int] | None = None) -> Path:
    """The policy `file` belongs to.

    The nearest directory, from the file's own up to `bound`, whose files declare exactly one
    `workspace` is a directory policy and the file is part of it. A file whose own directory
    declares several workspaces (a directory of single-file policies, like `policies/examples/`)
    is a policy by itself. A file with no workspace anywhere up to `bound` belongs to its own
    directory (which then reports the missing `workspace`).
    """
    cache = {} if cache is None else cache
    here = file.parent
    found = _workspaces_in(here, cache)
    if found == 1:
        return here
    if found >= 2:
        return file
    d = here
    while d != bound and d.parent != d:
        d = d.parent
        found = _workspaces_in(d, cache)
        if found == 1:
            return d
        if found >= 2:
            break
    return here


def find_policies(paths: list[str | Path]) -> tuple[list[PolicyRoot], list[Diagnostic]]:
    """The policies the given paths belong to, each once, in order of first mention.

    A directory contributes every policy under it (one, for a policy directory); a file contributes the
    policy it belongs to (`policy_root`). The files of a directory policy are the files under it that
    belong to it, so a policy nested inside another directory is never compiled twice.
    """
    cache: dict[Path, int] = {}
    roots: dict[Path, None] = {}  # ordered set
    diags: list[Diagnostic] = []
    for arg in paths:
        p = Path(arg)
        if p.is_dir():
            files, problems = policy_files(p)
            diags += problems
            for f in files:
                roots.setdefault(policy_root(f, p, cache))
        elif p.is_file():
            roots.setdefault(policy_root(p, _walk_bound(p), cache))
        else:
            diags += policy_files(p)[1]
    out = []
    for root in roots:
        if root.is_dir():
            files = [f for f in policy_files(root)[0] if policy_root(f, root, cache) == root]
        else:
            files = [root]
        out.append(PolicyRoot(root, tuple(files)))
    return out, diags


def read_files(files: list[Path] | tuple[Path, ...]) -> tuple[dict[str, str], list[Diagnostic]]:
    """Display path -> text for the given policy files; unreadable files become diagnostics."""
    sources: dict[str, str] = {}
    diags: list[Diagnostic] = []
    for f in files:
        try:
            sources[str(f)] = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            diags.append(error("EL0035", f"`{f}` is not UTF-8 text", Span(str(f), 0, 0, 0, 0), "save the file as UTF-8"))
        except OSError as exc:
            diags.append(error("EL0035", f"cannot read `{f}`: {exc.strerror}", Span(str(f), 0, 0, 0, 0)))
    return sources, diags


def read_sources(paths: list[str | Path]) -> tuple[dict[str, str], list[Diagnostic]]:
    """Display path -> text for every policy file under `paths`; unreadable files become diagnostics."""
    sources: dict[str, str] = {}
    diags: list[Diagnostic] = []
    for path in paths:
        files, problems = policy_files(path)
        more, unreadable = read_files(files)
        sources.update(more)
        diags += problems + unreadable
    return sources, diags


def parse_sources(sources: dict[str, str], progress=None) -> tuple[tuple[SourceFile, ...], list[Diagnostic]]:
    files = []
    diags: list[Diagnostic] = []
    for i, (path, text) in enumerate(sources.items(), start=1):
        tree, problems = parse_source(text, path)
        diags += problems
        if tree is not None:
            files.append(tree)
        if progress is not None:
            progress.update(i, len(sources), "files parsed")
    return tuple(files), diags


def check(paths: list[str | Path]) -> list[tuple[PolicyRoot | None, CompileResult]]:
    """Parse and admit without building anything (the fast pre-commit path): each policy the paths
    belong to separately (`find_policies`), so one file is checked with the rest of its policy and
    several policy roots never merge. Path problems come back as one result without a root."""
    roots, problems = find_policies(paths)
    results: list[tuple[PolicyRoot | None, CompileResult]] = []
    if problems:
        results.append((None, CompileResult(None, sorted_diagnostics(problems))))
    for root in roots:
        results.append((root, compile_sources(*read_files(root.files))))
    return results


def compile_paths(paths: list[str | Path]) -> CompileResult:
    """Compile a policy (one or more files or directories compiled as one)."""
    return compile_sources(*read_sources(paths))


def compile_text(text: str, path: str = "policy.egress") -> CompileResult:
    """Compile a single in-memory file (tests, tools)."""
    return compile_sources({path: text}, [])


def compile_sources(sources: dict[str, str], diags: list[Diagnostic], progress=None) -> CompileResult:
    """Parse and admit `sources` as one policy. `progress` (optional, see egresslaw.common.Progress) hears
    `stage(text)` at each phase and `update(done, total, what)` as files are parsed."""
    if progress is not None:
        lines = sum(text.count("\n") + 1 for text in sources.values())
        progress.stage(f"parsing {len(sources)} file(s) ({lines:,} lines)")
    files, parse_diags = parse_sources(sources, progress)
    diags = diags + parse_diags
    if not files:
        if not diags:
            diags.append(error("EL0035", "no policy files given", NO_SPAN))
        return CompileResult(None, sorted_diagnostics(diags), sources, files)
    if progress is not None:
        progress.stage(f"admitting {sum(len(f.decls) for f in files):,} declarations")
    policy = run_passes(Policy(files))
    diags += policy.diagnostics
    if has_errors(diags):
        return CompileResult(None, sorted_diagnostics(diags), sources, files)
    if progress is not None:
        progress.stage("building the artifact")
    return CompileResult(build_artifact(policy), sorted_diagnostics(diags), sources, files)


def source_digest(files: tuple[SourceFile, ...]) -> str:
    """sha256 over the declarations' values, independent of formatting, comments, file split and order."""
    decls = []
    for f in files:
        for d in f.decls:
            body = _plain_block(d.body) if d.body is not None else None
            decls.append({"kind": d.kind, "name": d.name, "body": body})
    decls.sort(key=lambda d: (d["kind"], d["name"]))
    return sha256_hex(canonical_json(decls))


def _plain_block(obj) -> dict:
    out = {p.key: plain(p.value) for p in obj.pairs}
    if obj.blocks:
        # rule order is semantic (first match wins), so blocks keep source order
        out["__blocks__"] = [{"kind": b.kind, "name": b.name, "body": _plain_block(b.body) if b.body else None} for b in obj.blocks]
    return out


def build_artifact(policy: Policy) -> Artifact:
    """The sealed artifact of an admitted policy (every version 1 until the lock says otherwise)."""
    # INVARIANT: called only when the passes reported no error, so every reference resolves.
    catalog = policy.catalog
    artifact = Artifact(
        workspace=policy.workspace,
        catalog=CatalogRef(
            version=catalog.version, digest=catalog.digest, special_purpose_date=catalog.special_purpose.registry_date
        ),
        source_digest=source_digest(policy.files),
        workers=tuple(policy.workers[n] for n in sorted(policy.workers)),
        sandbox_profiles=tuple(policy.profiles[n] for n in sorted(policy.profiles)),
        connections=tuple(policy.connections[n] for n in sorted(policy.connections)),
        locations=source_map(policy.files),
    )
    return artifact.sealed()


_MAP_KIND = {"worker": "worker", "connection": "connection", "sandbox_profile": "profile"}


def source_map(files: tuple[SourceFile, ...]) -> SourceMap:
    """Where every declaration, rule and key was written (see `SourceMap`)."""
    paths: dict[str, int] = {}
    spans: dict[str, tuple[str, int, int, int, int, int]] = {}

    def put(key: str, span: Span) -> None:
        if span.line and key not in spans:  # the first declaration wins, as in the passes
            index = paths.setdefault(span.path, len(paths))
            spans[key] = (key, index, span.line, span.column, span.end_line, span.end_column)

    for f in files:
        for d in f.decls:
            if d.kind in ("workspace", "catalog"):
                put(d.kind, d.span)
                continue
            kind = _MAP_KIND.get(d.kind)
            if kind is None:
                continue
            key = f"{kind}:{d.name}"
            put(key, d.name_span)
            if d.body is None:
                continue
            for pair in d.body.pairs:
                put(f"{key}.{pair.key}", pair.key_span)
            for block in d.body.blocks:
                # a rule's own keys sit on the lines below its name; one span per rule keeps large
                # policies' artifacts small (1,000 connections x 32 rules: 32,000 spans, not 190,000)
                put(f"rule:{d.name}/{block.name}", block.name_span)
    return SourceMap(files=tuple(paths), spans=tuple(spans[k] for k in sorted(spans)))
