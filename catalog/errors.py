"""The one error shape of egresslaw, in the lowest package so every package's root error can derive from it.

A `Problem` carries a `message` (lowercase, user input in backticks, never a secret or a peer's bytes) and an
optional `help` with the fix; the CLI prints both and never a traceback. Each package has one root below it:
`catalog.CatalogError`, `compiler.errors.CompilerError`, `proofs.errors.ProofError`,
`egress_proxy.errors.EgressError` and `egresslaw.common.CliError`.
"""

from __future__ import annotations


class Problem(Exception):
    """A located, explained refusal: `message` and, when a fix is known, `help`."""

    def __init__(self, message: str, help: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.help = help
