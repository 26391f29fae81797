"""Run every property for every worker and subject of an artifact, in `jobs` processes, into a Report.

Work is split into tasks: one per worker (its own checks) and batches of that worker's subjects.
Each task runs in a worker process (spawned, so nothing of the parent's Z3 state is shared) and
every subject is encoded in a fresh `z3.Context` with fixed seeds and a deterministic budget
(`proofs.solve`), so the verdicts and counterexamples depend neither on `jobs`, on batching nor on
the machine's load. Results are gathered in plan order, whatever order the pool finishes in.

A check that raises is `unknown` (`proofs.contain`): within a property (`proofs.properties`), while
encoding a subject or a worker (here, per subject), and for a whole task whose process failed.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections.abc import Callable

import z3

from catalog import load_catalog
from compiler.artifact import Artifact, load_artifact
from egress_proxy.decision.adapter import decide as real_decide
from egress_proxy.decision.provenance import core_digest, egresslaw_version
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
) -> Report:
    """Prove every property (and `within` a ceiling, when one is given); `jobs` > 1 uses that many spawned processes.
    `decide` (tests only) replaces the replay target."""
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
    results = [r for task_results in done for r in task_results] + orphans(artifact)
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
    )
