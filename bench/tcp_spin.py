"""tcp://'s spin window on and off, interleaved: what the default buys and costs.

``TransportConfig.tcp_spin`` (200 µs by default) keeps a connection's event
loop polling after a read of exactly one message instead of sleeping. It
should buy latency between processes and cost nothing where processes
outnumber cores. This host's run-to-run spread is larger than either
effect, so each round measures every case once with ``tcp_spin=0`` and
once with the default, back to back, and the table gives medians over the
rounds with their range:

- the tiny-call p50 of tensorwire RPC over tcp:// (one call in flight),
  with the OS placing the pair, on an idle host and beside one busy loop
  per CPU, with the bare asyncio Protocol echo (coalescing) as the ceiling
  (bench/rpc.py's measurement);
- a float32 sum allreduce over tcp:// of 2 and of 4 processes on this host's
  cores (bench/collective.py's measurement, its quick sizes).

    python bench/tcp_spin.py              # 5 rounds, writes bench/results/tcp_spin.md
    python bench/tcp_spin.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import collective
from _rpc_measure import run_variant
from _rpc_report import _load, _revision, environment
from _rpc_variants import FLOOR, VARIANTS, Plan
from _spin_setting import TCP_SPIN_VARIABLE, tcp_spin

RESULTS = Path(__file__).parent / "results" / "tcp_spin.md"
RPC = "tensorwire RPC tcp://"
WORLDS = (2, 4)
SETTINGS = ("0", "default")


def tiny_p50(name: str, busy: bool) -> float:
    """Microseconds: the tiny-call p50 of the variant ``name``."""
    variant = next(v for v in VARIANTS if v.name == name)
    result = run_variant(variant, Plan.quick(), timeout=120, only="tiny", busy=busy)
    if isinstance(result, str):
        raise RuntimeError(f"{name}: {result[-2000:]}")
    return float(result["p50"]) * 1e6


def allreduce(world: int) -> list[float]:
    """Microseconds per tcp:// allreduce of bench/collective.py's quick sizes."""
    times = collective.run_variant("tensorwire tcp://", world, collective.QUICK_SIZES, True)
    return [t * 1e6 for t in times]


def cases() -> dict[str, Callable[[], list[float]]]:
    """Each case's name and its measurement (one value or one per size)."""
    found: dict[str, Callable[[], list[float]]] = {}
    for busy in (False, True):
        where = "busy host" if busy else "idle host"
        found[f"tiny call p50 (µs), {where}"] = lambda busy=busy: [tiny_p50(RPC, busy)]
    for world in WORLDS:
        found[f"allreduce of {world} processes (µs)"] = lambda world=world: allreduce(world)
    return found


def run(rounds: int) -> tuple[dict[tuple[str, str], list[list[float]]], dict[str, list[float]]]:
    """Every case under both settings, interleaved, ``rounds`` times; and the
    bare echo's p50 on the idle and the busy host once a round."""
    results: dict[tuple[str, str], list[list[float]]] = {}
    floor: dict[str, list[float]] = {"idle host": [], "busy host": []}
    for number in range(rounds):
        for where in floor:
            floor[where].append(tiny_p50(FLOOR, where == "busy host"))
        for name, measure in cases().items():
            for setting in SETTINGS:
                if setting != "default":
                    os.environ[TCP_SPIN_VARIABLE] = setting
                try:
                    values = measure()
                finally:
                    os.environ.pop(TCP_SPIN_VARIABLE, None)
                results.setdefault((name, setting), []).append(values)
                print(f"round {number + 1}: {name}, tcp_spin={setting}: "
                      + ", ".join(f"{v:,.1f}" for v in values), file=sys.stderr, flush=True)
    return results, floor


def spread(values: list[float]) -> str:
    return (f"{statistics.median(values):,.1f} "
            f"[{min(values):,.1f}-{max(values):,.1f}]")


def table(results: dict[tuple[str, str], list[list[float]]], floor: dict[str, list[float]],
          rounds: int) -> list[str]:
    default = tcp_spin()  # the library's: the variable is unset here
    lines = ["| case | size | tcp_spin=0 | tcp_spin default | default / 0, each round |",
             "|---|---:|---:|---:|---:|"]
    for name in cases():
        off, on = results[(name, "0")], results[(name, "default")]
        sizes = ([""] if len(off[0]) == 1
                 else [collective.fmt_size(s) for s in collective.QUICK_SIZES])
        for i, size in enumerate(sizes):
            a = [values[i] for values in off]
            b = [values[i] for values in on]
            ratios = [y / x for x, y in zip(a, b, strict=True)]
            lines.append(f"| {name} | {size} | {spread(a)} | {spread(b)} | "
                         f"{statistics.median(ratios):.2f} "
                         f"[{min(ratios):.2f}-{max(ratios):.2f}] |")
    lines += ["", f"The ceiling, the bare Protocol echo's tiny-call p50 (µs) in the same "
              f"rounds: idle host {spread(floor['idle host'])}, busy host "
              f"{spread(floor['busy host'])}.", "",
              f"Each cell: the median over {rounds} rounds [lowest-highest]; the last "
              f"column: the default's figure over tcp_spin=0's, round by round (below 1: "
              f"the default is faster). The default here is {default * 1e6:g} µs."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    started, load_before = time.monotonic(), _load()
    results, floor = run(args.rounds)
    command = "python bench/tcp_spin.py" + (
        f" --rounds {args.rounds}" if args.rounds != 5 else "")
    lines = [
        "# tcp:// spin window, on and off", "",
        f"Command: `{command}` (took {time.monotonic() - started:.0f} s)", "",
        *environment(),
        f"- tensorwire tree: {_revision()}",
        f"- Load average (1/5/15 min) before the run {load_before}, after {_load()}.",
        "- Each round measures every case with `TransportConfig(tcp_spin=0)` and with "
        "the default, back to back; the tiny calls as bench/rpc.py measures them (quick "
        "plan, the OS places server and client, uvloop), the allreduce as "
        "bench/collective.py --quick does (every process on the same cores).",
        "",
        *table(results, floor, args.rounds),
        "",
    ]
    args.output.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
