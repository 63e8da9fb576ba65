"""bench/rpc.py's report: combining the rounds, the tables, the targets."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _rpc_instructions import _count_note, count_section
from _rpc_variants import (
    CONCURRENCY,
    FLOOR,
    PAIRED,
    PAIRED_ONE_CPU,
    SOCKET,
    TINY,
    UCXX,
    VARIANTS,
    MiB,
    Plan,
    placement,
)
from _spin_setting import tcp_spin

#: The keys of a result whose median over the rounds the tables show.
_NUMBERS = ("p50", "p99", "cps1", "cps64", "cps64_os", "cps64_one", "cps64_two")
#: A tiny call slower than this at the median of a round is "millisecond mode".
MILLISECOND_MODE = 1e-3

def _errors(results: list[dict[str, Any] | str]) -> list[str]:
    """Every distinct error of the rounds, in order (a round that did not
    run is its error)."""
    errors: list[str] = []
    for r in results:
        errors += [e for e in (r["errors"] if isinstance(r, dict) else [r]) if e not in errors]
    return errors


def combine(results: list[dict[str, Any] | str]) -> dict[str, Any] | str:
    """The median of each number over the rounds that ran; the first error if none did."""
    good = [r for r in results if isinstance(r, dict)]
    if not good:
        return str(results[0])
    out: dict[str, Any] = {"errors": _errors(results)}
    for key in _NUMBERS:
        values = [r[key] for r in good if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    out["p50s"] = [r["p50"] for r in good if r.get("p50") is not None]
    sizes = {size for r in good for size in r.get("bw", {})}
    out["bw"] = {size: statistics.median([r["bw"][size] for r in good if size in r["bw"]])
                 for size in sizes}
    return out


def combine_pair(results: list[dict[str, Any] | str], other: str) -> dict[str, Any] | str:
    """A paired variant's medians over the rounds, and each round's ratio of
    the RPC to ``other`` ("raw" or "grpc"); the ratio's median is what the
    targets use. Keys ``other_p50``, ``other_bw`` hold the other side's."""
    good = [r for r in results if isinstance(r, dict)]
    if not good:
        return str(results[0])
    out: dict[str, Any] = {"errors": _errors(results)}
    out["p50_ratios"] = [r["rpc"]["p50"] / r[other]["p50"] for r in good]
    out["p50_ratio"] = statistics.median(out["p50_ratios"])
    out["shares"] = {}
    sides = {"rpc": "rpc", other: "other"}
    for side, key in sides.items():
        out[f"{key}_p50"] = statistics.median([r[side]["p50"] for r in good])
        out[f"{key}_bw"] = {}
    for size in sorted({size for r in good for size in r["rpc"]["bw"]}):
        paired = [r for r in good if size in r["rpc"]["bw"] and size in r[other]["bw"]]
        if not paired:
            continue
        for side, key in sides.items():
            out[f"{key}_bw"][size] = statistics.median([r[side]["bw"][size] for r in paired])
        out["shares"][size] = [r["rpc"]["bw"][size] / r[other]["bw"][size] for r in paired]
    return out


def combine_cps_pair(results: list[dict[str, Any] | str], other: str) -> dict[str, Any] | str:
    """The one-CPU calls/s pair over the rounds: each side's median (the
    RPC's and ``other``'s), and each round's ratio (the median of its
    slices' ratios), whose median the target reads."""
    good = [r for r in results if isinstance(r, dict)]
    if not good:
        return str(results[0])
    ratios = [statistics.median(r["ratios"]) for r in good]
    return {"errors": _errors(results), "ratios": ratios, "ratio": statistics.median(ratios),
            "slices": [len(r["ratios"]) for r in good],
            "rpc_cps64": statistics.median([r["rpc"]["cps64"] for r in good]),
            "other_cps64": statistics.median([r[other]["cps64"] for r in good])}


