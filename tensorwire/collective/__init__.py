"""Collective operations for process groups: allreduce, broadcast, allgather, ...

::

    group = await collective.Group.from_env()      # torchrun, Slurm or mpirun
    # or: await collective.Group.create(rank=r, world_size=n, master="tcp://10.0.0.1:29500")
    await group.allreduce(grad)                    # in place, ReduceOp.SUM by default
    await group.broadcast(params, root=0)
    parts = await group.allgather(x)               # parts[i] is rank i's x
    await group.barrier()
    await group.close()

Operations run in the order they are called, the same order on every rank
(as on an NCCL stream); each returns an awaitable at once, so communication
overlaps computation.
"""

from ._arrays import ReduceOp
from ._runtime import RendezvousServer, serve_rendezvous
from .config import GroupConfig
from .group import Algorithm, Group
from .launcher import LaunchResult, launch
from .sync import SyncGroup

__all__ = ("Algorithm", "Group", "GroupConfig", "LaunchResult", "ReduceOp", "RendezvousServer",
           "SyncGroup", "launch", "serve_rendezvous")
