"""The tensorwire command, run as a user runs it: real processes, real output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "tensorwire"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_info() -> None:
    result = run("info")
    assert result.returncode == 0, result.stderr
    assert "transports:" in result.stdout
    assert "tcp://    yes" in result.stdout
    facts = json.loads(run("info", "--json").stdout)
    assert facts["versions"]["tensorwire"]
    assert facts["transports"]["tcp"]["usable"] is True
    assert set(facts) >= {"versions", "transports", "ucx", "gpus"}


@pytest.fixture
def served() -> Iterator[str]:
    child = subprocess.Popen([*COMMAND, "serve", "tests.rpc.services:Store", "--listen",
                              "tcp://127.0.0.1:0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("listening on "), line
        yield line.split()[-1]
    finally:
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == 0  # a clean shutdown on SIGTERM
        assert child.stdout is not None
        child.stdout.close()


def test_serve_ls_and_call(served: str) -> None:
    listing = run("ls", served)
    assert listing.returncode == 0, listing.stderr
    assert "Store  -- A key-value store of tensors." in listing.stdout
    assert "  get(key: str) -> Any  -- The value under ``key``." in listing.stdout
    assert "count(n: int) -> AsyncIterator[int] (stream)" in listing.stdout
    assert run("call", served, "Store.put", '"w"', "[1, 2, 3]").returncode == 0
    got = run("call", served, "Store.get", '"w"')
    assert got.returncode == 0 and json.loads(got.stdout) == [1, 2, 3]


def test_errors_are_one_line_with_a_hint(served: str) -> None:
    missing = run("call", served, "Store.nothing")
    assert missing.returncode == 1
    assert missing.stderr.splitlines() == [
        "tensorwire: error: [NOT_FOUND] service 'Store' has no method 'nothing'",
        "  hint: tensorwire ls URL lists what the server hosts",
    ]
    bad_json = run("call", served, "Store.get", "w")
    assert bad_json.returncode == 1 and "arguments must be JSON" in bad_json.stderr
    assert "Traceback" not in missing.stderr + bad_json.stderr
    verbose = run("--verbose", "call", served, "Store.nothing")
    assert "Traceback" in verbose.stderr


def test_unreachable_server() -> None:
    result = run("call", "tcp://127.0.0.1:1", "Store.get", '"w"')
    assert result.returncode == 1
    assert "hint: is a tensorwire server running at tcp://127.0.0.1:1?" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_a_class_that_does_not_exist() -> None:
    result = run("serve", "tests.rpc.services:Nope")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "tensorwire: error: module 'tests.rpc.services' has no 'Nope'")


def test_launch_runs_a_collective_script_on_three_ranks() -> None:
    result = run("launch", "-n", "3", "examples/allreduce.py", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank 0] trained:" in result.stdout
    assert "weights identical on all 3 ranks" in result.stdout


def test_launch_fails_fast_with_the_ranks_status(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '2':\n"
                      "    sys.exit(7)\n"
                      "time.sleep(60)\n")
    result = run("launch", "-n", "3", str(script), timeout=60)
    assert result.returncode == 7
    assert "[launch] rank 2 exited with status 7" in result.stdout


def test_launch_restarts_a_failed_job(tmp_path: Path) -> None:
    script = tmp_path / "flaky.py"
    script.write_text("import os, sys\n"
                      "attempt = os.environ['TENSORWIRE_RESTART_COUNT']\n"
                      "if os.environ['RANK'] == '1' and attempt == '0':\n"
                      "    sys.exit(5)\n"
                      "print('attempt', attempt, 'ok')\n")
    result = run("launch", "-n", "2", "--max-restarts", "1", str(script), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[launch] rank 1 exited with status 5" in result.stdout
    assert "[launch] restarting all 2 ranks (restart 1 of 1)" in result.stdout
    assert "[rank 0] attempt 1 ok" in result.stdout
    assert "[rank 1] attempt 1 ok" in result.stdout


def test_log_level_from_the_environment() -> None:
    env = {**os.environ, "TENSORWIRE_LOG": "nonsense"}
    result = subprocess.run([*COMMAND, "info"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=60)
    assert result.returncode != 0 and "nonsense" in result.stderr


def test_bench_p2p_sweep_as_json_with_a_plot(tmp_path: Path) -> None:
    plot = tmp_path / "p2p.png"
    result = run("bench", "p2p", "--sizes", "8,64K", "--listen", "tcp://127.0.0.1:0", "--json",
                 "--plot", str(plot), timeout=120)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["size"] for r in rows] == [8, 65536]
    assert all(r["latency_us"] > 0 and r["bandwidth_gbs"] > 0 for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rpc_and_allreduce_tables() -> None:
    rpc = run("bench", "rpc", "--sizes", "1K", "--listen", "tcp://127.0.0.1:0", timeout=120)
    assert rpc.returncode == 0, rpc.stderr
    assert rpc.stdout.splitlines()[:2] == [
        "# rpc over tcp://", "      size    latency (µs)  bandwidth (GB/s)"]
    allreduce = run("bench", "allreduce", "-n", "3", "--sizes", "4K,1M", "--csv",
                    "--listen", "tcp://127.0.0.1:0", timeout=120)
    assert allreduce.returncode == 0, allreduce.stderr
    lines = allreduce.stdout.splitlines()
    assert lines[0] == "size,latency_us,bandwidth_gbs,busbw_gbs"
    sizes = [int(line.split(",")[0]) for line in lines[1:]]
    assert sizes == [4096, 1 << 20]
    for line in lines[1:]:
        _, seconds, algbw, busbw = (float(v) for v in line.split(","))
        assert seconds > 0 and algbw > 0
        assert busbw == pytest.approx(algbw * 4 / 3)


def test_bench_ps_through_a_shard_it_starts() -> None:
    result = run("bench", "ps", "--sizes", "4K,1M", "--listen", "tcp://127.0.0.1:0", "--json",
                 timeout=120)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["size"] for r in rows] == [4096, 1 << 20]
    assert all(r["latency_us"] > 0 and r["bandwidth_gbs"] > 0 for r in rows)


def test_bench_bad_sizes() -> None:
    result = run("bench", "p2p", "--sizes", "8,lots")
    assert result.returncode == 1
    assert "bad size 'lots'" in result.stderr


def test_a_port_in_use(served: str) -> None:
    result = run("serve", "tests.rpc.services:Store", "--listen", served)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert "Address already in use" in lines[0]
    assert lines[1] == "  hint: the port is in use or the address is not this host's; try port 0"
