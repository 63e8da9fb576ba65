"""RPC benchmark: tensorwire RPC vs its raw transports vs grpc.aio, side by side.

Every variant runs as a server process and a client process (spawn context;
UCX reads its settings once per process, so each variant gets fresh ones):

- tensorwire RPC over tcp:// and ucx:// (``@rpc.method`` echo, called through
  a typed proxy; uvloop in both processes),
- the raw transport echo over tcp:// and ucx:// (``tensorwire.transports``
  ``listen``/``connect`` echoing the frames, no RPC; uvloop),
- grpc.aio unary-unary over TCP with a generic handler on bytes and identity
  serializers (the tensor travels as ``arr.tobytes()``, is rebuilt with
  ``np.frombuffer``; asyncio's default loop, as grpc.aio ships),
- the ceilings (bench/_rpc_bare.py): a bare ``asyncio.Protocol`` echo with
  write coalescing (the ceiling of any asyncio RPC on this host, tiny calls
  only), a bare blocking-socket echo (TCP's ceiling for large tensors) and
  raw ucxx in its blocking progress mode (ucx://'s ceiling), the last two
  receiving into preallocated NumPy buffers. Issue 22's targets are ratios
  to these, written as met or missed.

- RPC against its raw transport, paired: one server process hosts both the
  RPC echo and the raw echo on the same transport, and one client process
  alternates between them call by call and echo by echo, so that both see
  the same process placement and the same moment of this shared host. The
  targets that compare the RPC with its transport use these pairs. The
  same against grpc.aio for the targets that compare the RPC with gRPC,
  except that the RPC and grpc.aio each run in a server and a client
  process of their own (grpc.aio's threads slowed the RPC beside them in
  one process), the RPC's client handing every other turn to the gRPC
  client over a pipe; both on uvloop there, which grpc.aio supports.

- calls/s with 64 in flight against the bare Protocol echo, paired on one
  CPU: the RPC and the echo each in a server and a client process of their
  own, all four pinned to the one CPU, the clients taking turns of a quarter
  of a second (the idle side's server stopped). Unpaired, each pair of
  processes on one CPU read the RPC from 198,827 to 323,649 calls/s between
  the rounds of one run; the paired turns see the same moments of the
  host, and the one-CPU target reads them.

- instructions per tiny call, counted by valgrind's callgrind with the
  client and the server in one process (64 calls in flight over tcp://
  loopback): the RPC against the floor above. Times on this shared host
  swing by half or more within an hour; the count moves by a few percent
  from run to run (how many messages one read takes in still depends on
  timing; the floor's small count moves most), so it tracks the cost of a
  call from one commit to the next far better. Skipped without valgrind.

Measurements: a tiny call's latency (p50/p99, one call in flight) and calls
per second with 1 and 64 calls in flight (64 in flight again with both
processes on one CPU and with the pair on two CPUs); echo bandwidth of a
float32 tensor of 1, 64 and 256 MiB (GB/s counting both directions, median
of a few echoes after a warm-up). tensorwire's receivers allocate a fresh
buffer per message (the transports' default allocator), as an RPC must.
With ``--busy``, the tiny-call latency of the RPC and of the ceilings again
beside one busy-looping process per core.

The code: bench/_rpc_variants.py (the plan, the variants, tensorwire's and
grpc.aio's servers and callers), _rpc_bare.py (the ceilings),
_rpc_measure.py (processes, measuring, busy neighbours), _rpc_report.py
(tables and targets), _rpc_instructions.py (``--instructions``).

    python bench/rpc.py                  # writes bench/results/rpc.md (3 rounds, ~15 min)
    python bench/rpc.py --quick          # one round of shorter runs (~3 min)
    python bench/rpc.py --profile DIR    # cProfile the 64-in-flight tcp:// case
    python bench/rpc.py --pin            # server and client on fixed, different CPUs
    python bench/rpc.py --instructions   # only the instruction counts (~4 min)
    python bench/rpc.py --busy           # also beside one busy loop per core

``--pin`` puts every server and client on two fixed, different CPUs (see
``placement``); by default the OS places them, except for the calls/s with
64 in flight, which run again in pinned pairs of their own (see
``write_results``). ``--tcp-spin SECONDS`` runs tensorwire's tcp:// with
``TransportConfig(tcp_spin=SECONDS)`` (default: the library's, 200 µs; 0 never
spins).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from _rpc_instructions import _calls_in_one_process, instructions_per_call
from _rpc_measure import run_variant
from _rpc_report import _load, combine, combine_cps_pair, combine_pair, write_results
from _rpc_variants import (
    BUSY_VARIANTS,
    CONCURRENCY,
    PAIRED,
    PINNED_CPS64,
    RESULTS,
    VARIANTS,
    Plan,
)
from _spin_setting import TCP_SPIN_VARIABLE


def profile(directory: Path, plan: Plan, *, cprofile: bool = True, pin: bool = False) -> None:
    """cProfile the 64-in-flight tcp:// RPC case in both processes; print the top."""
    import pstats

    directory.mkdir(parents=True, exist_ok=True)
    variant = VARIANTS[0]
    result = run_variant(variant, plan, timeout=300, profile_dir=directory if cprofile else None,
                         only="cps64", where="two" if pin else "os")
    how = "under cProfile" if cprofile else "unprofiled"
    print(f"{variant.name}, {CONCURRENCY} in flight {how}: {result}", file=sys.stderr)
    if not cprofile:
        return
    for role in ("client", "server"):
        path = directory / f"{role}.prof"
        if not path.exists():
            print(f"no profile from the {role}", file=sys.stderr)
            continue
        print(f"\n===== {role}: top functions by self time =====")
        pstats.Stats(str(path)).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--no-ucx", action="store_true", help="skip the ucx:// variants")
    parser.add_argument("--rounds", type=int, default=None,
                        help="run every variant this many times, round-robin, and report the "
                             "median of each number (default 3, with --quick 1)")
    parser.add_argument("--pin", action="store_true",
                        help="pin every server to the first allowed CPU and every client to "
                             "the second (default: the OS places them)")
    parser.add_argument("--busy", action="store_true",
                        help="also measure the tiny-call latency of the RPC and the ceilings "
                             "beside one busy-looping process per CPU")
    parser.add_argument("--tcp-spin", type=float, metavar="SECONDS",
                        help="TransportConfig.tcp_spin for tensorwire over tcp:// (default: "
                             "the library's)")
    parser.add_argument("--only", metavar="TEXT", action="append", default=[],
                        help="run only the variants whose name contains TEXT (repeatable; "
                             "for development)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--instructions", action="store_true",
                        help="only count the instructions per tiny call (needs valgrind)")
    parser.add_argument("--count-calls", nargs=2, metavar=("KIND", "CALLS"),
                        help=argparse.SUPPRESS)  # the process that --instructions counts
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="only cProfile tensorwire RPC over tcp:// with 64 calls in flight, "
                             "writing DIR/client.prof and DIR/server.prof")
    parser.add_argument("--profiler", choices=("cprofile", "none"), default="cprofile",
                        help="with --profile: 'none' runs the case unprofiled, for an outside "
                             "sampler (py-spy record --subprocesses -- python bench/rpc.py ...)")
    args = parser.parse_args()
    if args.tcp_spin is not None:
        # Read by every process started from here (bench/_rpc_variants.py).
        os.environ[TCP_SPIN_VARIABLE] = repr(args.tcp_spin)
    if args.count_calls:
        import uvloop

        kind, calls = args.count_calls
        uvloop.run(_calls_in_one_process(kind, int(calls)))
        return
    if args.instructions:
        for kind in ("rpc", "floor"):
            print(f"{kind}: {instructions_per_call(kind)} instructions per call")
        return
    plan = Plan.quick() if args.quick else Plan()
    if args.profile is not None:
        profile(args.profile, plan, cprofile=args.profiler == "cprofile", pin=args.pin)
        return
    rounds = max(1, args.rounds if args.rounds is not None else (1 if args.quick else 3))
    started, load_before = time.perf_counter(), _load()
    runs: dict[str, list[dict[str, Any] | str]] = {}
    busy_runs: dict[str, list[dict[str, Any] | str]] = {}
    main_placement = "two" if args.pin else "os"
    chosen = [v for v in VARIANTS
              if not (args.no_ucx and (v.url.startswith("ucx://") or v.kind == "ucxx"))
              and (not args.only or any(text in v.name for text in args.only))]
    for round_ in range(rounds):
        step = f"round {round_ + 1}/{rounds}"
        for variant in chosen:
            print(f"{step}: {variant.name} ...", file=sys.stderr)
            result = run_variant(variant, plan, timeout=240,
                                 where=variant.placed or main_placement)
            if isinstance(result, dict) and "cps64" in result:
                result[f"cps64_{main_placement}"] = result.pop("cps64")
            if variant.kind in PINNED_CPS64 and isinstance(result, dict):
                for where in ("one", "two"):
                    if where == main_placement:
                        continue
                    print(f"{step}: {variant.name}, 64 in flight, {where} CPU(s) ...",
                          file=sys.stderr)
                    pinned = run_variant(variant, plan, timeout=240, only="cps64", where=where)
                    if isinstance(pinned, dict) and "cps64" in pinned:
                        result[f"cps64_{where}"] = pinned["cps64"]
                    else:
                        result["errors"].append(f"64 in flight on {where} CPU(s): {pinned}")
            runs.setdefault(variant.name, []).append(result)
            print(f"  {result}", file=sys.stderr)
        if args.busy:
            for variant in chosen:
                if variant.name not in BUSY_VARIANTS:
                    continue
                print(f"{step}: {variant.name}, busy host ...", file=sys.stderr)
                result = run_variant(variant, plan, timeout=120, only="tiny", busy=True)
                busy_runs.setdefault(variant.name, []).append(result)
                print(f"  {result}", file=sys.stderr)
    counts: dict[str, float | str] = {}
    if not args.quick:
        for kind in ("rpc", "floor"):
            print(f"counting the instructions of a tiny call: {kind} ...", file=sys.stderr)
            counts[kind] = instructions_per_call(kind)
    kinds = {v.name: v.kind for v in VARIANTS}
    rows = {name: (combine_cps_pair(results, PAIRED[kinds[name]]) if kinds[name] == "pair-floor"
                   else combine_pair(results, PAIRED[kinds[name]]) if kinds[name] in PAIRED
                   else combine(results))
            for name, results in runs.items()}
    busy_rows = {name: combine(results) for name, results in busy_runs.items()}
    write_results(args.output, plan, rows, " ".join(["python", *sys.argv]),
                  time.perf_counter() - started, load_before, runs, pin=args.pin,
                  counts=counts, busy_rows=busy_rows)


if __name__ == "__main__":
    main()
