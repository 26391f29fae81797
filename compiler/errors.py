"""The compiler's root error: everything the compiler refuses outside a policy's diagnostics derives from it."""

from __future__ import annotations

from catalog.errors import Problem


class CompilerError(Problem):
    """An artifact, lock, format or import the compiler cannot use (diagnostics of a policy are `Diagnostic`s)."""
