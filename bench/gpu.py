"""GPU benchmark: device-to-device echo and allreduce between processes on one GPU.

Side by side in one run, each pair in processes of its own:

- echo of a CuPy array, 1 MiB to 1 GiB: tensorwire RPC over ucx:// (the
  client calls ``Echo.echo(x)``, the server's handler returns the array it
  received) against raw ucxx in its blocking mode with the same buffers
  (preallocated on both sides, tag send and receive), and against a CuPy
  device-to-device copy in one process, the physical ceiling. An echo moves
  the array twice: GB/s = 2 * size / round trip; the copy's GB/s = size / time.
- allreduce of float32 CuPy arrays by 2 processes: tensorwire over ucx://
  against torch.distributed with NCCL on the same GPU, where NCCL allows two
  ranks on one device (where it refuses, the table says so and why).
  busbw = size / time * 2 (n - 1) / n, as nccl-tests reports it.

    python bench/gpu.py                  # writes bench/results/gpu.md
    python bench/gpu.py --quick          # fewer sizes and repetitions

Needs a CUDA device, CuPy and ucxx (scripts/gpu-check installs what is
missing and runs this). UCX prints its protocol choices for the tensorwire
pair (UCX_PROTO_INFO), and the results name the transports it chose for
device memory (cuda_ipc moves it GPU to GPU; cuda_copy would stage it).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.gpu._procs reads UCX's protocol tables
sys.path.insert(0, str(ROOT / "bench"))
import _gpu_trace  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu.md"
MiB = 1 << 20
SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB]
QUICK_SIZES = [1 * MiB, 16 * MiB, 256 * MiB]
ALLREDUCE_SIZES = [1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_ALLREDUCE_SIZES = [1 * MiB, 64 * MiB]
TARGET_FROM = 16 * MiB
TARGET_RATIO = 0.9
_TAG_DATA, _TAG_BACK = 2, 3
_HEAD = struct.Struct("<QQ")  # size, count of a round


def repetitions(size: int, quick: bool) -> int:
    budget = (2 if quick else 8) << 30  # bytes echoed per size
    return max(5, min(200 if not quick else 50, budget // size))


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def time_echoes(echo: Any, sizes: list[int], quick: bool, before: Any = None) -> None:
    """Report the median round trip of ``await echo(data)`` for a CuPy array of
    each size (two untimed first), and whether what came back is equal.
    ``before(size, count)`` is awaited first (a peer that must be told)."""
    import cupy

    for size in sizes:
        data = cupy.ones(size, cupy.uint8)
        count = repetitions(size, quick) + 2
        if before is not None:
            await before(size, count)
        samples = []
        back = None
        for i in range(count):
            _gpu_trace.mark("start", size)
            start = time.perf_counter()
            back = await echo(data)
            _gpu_trace.mark("end", size)
            if i >= 2:
                samples.append(time.perf_counter() - start)
        ok = back is not None and bool((cupy.asarray(back) == data).all())
        report(size=size, seconds=statistics.median(samples), ok=ok)
        del data, back


def peer_env(proto_info: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["UCX_RNDV_SCHEME"] = "put_zcopy"  # as ucx:// sets it
    if proto_info:
        env["UCX_PROTO_INFO"] = "y"
        env["UCX_LOG_LEVEL"] = "info"
    return env


def spawn(*args: str, proto_info: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, "--role", *args], cwd=ROOT,
                            env=peer_env(proto_info), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def first_json(child: subprocess.Popen[str]) -> dict[str, Any]:
    """The child's first JSON line; the rest of its output is drained behind it
    (a full pipe would stop a server that UCX makes talkative)."""
    assert child.stdout is not None
    seen = []
    for line in child.stdout:
        if line.startswith("{"):
            found: dict[str, Any] = json.loads(line)
            threading.Thread(target=child.stdout.read, daemon=True).start()
            return found
        seen.append(line)
    raise RuntimeError("peer ended early:\n" + "".join(seen)[-3000:])


def finish_all(children: list[subprocess.Popen[str]],
               timeout: float) -> list[tuple[list[dict[str, Any]], str]]:
    """Each child's JSON lines and output, read side by side.

    Raises:
        RuntimeError: a child failed or outran ``timeout`` (all are killed).
    """
    def finish(child: subprocess.Popen[str]) -> tuple[list[dict[str, Any]], str]:
        out, _ = child.communicate(timeout=timeout)
        if child.returncode != 0:
            raise RuntimeError(f"peer failed ({child.returncode}):\n{out[-3000:]}")
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")], out

    pool = concurrent.futures.ThreadPoolExecutor(len(children))
    futures = [pool.submit(finish, child) for child in children]
    try:
        for future in concurrent.futures.as_completed(futures):
            future.result()  # the first failure stops the others
        return [future.result() for future in futures]
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"timed out after {timeout:.0f} s") from exc
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        pool.shutdown()


# -- the ceiling in one process: a device-to-device copy -----------------------------


def copy_rates(sizes: list[int], quick: bool) -> dict[int, float]:
    import cupy

    rates = {}
    for size in sizes:
        src = cupy.ones(size, cupy.uint8)
        dst = cupy.empty_like(src)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        samples = []
        for i in range(repetitions(size, quick) + 2):
            start.record()
            cupy.copyto(dst, src)
            end.record()
            end.synchronize()
            if i >= 2:
                samples.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        rates[size] = size / statistics.median(samples)
        del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return rates


# -- raw ucxx, blocking mode, preallocated buffers --------------------------------


async def _ucxx_endpoint(ucxx: Any, reader: Any, writer: Any) -> Any:
    ours = bytes(ucxx.get_worker_address())
    writer.write(_HEAD.pack(len(ours), 0) + ours)
    await writer.drain()
    size, _ = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    theirs = await reader.readexactly(size)
    address = ucxx.get_ucx_address_from_buffer(theirs)
    return await ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)


#: How a raw ucxx pair shapes its messages (``--shapes``): "preallocated" posts
#: the receive into a buffer kept per size before the data comes (the
#: ceiling); "header first" sends a small host message with the size first
#: and the receiver posts the data's receive only when that has arrived, as a
#: ucx:// message does; "header first, fresh buffers" also allocates each
#: receive buffer from CuPy's pool on arrival, as ucx:// does. The
#: differences say what the ucx:// message shape costs on its own.
RAW_SHAPES = ("preallocated", "header", "fresh")
_TAG_HEAD_DATA, _TAG_HEAD_BACK = 4, 5


async def _raw_recv(ep: Any, shape: str, tag: int, head_tag: int,
                    kept: Any) -> Any:
    """One message as ``shape`` receives it; ``kept``: the buffer of its size."""
    import cupy
    import numpy

    if shape == "preallocated":
        await ep.recv(kept, tag=tag, force_tag=True)
        return kept
    head = numpy.empty(1, numpy.uint64)
    await ep.recv(head, tag=head_tag, force_tag=True)
    buf = kept if shape == "header" else cupy.empty(int(head[0]), cupy.uint8)
    await ep.recv(buf, tag=tag, force_tag=True)
    return buf


async def _raw_send(ep: Any, shape: str, data: Any, tag: int, head_tag: int) -> None:
    import numpy

    if shape != "preallocated":
        await ep.send(numpy.array([data.nbytes], numpy.uint64), tag=head_tag, force_tag=True)
    await ep.send(data, tag=tag, force_tag=True)


def raw_server(shape: str = "preallocated") -> None:
    import cupy
    import ucxx

    async def main() -> None:
        cupy.cuda.Device(0).use()
        ucxx.init(progress_mode="blocking")
        done = asyncio.Event()

        async def serve(reader: Any, writer: Any) -> None:
            ep = await _ucxx_endpoint(ucxx, reader, writer)
            while True:
                head = await reader.readexactly(_HEAD.size)
                size, count = _HEAD.unpack(head)
                if size == 0:
                    break
                kept = cupy.empty(size, cupy.uint8)
                for _ in range(count):
                    buf = await _raw_recv(ep, shape, _TAG_DATA, _TAG_HEAD_DATA, kept)
                    await _raw_send(ep, shape, buf, _TAG_BACK, _TAG_HEAD_BACK)
                del kept, buf
            writer.close()
            done.set()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        report(address=server.sockets[0].getsockname()[1])
        await done.wait()
        server.close()

    asyncio.run(main())


def raw_client(port: str, sizes: list[int], quick: bool, shape: str = "preallocated") -> None:
    import cupy
    import ucxx

    async def main() -> None:
        cupy.cuda.Device(0).use()
        ucxx.init(progress_mode="blocking")
        reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
        ep = await _ucxx_endpoint(ucxx, reader, writer)
        backs: dict[int, Any] = {}  # one receive buffer per size, as a raw user keeps

        async def announce(size: int, count: int) -> None:
            backs.clear()
            backs[size] = cupy.empty(size, cupy.uint8)
            writer.write(_HEAD.pack(size, count))
            await writer.drain()

        async def echo(data: Any) -> Any:
            await _raw_send(ep, shape, data, _TAG_DATA, _TAG_HEAD_DATA)
            return await _raw_recv(ep, shape, _TAG_BACK, _TAG_HEAD_BACK,
                                   backs[data.size])

        await time_echoes(echo, sizes, quick, announce)
        writer.write(_HEAD.pack(0, 0))
        await writer.drain()
        writer.close()

    asyncio.run(main())


# -- tensorwire over ucx://: the RPC, and its transport alone ---------------------------


def transport_config() -> Any:
    """ucx:// settings of the tensorwire roles: progress mode and spin from
    ``GPU_BENCH_UCX`` (``mode,spin``; set by ``--progress`` and ``--spin``)."""
    from tensorwire.transports import TransportConfig, UCXOptions

    mode, _, spin = os.environ.get("GPU_BENCH_UCX", "blocking,").partition(",")
    options = UCXOptions(progress_mode=mode) if not spin else UCXOptions(
        progress_mode=mode, spin=float(spin))
    return TransportConfig(ucx=options)


def run(role: str, main: Any) -> None:
    """``asyncio.run(main())``; under cProfile when ``GPU_BENCH_PROFILE`` names
    a folder (``--profile``), which gets the role's top functions."""
    folder = os.environ.get("GPU_BENCH_PROFILE")
    if not folder:
        asyncio.run(main())
        return
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.runcall(asyncio.run, main())
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    Path(folder, f"profile-{role}.txt").write_text(text.getvalue())


