"""Benchmark the serde codec against pickle and plain msgpack; writes bench/results/serde.md.

Run from the repository root::

    python bench/serde.py            # full run, incl. the 1 GiB case
    python bench/serde.py --quick    # fewer repetitions, no 1 GiB case

Each figure is the median over repetitions of encode time, decode time and
their sum (``time.perf_counter_ns``); fast cases time a batch of calls per
repetition and divide. This script measures and reports; it never asserts.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from tensorwire import serde

Codec = tuple[Callable[[Any], Any], Callable[[Any], Any]]


def _tensorwire(threshold: int = serde.DEFAULT_INLINE_THRESHOLD) -> Codec:
    enc = serde.Encoder(inline_threshold=threshold)
    dec = serde.Decoder()
    return enc.encode, lambda msg: dec.decode(*msg)


def _pickle5() -> Codec:
    def dumps(obj: Any) -> Any:
        bufs: list[pickle.PickleBuffer] = []
        return pickle.dumps(obj, protocol=5, buffer_callback=bufs.append), bufs

    return dumps, lambda msg: pickle.loads(msg[0], buffers=msg[1])


def _pickle_default() -> Codec:
    return pickle.dumps, pickle.loads


def _to_plain(obj: Any) -> Any:
    if type(obj) is np.ndarray:
        return {"__nd__": True, "dtype": obj.dtype.str, "shape": obj.shape, "data": obj.tobytes()}
    if type(obj) is dict:
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _from_plain(obj: Any) -> Any:
    if type(obj) is dict:
        if obj.get("__nd__"):
            return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
        return {k: _from_plain(v) for k, v in obj.items()}
    return obj


def _msgpack_tobytes() -> Codec:
    packer = msgpack.Packer(use_bin_type=True)
    return (
        lambda obj: packer.pack(_to_plain(obj)),
        lambda data: _from_plain(msgpack.unpackb(data)),
    )


CODECS: dict[str, Callable[[], Codec]] = {
    "tensorwire": _tensorwire,
    "tensorwire inline<2KiB": lambda: _tensorwire(2048),
    "pickle5 out-of-band": _pickle5,
    "pickle default": _pickle_default,
    "msgpack tobytes": _msgpack_tobytes,
}


#: Codecs that copy the array data (slow at 1 GiB).
COPYING = frozenset({"pickle default", "msgpack tobytes"})


def _measure(codec: Codec, value: Any, reps: int, batch: int) -> tuple[float, float, float]:
    """Median encode, decode and encode+decode time in microseconds."""
    encode, decode = codec
    decode(encode(value))  # warm up
    enc_t: list[float] = []
    dec_t: list[float] = []
    tot_t: list[float] = []
    gc.collect()
    for _ in range(reps):
        msgs = []
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            msgs.append(encode(value))
        t1 = time.perf_counter_ns()
        for msg in msgs:
            decode(msg)
        t2 = time.perf_counter_ns()
        del msgs
        enc_t.append((t1 - t0) / batch / 1e3)
        dec_t.append((t2 - t1) / batch / 1e3)
        tot_t.append((t2 - t0) / batch / 1e3)
    return statistics.median(enc_t), statistics.median(dec_t), statistics.median(tot_t)


def _msgpack_floor() -> float:
    """Median microseconds of a bare Packer.pack + unpackb of the RPC dict."""
    value = {
        "method": "Store.put",
        "key": "layer3.weight",
        "step": 1234,
        "lr": 0.001,
        "flags": [True, False],
        "tags": {"a": 1},
    }
    packer = msgpack.Packer()
    times = []
    for _ in range(100):
        t0 = time.perf_counter_ns()
        for _ in range(200):
            msgpack.unpackb(packer.pack(value))
        times.append((time.perf_counter_ns() - t0) / 200 / 1e3)
    return statistics.median(times)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, skip 1 GiB")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serde.md")
    args = parser.parse_args(argv)
    scale = 0.2 if args.quick else 1.0

    def reps(n: int) -> int:
        return max(3, int(n * scale))

    rpc = {
        "method": "Store.put",
        "key": "layer3.weight",
        "step": 1234,
        "lr": 0.001,
        "flags": [True, False],
        "tags": {"a": 1},
    }
    cases: list[tuple[str, Callable[[], Any], int, int, list[str]]] = [
        ("(a) float32 1 MiB", lambda: np.ones(1 << 18, np.float32), reps(300), 20, []),
        ("(a) float32 64 MiB", lambda: np.ones(1 << 24, np.float32), reps(30), 1, []),
    ]
    if not args.quick:
        cases.append(("(a) float32 1 GiB", lambda: np.ones(1 << 28, np.float32), reps(30), 1, []))
    cases += [
        (
            "(b) dict of 1,000 x 1 KiB float32",
            lambda: {f"layer{i}.weight": np.ones(256, np.float32) for i in range(1000)},
            reps(50),
            1,
            [],
        ),
        ("(c) RPC argument dict", lambda: rpc, reps(300), 200, ["tensorwire inline<2KiB"]),
    ]
    results: dict[str, dict[str, tuple[float, float, float]]] = {}
    for name, make, n, batch, skip in cases:
        big = "GiB" in name
        value = make()
        results[name] = {}
        for cname, factory in CODECS.items():
            if cname in skip or (cname == "tensorwire inline<2KiB" and name.startswith("(a)")):
                continue
            # Copying codecs take seconds per 1 GiB round trip: few repetitions
            # for them there; zero-copy ones get the full count (noise).
            n_codec = min(n, 3) if big and cname in COPYING else n
            results[name][cname] = _measure(factory(), value, n_codec, batch)
            print(f"{name:36s} {cname:24s} {results[name][cname][2]:12.2f} us", flush=True)
        del value
        gc.collect()
    _write(args, results)
    return 0


def _fmt(us: float) -> str:
    if us >= 10_000:
        return f"{us / 1e3:,.1f} ms"
    return f"{us:,.2f} µs"


def _write(
    args: argparse.Namespace, results: dict[str, dict[str, tuple[float, float, float]]]
) -> None:
    cols = list(CODECS)
    lines = [
        "# serde benchmark",
        "",
        "Encode + decode time, median over repetitions (`time.perf_counter_ns`);",
        "cells are `total (encode + decode)`. Decoding gets the encoder's own buffers",
        "(in-process round trip; no transport). The 1 GiB row uses 3 repetitions for",
        "the copying codecs (pickle default, msgpack tobytes), 30 for the others.",
        "",
        f"- command: `python bench/serde.py{' --quick' if args.quick else ''}`",
        f"- python {platform.python_version()}, numpy {np.__version__}, "
        f"msgpack {'.'.join(map(str, msgpack.version))}, tensorwire serde default "
        f"inline_threshold = {serde.DEFAULT_INLINE_THRESHOLD} bytes",
        f"- CPU: {_cpu()} ({platform.machine()}), {sys.platform}",
        "",
        "| case | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for case, row in results.items():
        cells = []
        for c in cols:
            if c in row:
                e, d, t = row[c]
                cells.append(f"{_fmt(t)} ({_fmt(e)} + {_fmt(d)})")
            else:
                cells.append("-")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines += ["", "## Targets", ""]
    a = {k: v for k, v in results.items() if k.startswith("(a)")}
    tw_a = [v["tensorwire"][2] for v in a.values()]
    spread = max(tw_a) / min(tw_a)
    lines.append(
        f"- (a) time independent of array size: tensorwire {_fmt(min(tw_a))} .. {_fmt(max(tw_a))} "
        f"(max/min {spread:.2f}x) — {'MET' if spread < 2 else 'MISSED'}"
    )
    for case, row in a.items():
        ratio = row["tensorwire"][2] / row["pickle5 out-of-band"][2]
        lines.append(
            f"- {case}: within 2x of pickle5 out-of-band: {ratio:.2f}x — "
            f"{'MET' if ratio <= 2 else 'MISSED'}"
        )
    for case in results:
        if case.startswith(("(b)", "(c)")):
            row = results[case]
            p5 = row["pickle5 out-of-band"][2]
            for c in ("tensorwire", "tensorwire inline<2KiB"):
                if c in row:
                    ratio = row[c][2] / p5
                    lines.append(
                        f"- {case}, {c}: faster than pickle5 out-of-band: {ratio:.2f}x of its "
                        f"time — {'MET' if ratio < 1 else 'MISSED'}"
                    )
    floor = _msgpack_floor()
    lines += [
        "",
        "## Notes",
        "",
        "- Default: arrays of 1 KiB (>= `inline_threshold`) go out of band; smaller ones",
        "  are copied into the header. The inline column shows why the default is not",
        "  higher: an inline array costs a copy into the header and a copy out of it (so",
        "  that the decoded array is writable and aligned), where an out-of-band one",
        "  costs a byte view on each side. (A transport pays per buffer, a frame and an",
        "  iovec, which this in-process benchmark does not see.)",
        "- (c) floor: msgpack alone (one `Packer.pack` + `unpackb` of the same dict, no",
        f"  prefix, no checks) takes {_fmt(floor)}, which is already "
        f"{floor / results['(c) RPC argument dict']['pickle5 out-of-band'][2]:.0%} of",
        "  pickle5's total. tensorwire adds, per call: the header prefix and its checks,",
        "  a scan of the packed body for bin markers and container markers (to prove the",
        "  C fast path equals the Python walk: no bytes-likes, depth within limits), a",
        "  check that no top-level value is a bytes-like (so that a big blob is not",
        "  copied into a header that is then thrown away), and buffer bookkeeping.",
        "  Profiling (cProfile) shows no single hot spot left: the rest is",
        "  per-call Python overhead of a few attribute loads and calls. Beating",
        "  pickle here would need a C extension (as msgspec is) or dropping a check.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
