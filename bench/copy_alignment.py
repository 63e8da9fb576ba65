"""How fast a large copy runs by where its source and destination start past
a 64-byte boundary: the kernel's cross-process copy (``process_vm_writev``,
the copy UCX's shared-memory transport ``cma`` makes for a ucx:// frame
between processes on one host) and glibc's ``memcpy`` (NumPy ``copyto``),
side by side in one run.

Why ucx:// tells the receiver where each frame lay (``FrameInfo.offset``):
a NumPy array of a megabyte or more starts 16 bytes past a 64-byte boundary
(malloc's header), and the receive buffers were 64-byte aligned.

    python bench/copy_alignment.py      # writes bench/results/copy_alignment.md
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tensorwire.transports._huge_pages import huge_page_empty

RESULTS = Path(__file__).parent / "results" / "copy_alignment.md"
#: (source offset, destination offset) past a 64-byte boundary.
CASES = [(0, 0), (16, 16), (16, 0), (0, 16), (32, 0), (48, 0), (8, 0), (2, 0)]


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _process_vm_writev() -> ctypes._CFuncPtr:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_writev
    fn.restype = ctypes.c_ssize_t
    return fn


def measure(size: int, repeats: int, rounds: int) -> dict[tuple[int, int], dict[str, list[float]]]:
    """GB/s of each case, per round (cases alternate within a round)."""
    writev = _process_vm_writev()
    src_raw = huge_page_empty(size + 4096)
    dst_raw = huge_page_empty(size + 4096)
    src_raw[:] = 1  # faulted in before anything is timed
    dst_raw[:] = 0
    pid = os.getpid()
    results: dict[tuple[int, int], dict[str, list[float]]] = {
        case: {"kernel": [], "memcpy": []} for case in CASES}

    def kernel(src: int, dst: int) -> None:
        local = _IOVec(src_raw.ctypes.data + src, size)
        remote = _IOVec(dst_raw.ctypes.data + dst, size)
        done = writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if done != size:
            raise OSError(ctypes.get_errno(), "process_vm_writev failed")

    def memcpy(src: int, dst: int) -> None:
        np.copyto(dst_raw[dst : dst + size], src_raw[src : src + size])

    for _ in range(rounds):
        for case in CASES:
            for name, copy in (("kernel", kernel), ("memcpy", memcpy)):
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    copy(*case)
                    times.append(time.perf_counter() - start)
                results[case][name].append(size / statistics.median(times) / 1e9)
    return results


def write(results: dict[tuple[int, int], dict[str, list[float]]], size: int, command: str,
          output: Path) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    lines = [
        "# Copy speed by alignment",
        "",
        f"Command: `{command}`",
        "",
        f"- CPU: {cpu}, {os.cpu_count()} cores; Linux {platform.release()}; "
        f"Python {platform.python_version()}; NumPy {np.__version__}",
        f"- {size >> 20} MiB copied within one process, source and destination backed by "
        "huge pages and faulted in before timing; each figure the median of the rounds' "
        "medians (GB/s, 1 GB = 1e9 bytes), min to max over the rounds in brackets.",
        "- kernel: `process_vm_writev`, the copy UCX's `cma` transport makes between two "
        "processes on one host (ucx:// rendezvous, `put_zcopy`); memcpy: NumPy `copyto`.",
        "",
        "| source offset | destination offset | kernel (GB/s) | memcpy (GB/s) |",
        "|---:|---:|---:|---:|",
    ]
    for (src, dst), by in results.items():
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f} to {max(v):.2f})"
                 for v in (by["kernel"], by["memcpy"])]
        lines.append(f"| {src} | {dst} | {cells[0]} | {cells[1]} |")
    lines.append("")
    output.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1 or args.size_mib < 1:
        parser.error("--size-mib, --repeats and --rounds must be at least 1")
    size = args.size_mib << 20
    results = measure(size, args.repeats, args.rounds)
    write(results, size, "python " + " ".join(["bench/copy_alignment.py", *sys.argv[1:]]),
          args.output)
    print(args.output.read_text())


if __name__ == "__main__":
    main()