def conn_server() -> None:
    import cupy

    from tensorwire.transports import listen

    async def main() -> None:
        cupy.cuda.Device(0).use()
        done = asyncio.Event()

        async def echo(conn: Any) -> None:
            while True:
                frames = await conn.recv()
                if len(frames) == 1:
                    break  # the client's goodbye
                await conn.send(frames[1:])
            await conn.close()
            done.set()

        listener = await listen("ucx://127.0.0.1:0", echo, config=transport_config())
        report(address=listener.address)
        await done.wait()
        await listener.close()

    run("conn-server", main)


def conn_client(address: str, sizes: list[int], quick: bool) -> None:
    import cupy

    from tensorwire.transports import connect

    async def main() -> None:
        cupy.cuda.Device(0).use()
        conn = await connect(address, config=transport_config())

        async def echo(data: Any) -> Any:
            await conn.send([b"echo", data])
            (back,) = await conn.recv()
            return back

        await time_echoes(echo, sizes, quick)
        await conn.send([b"end"])
        await conn.close()

    run("conn-client", main)


def tw_server() -> None:
    import cupy

    from tensorwire import Server, rpc
    from tensorwire.rpc import ServerConfig

    class Echo(rpc.Service):
        @rpc.method
        async def echo(self, x: Any) -> Any:
            return x

        @rpc.method
        async def stop(self) -> None:
            done.set()

    async def main() -> None:
        cupy.cuda.Device(0).use()
        server = Server([Echo()], config=ServerConfig(transport=transport_config()))
        (address,) = await server.start("ucx://127.0.0.1:0")
        report(address=address)
        await done.wait()
        await server.close(grace=1)

    done = asyncio.Event()
    run("tw-server", main)


