"""Parameter server over tensorwire RPC (sharding, consistency, optimizers): planned, empty."""

__all__ = ()
