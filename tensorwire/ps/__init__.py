"""Parameter server: sharded tensors, consistency models, server-side optimizers.

::

    from tensorwire import ps

    shard = await ps.serve("tcp://0.0.0.0:7000", checkpoint_dir="ckpt/0")   # per shard
    client = await ps.connect(["tcp://h1:7000", "tcp://h2:7000"], worker=rank,
                              num_workers=n, consistency="ssp", staleness=2,
                              compression="topk", optimizer=ps.Adam(lr=1e-3))
    params = await client.init(initial_params)     # worker 0's values win
    await client.push(grads)
    params = await client.pull()                   # or: await client.push_pull(grads)

See docs/ps.md for the guarantees.
"""

from ._compress import (
    BF16,
    FP8E4M3,
    FP8E5M2,
    FP16,
    CompressionSpec,
    Compressor,
    ErrorFeedback,
    Int8,
    NoCompression,
    TopK,
    compressor_for,
    register_compressor,
)
from ._optim import SGD, Adagrad, Adam, Aggregate, Optimizer
from ._placement import (
    Chunk,
    Placement,
    TensorSpec,
    balance,
    chunk_tensors,
    place,
    predicted_times,
    relocate,
    resize,
)
from ._step import Step
from .client import Arrivals, PSClient, connect
from .config import Job, PSConfig, ShardConfig
from .server import Shard, ShardServer, serve
from .sync import SyncClient, SyncStep

__all__ = (
    "BF16",
    "FP8E4M3",
    "FP8E5M2",
    "FP16",
    "SGD",
    "Adagrad",
    "Adam",
    "Aggregate",
    "Arrivals",
    "Chunk",
    "CompressionSpec",
    "Compressor",
    "ErrorFeedback",
    "Int8",
    "Job",
    "NoCompression",
    "Optimizer",
    "PSClient",
    "PSConfig",
    "Placement",
    "Shard",
    "ShardConfig",
    "ShardServer",
    "Step",
    "SyncClient",
    "SyncStep",
    "TensorSpec",
    "TopK",
    "balance",
    "chunk_tensors",
    "compressor_for",
    "connect",
    "place",
    "predicted_times",
    "register_compressor",
    "relocate",
    "resize",
    "serve",
)
