"""egresslaw: the thin CLI that wires catalog, compiler, proofs and egress_proxy together."""

__version__ = "0.1.0"
