"""The compiled core, before and after: RPC calls, allreduces and PS steps of two trees in turn.

Issue 22 asks that the collective and parameter-server benchmarks improve
with the compiled core and that none regresses; the tiny RPC call is what
the core serves on every call. Two runs of
bench/collective.py or bench/ps.py made hours apart differ more by this
shared host's load than by the code, and the earlier results were made on
another CPU. So this runs the same measurements, with bench/collective.py's
and bench/ps.py's own functions, against two tensorwires in turn: an earlier
revision (checked out in a temporary git worktree, its extensions built if
it has any) and this tree. Each round measures both, in alternating order,
and the ratios are taken round by round, so both see the same load.

    python bench/before_after.py                 # writes bench/results/before_after.md
    python bench/before_after.py --rounds 5 --before <revision>

The default revision, 920ef11, is the last tree without the compiled core
(the next commit added the Cython build).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results" / "before_after.md"
BEFORE = "920ef11"

#: Small allreduces: (transport, processes, bytes).
ALLREDUCES = [(scheme, world, size) for scheme in ("tcp", "ucx") for world in (2, 4)
              for size in (8, 1 << 10, 64 << 10)]
#: Parameter-server steps: (transport, workers = shards, model MiB per worker).
PS_STEPS = [(scheme, workers, megabytes) for scheme in ("tcp", "ucx")
            for workers, megabytes in ((1, 4), (1, 32), (2, 32))]
PS_ROUNDS = 9
#: Tiny RPC calls (bench/rpc.py's echo of the int 7, its quick plan):
#: (transport, calls in flight, placement of the server and client).
RPC_CALLS = [("tcp", 1, "os"), ("ucx", 1, "os"), ("tcp", 64, "one")]


def measure() -> dict[str, float]:
    """Seconds per operation for every case, with the tensorwire on sys.path."""
    sys.path.insert(0, str(BENCH))
    import collective
    import ps

    out: dict[str, float] = {}
    for scheme, in_flight, where in RPC_CALLS:
        out[_rpc_name(scheme, in_flight, where)] = _rpc_seconds(scheme, in_flight, where)
    for scheme, world in sorted({(s, w) for s, w, _ in ALLREDUCES}):
        sizes = [size for s, w, size in ALLREDUCES if (s, w) == (scheme, world)]
        seconds = collective.run_variant(f"tensorwire {scheme}://", world, sizes, False)
        for size, value in zip(sizes, seconds, strict=True):
            out[_allreduce_name(scheme, world, size)] = value
    for scheme, workers, megabytes in PS_STEPS:
        row = ps.run_ps(f"{scheme}://127.0.0.1:0", workers, workers, megabytes, PS_ROUNDS)
        moved = 2 * len(ps._model(megabytes)) * ps.TENSOR
        # run_ps reports the mean over workers of bytes / median step time.
        out[_ps_name(scheme, workers, megabytes)] = moved / (row["push_pull"][0] * 1e9)
    return out


def _rpc_seconds(scheme: str, in_flight: int, where: str) -> float:
    """Seconds per tiny call: the p50 with one in flight, else the inverse
    of the calls per second with ``in_flight`` on the connection."""
    from _rpc_measure import run_variant
    from _rpc_variants import VARIANTS, Plan

    variant = next(v for v in VARIANTS if v.name == f"tensorwire RPC {scheme}://")
    result = run_variant(variant, Plan.quick(), timeout=240,
                         only="tiny" if in_flight == 1 else "cps64", where=where)
    if isinstance(result, str) or result["errors"]:
        why = result if isinstance(result, str) else result["errors"]
        raise RuntimeError(f"{variant.name}: {why}")
    return float(result["p50"]) if in_flight == 1 else 1.0 / result["cps64"]


def _rpc_name(scheme: str, in_flight: int, where: str) -> str:
    if in_flight == 1:
        return f"RPC tiny call {scheme}://, 1 in flight (p50)"
    return (f"RPC tiny call {scheme}://, {in_flight} in flight, "
            f"{'both on one CPU' if where == 'one' else where} (time per call)")


def _allreduce_name(scheme: str, world: int, size: int) -> str:
    unit = f"{size >> 10} KiB" if size >= 1 << 10 else f"{size} B"
    return f"allreduce {scheme}://, {world} processes, {unit}"


def _ps_name(scheme: str, workers: int, megabytes: int) -> str:
    return (f"PS push_pull {scheme}://, {workers} worker{'s' if workers > 1 else ''} and "
            f"{workers} shard{'s' if workers > 1 else ''}, {megabytes} MiB")


def run_tree(tree: Path) -> tuple[dict[str, float], str]:
    """One round of measure() in a child whose tensorwire is ``tree``'s."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    child = subprocess.run([sys.executable, __file__, "--measure"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=1800)
    if child.returncode != 0:
        raise RuntimeError(f"measuring {tree} failed:\n{child.stderr[-3000:]}")
    lines = child.stdout.strip().splitlines()
    loaded = json.loads(lines[-2])
    if not loaded["file"].startswith(str(tree)):
        raise RuntimeError(f"the child imported {loaded['file']}, not the tree {tree}")
    return json.loads(lines[-1]), loaded["core"]


