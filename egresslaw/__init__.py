"""egresslaw: the thin CLI that wires catalog, compiler, proofs and egress_proxy together."""

__version__ = "0.2.0"
