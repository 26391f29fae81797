"""Z3 proofs of SPEC §5 over the decision core the proxy runs, the proof report, the start gate, and the semantic diff.

Encode, solve, decode (import the submodule; this package imports nothing heavy):
- `inputs`      — the symbolic inputs: a request as the core observes it, resolver answers, a header name.
- `symexec`     — the source of `egress_proxy.decision.core` evaluated on Z3 terms.
- `model`       — what the core answers on those inputs.
- `shapes`      — request shapes: the judges of `egress_proxy.decision.shapes` on symbolic parsed values, replayed.
- `regex`       — the pattern subset's AST as a Z3 regular expression (the evaluator's and the statements' one translation).
- `spec/`       — each property stated from its source, without importing `egress_proxy`.
- `statements`  — the one statement of each property and of what "proved" covers.
- `properties`  — the checks: `core behaviour ∧ ¬statement` for one worker and its subjects.
- `solve`       — one question to Z3 under a deterministic budget (an rlimit; the wall clock a safety bound).
- `contain`     — a check that raises is `unknown`, naming the line, never a crash.
- `decode`      — counterexamples as domain objects, replayed through the real `decide()`.
- `runner`      — `prove(artifact, old=None, jobs=1, limits=Limits()) -> Report`, in `jobs` processes.
- `report`      — the proof report: one list of results, text, JSON and SARIF (`load_report(text)`).
- `signing`     — signed reports: the deploy pipeline's prover signs, the proxy accepts only its key's.
- `gate`        — `read_report(path, artifact, trusted_key=None)`: the proxy's start gate; no z3 import.
- `diff`        — `semantic_diff(old, new)`: example requests one artifact admits and the other denies.
- `capacity`    — `capacities(artifact)`: the bits one admitted request of each subject can carry, per request and per window; `witness`.
- `errors`      — `ProofError`, the package's root error.
"""
