"""One process of a GPU test: a server that receives device arrays, a client
that sends them, or a rank of a group.

Run as ``python -m tests.gpu._peer ROLE ...`` (see ``main``). Each prints
JSON lines on stdout (``{"address": ...}``, ``{"check": ..., "ok": ...}``);
UCX writes its own log lines there too (``UCX_PROTO_INFO``), which the tests
read to see which UCX transport carried device memory.

``--no-cupy`` makes ``import cupy`` fail in this process, as on a machine
with torch alone.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from typing import Any

import numpy as np

#: Elements of the large test arrays (int64: 128 MiB).
LARGE = 16 << 20
#: Elements of the streams check's array (float32: 256 MiB), and the kernels
#: queued on it right before it is sent: milliseconds of work still pending.
STREAM_ELEMENTS = 64 << 20
KERNELS = 64


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


# -- what the checks need of each array library --------------------------------


class CuPy:
    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy

    def pattern(self, count: int, seed: int) -> Any:
        return (self.cupy.arange(count, dtype=self.cupy.int64) * 7 + seed) % 1000003

    def full(self, count: int, value: float) -> Any:
        return self.cupy.full(count, value, self.cupy.float32)

    def is_kind(self, x: Any) -> bool:
        return type(x) is self.cupy.ndarray

    def pointer(self, x: Any) -> int:
        return int(x.data.ptr)

    def equal(self, x: Any, y: Any) -> bool:
        return bool((x == y).all())

    def all_equal_to(self, x: Any, value: float) -> bool:
        return bool((x == value).all())

    def queue_kernels(self, x: Any, count: int) -> None:
        x.fill(0)
        for _ in range(count):
            x += 1

    def side_stream(self) -> Any:
        return self.cupy.cuda.Stream(non_blocking=True)

    def pool_memory(self, x: Any) -> bool:
        """The array lives in a block of this process's CuPy memory pool."""
        return type(x.data.mem).__name__ == "PooledMemory"

    def to_host(self, x: Any) -> np.ndarray[Any, Any]:
        return self.cupy.asnumpy(x)

    def from_host(self, x: np.ndarray[Any, Any]) -> Any:
        return self.cupy.asarray(x)


class TorchCUDA:
    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def pattern(self, count: int, seed: int) -> Any:
        t = self.torch
        return (t.arange(count, dtype=t.int64, device="cuda") * 7 + seed) % 1000003

    def full(self, count: int, value: float) -> Any:
        return self.torch.full((count,), value, dtype=self.torch.float32, device="cuda")

    def is_kind(self, x: Any) -> bool:
        return isinstance(x, self.torch.Tensor) and x.device.type == "cuda"

    def pointer(self, x: Any) -> int:
        return int(x.data_ptr())

    def equal(self, x: Any, y: Any) -> bool:
        return bool(self.torch.equal(x, y))

    def all_equal_to(self, x: Any, value: float) -> bool:
        return bool((x == value).all())

    def queue_kernels(self, x: Any, count: int) -> None:
        x.zero_()
        for _ in range(count):
            x.add_(1)

    def side_stream(self) -> Any:
        return self.torch.cuda.stream(self.torch.cuda.Stream())

    def pool_memory(self, x: Any) -> bool:
        return False  # torch tensors are checked against the allocators' counters

    def to_host(self, x: Any) -> np.ndarray[Any, Any]:
        return x.cpu().numpy()

    def from_host(self, x: np.ndarray[Any, Any]) -> Any:
        return self.torch.from_numpy(x).to("cuda")


KINDS = {"cupy": CuPy, "torch": TorchCUDA}


def device_memory(ptr: int) -> bool:
    """``ptr`` is plain device memory (not host, not managed) of device 0.

    Asks the CUDA driver (``cuPointerGetAttribute``), which every CUDA
    process has loaded, whichever array library allocated the memory.
    """
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    memory_type, managed, ordinal = ctypes.c_uint(), ctypes.c_int(), ctypes.c_int()
    for attribute, out in ((2, memory_type), (8, managed), (9, ordinal)):
        # CU_POINTER_ATTRIBUTE_MEMORY_TYPE, _IS_MANAGED, _DEVICE_ORDINAL
        if driver.cuPointerGetAttribute(ctypes.byref(out), attribute,
                                        ctypes.c_uint64(ptr)) != 0:
            return False
    return memory_type.value == 2 and not managed.value and ordinal.value == 0  # DEVICE


def torch_allocated() -> int:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_allocated())


def cupy_pool_used() -> int:
    cupy = sys.modules.get("cupy")
    return 0 if cupy is None else int(cupy.get_default_memory_pool().used_bytes())


