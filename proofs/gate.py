"""The proxy's start gate: the checks an artifact requires, and whether a proof report covers every one.

`required_checks(artifact)` is computed from the artifact alone; the prover plans exactly these
checks (`proofs.runner.plan`), and `check_report` refuses a report unless it carries a valid Ed25519
signature by the trusted key (an unsigned one only with `allow_unsigned`, development; a signed one is
always verified, so a signed report without a trusted key is refused too), its `summary` agrees with its
results, every required check is present and `proved`, nothing in it is refuted or unknown, it is
about this artifact, and it was made by this egresslaw version with this decision code
(`egress_proxy.decision.provenance.core_digest`: every module the proof depends on). No z3 here.
"""

from __future__ import annotations

import json
from pathlib import Path

from compiler.artifact import Artifact
from compiler.constants import DEFAULT_WORKER
from egress_proxy.decision.provenance import (
    DIGEST_SCOPE,
    core_digest,
    egresslaw_version,
)
from proofs.errors import ProofError
from proofs.report import Report, ReportError, load_report
from proofs.signing import SigningError, load_public_key, verify_document
from proofs.statements import (
    BROKER_PROPERTIES,
    BROKERED_SHAPE_PROPERTIES,
    SHAPE_PROPERTIES,
    CONNECTION_PROPERTIES,
    PROFILE_PROPERTIES,
    WORKER_PROPERTIES,
)

Check = tuple[str, str, str]  # (worker, subject, property)
SHOWN = 8  # missing checks named in a refusal


class GateError(ProofError):
    """A proof report the proxy must not start (or reload) with; the message names what is wrong."""


def worker_subject(name: str) -> str:
    return f"worker:{name}"


def subjects_of(artifact: Artifact, worker: str) -> list[tuple[str, str]]:
    """(kind, name) of every connection that uses `worker`, plus every profile when it is the default worker."""
    out = [("connection", c.name) for c in artifact.connections if c.worker == worker]
    if worker == DEFAULT_WORKER:
        out += [("profile", p.name) for p in artifact.sandbox_profiles]
    return sorted(out)


def subject_properties(artifact: Artifact, kind: str, name: str) -> tuple[str, ...]:
    """The properties checked for one subject: a profile that brokers a connection also gets credential-scope."""
    if kind == "connection":
        conn = artifact.connection(name)
        return CONNECTION_PROPERTIES + (SHAPE_PROPERTIES if conn is not None and shaped(conn) else ())
    prof = artifact.profile(name)
    brokered = [artifact.connection(b) for b in prof.brokers] if prof is not None else []
    return (PROFILE_PROPERTIES + (BROKER_PROPERTIES if prof is not None and prof.brokers else ())
            + (BROKERED_SHAPE_PROPERTIES if prof is not None and prof.trust == "trusted" and any(c is not None and shaped(c) for c in brokered) else ()))


def shaped(conn) -> bool:
    """A connection with a rule that has a request shape (docs/shapes.md)."""
    return any(r.template is not None or r.query is not None or r.header_values or r.mcp is not None or r.graphql is not None
               or r.git is not None for r in conn.rules)


def required_checks(artifact: Artifact) -> frozenset[Check]:
    """Every (worker, subject, property) a report must prove before this artifact may be enforced."""
    out: set[Check] = set()
    workers = {w.name for w in artifact.workers}
    for w in workers:
        out.update((w, worker_subject(w), p) for p in WORKER_PROPERTIES)
        for kind, name in subjects_of(artifact, w):
            out.update((w, f"{kind}:{name}", p) for p in subject_properties(artifact, kind, name))
    for c in artifact.connections:
        if c.worker not in workers:  # decide() denies it everything; the prover refutes its vacuity
            out.add((c.worker, f"connection:{c.name}", "vacuity"))
    return frozenset(out)


UNSIGNED_HELP = ("sign it in the deploy pipeline (`egresslaw prove --sign KEYS/proof-signing.key`) and start the proxy with "
                 "`--trust-proofs KEYS/proof-signing.pub`; `--allow-unsigned-proofs` accepts an unsigned report (development only)")


