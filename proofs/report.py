"""The proof report (`build/proof.json`): one list of results, three renderings (text, JSON, SARIF 2.1.0).

This module imports neither z3 nor the decision function, so the proxy can load a report at
start-up cheaply (`proofs.gate.check_report` decides whether it may start with it).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from compiler import sarif
from compiler.artifact import SourceMap
from proofs.errors import ProofError
from proofs.statements import PROPERTIES

REPORT_FORMAT = "egresslaw.proof/2"
Verdict = Literal["proved", "refuted", "unknown"]
VERDICTS: tuple[str, ...] = ("proved", "refuted", "unknown")

# The checks capacity adds (docs/budget.md, "The gate"): counted, not solved, so they are not among PROPERTIES.
CAPACITY_CHECKS: dict[str, str] = {
    "max-bits": "(with `--max-bits N[/WINDOW]`) the subject's capacity, per request or over any interval of WINDOW, is at "
                "most N bits (docs/budget.md); a refutation names the route and field carrying the most bits, with two "
                "admitted requests that differ in it, both replayed through decide()",
    "capacity-within": "(with `--within`) the subject's capacity, per request and over its ceiling subject's window, is at "
                       "most its ceiling subject's",
}

# Exit codes of `egresslaw prove`.
EXIT_PROVED, EXIT_REFUTED, EXIT_UNKNOWN = 0, 1, 4


class ReportError(ProofError):
    """A proof report that cannot be used: not JSON, wrong format, or malformed."""


@dataclass(frozen=True, slots=True)
class Result:
    """One (worker, subject, property) verdict. `counterexample` is the JSON form of a domain counterexample."""

    worker: str
    subject: str  # "worker:<name>" | "connection:<name>" | "profile:<name>"
    property: str
    verdict: Verdict
    time_ms: int
    counterexample: dict[str, Any] | None = None
    detail: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.worker, self.subject, self.property)

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "subject": self.subject,
            "property": self.property,
            "verdict": self.verdict,
            "time_ms": self.time_ms,
            "counterexample": self.counterexample,
            "detail": self.detail,
        }

    def fingerprint(self) -> str:
        """Stable across runs and timings: what was checked, not what was found."""
        return hashlib.sha256(f"{self.worker}\x00{self.subject}\x00{self.property}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Report:
    """Every verdict for one artifact. Results are kept sorted by (worker, subject, property)."""

    artifact_digest: str
    z3_version: str
    catalog_version: str
    special_purpose_date: str
    results: tuple[Result, ...] = ()
    against_digest: str | None = None  # the previous artifact no-widening was checked against
    within_digest: str | None = None  # prove --within: the ceiling artifact `within` was checked against
    within_map: dict[str, str] | None = None  # candidate subject -> the ceiling subject bounding it (same name otherwise)
    tool: str = "egresslaw"
    egresslaw_version: str = ""  # the prover's version and decision core (egress_proxy.decision.provenance)
    core_digest: str = ""
    # proofs.solve.Limits.budget(): rlimit per solver call, its scope, the wall-clock bound and the seed (None: an
    # older report, made before the budget was recorded)
    budget: dict[str, int | str] | None = None
    # proofs.runner.capacity_section: the head limits and clock resolution assumed, and every subject's capacity (None:
    # an older report, or a count that raised)
    capacity: dict[str, Any] | None = None
    signature: dict[str, str] | None = None  # proofs.signing: Ed25519 over everything else

    def __post_init__(self) -> None:
        object.__setattr__(self, "results", tuple(sorted(self.results, key=lambda r: r.key)))

    @property
    def summary(self) -> dict[str, int]:
        counts = Counter(r.verdict for r in self.results)
        return {"total": len(self.results), **{v: counts.get(v, 0) for v in VERDICTS}}

    def exit_code(self) -> int:
        """0 all proved, 1 something refuted, 4 otherwise unknown (refuted wins over unknown)."""
        verdicts = {r.verdict for r in self.results}
        if "refuted" in verdicts:
            return EXIT_REFUTED
        if "unknown" in verdicts or not self.results:
            return EXIT_UNKNOWN
        return EXIT_PROVED

    # -- renderings ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "tool": self.tool,
            "egresslaw_version": self.egresslaw_version,
            "core_digest": self.core_digest,
            "artifact_digest": self.artifact_digest,
            "against_digest": self.against_digest,
            # only when given: a report made without a ceiling keeps the exact shape (and signature) it always had
            **({"within_digest": self.within_digest} if self.within_digest is not None else {}),
            **({"within_map": self.within_map} if self.within_map else {}),
            "z3_version": self.z3_version,
            **({"budget": self.budget} if self.budget is not None else {}),
            "catalog": {"version": self.catalog_version, "special_purpose_date": self.special_purpose_date},
            "results": [r.to_dict() for r in self.results],
            **({"capacity": self.capacity} if self.capacity is not None else {}),
            "summary": self.summary,
            **({"signature": self.signature} if self.signature is not None else {}),
        }

    def to_json(self) -> str:
        """The JSON text of `build/proof.json`: sorted keys, indented, deterministic apart from `time_ms`."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2, ensure_ascii=True) + "\n"

    def render_text(self, verbose: bool = False) -> str:
        """Human-readable: one line per non-proved result with its counterexample, then a summary."""
        lines: list[str] = []
        for r in self.results:
            if r.verdict == "proved" and not verbose:
                continue
            head = f"{r.verdict:<8} {r.property:<17} {r.subject} (worker `{r.worker}`)"
            lines.append(head + (f"  [{r.time_ms} ms]" if verbose else ""))
            if r.counterexample:
                summary = r.counterexample.get("summary")
                if summary:
                    lines.append(f"         counterexample: {summary}")
                req = r.counterexample.get("request")
                if req and req.get("line"):
                    lines.append(f"         request: {req['line']}")
            if r.detail:
                lines += [f"         {line}" for line in r.detail.splitlines()]
        lines += capacity_lines(self.capacity)
        s = self.summary
        lines.append(
            f"{s['total']} checks: {s['proved']} proved, {s['refuted']} refuted, {s['unknown']} unknown"
            f" (artifact {self.artifact_digest[:12]}, egresslaw {self.egresslaw_version} core {self.core_digest[:12]},"
            f" z3 {self.z3_version}, catalog {self.catalog_version} table {self.special_purpose_date}"
            + (f"; {budget_text(self.budget)})" if self.budget is not None else ")")
        )
        return "\n".join(lines) + "\n"

    def locate(self, r: Result, locations: SourceMap | None):
        """Where a result points in the policy: its rule, setting, subject or worker (see compiler.sarif.locate)."""
        cex = r.counterexample or {}
        setting = cex.get("setting")
        keys = {"credential-scope": ("path_prefix", "host"), "header-safety": ("headers",), "trust-lane": ("trust", "network", "networking"),
                "no-redirect": ("follow_redirects", "max_redirects")}.get(r.property, ())
        name = re.match(r"[a-z_]+", setting) if isinstance(setting, str) else None  # "allow_cidrs = [...]" -> allow_cidrs
        # a profile's request brokered to a connection: its rule and the worker that judged it are the connection's
        broker = (cex.get("decision") or {}).get("broker")
        subject = f"connection:{broker}" if broker else r.subject
        worker = (cex.get("extra") or {}).get("worker") or r.worker
        return sarif.locate(locations, subject, worker, cex.get("rule"), name.group(0) if name else None, keys)

    def _message(self, r: Result) -> str:
        message = f"{r.property} {r.verdict} for {r.subject} (worker `{r.worker}`)"
        if r.counterexample and r.counterexample.get("summary"):
            message += f": {r.counterexample['summary']}"
        elif r.detail:
            message += f": {r.detail}"
        return message

    def to_sarif(self, locations: SourceMap | None = None, fallback_uri: str = "build/egresslaw.json") -> str:
        """SARIF 2.1.0: ruleId = property id; refuted is an error, unknown a warning, proved a pass. Every
        result is placed on the `.egress` line of its rule, setting, subject or worker (`locations`, the
        artifact's source map), or on the artifact file when the artifact carries none."""
        described = {**PROPERTIES, **{k: v for k, v in CAPACITY_CHECKS.items() if any(r.property == k for r in self.results)}}
        rules = [sarif.rule(pid, text) for pid, text in described.items()]
        index = {pid: i for i, pid in enumerate(described)}
        results = []
        for r in self.results:
            level, kind = {"proved": ("none", "pass"), "refuted": ("error", "fail"), "unknown": ("warning", "open")}[
                r.verdict
            ]
            span = self.locate(r, locations)
            entry: dict[str, Any] = {
                "ruleId": r.property,
                "kind": kind,
                "level": level,
                "message": {"text": self._message(r)},
                "partialFingerprints": {"egresslaw/check/v1": r.fingerprint()},
                "locations": [sarif.physical_location(span.path if span else fallback_uri, span, f"{r.worker}/{r.subject}")],
                "properties": {"worker": r.worker, "subject": r.subject, "counterexample": r.counterexample},
            }
            if r.property in index:
                entry["ruleIndex"] = index[r.property]
            results.append(entry)
        properties = {
            "artifact_digest": self.artifact_digest,
            "egresslaw_version": self.egresslaw_version,
            "core_digest": self.core_digest,
            "z3_version": self.z3_version,
            **({"budget": self.budget} if self.budget is not None else {}),
            "catalog": {"version": self.catalog_version, "special_purpose_date": self.special_purpose_date},
        }
        return sarif.document({"name": "egresslaw-prove", "rules": rules}, results, properties)

    def render_github(self, locations: SourceMap | None = None, fallback_uri: str = "build/egresslaw.json") -> str:
        """GitHub workflow annotations: an error per refuted result, a warning per unknown one."""
        lines = []
        for r in self.results:
            level = {"refuted": "error", "unknown": "warning"}.get(r.verdict)
            if level is None:
                continue
            span = self.locate(r, locations)
            line = sarif.github_annotation(level, self._message(r), f"{r.property} {r.verdict}", span.path if span else fallback_uri, span)
            if line:
                lines.append(line)
        return "\n".join(lines) + ("\n" if lines else "")

    def render(self, fmt: str, locations: SourceMap | None = None, fallback_uri: str = "build/egresslaw.json") -> str:
        if fmt == "json":
            return self.to_json()
        if fmt == "sarif":
            return self.to_sarif(locations, fallback_uri)
        if fmt == "github":
            return self.render_github(locations, fallback_uri)
        return self.render_text()