def cps_pair_section(row: dict[str, Any] | str, plan: Plan) -> list[str]:
    """The table of the one-CPU calls/s pair."""
    out = ["", "## Calls/s with 64 in flight against the bare echo, paired on one CPU", "",
           "The RPC and the bare Protocol echo each run in a server process and a client "
           "process of their own, all four pinned to the same CPU; the two clients take "
           f"turns of {plan.slice_seconds:g} s, {plan.slices} each a round after one to warm "
           f"up, each turn {CONCURRENCY} calls in flight on its connection (who goes first "
           "alternates; the idle side's server is stopped), so that both see the same "
           "moments of this shared host. A round's ratio is the median of its turns' ratios "
           "(the RPC's turn over the echo's next to it); the target reads the median of the "
           "rounds' ratios (min to max in brackets).", "",
           "| variant | calls/s, RPC / bare echo (median of the turns' medians) | RPC ÷ bare "
           "echo |", "|---|---:|---:|"]
    if isinstance(row, str):
        out.append(f"| {PAIRED_ONE_CPU} | did not run: {row} | |")
        return out
    ratios = row["ratios"]
    spread = (f" ({100 * min(ratios):.0f}% to {100 * max(ratios):.0f}%)"
              if len(ratios) > 1 else "")
    out.append(f"| {PAIRED_ONE_CPU} | {_rate(row['rpc_cps64'])} / {_rate(row['other_cps64'])}"
               f" | {100 * row['ratio']:.0f}%{spread} |")
    return out


def _paired(rows: dict[str, dict[str, Any] | str], name: str) -> dict[str, Any] | None:
    row = rows.get(name)
    return row if isinstance(row, dict) else None


def _share(row: dict[str, Any] | None, size: int) -> float | None:
    shares = None if row is None else row["shares"].get(size)
    return statistics.median(shares) if shares else None


def _spread(results: list[dict[str, Any] | str], key: str, fmt: Callable[[Any], str],
            size: int | None = None) -> str:
    values = []
    for r in results:
        if isinstance(r, dict):
            value = r.get(key)
            if size is not None:
                value = value.get(size) if isinstance(value, dict) else None
            if isinstance(value, int | float):
                values.append(value)
    if not values:
        return "—"
    return f"{fmt(min(values))} to {fmt(max(values))}"


def environment() -> list[str]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import tensorwire

    versions = [f"Python {platform.python_version()}", f"NumPy {np.__version__}",
                f"tensorwire {tensorwire.__version__}"]
    for module in ("grpc", "uvloop", "ucxx"):
        try:
            mod = __import__(module)
            versions.append(f"{'grpcio' if module == 'grpc' else module} "
                            f"{str(mod.__version__).strip()}")
        except ImportError:
            versions.append(f"{module} not installed")
    return [f"- CPU: {cpu}, {os.cpu_count()} cores, loopback only; "
            f"{platform.system()} {platform.release()}",
            "- " + "; ".join(versions),
            f"- Transparent huge pages: {huge_pages()}"]


def huge_pages() -> str:
    """Whether the kernel backs large buffers with huge pages, and NumPy's part in it."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            setting = f.read().strip()
    except OSError:
        return "unknown (no /sys/kernel/mm/transparent_hugepage/enabled)"
    chosen = setting[setting.find("[") + 1:setting.find("]")] if "[" in setting else setting
    try:
        from numpy._core.multiarray import _get_madvise_hugepage

        numpy_asks = bool(_get_madvise_hugepage())
    except ImportError:
        numpy_asks = False
    if chosen == "always":
        how = "on (`always`): every large anonymous buffer may use them"
    elif chosen == "madvise":
        how = ("on where asked (`madvise`): " + (
            "NumPy asks for them on its large arrays (`madvise(MADV_HUGEPAGE)`), so the "
            "bench's preallocated NumPy buffers are backed by huge pages" if numpy_asks else
            "NumPy does not ask for them here"))
    else:
        how = "off (`never`)"
    return f"{how}; /sys/kernel/mm/transparent_hugepage/enabled reads `{setting}`"


def _revision() -> str:
    """The commit, and whether the library had uncommitted changes when this ran."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "tensorwire"], cwd=root,
                               text=True, capture_output=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = [line[3:] for line in dirty if line.strip()]
    if not changed:
        return head
    return f"{head} + uncommitted changes to {', '.join(changed)}"


