"""A listener's admission of connections against its caps
(``TransportConfig.max_connections``, ``max_pending_connections``)."""

from __future__ import annotations

import logging
import math
import time

from .config import TransportConfig

__all__ = ("Admission",)

logger = logging.getLogger(__name__)


class Admission:
    """A listener's count of open and not yet handshaken connections,
    against ``TransportConfig.max_connections`` and
    ``max_pending_connections``. A refusal is logged as a warning that names
    the cap, at most once a second (a flood of refusals is one line a
    second, with their count)."""

    def __init__(self, config: TransportConfig, address: str) -> None:
        self._max_open = config.max_connections
        self._max_pending = config.max_pending_connections
        self._address = address
        self.open = 0
        self.pending = 0
        self._refused = 0
        self._logged_at = -math.inf

    def admit(self, peer: str) -> bool:
        """Count a new connection in; False: refuse it (close it at once)."""
        if self.open >= self._max_open:
            reason = (f"{self.open} connections are open "
                      f"(TransportConfig.max_connections={self._max_open})")
        elif self.pending >= self._max_pending:
            reason = (f"{self.pending} connections have not finished their handshake "
                      f"(TransportConfig.max_pending_connections={self._max_pending})")
        else:
            self.open += 1
            self.pending += 1
            return True
        self._refused += 1
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            logger.warning("refusing a connection from %s on %s: %s (%d refused since the "
                           "last such line)", peer, self._address, reason, self._refused)
            self._logged_at, self._refused = now, 0
        return False

    def handshaken(self) -> None:
        """An admitted connection finished (or failed) its handshake."""
        self.pending -= 1

    def closed(self) -> None:
        """An admitted connection ended."""
        self.open -= 1
