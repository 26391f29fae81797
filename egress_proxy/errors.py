"""The edge's root error, shared by every room (it imports nothing of them): each room's errors derive from it."""

from __future__ import annotations

from catalog.errors import Problem


class EgressError(Problem):
    """Something the proxy, custody, the audit or the decision refuses; the message never carries a secret."""
