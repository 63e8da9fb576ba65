"""A timeline of communication, in the Chrome trace-event format.

Open the file it writes in Perfetto (ui.perfetto.dev) or chrome://tracing to
see where a training step's communication time went: one row per process,
one slice per operation of whatever was given the timeline: collective
operations (``GroupConfig(timeline=...)``), RPC calls on the client and the
server (``ClientConfig`` / ``ServerConfig(timeline=...)``), and
parameter-server pushes and pulls (``PSConfig(timeline=...)``), with sizes
and outcomes in the slice's arguments. Horovod's timeline is the model.

::

    timeline = Timeline()
    group = await Group.create(..., config=GroupConfig(timeline=timeline))
    ...
    timeline.save("rank0.trace.json")

Recording costs a list append per operation; a timeline holds at most
``max_events`` events and drops (and counts) the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ("Timeline",)


class Timeline:
    """Records spans; :meth:`save` writes them as Chrome trace events."""

    def __init__(self, *, max_events: int = 1_000_000, process_name: str | None = None) -> None:
        self.max_events = max_events
        self.dropped = 0
        self._events: list[dict[str, Any]] = []
        self._origin = time.perf_counter()
        self._pid = os.getpid()
        self._process_name = process_name

    def _now_us(self) -> float:
        return (time.perf_counter() - self._origin) * 1e6

    def add(self, name: str, category: str, start_us: float, duration_us: float,
            args: dict[str, Any] | None = None) -> None:
        """One complete span (phase ``X``), times in µs since the timeline began."""
        if len(self._events) >= self.max_events:
            self.dropped += 1
            return
        event = {"name": name, "cat": category, "ph": "X", "ts": start_us,
                 "dur": duration_us, "pid": self._pid, "tid": threading.get_ident()}
        if args:
            event["args"] = args
        self._events.append(event)

    @contextlib.contextmanager
    def span(self, name: str, category: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Time the ``with`` body; the yielded dict's items become the span's arguments."""
        start = self._now_us()
        extra: dict[str, Any] = dict(args)
        try:
            yield extra
        finally:
            self.add(name, category, start, self._now_us() - start, extra)

    def add_since(self, name: str, category: str, started: float, **args: Any) -> None:
        """A span from ``started`` (a ``time.perf_counter()`` reading) until now."""
        now = time.perf_counter()
        self.add(name, category, (started - self._origin) * 1e6, (now - started) * 1e6, args)

    @property
    def events(self) -> list[dict[str, Any]]:
        return list(self._events)

    def save(self, path: str | Path) -> None:
        """Write the trace (``{"traceEvents": [...]}``); the file opens in Perfetto."""
        meta = []
        if self._process_name:
            meta.append({"name": "process_name", "ph": "M", "pid": self._pid,
                         "args": {"name": self._process_name}})
        document = {"traceEvents": meta + self._events, "displayTimeUnit": "ms",
                    "otherData": {"dropped_events": self.dropped}}
        Path(path).write_text(json.dumps(document))
