"""collective.launch: local ranks with a torchrun-style environment, prefixed
output, fail-fast, signal forwarding and restarts; real processes."""

from __future__ import annotations

import asyncio
import io
import signal
import sys
import time
from pathlib import Path

import pytest

from tensorwire.collective import launch
from tensorwire.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

RANK_SCRIPT = """
import asyncio, os
import numpy as np
from tensorwire.collective import Group, GroupConfig

async def main():
    group = await Group.from_env(config=GroupConfig(timeout=60))
    if group.rank == int(os.environ.get("FAIL_RANK", "-1")):
        print("failing on purpose", flush=True)
        os._exit(3)
    x = np.full(4, float(group.rank))
    await group.allreduce(x)
    print("sum", x[0], "local", os.environ["LOCAL_RANK"], "of", os.environ["WORLD_SIZE"],
          flush=True)
    await group.close()

asyncio.run(main())
"""


async def test_ranks_run_with_the_environment_and_prefixed_output() -> None:
    out = io.StringIO()
    result = await launch([sys.executable, "-c", RANK_SCRIPT], 3, output=out,
                          listen="tcp://127.0.0.1:0")
    assert result.exit_code == 0 and result.returncodes == (0, 0, 0)
    lines = sorted(out.getvalue().splitlines())
    assert lines == [f"[rank {r}] sum 3.0 local {r} of 3" for r in range(3)]


async def test_one_failed_rank_stops_the_others_at_once() -> None:
    out = io.StringIO()
    started = time.monotonic()
    result = await launch([sys.executable, "-c", RANK_SCRIPT], 3, output=out,
                          env={**__import__("os").environ, "FAIL_RANK": "1"})
    # Ranks 0 and 2 would wait 60 s in their allreduce; the launcher stops them.
    assert time.monotonic() - started < 30
    assert result.returncodes[1] == 3 and result.exit_code != 0
    assert result.failed_rank is not None
    assert "[rank 1] failing on purpose" in out.getvalue()
    assert "[launch] rank 1 exited with status 3" in out.getvalue()
    # The others were stopped or failed with it, none finished its allreduce.
    assert "sum" not in out.getvalue()


async def test_sigterm_reaches_every_rank() -> None:
    ranks = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    print('got SIGTERM', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    launcher = (
        "import asyncio, sys\n"
        "from tensorwire.collective import launch\n"
        f"result = asyncio.run(launch([sys.executable, '-c', {ranks!r}], 2))\n"
        "sys.exit(result.exit_code)\n"
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", launcher, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    seen = []
    while len([line for line in seen if b"ready" in line]) < 2:
        seen.append(await asyncio.wait_for(child.stdout.readline(), 30))
    child.send_signal(signal.SIGTERM)
    rest = await asyncio.wait_for(child.stdout.read(), 30)
    assert await child.wait() == 0
    assert sorted(rest.decode().split("\n")[:2]) == ["[rank 0] got SIGTERM",
                                                     "[rank 1] got SIGTERM"]


async def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="command"):
        await launch([], 2)
    with pytest.raises(ConfigError, match="at least one"):
        await launch([sys.executable], 0)
    with pytest.raises(ConfigError, match="max_restarts"):
        await launch([sys.executable], 1, max_restarts=-1)


RESUMING_SCRIPT = """
import asyncio, json, os, sys
from pathlib import Path
import numpy as np
from tensorwire.collective import Group, GroupConfig

async def main():
    group = await Group.from_env(config=GroupConfig(timeout=60))
    attempt = int(os.environ["TENSORWIRE_RESTART_COUNT"])
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
    state_file = Path(sys.argv[1]) / f"rank{group.rank}.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"step": 0, "total": 0.0}
    print("attempt", attempt, "starts at step", state["step"], flush=True)
    while state["step"] < 6:
        # Past this barrier every rank has saved the step before, so a crash
        # here leaves the ranks' checkpoints at the same step.
        await group.barrier()
        if group.rank == 1 and state["step"] == 3 and attempt < int(sys.argv[2]):
            os._exit(3)  # a crash before step 3's allreduce
        x = np.full(4, float(group.rank + 1))
        await group.allreduce(x)
        state = {"step": state["step"] + 1, "total": state["total"] + float(x[0])}
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(state_file)
    print("done", state["total"], flush=True)
    await group.close()

asyncio.run(main())
"""


async def test_a_failed_job_restarts_every_rank_and_resumes(tmp_path: Path) -> None:
    out = io.StringIO()
    result = await launch([sys.executable, "-c", RESUMING_SCRIPT, str(tmp_path), "1"], 3,
                          output=out, max_restarts=2)
    text = out.getvalue()
    assert result.exit_code == 0 and result.restarts == 1, text
    assert "[launch] rank 1 exited with status 3" in text
    assert "[launch] restarting all 3 ranks (restart 1 of 2)" in text
    for rank in range(3):
        assert f"[rank {rank}] attempt 0 starts at step 0" in text
        # Every rank had saved step 2 when rank 1 crashed: all resume at 3.
        assert f"[rank {rank}] attempt 1 starts at step 3" in text
        # 6 steps of 1 + 2 + 3, none lost or counted twice across the restart.
        assert f"[rank {rank}] done 36.0" in text


async def test_restarts_stop_at_the_limit(tmp_path: Path) -> None:
    out = io.StringIO()
    result = await launch([sys.executable, "-c", RESUMING_SCRIPT, str(tmp_path), "99"], 3,
                          output=out, max_restarts=2)
    text = out.getvalue()
    assert result.restarts == 2 and result.failed_rank is not None
    assert result.exit_code != 0
    assert text.count("[launch] rank 1 exited with status 3") == 3
    assert "(restart 2 of 2)" in text and "(restart 3" not in text
    assert "done" not in text


async def test_a_line_longer_than_a_pipe_buffer_is_passed_on() -> None:
    out = io.StringIO()
    script = "print('x' * 300_000); print('done')"
    result = await launch([sys.executable, "-c", script], 1, output=out)
    assert result.exit_code == 0
    assert out.getvalue().splitlines() == ["[rank 0] " + "x" * 300_000, "[rank 0] done"]
