"""PyTorch integration: DDP communication hooks, a distributed optimizer.

Importable where PyTorch is installed (``import tensorwire`` never imports
torch). Two lines turn a DDP script's gradient exchange over to tensorwire::

    import tensorwire.torch as twt
    from tensorwire import collective

    group = collective.SyncGroup.from_env()          # tensorwire launch, torchrun
    model = DistributedDataParallel(model)           # torch.distributed on gloo, as before
    model.register_comm_hook(twt.AllreduceState(group, compression="fp16"),
                             twt.allreduce_hook)

or, without DDP, Horovod's shape::

    optimizer = twt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group)
    twt.broadcast_parameters(model.state_dict(), group, root_rank=0)
    twt.broadcast_optimizer_state(optimizer, group, root_rank=0)

See docs/torch.md for when to choose which hook.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without torch
    raise ImportError(
        "tensorwire.torch needs PyTorch, which is not installed: pip install torch "
        "(the CPU build: --index-url https://download.pytorch.org/whl/cpu)"
    ) from exc

from ._hooks import AllreduceState, PSState, allreduce_hook, ps_hook
from ._optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters

__all__ = ("AllreduceState", "DistributedOptimizer", "PSState", "allreduce_hook",
           "broadcast_optimizer_state", "broadcast_parameters", "ps_hook")
