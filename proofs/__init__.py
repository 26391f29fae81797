"""Z3 proofs of SPEC §5 over the decision core the proxy runs, the proof report, the start gate, and the semantic diff.

Public entry points (import the submodule; this package imports nothing heavy):

- `proofs.gate.read_report(path, artifact, trusted_key=None) -> Report` (the proxy's gate; no z3 import);
- `proofs.report.load_report(text) -> Report`;
- `proofs.runner.prove(artifact, old=None, jobs=1, limits=Limits()) -> Report`;
- `proofs.diff.semantic_diff(old, new) -> SemanticDiff` (`.same`, `.widened`, `.examples`).

`proofs.solve` asks Z3 under a deterministic budget (an rlimit; the wall clock only a safety bound);
`proofs.contain` makes a check that raises `unknown`, naming the line. `proofs.symexec` evaluates `egress_proxy.decision.core` on Z3 terms; `proofs.spec` states each property
without importing `egress_proxy`; `proofs.statements` holds the one statement of each property.
"""