def _placement_note(pin: bool) -> str:
    server, client = placement("two" if pin else "os")
    if server is None:
        return ("- Process placement: left to the OS. On this 2-vCPU host a pair that shares "
                "one vCPU moves large echoes about twice as fast as a pair on two (1 MiB: "
                "about 4 against 2 GB/s for the raw transport, the same code), so each "
                "bandwidth figure depends on where its pair landed; see the spread table. "
                "`--pin` puts every server and client on fixed, different CPUs.")
    return (f"- Process placement (`--pin`): every server on CPU {server}, every client on "
            f"CPU {client}, so that all variants run alike (left to the OS, a pair sharing "
            "one vCPU moved large echoes about twice as fast as a pair on two). Pinned "
            "processes cannot move away from other work on their CPU.")


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e6:.1f}"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _gbps(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e9:.2f}"


def _get(rows: dict[str, dict[str, Any] | str], name: str, key: str,
         size: int | None = None) -> float | None:
    row = rows.get(name)
    if not isinstance(row, dict):
        return None
    value = row.get(key)
    if size is not None:
        value = value.get(size) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def targets(rows: dict[str, dict[str, Any] | str], sizes: tuple[int, ...],
            counts: dict[str, float | str] | None = None) -> list[str]:
    out = []

    def verdict(ok: bool | None) -> str:
        return "**not measured**" if ok is None else ("**met**" if ok else "**missed**")

    for scheme in ("tcp", "ucx"):
        pair = _paired(rows, f"paired {scheme}://")
        line = f"- Tiny-call p50 within 1.5x of the raw {scheme}:// echo: "
        if pair is None:
            out.append(line + verdict(None))
            continue
        ratio = pair["p50_ratio"]
        out.append(line + f"{verdict(ratio <= 1.5)} — {ratio:.2f}x (paired: RPC "
                   f"{_us(pair['rpc_p50'])} µs vs raw {_us(pair['other_p50'])} µs)")
    cps = _get(rows, "tensorwire RPC tcp://", "cps64_two")
    cps_os = _get(rows, "tensorwire RPC tcp://", "cps64_os")
    grpc_cps = _get(rows, "grpc.aio", "cps64_two")
    floor_cps = _get(rows, FLOOR, "cps64_two")
    placed = "" if cps_os is None else (
        f" with the server and the client on two CPUs; left to the OS {_rate(cps_os)}")
    out.append(f"- ≥ 50,000 tiny calls/s with 64 in flight on one tcp:// connection: "
               f"{verdict(None if cps is None else cps >= 50_000)} — {_rate(cps)} calls/s"
               f"{placed} (grpc.aio {_rate(grpc_cps)} calls/s; the bare Protocol echo "
               f"{_rate(floor_cps)} calls/s)" + _count_note(counts or {}))
    goals = [(f"paired {scheme}://", size, 0.85, f"{size // MiB} MiB echo over {scheme}:// "
              "≥ 85% of the raw transport", "raw")
             for scheme in ("tcp", "ucx") for size in sizes]
    goals += [(f"paired {scheme}:// and grpc.aio", 64 * MiB, factor,
               f"64 MiB echo over {scheme}:// ≥ {factor}x grpc.aio", "grpc.aio")
              for scheme, factor in (("tcp", 5), ("ucx", 20))]
    for name, size, goal, text, other in goals:
        pair = _paired(rows, name)
        share = _share(pair, size)
        line = f"- {text}: {verdict(None if share is None else share >= goal)}"
        if pair is not None and share is not None:
            shown = f"{100 * share:.0f}%" if goal < 1 else f"{share:.1f}x"
            line += (f" — {shown} (paired: RPC {_gbps(pair['rpc_bw'].get(size))} GB/s vs "
                     f"{other} {_gbps(pair['other_bw'].get(size))} GB/s)")
        out.append(line)
    return out


#: How the paired tables name the side the RPC takes turns with (``PAIRED``):
#: in their columns, and in their heading.
PAIR_NAMES = {"raw": ("raw", "its raw transport"), "grpc": ("grpc.aio", "grpc.aio"),
              "socket": ("bare socket", "the bare blocking socket"),
              "ucxx": ("raw ucxx", "raw ucxx")}


