"""The egresslaw compiler: `.egress` source -> admitted, frozen artifact.

Importing this package pulls in nothing heavy: `compiler.artifact` and `compiler.normalize`
are what `proofs` and `egress_proxy` read; the Lark front end lives in `compiler.parser`.
"""
