"""What a launcher's environment says about this process's group.

torchrun, Slurm and Open MPI each name the rank and world size in their own
variables; the rendezvous comes from ``TENSORWIRE_MASTER`` or torch's
``MASTER_ADDR``/``MASTER_PORT``. Read only by :meth:`Group.from_env
<tensorwire.collective.Group.from_env>`, never at import time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..errors import ConfigError
from ..transports import format_host_port

__all__ = ("EnvSettings", "env_settings")


@dataclasses.dataclass(frozen=True, slots=True)
class EnvSettings:
    """What a launcher's environment says about this process's group."""

    rank: int
    world_size: int
    master: str
    host_master: bool | None


def env_settings(env: Mapping[str, str]) -> EnvSettings:
    """Rank, world size and rendezvous from a torchrun, Slurm or Open MPI environment.

    The rendezvous is ``TENSORWIRE_MASTER`` when set, else
    ``tcp://MASTER_ADDR:MASTER_PORT`` (port 29500 by default). Under torchrun
    with its agent store (``TORCHELASTIC_USE_AGENT_STORE=True``) torch's own
    store holds ``MASTER_PORT``, so tensorwire's rank 0 takes the next port.
    ``TENSORWIRE_MASTER_HOSTED=1`` says a launcher serves the rendezvous
    (no rank hosts it).

    Raises:
        ConfigError: no launcher's variables, or values that are not numbers.
    """
    for rank_key, size_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_key in env and size_key in env:
            break
    else:
        raise ConfigError(
            "no rank in the environment: set RANK and WORLD_SIZE (torchrun), or run under "
            "Slurm (SLURM_PROCID, SLURM_NTASKS) or Open MPI (OMPI_COMM_WORLD_RANK/SIZE)"
        )
    try:
        rank, world_size = int(env[rank_key]), int(env[size_key])
        port = int(env.get("MASTER_PORT", "29500"))
    except ValueError as exc:
        raise ConfigError(f"launcher variables must be integers: {exc}") from None
    hosted = env.get("TENSORWIRE_MASTER_HOSTED", "") in ("1", "true", "True")
    master = env.get("TENSORWIRE_MASTER")
    if not master:
        host = env.get("MASTER_ADDR")
        if not host:
            raise ConfigError(
                f"{rank_key} is set but neither TENSORWIRE_MASTER nor MASTER_ADDR "
                "(rank 0's host) is")
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            port += 1
        # MASTER_ADDR may come bracketed ("[::1]") or bare ("::1").
        master = format_host_port("tcp", host.removeprefix("[").removesuffix("]"), port)
    return EnvSettings(rank, world_size, master, False if hosted else None)
