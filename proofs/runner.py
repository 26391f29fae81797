"""Run every property for every worker and subject of an artifact, in `jobs` processes, into a Report.

Work is split into tasks: one per worker (its own checks) and batches of that worker's subjects.
Each task runs in a worker process (spawned, so nothing of the parent's Z3 state is shared) and
every subject is encoded in a fresh `z3.Context` with fixed seeds and a deterministic budget
(`proofs.solve`), so the verdicts and counterexamples depend neither on `jobs`, on batching nor on
the machine's load. Results are gathered in plan order, whatever order the pool finishes in.

A check that raises is `unknown` (`proofs.contain`): within a property (`proofs.properties`), while
encoding a subject or a worker (here, per subject), and for a whole task whose process failed.

Capacity (`proofs.capacity`, docs/budget.md) is counted here, in the calling process, once per subject: it needs no
solver. The report records every subject's figure; `max_bits` (`prove --max-bits N[/WINDOW]`) adds a `max-bits` check
per subject and a ceiling a `capacity-within` one, each refutation carrying two admitted requests replayed through
`decide()` (`proofs.capacity.witness`).
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import z3

from catalog import load_catalog
from compiler.artifact import Artifact, load_artifact
from compiler.budget import describe_window
from compiler.constants import DEFAULT_WORKER
from egress_proxy.decision.adapter import decide as real_decide
from egress_proxy.decision.provenance import core_digest, egresslaw_version
from proofs.capacity import (
    CLOCK_RESOLUTION,
    Capacity,
    CapacityError,
    HeadLimits,
    capacities,
    format_bits,
    witness,
)
from proofs.contain import crashed
from proofs.gate import shaped, subject_properties, subjects_of, worker_subject
from proofs.model import Ceiling, declared
from proofs.properties import SEPARATE, Ctx, shape_checks, subject_checks, worker_checks
from proofs.report import Report, Result
from proofs.solve import Limits
from proofs.statements import WORKER_PROPERTIES

Task = tuple[str, str, tuple[tuple[str, str], ...]]  # (worker, "worker"|"subjects"|"shapes", subjects)
BATCH = 25


def plan(artifact: Artifact, jobs: int) -> list[Task]:
    """The tasks: worker checks first, then each worker's subjects in batches small enough to balance `jobs`."""
    tasks: list[Task] = []
    for w in sorted(artifact.workers, key=lambda w: w.name):
        tasks.append((w.name, "worker", ()))
        subs = subjects_of(artifact, w.name)
        # batches even with one job: progress then moves every batch, not once per worker
        size = max(1, min(BATCH, -(-len(subs) // max(1, jobs * 4))))
        for i in range(0, len(subs), size):
            tasks.append((w.name, "subjects", tuple(subs[i : i + size])))
        # a shaped connection's shape-confined: a task of its own, beside its other checks
        tasks += [(w.name, "shapes", ((kind, name),)) for kind, name in subs
                  if kind == "connection" and (conn := artifact.connection(name)) is not None and shaped(conn)]
    return tasks


def run_task(artifact: Artifact, old: Artifact | None, task: Task, limits: Limits, decide: Callable | None = None,
             ceiling: Ceiling | None = None) -> list[Result]:
    """The task's results; whatever raises while encoding a worker or a subject makes its checks `unknown`."""
    if decide is None:
        decide = real_decide
    table = load_catalog(artifact.catalog.version).special_purpose
    c = Ctx(artifact, old, table, limits, decide, ceiling)
    worker = artifact.worker(task[0])
    assert worker is not None
    if task[1] == "worker":
        try:
            return worker_checks(c, worker)
        except Exception as exc:  # a crash is this worker's `unknown`, never the prover's
            return [crashed(worker.name, worker_subject(worker.name), p, exc) for p in WORKER_PROPERTIES]
    out: list[Result] = []
    if task[1] == "shapes":
        for kind, name in task[2]:
            out += shape_checks(c, worker, kind, name)
        return out
    for kind, name in task[2]:
        try:
            out += subject_checks(c, worker, kind, name)
        except Exception as exc:  # a crash is this subject's `unknown`, never the prover's
            out += [crashed(worker.name, f"{kind}:{name}", p, exc) for p in planned(artifact, old, ceiling, kind, name)]
    return out


def planned(artifact: Artifact, old: Artifact | None, ceiling: Ceiling | None, kind: str, name: str) -> list[str]:
    """The properties checked for one subject (as `proofs.properties.subject_checks` lists them)."""
    props = [p for p in subject_properties(artifact, kind, name) if p not in SEPARATE]
    if old is not None and declared(old, kind, name) is not None:
        props.append("no-widening")
    if ceiling is not None:
        props.append("within")
    return props


def task_crashed(artifact: Artifact, old: Artifact | None, ceiling: Ceiling | None, task: Task, exc: BaseException) -> list[Result]:
    """Every check of a task whose process failed (it died, or its results could not come back), as `unknown`."""
    if task[1] == "worker":
        return [crashed(task[0], worker_subject(task[0]), p, exc) for p in WORKER_PROPERTIES]
    if task[1] == "shapes":
        return [crashed(task[0], f"{kind}:{name}", p, exc) for kind, name in task[2] for p in SEPARATE]
    return [crashed(task[0], f"{kind}:{name}", p, exc) for kind, name in task[2] for p in planned(artifact, old, ceiling, kind, name)]


def orphans(artifact: Artifact) -> list[Result]:
    """Connections naming a worker the artifact lacks: decide() denies them all (`worker-unknown`), so any proof is vacuous."""
    names = {w.name for w in artifact.workers}
    return [
        Result(c.worker, f"connection:{c.name}", "vacuity", "refuted", 0,
               {"summary": f"connection `{c.name}` names worker `{c.worker}`, which the artifact does not contain",
                "setting": f"worker = {c.worker}"},
               "every request is denied worker-unknown")
        for c in artifact.connections if c.worker not in names
    ]


# -- process pool ---------------------------------------------------------------------------------

_STATE: dict[str, object] = {}


def _init(artifact_text: str, old_text: str | None, limits: Limits, ceiling: tuple[str, tuple] | None = None) -> None:
    z3.set_param("smt.random_seed", 0)
    _STATE["artifact"] = load_artifact(artifact_text)
    _STATE["old"] = load_artifact(old_text) if old_text is not None else None
    _STATE["limits"] = limits
    _STATE["ceiling"] = Ceiling(load_artifact(ceiling[0]), ceiling[1]) if ceiling is not None else None


def _run(task: Task) -> list[Result]:
    artifact, old, ceiling = _STATE["artifact"], _STATE["old"], _STATE["ceiling"]
    try:
        return run_task(artifact, old, task, _STATE["limits"], None, ceiling)  # type: ignore[arg-type]
    except Exception as exc:  # raised here, the innermost frame is still this process's own
        return task_crashed(artifact, old, ceiling, task, exc)  # type: ignore[arg-type]


def prove(
    artifact: Artifact,
    old: Artifact | None = None,
    *,
    jobs: int = 1,
    limits: Limits = Limits(),
    decide: Callable | None = None,
    progress: Callable[[int, int], None] | None = None,
    ceiling: Ceiling | None = None,
    max_bits: MaxBits | None = None,
    head_limits: HeadLimits = HeadLimits(),
) -> Report:
    """Prove every property (and `within` a ceiling, when one is given); `jobs` > 1 uses that many spawned processes.
    Every subject's capacity is counted (under `head_limits`) and checked against `max_bits` and the ceiling's.
    `decide` (tests only) replaces the replay target of the solver's counterexamples."""
    table = load_catalog(artifact.catalog.version).special_purpose  # a CatalogError stops the run here (exit 2)
    tasks = plan(artifact, jobs)
    total = len(tasks)
    done: list[list[Result]] = [[] for _ in tasks]  # in plan order, whatever order the tasks finish in
    if jobs <= 1 or total <= 1:
        for i, task in enumerate(tasks):
            try:
                done[i] = run_task(artifact, old, task, limits, decide, ceiling)
            except Exception as exc:  # outside every check (the task's set-up): still each check's `unknown`
                done[i] = task_crashed(artifact, old, ceiling, task, exc)
            if progress:
                progress(i + 1, total)
    else:
        mp = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(
            max_workers=jobs, mp_context=mp, initializer=_init,
            initargs=(artifact.to_json(), old.to_json() if old is not None else None, limits,
                      (ceiling.artifact.to_json(), ceiling.mapping) if ceiling is not None else None),
        ) as pool:
            futures = {pool.submit(_run, t): i for i, t in enumerate(tasks)}
            for n, fut in enumerate(cf.as_completed(futures)):
                i = futures[fut]
                try:
                    done[i] = fut.result()
                except Exception as exc:  # the process died (BrokenProcessPool) or the results did not come back
                    done[i] = task_crashed(artifact, old, ceiling, tasks[i], exc)
                if progress:
                    progress(n + 1, total)
    section, capacity_results = capacity_checks(artifact, max_bits, ceiling, head_limits)
    results = [r for task_results in done for r in task_results] + orphans(artifact) + capacity_results
    return Report(
        artifact_digest=artifact.digest,
        z3_version=z3.get_version_string(),
        catalog_version=artifact.catalog.version,
        special_purpose_date=table.registry_date,
        results=tuple(results),
        against_digest=old.digest if old is not None else None,
        within_digest=ceiling.artifact.digest if ceiling is not None else None,
        within_map=dict(ceiling.mapping) if ceiling is not None and ceiling.mapping else None,
        egresslaw_version=egresslaw_version(),
        core_digest=core_digest(),
        budget=limits.budget(),
        capacity=section,
    )


# -- capacity -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MaxBits:
    """`prove --max-bits N[/WINDOW]`: at most `bits` per request, or over any interval of `seconds` when given."""

    bits: float
    seconds: int | None = None

    def text(self) -> str:
        return f"{self.bits:g} bits " + ("per request" if self.seconds is None else f"over any {describe_window(self.seconds)}")


def subject_worker(artifact: Artifact, kind: str, name: str) -> str:
    """The worker whose checks list a subject (`proofs.gate.subjects_of`): a connection's own, the default for a profile."""
    conn = artifact.connection(name) if kind == "connection" else None
    return conn.worker if conn is not None else DEFAULT_WORKER


def capacity_section(caps: tuple[Capacity, ...], head_limits: HeadLimits) -> dict[str, Any]:
    """The report's `capacity`: the assumed limits and clock resolution, and every subject's figure with its line."""
    return {
        "limits": {"max_head_bytes": head_limits.max_head_bytes, "max_request_line": head_limits.max_request_line,
                   "max_headers": head_limits.max_headers},
        "clock_resolution": CLOCK_RESOLUTION,
        "subjects": [{**cap.to_dict(), "text": cap.text()} for cap in caps],
    }


def capacity_checks(artifact: Artifact, max_bits: MaxBits | None, ceiling: Ceiling | None,
                    head_limits: HeadLimits = HeadLimits()) -> tuple[dict[str, Any] | None, list[Result]]:
    """The report's capacity section, and a `max-bits` (with `max_bits`) and a `capacity-within` (with a ceiling)
    result per subject. A count that raises leaves the section out and makes those checks `unknown`."""
    wanted = (("max-bits",) if max_bits is not None else ()) + (("capacity-within",) if ceiling is not None else ())
    try:
        caps = capacities(artifact, head_limits)
        ceiling_caps = {(c.kind, c.name): c for c in capacities(ceiling.artifact, head_limits)} if ceiling is not None else {}
    except Exception as exc:  # a crash is every capacity check's `unknown`, never the prover's
        subjects = [("connection", c.name) for c in artifact.connections] + [("profile", p.name) for p in artifact.sandbox_profiles]
        return None, [crashed(subject_worker(artifact, k, n), f"{k}:{n}", p, exc) for k, n in subjects for p in wanted]
    out: list[Result] = []
    for cap in caps:
        worker = subject_worker(artifact, cap.kind, cap.name)
        subject = f"{cap.kind}:{cap.name}"
        if max_bits is not None:
            try:
                out.append(max_bits_result(artifact, cap, max_bits, worker))
            except Exception as exc:
                out.append(crashed(worker, subject, "max-bits", exc))
        if ceiling is not None:
            try:
                bound = ceiling_caps.get((cap.kind, ceiling.name_for(cap.kind, cap.name)))
                out.append(capacity_within_result(artifact, cap, bound, worker))
            except Exception as exc:
                out.append(crashed(worker, subject, "capacity-within", exc))
    return capacity_section(caps, head_limits), out


def bits_value(bits: float) -> float | str:
    """A figure as JSON holds it: a number, or `unbounded`."""
    return "unbounded" if math.isinf(bits) else bits


def over_result(artifact: Artifact, cap: Capacity, prop: str, worker: str, figure: float, bound: str, summary: str,
                start: float) -> Result:
    """A refutation: the figure over its bound, with two admitted requests that differ in the field carrying the most
    bits, both replayed through `decide()` (`proofs.capacity.witness`); `unknown` when no such pair can be built."""
    subject = f"{cap.kind}:{cap.name}"
    try:
        w = witness(artifact, cap)
    except CapacityError as exc:
        return Result(worker, subject, prop, "unknown", ms(start), None,
                      f"{summary}; no two admitted requests could be built to show it: {exc}")
    cex = {"summary": summary, "capacity": bits_value(figure), "bound": bound, "rule": w.route.rule,
           "field": w.field.name, "witness": w.to_dict()}
    return Result(worker, subject, prop, "refuted", ms(start), cex, w.describe())


def ms(start: float) -> int:
    return int((time.perf_counter() - start) * 1000)


def max_bits_result(artifact: Artifact, cap: Capacity, gate: MaxBits, worker: str) -> Result:
    """`max-bits`: the subject's capacity (per request, or over any interval of the gate's length) is at most N bits."""
    start = time.perf_counter()
    figure = cap.bits if gate.seconds is None else cap.over(gate.seconds)
    per = "per request" if gate.seconds is None else f"over any {describe_window(gate.seconds)}"
    if figure <= gate.bits:
        return Result(worker, f"{cap.kind}:{cap.name}", "max-bits", "proved", ms(start), None,
                      f"{format_bits(figure)} {per}, at most {gate.bits:g}")
    why = f" ({cap.unbounded})" if math.isinf(figure) and cap.unbounded else ""
    summary = f"{cap.kind} `{cap.name}` can carry {format_bits(figure)} {per}{why}, over the budget of {gate.text()}"
    return over_result(artifact, cap, "max-bits", worker, figure, gate.text(), summary, start)


def capacity_within_result(artifact: Artifact, cap: Capacity, bound: Capacity | None, worker: str) -> Result:
    """`capacity-within`: the subject carries no more than its ceiling subject, per request and, when the ceiling
    subject has caps, over its window and the subject's own (a subject without caps is unbounded over any window). A subject the ceiling lacks may carry nothing (the ceiling admits none of its requests)."""
    start = time.perf_counter()
    subject = f"{cap.kind}:{cap.name}"
    over: list[str] = []
    if bound is None:
        if cap.routes:
            over.append(f"{format_bits(cap.bits)} per request; the ceiling has no such {cap.kind}")
    else:
        if cap.bits > bound.bits:
            over.append(f"{format_bits(cap.bits)} per request, the ceiling's `{bound.name}` {format_bits(bound.bits)}")
        if bound.budget is not None:  # the ceiling caps a window: so must the subject (without caps it is unbounded)
            windows = {bound.budget.window} | ({cap.budget.window} if cap.budget is not None else set())
            for seconds in sorted(windows):
                mine, theirs = cap.over(seconds), bound.over(seconds)
                if mine > theirs:
                    over.append(f"{format_bits(mine)} over any {describe_window(seconds)}, the ceiling's {format_bits(theirs)}")
    if not over:
        limit = "nothing" if bound is None else f"`{bound.name}`'s {format_bits(bound.bits)} per request"
        return Result(worker, subject, "capacity-within", "proved", ms(start), None,
                      f"{format_bits(cap.bits)} per request, within {limit}")
    summary = f"{cap.kind} `{cap.name}` can carry " + "; ".join(over)
    return over_result(artifact, cap, "capacity-within", worker, cap.bits, "ceiling", summary, start)
