"""Train a classifier through the parameter server: 2 shards, 3 worker processes.

    tensorwire demo                                     # tcp:// on loopback
    tensorwire demo --url ucx://127.0.0.1:0 --consistency ssp --staleness 2
    python examples/ps_train.py                         # the same

It ships inside the package, so that ``tensorwire demo`` runs from a wheel as
from a checkout; scikit-learn comes with the ``demo`` extra
(``pip install 'tensorwire[demo]'``).

A small multi-layer perceptron in plain NumPy learns scikit-learn's bundled
digits data set (8x8 images of handwritten digits, no download). Each shard
is a process running ``ps.serve``; each worker is a process that holds a
third of the training data, computes gradients on its mini-batches and
calls ``push_pull``: the shards average the three workers' gradients, apply
SGD with momentum and send back the new parameters. Worker 0 reports the
test accuracy after each epoch.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import queue
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorwire import ps
from tensorwire.errors import ConfigError

__all__ = ("main", "train")

Params = dict[str, np.ndarray]


def init_params(sizes: list[int], seed: int) -> Params:
    """He-initialized weights, zero biases."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        params[f"w{i}"] = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2 / fan_in)).astype(
            np.float32)
        params[f"b{i}"] = np.zeros(fan_out, np.float32)
    return params


def forward(params: Params, x: np.ndarray) -> list[np.ndarray]:
    """Activations of every layer; the last are the logits."""
    layers = len(params) // 2
    activations = [x]
    for i in range(layers):
        z = activations[-1] @ params[f"w{i}"] + params[f"b{i}"]
        activations.append(np.maximum(z, 0) if i < layers - 1 else z)
    return activations


def loss_and_grads(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
    """Softmax cross-entropy and its gradients (backpropagation by hand)."""
    activations = forward(params, x)
    logits = activations[-1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = float(-np.log(probs[np.arange(len(y)), y] + 1e-12).mean())
    delta = probs
    delta[np.arange(len(y)), y] -= 1
    delta /= len(y)
    grads: Params = {}
    for i in reversed(range(len(params) // 2)):
        grads[f"w{i}"] = (activations[i].T @ delta).astype(np.float32)
        grads[f"b{i}"] = delta.sum(axis=0).astype(np.float32)
        if i:
            delta = (delta @ params[f"w{i}"].T) * (activations[i] > 0)
    return loss, grads


def accuracy(params: Params, x: np.ndarray, y: np.ndarray) -> float:
    return float((forward(params, x)[-1].argmax(axis=1) == y).mean())


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits scaled to [0, 1], split 75/25 into training and test sets.

    Raises:
        ConfigError: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("the demo needs scikit-learn for its data set: "
                          "pip install 'tensorwire[demo]'") from None

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = len(y) * 3 // 4
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def run_shard(url: str, addresses: Any, stop: Any) -> None:
    """A shard process: serve until told to stop."""

    async def main() -> None:
        shard = await ps.serve(url)
        addresses.put(shard.addresses[0])
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await shard.close()

    asyncio.run(main())


def run_worker(rank: int, args: argparse.Namespace, addresses: list[str], data: Any,
               reports: Any) -> None:
    """A worker process: train on this worker's slice of the training set."""
    x_train, y_train, x_test, y_test = data
    mine = slice(rank, None, args.workers)
    x, y = x_train[mine], y_train[mine]
    rng = np.random.default_rng(args.seed + 1 + rank)

    async def main() -> None:
        client = await ps.connect(
            addresses, worker=rank, num_workers=args.workers, consistency=args.consistency,
            staleness=args.staleness, compression=args.compression,
            optimizer=ps.SGD(lr=args.lr, momentum=0.9),
            # A model this small fits in one default 4 MiB chunk per tensor;
            # small chunks spread it evenly over the shards.
            config=ps.PSConfig(chunk_bytes=args.chunk_bytes),
        )
        async with client:
            params = await client.init(init_params([64, args.hidden, 10], args.seed + rank))
            steps = len(y) // args.batch
            for epoch in range(args.epochs):
                order = rng.permutation(len(y))
                losses = []
                for step in range(steps):
                    batch = order[step * args.batch:(step + 1) * args.batch]
                    loss, grads = loss_and_grads(params, x[batch], y[batch])
                    losses.append(loss)
                    params = await client.push_pull(grads)
                if rank == 0:
                    reports.put((epoch, float(np.mean(losses)), accuracy(params, x_test, y_test),
                                 client.imbalance))
            if rank == 0:
                # The final word is the shards' state after every worker's last step.
                final = await client.pull()
                reports.put(("final", accuracy(final, x_test, y_test)))

    asyncio.run(main())


def train(args: argparse.Namespace) -> float:
    """Start the shards and workers, print progress; returns the test accuracy."""
    data = load_data(args.seed)
    context = mp.get_context("spawn")
    addresses: Any = context.Queue()
    reports: Any = context.Queue()
    stop = context.Event()
    started = time.perf_counter()
    shards = [context.Process(target=run_shard, args=(args.url, addresses, stop))
              for _ in range(args.shards)]
    for process in shards:
        process.start()
    workers: list[Any] = []
    try:
        urls = [addresses.get(timeout=60) for _ in shards]
        print(f"{args.shards} shards on {', '.join(urls)}; {args.workers} workers, "
              f"{args.consistency}, compression {args.compression}", flush=True)
        workers = [context.Process(target=run_worker, args=(rank, args, urls, data, reports))
                   for rank in range(args.workers)]
        for process in workers:
            process.start()
        result = 0.0
        deadline = time.monotonic() + args.time_limit
        while True:
            try:
                report = reports.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in workers):
                    raise RuntimeError("a worker failed") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("training took too long") from None
                continue
            if report[0] == "final":
                result = float(report[1])
                break
            epoch, loss, acc, imbalance = report
            print(f"epoch {epoch + 1:2d}/{args.epochs}  loss {loss:.4f}  test accuracy "
                  f"{acc:.3f}  (placement imbalance {imbalance:.3f})", flush=True)
        for process in workers:
            process.join(timeout=30)
    finally:
        stop.set()
        for process in [*workers, *shards]:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    print(f"final test accuracy {result:.3f} in {time.perf_counter() - started:.1f} s",
          flush=True)
    return result


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    """Parse the demo's options from ``argv`` (default ``sys.argv[1:]``) and train.

    Raises:
        ConfigError: scikit-learn is not installed.
        SystemExit: status 1 when the final accuracy is below ``--min-accuracy``.
    """
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="tcp://127.0.0.1:0", help="shard listen address")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--consistency", choices=["sync", "ssp", "async"], default="sync")
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--compression", default="none",
                        choices=["none", "fp16", "bf16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2",
                                 "topk"])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--chunk-bytes", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=100.0, help="seconds")
    parser.add_argument("--min-accuracy", type=float, default=0.9,
                        help="exit with status 1 below this test accuracy")
    args = parser.parse_args(argv)
    if args.consistency == "ssp" and not args.staleness:
        args.staleness = 2
    if args.consistency != "ssp":
        args.staleness = 0
    if train(args) < args.min_accuracy:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
