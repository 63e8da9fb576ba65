"""The tcp:// spin window (``TransportConfig.tcp_spin``) that a bench run's
tensorwire processes use: the library's default, unless the process that
started them set ``TENSORWIRE_BENCH_TCP_SPIN`` (``bench/rpc.py --tcp-spin``,
``bench/tcp_spin.py``), which every process it starts inherits."""

from __future__ import annotations

import os

TCP_SPIN_VARIABLE = "TENSORWIRE_BENCH_TCP_SPIN"


def tcp_spin() -> float:
    """Seconds: the ``tcp_spin`` of this run's tcp:// connections."""
    from tensorwire.transports import TransportConfig

    spin = os.environ.get(TCP_SPIN_VARIABLE)
    return TransportConfig().tcp_spin if spin is None else float(spin)