def tw_client(address: str, sizes: list[int], quick: bool) -> None:
    import cupy

    from tensorwire import connect

    async def main() -> None:
        cupy.cuda.Device(0).use()
        async with connect(address, timeout=300, transport=transport_config()) as client:
            await time_echoes(functools.partial(client.call, "Echo.echo"), sizes, quick)
            stats = client.transport_stats()[address]
            report(staged=stats["device_bytes_staged"])
            await client.call("Echo.stop")

    run("tw-client", main)


def echo_pair(server_role: str, client_role: str, sizes: list[int],
              quick: bool) -> tuple[dict[int, float], str, int | None]:
    """Rates by size, the client's output, and its staged bytes (tensorwire)."""
    server = spawn(server_role, proto_info=server_role == "tw-server")
    try:
        address = str(first_json(server)["address"])
        client = spawn(client_role, address, ",".join(map(str, sizes)), str(int(quick)),
                       proto_info=client_role == "tw-client")
        ((found, out),) = finish_all([client], timeout=400)
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
    rates = {}
    staged = None
    for r in found:
        if "size" in r:
            if not r["ok"]:
                raise RuntimeError(f"{client_role}: echo of {r['size']} bytes came back wrong")
            rates[int(r["size"])] = 2 * r["size"] / r["seconds"]
        elif "staged" in r:
            staged = int(r["staged"])
    return rates, out, staged