# -- the server ------------------------------------------------------------------


def make_sink(server_ref: list[Any]) -> Any:
    from tensorwire import rpc

    class Sink(rpc.Service):
        """Receives device arrays and says where and how they arrived."""

        @rpc.method
        async def inspect(self, x: Any, kind: str, seed: int) -> dict[str, Any]:
            # What the allocators hold before this handler allocates anything.
            pool_used, torch_used = cupy_pool_used(), torch_allocated()
            lib = KINDS[kind]()
            ptr = lib.pointer(x)
            return {
                "kind": lib.is_kind(x),
                "device_memory": device_memory(ptr),
                "equal": lib.equal(x, lib.pattern(int(x.shape[0]), seed)),
                "cupy_pool": lib.pool_memory(x),
                "cupy_pool_used": pool_used,
                "torch_allocated": torch_used,
                "has_cupy": sys.modules.get("cupy") is not None,
            }

        @rpc.method
        async def filled_with(self, x: Any, kind: str, value: float) -> bool:
            return KINDS[kind]().all_equal_to(x, value)

        @rpc.method
        async def echo(self, x: Any) -> Any:
            return x

        @rpc.method
        async def stats(self) -> dict[str, dict[str, int]]:
            result: dict[str, dict[str, int]] = server_ref[0].transport_stats()
            return result

    return Sink()


async def sink(url: str) -> None:
    from tensorwire import Server

    ref: list[Any] = []
    server = Server([make_sink(ref)])
    ref.append(server)
    (address,) = await server.start(url)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    report(address=address)
    await stop.wait()
    await server.close(grace=1)


# -- the client ------------------------------------------------------------------


def staged_expected(url: str, nbytes: int) -> int:
    return nbytes if url.startswith("tcp://") else 0