def load_report(text: str | bytes) -> Report:
    """Parse a `build/proof.json`; raises ReportError on anything but a well-formed report of this format."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"proof report is not JSON: {exc.__class__.__name__}") from None
    if not isinstance(raw, dict) or raw.get("format") != REPORT_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ReportError(f"proof report format is `{found}`, expected `{REPORT_FORMAT}`")
    try:
        catalog = raw["catalog"]
        results = tuple(_result(item) for item in raw["results"])
        report = Report(
            artifact_digest=_str(raw["artifact_digest"]),
            z3_version=_str(raw["z3_version"]),
            catalog_version=_str(catalog["version"]),
            special_purpose_date=_str(catalog["special_purpose_date"]),
            results=results,
            against_digest=raw.get("against_digest"),
            within_digest=_optional_str(raw.get("within_digest")),
            within_map=_string_map(raw.get("within_map")),
            egresslaw_version=_str(raw["egresslaw_version"]),
            core_digest=_str(raw["core_digest"]),
            budget=_budget(raw.get("budget")),
            capacity=_capacity(raw.get("capacity")),
            signature=_signature(raw.get("signature")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ReportError(f"proof report is malformed: {exc.__class__.__name__} {exc}") from None
    return report


def budget_text(budget: dict[str, int | str]) -> str:
    """`budget rlimit 50,000,000 per solver call, wall clock 600 s, seed 0`."""
    rlimit = budget.get("rlimit")
    steps = f"rlimit {rlimit:,} per {budget.get('rlimit_scope', 'solver call')}" if isinstance(rlimit, int) and rlimit else "no rlimit"
    wall = budget.get("wall_clock_ms")
    clock = f"wall clock {wall / 1000:g} s" if isinstance(wall, int) else "wall clock ?"
    return f"budget {steps}, {clock}, seed {budget.get('seed', '?')}"


def capacity_lines(section: dict[str, Any] | None) -> list[str]:
    """The `Capacity` block of the text report: one line per subject (`proofs.capacity.Capacity.text`)."""
    if not section:
        return []
    limits = section.get("limits") or {}
    clock = section.get("clock_resolution")
    assumed = ", ".join(f"{k} {v:,}" for k, v in limits.items() if isinstance(v, int))
    head = "Capacity (bits an admitted request can carry" + (f"; head limits {assumed}" if assumed else "") + (
        f"; clock resolution {clock * 1000:g} ms" if isinstance(clock, (int, float)) else "") + ")"
    return [head] + [f"  {s.get('text') or s.get('kind', '?') + ' ' + s.get('name', '?')}" for s in section.get("subjects", [])]


def _capacity(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("subjects"), list) or not all(
        isinstance(s, dict) for s in value["subjects"]
    ):
        raise TypeError("capacity must be an object with a list of subjects")
    return dict(value)


def _budget(value: object) -> dict[str, int | str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, str)) and not isinstance(v, bool) for k, v in value.items()
    ):
        raise TypeError("budget must be an object of integers and strings")
    return dict(value)


def _signature(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError("signature must be an object of strings")
    return dict(value)


def _optional_str(value: object) -> str | None:
    return None if value is None else _str(value)


def _string_map(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError("within_map must be an object of strings")
    return dict(value)


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, found {type(value).__name__}")
    return value


def _result(item: Any) -> Result:
    if not isinstance(item, dict):
        raise TypeError("a result must be an object")
    verdict = item["verdict"]
    if verdict not in VERDICTS:
        raise ValueError(f"unknown verdict `{verdict}`")
    cex = item.get("counterexample")
    if cex is not None and not isinstance(cex, dict):
        raise TypeError("counterexample must be an object or null")
    time_ms = item.get("time_ms", 0)
    if not isinstance(time_ms, int) or isinstance(time_ms, bool):
        raise TypeError("time_ms must be an integer")
    return Result(
        worker=_str(item["worker"]),
        subject=_str(item["subject"]),
        property=_str(item["property"]),
        verdict=verdict,
        time_ms=time_ms,
        counterexample=cex,
        detail=_str(item.get("detail", "")),
    )