# -- allreduce ---------------------------------------------------------------------------


def tw_rank(rank: str, world: str, master: str, sizes: list[int], quick: bool) -> None:
    import cupy

    from tensorwire.collective import Group, GroupConfig

    async def main() -> None:
        cupy.cuda.Device(0).use()
        group = await Group.create(rank=int(rank), world_size=int(world), master=master,
                                   listen="ucx://127.0.0.1:0",
                                   config=GroupConfig(timeout=300, rendezvous_timeout=120,
                                                      transport=transport_config()))
        try:
            for size in sizes:
                x = cupy.ones(size // 4, cupy.float32)
                samples = []
                for i in range(max(3, repetitions(size, quick) // 4) + 2):
                    x.fill(1)
                    cupy.cuda.get_current_stream().synchronize()
                    start = time.perf_counter()
                    await group.allreduce(x)
                    cupy.cuda.get_current_stream().synchronize()
                    if i >= 2:
                        samples.append(time.perf_counter() - start)
                ok = bool((x == int(world)).all())
                report(size=size, seconds=statistics.median(samples), ok=ok)
        finally:
            await group.close()

    asyncio.run(main())


def nccl_rank(rank: str, world: str, port: str, sizes: list[int], quick: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    os.environ.setdefault("NCCL_DEBUG", "WARN")  # says why it refuses
    try:
        dist.init_process_group("nccl", rank=int(rank), world_size=int(world),
                                device_id=torch.device("cuda", 0),
                                timeout=datetime.timedelta(seconds=60))
        for size in sizes:
            x = torch.ones(size // 4, dtype=torch.float32, device="cuda")
            samples = []
            for i in range(max(3, repetitions(size, quick) // 4) + 2):
                x.fill_(1)
                torch.cuda.synchronize()
                start = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize()
                if i >= 2:
                    samples.append(time.perf_counter() - start)
            report(size=size, seconds=statistics.median(samples),
                   ok=bool((x == int(world)).all()))
        dist.destroy_process_group()
    except Exception as exc:
        report(refused=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        sys.stdout.flush()
        os._exit(0)  # NCCL's threads may hold the interpreter up


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def allreduce_variant(kind: str, sizes: list[int], quick: bool,
                      world: int = 2) -> tuple[dict[int, float], str | None]:
    """busbw by size, or why the variant could not run."""
    port = str(free_port())
    role, master = ("tw-rank", f"tcp://127.0.0.1:{port}") if kind == "tensorwire" else (
        "nccl-rank", port)
    children = [spawn(role, str(rank), str(world), master, ",".join(map(str, sizes)),
                      str(int(quick))) for rank in range(world)]
    try:
        outputs = finish_all(children, timeout=240 if kind == "tensorwire" else 90)
    except RuntimeError as exc:
        return {}, " ".join(str(exc).split())[:400]
    results = [found for found, _ in outputs]
    refused = [r["refused"] for r in results[0] if "refused" in r]
    if refused:
        warnings = sorted({line.split("NCCL WARN", 1)[1].strip() for _, out in outputs
                           for line in out.splitlines() if "NCCL WARN" in line})
        return {}, "; ".join([refused[0], *warnings])[:600]
    factor = 2 * (world - 1) / world
    rates = {}
    for r in results[0]:
        if not r["ok"]:
            return {}, f"wrong result at {r['size']} bytes"
        rates[int(r["size"])] = r["size"] / r["seconds"] * factor
    return rates, None


# -- the report -------------------------------------------------------------------------


def environment() -> list[str]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    driver = cupy.cuda.runtime.driverGetVersion()
    runtime = cupy.cuda.runtime.runtimeGetVersion()
    smi = ""
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             check=False).stdout.strip()
    tree = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()
    lines = [f"- tensorwire tree: {tree or 'not a git checkout'}",
             f"- device: {name} ({props['totalGlobalMem'] / 2**30:.0f} GiB), "
             f"driver {smi or driver}, CUDA driver API {driver}, runtime {runtime}",
             f"- Python {platform.python_version()}, CuPy {cupy.__version__}"]
    for dist in ("ucxx-cu13", "libucx-cu13", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            lines.append(f"- {dist} {importlib.metadata.version(dist)}")
    return lines


def gbps(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / 1e9:.1f}"


def main() -> None:
    if "--role" in sys.argv:
        index = sys.argv.index("--role")
        role, *args = sys.argv[index + 1:]
        if os.environ.get("GPU_BENCH_TRACE"):
            os.environ["GPU_BENCH_ROLE"] = role.replace(":", "_")
            _gpu_trace.start()
        # A raw ucxx role may name its message shape: raw-server:header.
        role, _, shape = role.partition(":")
        shaped = {"shape": shape} if shape else {}
        servers = {"raw-server": raw_server, "tw-server": tw_server, "conn-server": conn_server}
        if role in servers:
            servers[role](**shaped)
            return
        *head, sizes, quick = args
        clients = {"raw-client": raw_client, "tw-client": tw_client, "conn-client": conn_client,
                   "tw-rank": tw_rank,
                   "nccl-rank": nccl_rank}
        clients[role](*head, [int(s) for s in sizes.split(",")], bool(int(quick)), **shaped)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the table")
    parser.add_argument("--progress", choices=("blocking", "polling"), default="blocking",
                        help="UCXOptions.progress_mode of the tensorwire processes")
    parser.add_argument("--spin", type=float, help="UCXOptions.spin of the tensorwire processes")
    parser.add_argument("--no-allreduce", action="store_true", help="the echo table only")
    parser.add_argument("--shapes", action="store_true",
                        help="also time raw ucxx with the ucx:// message shape (RAW_SHAPES)")
    parser.add_argument("--trace", type=Path,
                        help="a folder for call traces of every peer (bench/_gpu_trace.py)")
    parser.add_argument("--profile", type=Path,
                        help="a folder for cProfile summaries of the tensorwire processes")
    options = parser.parse_args()
    from tests.gpu._procs import cuda_transports

    quick = options.quick
    os.environ["GPU_BENCH_UCX"] = f"{options.progress},{options.spin or ''}"
    if options.trace:
        options.trace.mkdir(parents=True, exist_ok=True)
        os.environ["GPU_BENCH_TRACE"] = str(options.trace.resolve())
    if options.profile:
        options.profile.mkdir(parents=True, exist_ok=True)
        os.environ["GPU_BENCH_PROFILE"] = str(options.profile.resolve())
    sizes = QUICK_SIZES if quick else SIZES
    reduce_sizes = QUICK_ALLREDUCE_SIZES if quick else ALLREDUCE_SIZES
    began = time.perf_counter()
    copy = copy_rates(sizes, quick)
    raw, _, _ = echo_pair("raw-server", "raw-client", sizes, quick)
    conn, _, _ = echo_pair("conn-server", "conn-client", sizes, quick)
    tw, tw_out, staged = echo_pair("tw-server", "tw-client", sizes, quick)
    shaped = {shape: echo_pair(f"raw-server:{shape}", f"raw-client:{shape}", sizes, quick)[0]
              for shape in RAW_SHAPES[1:]} if options.shapes else {}
    transports = sorted(cuda_transports(tw_out))
    if not options.no_allreduce:
        tw_reduce, tw_why = allreduce_variant("tensorwire", reduce_sizes, quick)
        nccl, nccl_why = allreduce_variant("nccl", reduce_sizes, quick)
    took = time.perf_counter() - began

    command = " ".join(["python bench/gpu.py", *sys.argv[1:]])
    met = all(tw[s] >= TARGET_RATIO * raw[s] for s in sizes if s >= TARGET_FROM)
    spin = "" if options.spin is None else f", spin {options.spin} s"
    lines = [
        "# GPU: device-to-device echo and allreduce on one GPU",
        "",
        f"Command: `{command}` ({took:.0f} s). Written by bench/gpu.py; "
        "each pair runs in processes of its own on the one GPU.",
        "",
        *environment(),
        f"- ucx:// progress: {options.progress}{spin}; raw ucxx: blocking mode (its request "
        "waits poll the worker)",
        f"- UCX transports chosen for CUDA memory (UCX_PROTO_INFO, tensorwire pair): "
        f"{', '.join(transports) or 'none found in the log'}",
        f"- device bytes tensorwire staged through host memory over ucx://: {staged}",
        "",
        "## Echo of a CuPy array (GB/s = 2 x size / round trip; the copy: size / time)",
        "",
        "| size | tensorwire RPC ucx:// | ucx:// connection | raw ucxx | RPC / raw "
        "| CuPy copy, one process |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in sizes:
        lines.append(f"| {size // MiB} MiB | {gbps(tw[size])} | {gbps(conn[size])} | "
                     f"{gbps(raw[size])} | {tw[size] / raw[size]:.2f} | {gbps(copy[size])} |")
    lines += [
        "",
        f"Target: tensorwire RPC at least {TARGET_RATIO:.0%} of raw ucxx from "
        f"{TARGET_FROM // MiB} MiB: {'met' if met else 'missed'}.",
    ]
    if shaped:
        lines += ["", "## Raw ucxx in the ucx:// message shape (GB/s, as above)", "",
                  "A header message with the size first, the data's receive posted when it "
                  "has arrived; then also a receive buffer from CuPy's pool per message.", "",
                  "| size | raw ucxx, preallocated | header first | header first, fresh "
                  "buffers | ucx:// connection |", "| ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {size // MiB} MiB | {gbps(raw[size])} | {gbps(shaped['header'][size])} | "
                  f"{gbps(shaped['fresh'][size])} | {gbps(conn[size])} |" for size in sizes]
    if not options.no_allreduce:
        lines += ["", "## Allreduce, 2 processes, float32 (busbw GB/s)", ""]
        if tw_why:
            lines.append(f"tensorwire could not run: {tw_why}")
        if nccl_why:
            lines.append(f"NCCL, two ranks on one GPU: {nccl_why}")
        lines += ["", "| size | tensorwire ucx:// | NCCL |", "| ---: | ---: | ---: |"]
        for size in reduce_sizes:
            lines.append(f"| {size // MiB} MiB | {gbps(tw_reduce.get(size))} | "
                         f"{gbps(nccl.get(size))} |")
    text = "\n".join(lines) + "\n"
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
