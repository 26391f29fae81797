"""The prover's root error: a report, a gate, a signature or a construct the prover cannot use."""

from __future__ import annotations

from catalog.errors import Problem


class ProofError(Problem):
    """Something the prover refuses; `unknown`, never `proved`, is what a check makes of it."""