def check_report(text: bytes | str, artifact: Artifact, *, where: str = "proof", trusted_key: str | None = None,
                 allow_unsigned: bool = False, require_within: str | None = None) -> Report:
    """The report, if it lets `artifact` be enforced; GateError naming every reason otherwise. With `require_within`
    (a ceiling artifact's digest, or a prefix of 12+ digits), `within` must be proved for every subject against it."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise GateError(f"{where}: not a JSON proof report") from None
    try:
        report = load_report(text)  # a report that does not parse is refused as such (signed or not)
    except ReportError as exc:
        raise GateError(f"{where}: {exc}") from None
    signed = raw.get("signature") is not None
    if trusted_key is not None:
        try:
            verify_document(raw, load_public_key(trusted_key))
        except SigningError as exc:
            raise GateError(f"{where}: {exc.message} (--trust-proofs `{trusted_key}`)", exc.help) from None
    elif signed:
        key = raw["signature"].get("key_id") if isinstance(raw["signature"], dict) else None
        raise GateError(f"{where} is signed (key `{key}`) but no key is trusted to check the signature",
                        "pass `--trust-proofs` with the public key of the deploy pipeline's signing key")
    elif not allow_unsigned:
        raise GateError(f"{where} is not signed: production start-up requires a report signed by a trusted key",
                        UNSIGNED_HELP)
    if raw.get("summary") != report.summary:
        raise GateError(f"{where}: its summary {json.dumps(raw.get('summary'), sort_keys=True)} disagrees with its "
                        f"results {json.dumps(report.summary, sort_keys=True)}: it was edited",
                        "run `egresslaw prove` again; never edit a proof report")
    if report.artifact_digest != artifact.digest:
        raise GateError(f"{where} is about artifact `{report.artifact_digest[:12]}`, not `{artifact.digest[:12]}`",
                        "run `egresslaw prove` on the artifact you deploy")
    version, digest = egresslaw_version(), core_digest()
    if (report.egresslaw_version, report.core_digest) != (version, digest):
        raise GateError(
            f"{where} was made by egresslaw {report.egresslaw_version or '?'} (decision code "
            f"{(report.core_digest or '?')[:12]}); this is egresslaw {version} (decision code {digest[:12]}: "
            f"{', '.join(DIGEST_SCOPE)})",
            "prove the artifact again with the egresslaw that enforces it")
    problems = []
    verdicts = {r.key: r.verdict for r in report.results}
    if len(verdicts) != len(report.results):  # one check listed twice: a `proved` copy must not hide the other
        seen: set = set()
        twice = sorted({r.key for r in report.results if r.key in seen or seen.add(r.key)})
        w, subj, prop = twice[0]
        raise GateError(f"{where} lists {len(twice)} check{'s' if len(twice) != 1 else ''} more than once "
                        f"(e.g. {prop} for {subj}, worker `{w}`): it was edited", "run `egresslaw prove` again; never edit a proof report")
    required = set(required_checks(artifact))
    if require_within is not None:
        ceiling = report.within_digest or ""
        if not ceiling.startswith(require_within):
            raise GateError(f"{where} " + (f"was checked within ceiling `{ceiling[:12]}`, not `{require_within[:12]}`" if ceiling
                                           else "proves no ceiling, and --require-within asks for one"),
                            "prove it within the required ceiling: `egresslaw prove ARTIFACT --within CEILING --sign KEY`")
        required |= {(w, s, "within") for w, s, p in required if p == "vacuity" and not s.startswith("worker:")}
    missing = sorted(required - verdicts.keys())
    if missing:
        shown = ", ".join(f"{p} for {s} (worker `{w}`)" for w, s, p in missing[:SHOWN])
        more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
        problems.append(f"lacks {len(missing)} required check{'s' if len(missing) != 1 else ''}: {shown}{more}")
    failed = sorted(k for k, v in verdicts.items() if v != "proved")
    if failed:
        shown = ", ".join(f"{p} for {s} ({verdicts[(w, s, p)]})" for w, s, p in failed[:SHOWN])
        more = f" and {len(failed) - SHOWN} more" if len(failed) > SHOWN else ""
        problems.append(f"does not prove {shown}{more}")
    if problems:
        raise GateError(f"{where} " + "; ".join(problems), "run `egresslaw prove` on this artifact and fix what it refutes")
    return report


def read_report(path: str, artifact: Artifact, *, trusted_key: str | None = None, allow_unsigned: bool = False,
                require_within: str | None = None) -> Report:
    """`check_report` on a file; a missing or unreadable file is a GateError too."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        raise GateError(f"proof `{path}` does not exist") from None
    except OSError as exc:
        raise GateError(f"cannot read proof `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    return check_report(text, artifact, where=f"proof `{path}`", trusted_key=trusted_key, allow_unsigned=allow_unsigned,
                        require_within=require_within)
