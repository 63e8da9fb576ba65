"""One script under ``tensorwire launch`` with torchrun's spelling and environment:
torch.distributed (env://, gloo) and a tensorwire group side by side."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="torch is not installed")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import os
import torch
import torch.distributed as dist
from tensorwire.collective import SyncGroup

dist.init_process_group("gloo")          # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
with SyncGroup.from_env() as group:
    u = torch.full((3,), float(group.rank + 1))
    group.allreduce(u)
print("gloo", t[0].item(), "tensorwire", u[0].item(), "group_rank", os.environ["GROUP_RANK"],
      "local", os.environ["LOCAL_RANK"], "role", os.environ["ROLE_RANK"], flush=True)
dist.destroy_process_group()
"""


def test_torchrun_spelling_and_environment(tmp_path: Path) -> None:
    script = tmp_path / "both.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TENSORWIRE_LISTEN": "tcp://127.0.0.1:0"}
    result = subprocess.run(
        [sys.executable, "-m", "tensorwire", "launch", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(x for x in result.stdout.splitlines() if "gloo" in x)
    assert lines == [f"[rank {r}] gloo 3.0 tensorwire 3.0 group_rank 0 local {r} role {r}"
                     for r in range(2)]
