"""Z3 proofs of SPEC §5 over the decision function, the proof report, and the semantic diff.

Public entry points (import the submodule; this package imports nothing heavy):

- `proofs.report.load_report(text) -> Report`, `Report.all_proved_for(digest)` (no z3 import);
- `proofs.runner.prove(artifact, old=None, jobs=1, limits=Limits()) -> Report`;
- `proofs.diff.semantic_diff(old, new) -> SemanticDiff` (`.same`, `.widened`, `.examples`).
"""
