"""Where an echo's time goes: a call trace of the bench/gpu.py peers.

``python bench/gpu.py --trace DIR`` runs every tensorwire and raw peer under
:func:`start`, which records with ``sys.setprofile`` (perf_counter_ns, the
monotonic clock both processes share on one host) each call and return of
a function of tensorwire, ucxx's Python layer or bench/gpu.py, and the C
calls that wait or move data (epoll, UCX progress, arm, posts, stream
synchronization). :func:`mark` brackets each timed echo. Recording slows
the Python side (a callback per call everywhere), so the trace shows where
the waits are, not what the Python costs.

``python bench/_gpu_trace.py DIR [SIZE_MIB]`` then prints, for the median
echo of that size (16 MiB by default) of each client, both processes'
events side by side on one clock with the gaps over 20 µs marked.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_WATCHED_C = {"poll", "progress", "progress_worker_event", "arm", "tag_send", "tag_recv",
              "synchronize", "empty"}
_records: list[tuple[int, str, str]] = []
_MAX = 3_000_000


def _tracer(frame: Any, event: str, arg: Any) -> None:
    if len(_records) >= _MAX:
        return
    if event == "call" or event == "return":
        path = frame.f_code.co_filename
        if "tensorwire" in path or "ucxx" in path or path.endswith("gpu.py"):
            _records.append((time.perf_counter_ns(), event[0],
                             f"{Path(path).stem}.{frame.f_code.co_qualname}"))
    elif event == "c_call" or event == "c_return":
        name = getattr(arg, "__name__", "")
        if name in _WATCHED_C:
            _records.append((time.perf_counter_ns(), "C" if event == "c_call" else "R", name))


def start() -> None:
    """Trace this process (every thread started later too) until it exits."""
    import atexit
    import threading

    sys.setprofile(_tracer)
    threading.setprofile(_tracer)
    atexit.register(_save)


def mark(what: str, size: int) -> None:
    """An echo's start or end; recorded only while tracing."""
    if sys.getprofile() is _tracer:
        _records.append((time.perf_counter_ns(), "M", f"{what}:{size}"))


def _save() -> None:
    sys.setprofile(None)
    folder, role = os.environ["GPU_BENCH_TRACE"], os.environ.get("GPU_BENCH_ROLE", "peer")
    with open(Path(folder, f"trace-{role}-{os.getpid()}.jsonl"), "w") as out:
        for record in _records:
            out.write(json.dumps(record) + "\n")


def _load(path: Path) -> list[tuple[int, str, str]]:
    return [tuple(json.loads(line)) for line in path.open()]  # type: ignore[misc]


def report(folder: Path, size: int) -> None:
    """Print the median echo of ``size`` bytes of each client with its server."""
    traces = {p.name.split("-", 1)[1].rsplit("-", 1)[0]: _load(p)
              for p in sorted(folder.glob("trace-*.jsonl"))}
    for role, events in traces.items():
        if not role.endswith("client"):
            continue
        server = traces.get(role.replace("client", "server"), [])
        starts = [t for t, kind, name in events if kind == "M" and name == f"start:{size}"]
        ends = [t for t, kind, name in events if kind == "M" and name == f"end:{size}"]
        spans = list(zip(starts, ends, strict=False))[2:]  # the first two are warm-up
        if not spans:
            continue
        durations = [b - a for a, b in spans]
        median = statistics.median_low(durations)
        begin, end = spans[durations.index(median)]
        print(f"\n== {role} with its server: echo of {size >> 20} MiB, median "
              f"{median / 1e3:.0f} µs of {len(spans)} (min {min(durations) / 1e3:.0f})")
        merged = sorted([(t, "client", k, n) for t, k, n in events if begin <= t <= end]
                        + [(t, "server", k, n) for t, k, n in server if begin <= t <= end])
        last = begin
        for t, side, kind, name in merged:
            gap = (t - last) / 1e3
            flag = f"  <-- {gap:.0f} µs" if gap > 20 else ""
            indent = "" if side == "client" else " " * 50
            print(f"{(t - begin) / 1e3:9.1f} {indent}{side[0]} {kind} {name}{flag}")
            last = t


if __name__ == "__main__":
    mib = float(sys.argv[2]) if len(sys.argv) > 2 else 16.0
    report(Path(sys.argv[1]), int(mib * (1 << 20)))