def paired_section(rows: dict[str, dict[str, Any] | str], pairs: list[str],
                   plan: Plan, other: str) -> list[str]:
    """The table of the paired variants against ``other`` (a value of ``PAIRED``)."""
    name_of, against = PAIR_NAMES[other]
    if other == "raw":
        how = ("One server process hosts the RPC echo and the raw echo side by side; one "
               "client process takes turns between them, call by call and echo by echo "
               "(who goes first alternates), so that both see the same process placement "
               "and the same moment of this shared host.")
    else:
        how = (f"The RPC and {name_of} each run in a server process and a client process "
               "of their own, and the two clients take turns, call by call and echo by echo "
               f"(who goes first alternates; the RPC's client hands the {name_of} client its "
               "turns over a pipe, and each client times its own calls), so that both see "
               "the same moment of this shared host (with `--pin` the two servers share a "
               "CPU, and so do the two clients). The server of the side whose turn it is "
               "not is stopped (`SIGSTOP`) until its turn comes, so that an idle server "
               "takes no CPU from the other side's turns (raw ucxx's blocking mode polls "
               "a CPU while it waits for its next message).")
        if other == "grpc":
            how += (" In one process pair, grpc.aio's threads slowed the RPC's echo right "
                    "after a gRPC echo by about a fifth (64 MiB over ucx://). Both on uvloop "
                    "here, which grpc.aio supports; grpc.aio runs over TCP whatever the RPC's "
                    "transport.")
        else:
            how += (" These are the ceilings of issue 22's large-echo targets, measured "
                    "against the RPC at the same moments; the unpaired table above has each "
                    "on its own. Their tiny calls alternate with the other pair's too, so "
                    "each finds its server asleep: those latencies run higher than unpaired, "
                    "the RPC's most, and the latency targets read the unpaired runs.")
    out = ["", f"## RPC against {against}, paired", "",
           how + f" Latency: the median over {plan.latency_calls:,} turns each; bandwidth: as "
           "above. A ratio is the median over the rounds of each round's ratio (min to max "
           "in brackets); the targets use these ratios.", "",
           f"| variant | tiny p50, RPC / {name_of} (µs) | RPC ÷ {name_of} | "
           + " | ".join(f"{s // MiB} MiB, RPC / {name_of} (GB/s) | RPC ÷ {name_of}"
                        for s in plan.sizes) + " |",
           "|---|---:|---:|" + "---:|---:|" * len(plan.sizes)]

    def bracket(values: list[float], fmt: Callable[[float], str]) -> str:
        if len(values) < 2:
            return ""
        return f" ({fmt(min(values))} to {fmt(max(values))})"

    def share(value: float) -> str:
        return f"{value:.1f}x" if other == "grpc" else f"{100 * value:.0f}%"

    for name in pairs:
        row = rows[name]
        if isinstance(row, str):
            out.append(f"| {name} | did not run | | " + "| |" * len(plan.sizes))
            continue
        ratios = row["p50_ratios"]
        cells = [f"{_us(row['rpc_p50'])} / {_us(row['other_p50'])}",
                 f"{row['p50_ratio']:.2f}x" + bracket(ratios, lambda v: f"{v:.2f}x")]
        for size in plan.sizes:
            shares = row["shares"].get(size)
            if not shares:
                cells += ["—", "—"]
                continue
            cells.append(f"{_gbps(row['rpc_bw'].get(size))} / "
                         f"{_gbps(row['other_bw'].get(size))}")
            cells.append(share(statistics.median(shares)) + bracket(shares, share))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def ceiling_targets(rows: dict[str, dict[str, Any] | str],
                    busy_rows: dict[str, dict[str, Any] | str], sizes: tuple[int, ...],
                    counts: dict[str, float | str] | None = None) -> list[str]:
    """Issue 22's targets: each a ratio to a ceiling measured in the same run."""
    out = []

    def verdict(ok: bool | None) -> str:
        return "**not measured**" if ok is None else ("**met**" if ok else "**missed**")

    def ratio_line(text: str, ours: float | None, ceiling: float | None, goal: float,
                   fmt: Callable[[float | None], str], unit: str, at_most: bool) -> str:
        if ours is None or ceiling is None:
            return f"- {text}: {verdict(None)}"
        ratio = ours / ceiling
        ok = ratio <= goal if at_most else ratio >= goal
        shown = f"{ratio:.2f}x" if at_most else f"{100 * ratio:.0f}%"
        return f"- {text}: {verdict(ok)} — {shown} ({fmt(ours)} against {fmt(ceiling)} {unit})"

    rpc_tcp, rpc_ucx = "tensorwire RPC tcp://", "tensorwire RPC ucx://"
    text = (f"calls/s with {CONCURRENCY} in flight on one tcp:// connection ≥ 50% of the "
            "coalescing bare echo, on one CPU")
    pair = _paired(rows, PAIRED_ONE_CPU)
    if pair is None:
        out.append(ratio_line(
            text + " (unpaired, each pair on one CPU: the paired run did not run)",
            _get(rows, rpc_tcp, "cps64_one"), _get(rows, FLOOR, "cps64_one"), 0.5, _rate,
            "calls/s", at_most=False))
    else:
        ratios = pair["ratios"]
        out.append(f"- {text}: {verdict(pair['ratio'] >= 0.5)} — {100 * pair['ratio']:.0f}% "
                   f"(paired, rounds {100 * min(ratios):.0f}% to {100 * max(ratios):.0f}%: "
                   f"RPC {_rate(pair['rpc_cps64'])} against {_rate(pair['other_cps64'])} "
                   "calls/s; unpaired, each pair on one CPU: "
                   f"{_rate(_get(rows, rpc_tcp, 'cps64_one'))} against "
                   f"{_rate(_get(rows, FLOOR, 'cps64_one'))})")
    two = _get(rows, rpc_tcp, "cps64_two")
    out.append(f"- calls/s with {CONCURRENCY} in flight on one tcp:// connection ≥ 150,000, "
               f"the pair on two CPUs: {verdict(None if two is None else two >= 150_000)}"
               f" — {_rate(two)} calls/s (the bare echo: "
               f"{_rate(_get(rows, FLOOR, 'cps64_two'))})")
    out.append(ratio_line(
        "tiny-call p50 over tcp:// within 1.3x of the bare Protocol echo (one in flight)",
        _get(rows, rpc_tcp, "p50"), _get(rows, FLOOR, "p50"), 1.3, _us, "µs", at_most=True))
    for label, table in (("idle", rows), ("busy", busy_rows)):
        out.append(ratio_line(
            f"tiny-call p50 over ucx:// within 1.5x of raw ucxx blocking mode, {label} host",
            _get(table, rpc_ucx, "p50"), _get(table, UCXX, "p50"), 1.5, _us, "µs",
            at_most=True))
    rounds = [p for table in (rows, busy_rows)
              for p in (table[rpc_ucx].get("p50s", []) if isinstance(table.get(rpc_ucx), dict)
                        else [])]
    slow = [p for p in rounds if p >= MILLISECOND_MODE]
    out.append(f"- no ucx:// run in a millisecond mode (a round's p50 ≥ 1 ms): "
               f"{verdict(not slow if rounds else None)} — {len(slow)} of {len(rounds)} "
               "rounds (idle and busy)" + (f": {', '.join(_us(p) for p in slow)} µs"
                                           if slow else ""))
    rpc_count = (counts or {}).get("rpc")
    out.append("- instructions per tiny call ≤ 25,000: " + (
        f"{verdict(rpc_count <= 25_000)} — {rpc_count:,.0f}" if isinstance(rpc_count, float)
        else verdict(None)))
    # The large echoes against their ceilings, taking turns with them (the
    # paired variants); the unpaired medians where a pair did not run.
    ceilings = ((rpc_tcp, SOCKET, "tcp://", "paired tcp:// and bare socket"),
                (rpc_ucx, UCXX, "ucx://", "paired ucx:// and raw ucxx"))
    for size in sizes:
        if size < 64 * MiB:
            continue
        for ours, ceiling, scheme, pair_name in ceilings:
            text = f"{size // MiB} MiB echo over {scheme} ≥ 90% of the {ceiling}"
            pair = _paired(rows, pair_name)
            share = _share(pair, size)
            if pair is None or share is None:
                out.append(ratio_line(
                    text + " (unpaired: the pair did not run)", _get(rows, ours, "bw", size),
                    _get(rows, ceiling, "bw", size), 0.9, _gbps, "GB/s", at_most=False))
                continue
            shares = pair["shares"][size]
            out.append(f"- {text}: {verdict(share >= 0.9)} — {100 * share:.0f}% (paired, "
                       f"rounds {100 * min(shares):.0f}% to {100 * max(shares):.0f}%: RPC "
                       f"{_gbps(pair['rpc_bw'].get(size))} against "
                       f"{_gbps(pair['other_bw'].get(size))} GB/s)")
    return out