async def source(address: str, kinds: list[str]) -> None:
    """Send device arrays to the sink; report what it and this process saw."""
    from tensorwire import connect

    async with connect(address, timeout=120) as client:
        device_bytes = 0  # device frames' bytes this client sent and received
        for kind in kinds:
            lib = KINDS[kind]()
            for count in (1 << 17, LARGE):  # 1 MiB and 128 MiB of int64
                x = lib.pattern(count, seed=count % 97)
                nbytes = count * 8
                seen = await client.call("Sink.inspect", x, kind, count % 97)
                report(check=f"{kind} {nbytes} arrives on the device", **seen,
                       ok=seen["kind"] and seen["device_memory"] and seen["equal"])
                if seen["has_cupy"]:
                    # The transport's allocator is CuPy's pool; torch wraps
                    # that memory (torch allocated none of it).
                    landed = seen["cupy_pool_used"] >= nbytes and (
                        seen["cupy_pool"] if kind == "cupy" else seen["torch_allocated"] < nbytes)
                else:
                    landed = seen["torch_allocated"] >= nbytes
                report(check=f"{kind} {nbytes} lands in the receiver's allocator's memory",
                       ok=landed)
                back = await client.call("Sink.echo", x)
                ptr = lib.pointer(back)
                report(check=f"{kind} {nbytes} echoed back onto the device",
                       ok=lib.is_kind(back) and device_memory(ptr) and lib.equal(back, x)
                       and ptr != lib.pointer(x))
                device_bytes += 3 * nbytes  # sent twice, received once
            # Streams: kernels still queued on the array when it is sent.
            y = lib.full(STREAM_ELEMENTS, -1.0)
            lib.queue_kernels(y, KERNELS)
            ok = await client.call("Sink.filled_with", y, kind, float(KERNELS))
            report(check=f"{kind}: a send waits for the kernels queued on the current stream",
                   ok=ok)
            with lib.side_stream():
                lib.queue_kernels(y, KERNELS // 2)
                ok = await client.call("Sink.filled_with", y, kind, float(KERNELS // 2))
            report(check=f"{kind}: a send waits for the kernels queued on a side stream",
                   ok=ok)
            device_bytes += 2 * STREAM_ELEMENTS * 4
        mine = client.transport_stats()[address]["device_bytes_staged"]
        theirs = await client.call("Sink.stats")
        (server_side,) = theirs.values()
        want = staged_expected(address, device_bytes)
        report(check="device bytes staged through host memory, client",
               ok=mine == want, staged=mine, expected=want)
        # The sink received what the client sent and sent the echoes back.
        report(check="device bytes staged through host memory, server",
               ok=server_side["device_bytes_staged"] == want,
               staged=server_side["device_bytes_staged"], expected=want)


# -- a rank of a group -------------------------------------------------------------


def rank_input(rank: int, count: int, dtype: str) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(1000 + rank)
    if dtype.startswith("int"):
        return rng.integers(-50, 50, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


async def rank_main(kind: str, rank: int, world: int, master: str, listen: str) -> None:
    from tensorwire.collective import Group, GroupConfig, ReduceOp

    lib = KINDS[kind]()
    config = GroupConfig(timeout=120, rendezvous_timeout=120, segment_bytes=4 << 20)
    group = await Group.create(rank=rank, world_size=world, master=master, listen=listen,
                               host_master=False, config=config)
    try:
        for count, dtype in ((1000, "int64"), (3 << 20, "float32"), (12 << 20, "float64")):
            host = rank_input(rank, count, dtype)
            x = lib.from_host(host)
            ptr = lib.pointer(x)
            result = await group.allreduce(x)
            everyone = np.stack([rank_input(r, count, dtype) for r in range(world)])
            want = everyone.sum(axis=0, dtype=dtype)
            got = lib.to_host(x)
            if dtype.startswith("float"):
                close = bool(np.allclose(got, want, rtol=1e-5, atol=1e-5))
            else:
                close = bool(np.array_equal(got, want))
            report(check=f"{kind} allreduce {dtype}[{count}] in place on the device",
                   rank=rank, ok=result is x and lib.pointer(x) == ptr and lib.is_kind(x)
                   and device_memory(ptr) and close)
        avg = lib.full(1 << 20, float(rank))
        await group.allreduce(avg, ReduceOp.AVG)
        report(check=f"{kind} allreduce AVG", rank=rank,
               ok=lib.all_equal_to(avg, (world - 1) / 2))
    finally:
        await group.close()


# -- a parameter-server shard and its worker ------------------------------------------

#: SGD steps the worker pushes; tensors of 2 MiB in chunks of 512 KiB.
PS_STEPS = 3
PS_LR = 0.1


async def shard_main(url: str) -> None:
    """A shard; at SIGTERM it reports where its chunks live and what it applied."""
    from tensorwire import ps

    server = await ps.serve(url)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    report(address=server.addresses[0])
    await stop.wait()
    store = server.shard.store
    values = [] if store is None else [entry.value for entry in store.entries.values()]
    lib = KINDS["cupy"]()
    on_device = [lib.is_kind(v) and device_memory(lib.pointer(v)) for v in values]
    report(check="the shard holds every chunk in device memory, as CuPy arrays",
           ok=bool(values) and all(on_device), chunks=len(values))
    report(check="the shard applied every push", ok=store is not None
           and store.updates == PS_STEPS, updates=None if store is None else store.updates)
    await server.close(checkpoint=False)


def ps_host_values(step: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((1024, 512)).astype(np.float32),
            "b": rng.standard_normal(512).astype(np.float32)}


async def ps_worker(address: str) -> None:
    """Init CuPy parameters, push CuPy gradients with SGD; compare with the host."""
    from tensorwire import ps

    lib = KINDS["cupy"]()
    client = await ps.connect([address], worker=0, num_workers=1,
                              optimizer=ps.SGD(lr=PS_LR), config=ps.PSConfig(chunk_bytes=512 << 10))
    try:
        want = ps_host_values(0)
        got = await client.init({k: lib.from_host(v) for k, v in want.items()})
        report(check="init returns the parameters as CuPy arrays on the device",
               ok=all(lib.is_kind(v) and device_memory(lib.pointer(v)) for v in got.values()))
        for step in range(1, PS_STEPS + 1):
            grads = ps_host_values(step)
            pulled = await client.push_pull({k: lib.from_host(v) for k, v in grads.items()})
            want = {k: want[k] + np.multiply(grads[k], -PS_LR, dtype=np.float32) for k in want}
            close = all(np.allclose(lib.to_host(pulled[k]), want[k], rtol=1e-6, atol=1e-6)
                        for k in want)
            report(check=f"step {step}: the pulled CuPy parameters equal SGD on the host",
                   ok=close and all(lib.is_kind(v) and v.shape == want[k].shape
                                    for k, v in pulled.items()))
    finally:
        await client.close()


def main(argv: list[str]) -> None:
    if "--no-cupy" in argv:
        argv = [a for a in argv if a != "--no-cupy"]
        sys.modules["cupy"] = None  # type: ignore[assignment]
    role, *args = argv
    if role == "sink":
        asyncio.run(sink(args[0]))
    elif role == "source":
        asyncio.run(source(args[0], args[1].split(",")))
    elif role == "shard":
        asyncio.run(shard_main(args[0]))
    elif role == "ps-worker":
        asyncio.run(ps_worker(args[0]))
    elif role == "rank":
        kind, rank, world, master, listen = args
        asyncio.run(rank_main(kind, int(rank), int(world), master, listen))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