def checkout(revision: str, where: Path) -> str:
    """A detached worktree of ``revision``, extensions built in place; its short hash."""
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(where), revision],
                   cwd=ROOT, check=True)
    if any(where.glob("tensorwire/**/*.pyx")):
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                       cwd=where, check=True, capture_output=True)
    return _short(where)


def _short(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree,
                          capture_output=True, text=True, check=True).stdout.strip()


def _spread(values: list[float]) -> str:
    return f"{min(values):,.1f}-{max(values):,.1f}"


def report(args: argparse.Namespace, trees: dict[str, str], cores: dict[str, str],
           rounds: list[dict[str, dict[str, float]]], took: float,
           load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    before, after = load
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    command = "python bench/before_after.py" + (
        f" --rounds {args.rounds}" if args.rounds != 3 else "") + (
        f" --before {args.before}" if args.before != BEFORE else "")
    title = ("The compiled core, before and after" if args.before == BEFORE
             else f"Tree {trees['before']} against tree {trees['after']}")
    lines = [
        f"# {title}",
        "",
        f"Command: `{command}` (took {took:.0f} s)",
        "",
        f"- CPU: {cpu}, {os.cpu_count()} cores, loopback only; Linux {platform.release()}; "
        f"Python {platform.python_version()}",
        f"- before: tree {trees['before']} (compiled core: {cores['before']}); after: tree "
        f"{trees['after']} (compiled core: {cores['after']}).",
        f"- Load average (1/5/15 min) before the run {before[0]:.2f}/{before[1]:.2f}/"
        f"{before[2]:.2f}, after {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f}.",
        f"- {len(rounds)} rounds; each round measures both trees, in alternating order, with "
        "bench/rpc.py's quick plan (the tiny echo: the p50 of 2,000 calls with one in "
        "flight, placement left to the OS; calls/s with 64 in flight over 1 s, the server "
        "and the client pinned to one CPU, as time per call), "
        "the functions of bench/collective.py (float32 sum allreduce in place, the median "
        "of 3 timed batches after a warm-up) and bench/ps.py (push_pull in synchronous "
        f"mode with SGD on the shards, 4 MiB tensors, the median of {PS_ROUNDS} steps after "
        "a warm-up; with 2 workers, the mean of their medians).",
        "- after / before is the ratio of times within a round: below 1 is faster. The "
        "verdict calls a case changed only when every round agrees.",
        "",
        "| case | before, median (µs) | before, range | after, median (µs) | after, range | "
        "after / before, median | after / before, range | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in rounds[0]["before"]:
        old = [r["before"][name] * 1e6 for r in rounds]
        new = [r["after"][name] * 1e6 for r in rounds]
        ratios = [n / o for n, o in zip(new, old, strict=True)]
        verdict = ("faster" if max(ratios) < 1 else "**slower**" if min(ratios) > 1
                   else "no clear change")
        lines.append(
            f"| {name} | {statistics.median(old):,.1f} | {_spread(old)} | "
            f"{statistics.median(new):,.1f} | {_spread(new)} | {statistics.median(ratios):.2f} "
            f"| {min(ratios):.2f}-{max(ratios):.2f} | {verdict} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="the earlier revision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.measure:
        import tensorwire

        try:
            from tensorwire import _compiled
        except ImportError:  # a tree from before the compiled core
            core = "none"
        else:
            core = ("none" if not _compiled.MODULES
                    else "loaded" if _compiled.status()["loaded"] else "not loaded")
        values = measure()
        print(json.dumps({"file": tensorwire.__file__, "core": core}))
        print(json.dumps(values))
        return

    started, load_before = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "before"
        trees = {"before": checkout(args.before, old_tree), "after": _short(ROOT)}
        paths = {"before": old_tree, "after": ROOT}
        rounds: list[dict[str, dict[str, float]]] = []
        cores: dict[str, str] = {}
        try:
            for number in range(args.rounds):
                order = ["before", "after"] if number % 2 == 0 else ["after", "before"]
                measured: dict[str, dict[str, float]] = {}
                for which in order:
                    print(f"round {number + 1}: {which} ({trees[which]}) ...", flush=True)
                    measured[which], cores[which] = run_tree(paths[which])
                rounds.append(measured)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT,
                           check=False)
    text = report(args, trees, cores, rounds, time.time() - started,
                  (load_before, os.getloadavg()))
    args.output.write_text(text)
    print(text)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
