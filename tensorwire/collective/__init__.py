"""Collective operations over tensorwire RPC (allreduce, broadcast, ...): planned, empty."""

__all__ = ()