def busy_section(busy_rows: dict[str, dict[str, Any] | str], plan: Plan) -> list[str]:
    """The tiny-call latencies beside one busy-looping process per core."""
    out = ["", "## Tiny call on a busy host (`--busy`)", "",
           f"The same tiny echo, one in flight, {plan.latency_calls:,} calls after "
           f"{plan.warmup_calls} warm-up calls, while one busy-looping process per CPU "
           "(each pinned to its CPU) runs beside the pair; placement left to the OS. A "
           "round whose p50 is 1 ms or more is in a millisecond mode.", "",
           "| variant | p50 (µs) | p99 (µs) | p50 of each round (µs) |", "|---|---:|---:|---|"]
    for name, row in busy_rows.items():
        if isinstance(row, str):
            out.append(f"| {name} | did not run: {row} | | |")
            continue
        rounds = ", ".join(_us(p) for p in row.get("p50s", []))
        out.append(f"| {name} | {_us(_get(busy_rows, name, 'p50'))} | "
                   f"{_us(_get(busy_rows, name, 'p99'))} | {rounds} |")
    return out


def write_results(path: Path, plan: Plan, rows: dict[str, dict[str, Any] | str],
                  command: str, elapsed: float, load_before: str,
                  runs: dict[str, list[dict[str, Any] | str]] | None = None, *,
                  pin: bool = False, counts: dict[str, float | str] | None = None,
                  busy_rows: dict[str, dict[str, Any] | str] | None = None) -> None:
    kinds = {v.name: v.kind for v in VARIANTS}
    names = [name for name in rows if kinds[name] not in PAIRED]
    busy_rows = busy_rows or {}

    def cell(name: str, text: str) -> str:
        return "did not run" if isinstance(rows[name], str) else text

    out = ["# RPC benchmark", "", f"Command: `{command}` (took {elapsed:.0f} s)", "",
           *environment(),
           f"- tensorwire tree: {_revision()}",
           f"- Load average (1/5/15 min) before the run {load_before}, after {_load()}: "
           "other work on this shared 2-core host adds noise, most to the large echoes.",
           "- Every variant runs uvloop in both processes, grpc.aio and raw ucxx too, except "
           "the unpaired grpc.aio (asyncio's default loop). ucx:// uses `UCXOptions()`, and raw "
           "ucxx the same UCX settings (`UCX_RNDV_SCHEME=put_zcopy`); tcp:// uses "
           f"`TransportConfig(tcp_spin={tcp_spin()})`.",
           "- Each variant: one server process, one client process, one connection.",
           _placement_note(pin), ""]
    placements = ("one", "two") if not pin else ("one",)
    cps_columns = {"one": "one CPU", "two": "two CPUs", "os": "OS placement"}
    shown = ["one", "two"] + ([] if pin else ["os"])
    out += ["## Tiny unary call", "",
            f"Echo of a small value (RPC: the int {TINY}; the others: 8 bytes). Latency over "
            f"{plan.latency_calls:,} calls after {plan.warmup_calls} warm-up calls, one in "
            f"flight; calls/s over {plan.seconds:g} s, with 1 and with {CONCURRENCY} "
            "concurrent tasks on the one connection. The raw transport, the bare socket and "
            "raw ucxx have no call ids, so they run with 1 in flight only. Calls/s with "
            f"{CONCURRENCY} in flight run again in pairs of processes of their own: both "
            "processes pinned to one CPU (which removes most of the run-to-run spread of "
            "cross-CPU wake-ups), and the server and the client pinned to two different "
            "CPUs" + ("" if pin else "; the last column is the run left to the OS, where "
                      "the pair sometimes shares one vCPU and sometimes not")
            + f" ({', '.join(placements)} run again here).", "",
            "| variant | p50 (µs) | p99 (µs) | calls/s, 1 in flight | "
            + " | ".join(f"calls/s, {CONCURRENCY} in flight, {cps_columns[w]}" for w in shown)
            + " |", "|---|---:|---:|---:|" + "---:|" * len(shown)]
    for name in names:
        variant = next(v for v in VARIANTS if v.name == name)
        cps = [cell(name, _rate(_get(rows, name, f"cps64_{w}"))) if variant.multiplexed
               else "n/a" for w in shown]
        out.append(f"| {name} | {cell(name, _us(_get(rows, name, 'p50')))} | "
                   f"{cell(name, _us(_get(rows, name, 'p99')))} | "
                   f"{cell(name, _rate(_get(rows, name, 'cps1')))} | " + " | ".join(cps) + " |")
    if busy_rows:
        out += busy_section(busy_rows, plan)
    out += ["", "## Tensor echo bandwidth (GB/s, both directions)", "",
            "Echo of a float32 tensor: 2 * size / time per echo (1 GB = 1e9 bytes), the "
            "median of " + ", ".join(f"{r} ({s // MiB} MiB)"
                                     for s, r in zip(plan.sizes, plan.reps, strict=True))
            + " echoes after one warm-up echo. tensorwire receives into a fresh buffer per "
            "message (its allocator), as an RPC must; the bare socket and raw ucxx into "
            "buffers preallocated once per size. gRPC sends `arr.tobytes()` and rebuilds "
            "with `np.frombuffer`.", "",
            "| variant | " + " | ".join(f"{s // MiB} MiB" for s in plan.sizes) + " |",
            "|---|" + "---:|" * len(plan.sizes)]
    for name in names:
        if next(v for v in VARIANTS if v.name == name).tiny_only:
            continue
        cells = [cell(name, _gbps(_get(rows, name, "bw", s))) for s in plan.sizes]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    rounds = max((len(r) for r in (runs or {}).values()), default=1)
    if rounds > 1 and runs:
        out += ["", f"## Run-to-run spread (min to max over the {rounds} rounds)", "",
                "The tables above give each number's median over the rounds (every variant "
                "runs once per round, round-robin).", "",
                "| variant | p50 (µs) | "
                + " | ".join(f"calls/s, 64 in flight, {cps_columns[w]}" for w in shown)
                + " | " + " | ".join(f"{s // MiB} MiB (GB/s)" for s in plan.sizes) + " |",
                "|---|---:|" + "---:|" * len(shown) + "---:|" * len(plan.sizes)]
        for name, results in runs.items():
            if kinds[name] in PAIRED:
                continue
            cells = [_spread(results, "p50", _us)]
            cells += [_spread(results, f"cps64_{w}", _rate) for w in shown]
            cells += [_spread(results, "bw", _gbps, s) for s in plan.sizes]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    for kind, other in PAIRED.items():
        pairs = [name for name in rows if kinds[name] == kind]
        if pairs and kind == "pair-floor":
            out += cps_pair_section(rows[pairs[0]], plan)
        elif pairs:
            out += paired_section(rows, pairs, plan, other)
    if counts:
        out += count_section(counts)
    out += ["", "## Targets against the ceilings (issue 22)", "",
            "Each a ratio from this run: tensorwire against the bare Protocol echo, the bare "
            "blocking socket and raw ucxx in blocking mode, not against its own transport.",
            "", *ceiling_targets(rows, busy_rows, plan.sizes, counts),
            "", "## Earlier targets (the RPC against its transport and grpc.aio)", "",
            *targets(rows, plan.sizes, counts), ""]
    problems = []
    labelled = [(name, row) for name, row in rows.items()]
    labelled += [(f"{name} (busy)", row) for name, row in busy_rows.items()]
    for name, row in labelled:
        if isinstance(row, str):
            problems.append(f"- {name}: did not run: {row}")
        else:
            problems += [f"- {name}: {error}" for error in row["errors"]]
    if problems:
        out += ["## What did not run", "", *problems, ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))
    print(f"wrote {path}", file=sys.stderr)

