"""The tensorwire command, run as a user runs it: real processes, real output."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pty
import re
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tensorwire
from tensorwire.cli import _parser

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "tensorwire"]
# A child started in another folder still imports this checkout.
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(*args: str, timeout: float = 60, input: str | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, input=input, env=ENV)


def test_info() -> None:
    result = run("info")
    assert result.returncode == 0, result.stderr
    assert "transports:" in result.stdout
    assert "tcp://    yes" in result.stdout
    facts = json.loads(run("info", "--json").stdout)
    assert facts["versions"]["tensorwire"]
    assert facts["transports"]["tcp"]["usable"] is True
    assert set(facts) >= {"versions", "transports", "ucx", "gpus", "compiled_core"}
    # The compiled core is not optional: info names each module's built file.
    core = facts["compiled_core"]
    assert core["loaded"] is True, core
    assert all(where.endswith(".so") for where in core["modules"].values()), core
    assert "compiled core: loaded" in result.stdout


def test_info_for_a_bug_report(tmp_path: Path) -> None:
    # A ucx_info of another UCX first on PATH (a system UCX 1.13 beside the
    # wheel's): its devices are not the loaded library's.
    fake = tmp_path / "ucx_info"
    fake.write_text("#!/bin/sh\necho '# Library version: 1.13.0'\n"
                    "echo '#      Transport: rc_verbs'\necho '#         Device: mlx5_0:1'\n")
    fake.chmod(0o755)
    env = {**ENV, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
           "UCX_TLS": "tcp,self", "TENSORWIRE_SECRET": "hunter2hunter2"}
    result = subprocess.run([*COMMAND, "info", "--json"], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["os"] and facts["executable"] == sys.executable
    assert facts["environment"]["UCX_TLS"] == "tcp,self"
    assert facts["environment"]["TENSORWIRE_SECRET"] == "(set, not shown)"
    # ucxx sets UCX_* variables of its own when imported: not the user's.
    assert "UCX_MEMTYPE_CACHE" not in facts["environment"]
    assert set(facts["cuda"]) >= {"driver", "driver_cuda", "runtimes"}
    assert isinstance(facts["gpus"], list)
    if facts["transports"]["ucx"]["usable"]:
        assert Path(facts["ucx"]["library"]).name.startswith("libucp.so")
        assert facts["ucx"].get("ucx_info") != str(fake)
        assert "rc_verbs" not in facts["ucx"].get("devices", {})
    text = subprocess.run([*COMMAND, "info"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=60).stdout
    assert "  UCX_TLS=tcp,self" in text and "hunter2" not in text
    assert re.search(r"^os: +\S", text, re.M) and "CUDA driver: " in text


def test_demo_without_scikit_learn_names_the_extra() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['sklearn'] = None; "
         "from tensorwire.cli import main; sys.exit(main(['demo']))"],
        capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT)
    assert result.returncode == 1
    assert result.stderr.strip() == ("tensorwire: error: the demo needs scikit-learn for its "
                                     "data set: pip install 'tensorwire[demo]'")


@contextlib.contextmanager
def serving(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> Iterator[str]:
    """``tensorwire serve ARGS`` in a child process; yields the address it got."""
    child = subprocess.Popen([*COMMAND, "serve", *args], cwd=cwd, stdout=subprocess.PIPE,
                             text=True, env=env or ENV)
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


@pytest.fixture
def served() -> Iterator[str]:
    with serving("tests.rpc.services:Store", "--listen", "tcp://127.0.0.1:0") as address:
        yield address


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
    # After the command too, where the hint's readers put it.
    after = run("call", served, "Store.nothing", "--verbose")
    assert "Traceback" in after.stderr and after.returncode == 1


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
    assert {r["transport"] for r in rows} == {"tcp://"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Nothing but the result when standard error is no terminal: no bar.
    assert result.stderr == f"wrote {plot}\n"


def test_bench_rpc_and_allreduce_tables() -> None:
    rpc = run("bench", "rpc", "--sizes", "1K", "--listen", "tcp://127.0.0.1:0", timeout=120)
    assert rpc.returncode == 0, rpc.stderr
    assert rpc.stdout.splitlines()[:2] == [
        "# rpc over tcp://", "      size    latency (µs)  bandwidth (GB/s)"]
    allreduce = run("bench", "allreduce", "-n", "3", "--sizes", "4K,1M", "--csv",
                    "--listen", "tcp://127.0.0.1:0", timeout=120)
    assert allreduce.returncode == 0, allreduce.stderr
    lines = allreduce.stdout.splitlines()
    assert lines[0] == "transport,size,latency_us,bandwidth_gbs,busbw_gbs"
    sizes = [int(line.split(",")[1]) for line in lines[1:]]
    assert sizes == [4096, 1 << 20]
    for line in lines[1:]:
        transport, _, seconds, algbw, busbw = line.split(",")
        assert transport == "tcp://"
        assert float(seconds) > 0 and float(algbw) > 0
        assert float(busbw) == pytest.approx(float(algbw) * 4 / 3)


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


# -- call: streams, keyword arguments, pipes -----------------------------------


def test_call_prints_a_server_stream_as_json_lines(served: str) -> None:
    result = run("call", served, "Store.count", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["0", "1", "2"]
    assert run("call", served, "Store.count", "n=2").stdout.splitlines() == ["0", "1"]


def test_call_streams_json_lines_from_standard_input(served: str, tmp_path: Path) -> None:
    total = run("call", served, "Store.total", "@", input="1\n2.5\n\n[1, 2]\n")
    assert total.returncode == 0, total.stderr
    assert json.loads(total.stdout) == 6.5
    # Both directions streaming at once, the stream in the second place.
    scaled = run("call", served, "Store.scale", "2", "@", input="1\n2.5\n")
    assert scaled.returncode == 0, scaled.stderr
    assert [json.loads(line) for line in scaled.stdout.splitlines()] == [2, 5.0]
    # Standard input that is a file rather than a pipe.
    lines = tmp_path / "values.jsonl"
    lines.write_text("3\n4\n")
    with lines.open() as stdin:
        from_file = subprocess.run([*COMMAND, "call", served, "Store.total", "@"], stdin=stdin,
                                   capture_output=True, text=True, timeout=60, env=ENV)
    assert json.loads(from_file.stdout) == 7.0
    bad = run("call", served, "Store.total", "@", input="1\nnot json\n")
    assert bad.returncode == 1
    assert bad.stderr.startswith("tensorwire: error: standard input, line 2: not JSON")


def test_call_with_keyword_arguments(served: str) -> None:
    as_object = run("call", served, "Store.sleep", "--kwargs", '{"seconds": 0, "tag": "x"}')
    assert as_object.returncode == 0, as_object.stderr
    assert json.loads(as_object.stdout) == "x"
    as_pairs = run("call", served, "Store.sleep", "0", 'tag="y"')
    assert json.loads(as_pairs.stdout) == "y"
    mixed = run("call", served, "Store.sleep", "0", "--kwargs", '{"tag": "z"}')
    assert json.loads(mixed.stdout) == "z"
    for args, message in [
        (["seconds=0", '"y"'], "positional argument '\"y\"' after a keyword argument"),
        (["seconds=soon"], "the value of seconds= must be JSON"),
        (["--kwargs", "[1]"], "--kwargs must be a JSON object"),
        (["seconds=0", "seconds=1"], "the argument 'seconds' is given twice"),
    ]:
        result = run("call", served, "Store.sleep", *args)
        assert result.returncode == 1 and message in result.stderr, (args, result.stderr)


def test_a_closed_pipe_ends_the_command_quietly(served: str) -> None:
    command = " ".join(shlex.quote(a) for a in COMMAND)
    script = (f"{command} call {served} Store.count 100000 | head -n 2; "
              "echo status ${PIPESTATUS[0]} >&2; "
              f"{command} info | head -n 1")
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                            timeout=60, env=ENV)
    assert result.stdout.splitlines() == ["0", "1", "versions:"]
    # 128 + SIGPIPE, as the shell reports for `yes | head`; no traceback.
    assert result.stderr == "status 141\n"


def test_version_and_help_texts() -> None:
    version = run("--version")
    assert version.returncode == 0
    assert version.stdout.startswith(f"tensorwire {tensorwire.__version__} (Python ")
    top = run("--help")
    assert top.returncode == 0 and "call" in top.stdout and "``" not in top.stdout
    # Every subcommand's help, as argparse formats it: plain text, no reST.
    parsers = [_parser()]
    seen = 0
    while parsers:
        parser = parsers.pop()
        text = parser.format_help()
        assert "``" not in text and ":class:" not in text, text
        seen += 1
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    assert seen >= 10


# -- serve: the README's module, import errors, secret, TLS ---------------------


def _readme_quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"## Quick start.*?```python\n(.*?)```", readme, re.S)
    assert found is not None
    return found.group(1)


def test_serve_the_readme_quick_start(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(_readme_quick_start())
    with serving("app:Store", cwd=tmp_path) as address:
        assert run("call", address, "Store.put", '"w1"', "[1, 2]").returncode == 0
        assert run("call", address, "Store.put", 'key="x"', "value=3").returncode == 0
        assert json.loads(run("call", address, "Store.get", '"w1"').stdout) == [1, 2]
        scan = run("call", address, "Store.scan", 'prefix="w"')
        assert scan.returncode == 0, scan.stderr
        assert scan.stdout.splitlines() == ['"w1"']


def test_serve_a_module_that_runs_at_import(tmp_path: Path) -> None:
    # The quick start as it read before its __main__ guard.
    unguarded = re.sub(r'if __name__ == "__main__":.*\n\s+asyncio.run', "asyncio.run",
                       _readme_quick_start())
    assert "\nasyncio.run(main())" in unguarded
    (tmp_path / "app.py").write_text(unguarded)
    (tmp_path / "broken.py").write_text("import json\njson.loads('{')\n")
    ran = run("serve", "app:Store", cwd=tmp_path)
    assert ran.returncode == 1
    assert ran.stderr.splitlines() == [
        "tensorwire: error: importing 'app' ran its program (asyncio.run() cannot be called "
        "from a running event loop): put the program's start under "
        "`if __name__ == \"__main__\":`, so that serve can import the module"]
    broken = run("serve", "broken:Store", cwd=tmp_path)
    assert broken.returncode == 1
    assert broken.stderr.splitlines() == [
        "tensorwire: error: importing 'broken' failed: JSONDecodeError: Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1)"]
    missing = run("serve", "nowhere:Store", cwd=tmp_path)
    assert missing.stderr.splitlines() == [
        "tensorwire: error: cannot import 'nowhere': No module named 'nowhere'"]


def test_a_server_with_a_secret(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery\n")  # as `echo ... > secret` leaves it
    with serving("tests.rpc.services:Store", "--secret-file", str(secret)) as address:
        refused = run("call", address, "Store.put", '"k"', "1")
        assert refused.returncode == 1
        assert refused.stderr.splitlines()[1] == (
            "  hint: the server wants its shared secret: --secret-file FILE or "
            "--secret-env VAR")
        assert run("call", address, "Store.put", '"k"', "1", "--secret-file",
                   str(secret)).returncode == 0
        env = {**ENV, "STORE_SECRET": "correct horse battery"}
        by_env = subprocess.run([*COMMAND, "ls", address, "--secret-env", "STORE_SECRET"],
                                capture_output=True, text=True, env=env, timeout=60)
        assert by_env.returncode == 0 and "Store  -- " in by_env.stdout, by_env.stderr
        wrong = subprocess.run([*COMMAND, "ls", address, "--secret-env", "NOT_SET_ANYWHERE"],
                               capture_output=True, text=True, env=ENV, timeout=60)
        assert wrong.stderr.strip() == ("tensorwire: error: --secret-env: the environment "
                                        "variable NOT_SET_ANYWHERE is not set")


def test_a_server_with_mutual_tls(tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "server.pem"))
    ca.issue_cert("client.example").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "client.pem"))
    with serving("tests.rpc.services:Store", "--listen", "tcp://127.0.0.1:0",
                 "--tls-cert", str(tmp_path / "server.pem"),
                 "--tls-ca", str(tmp_path / "ca.pem")) as address:
        ok = run("call", address, "Store.echo", "[1]", "--tls-ca", str(tmp_path / "ca.pem"),
                 "--tls-cert", str(tmp_path / "client.pem"))
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout) == [1]
        untrusted = run("ls", address, "--tls")  # the system's CAs do not know ours
        assert untrusted.returncode == 1
        assert "hint: trust the server's CA with --tls-ca FILE" in untrusted.stderr
        no_client_cert = run("ls", address, "--tls-ca", str(tmp_path / "ca.pem"))
        assert no_client_cert.returncode == 1 and "Traceback" not in no_client_cert.stderr
        plain = run("ls", address)
        assert plain.returncode == 1 and "Traceback" not in plain.stderr


# -- bench output ---------------------------------------------------------------


def test_bench_two_transports_give_one_document() -> None:
    listen = ["--listen", "tcp://127.0.0.1:0", "--listen", "tcp://localhost:0"]
    result = run("bench", "rpc", "--sizes", "8", *listen, "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)  # one document, not one per transport
    assert [(r["transport"], r["size"]) for r in rows] == [
        ("tcp://127.0.0.1:0", 8), ("tcp://localhost:0", 8)]
    table = run("bench", "p2p", "--sizes", "8,1K", *listen, "--csv", timeout=120)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == "transport,size,latency_us,bandwidth_gbs,busbw_gbs"  # once
    assert [tuple(line.split(",")[:2]) for line in lines[1:]] == [
        ("tcp://127.0.0.1:0", "8"), ("tcp://127.0.0.1:0", "1024"),
        ("tcp://localhost:0", "8"), ("tcp://localhost:0", "1024")]


def test_bench_allreduce_under_a_launcher_warns_of_nothing() -> None:
    # Under launch, as under torchrun: each rank reads RANK and WORLD_SIZE.
    # 1 MiB takes ~190 rounds, enough to overflow a float32 sum of ones.
    result = run("launch", "-n", "2", sys.executable, "-m", "tensorwire", "bench",
                 "allreduce", "--sizes", "1M", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stdout + result.stderr
    assert "[rank 0] # allreduce over tcp://, 2 ranks" in result.stdout
    assert re.search(r"\[rank 0\]\s+1 MiB\s+[\d,.]+\s+[\d.]+\s+[\d.]+", result.stdout)


def test_bench_plot_is_checked_before_the_sweep(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run("bench", "p2p", "--plot", str(tmp_path / "missing" / "p2p.png"))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        f"tensorwire: error: --plot {tmp_path}/missing/p2p.png: the folder "
        f"{tmp_path}/missing does not exist")
    # No matplotlib: the same, before any sweep (the default one takes minutes).
    without = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['matplotlib'] = None; "
         "from tensorwire.cli import main; sys.exit(main(sys.argv[1:]))",
         "bench", "p2p", "--plot", str(tmp_path / "p2p.png")],
        capture_output=True, text=True, timeout=60, env=ENV)
    assert without.returncode == 1
    assert without.stderr.strip() == ("tensorwire: error: --plot needs matplotlib: "
                                      "pip install 'tensorwire[plot]'")
    assert time.monotonic() - started < 30


def test_bench_progress_bar_on_a_terminal() -> None:
    controller, terminal = pty.openpty()
    # A terminal 100 columns wide (a new pty has none, and tqdm fits the bar
    # to the width).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        child = subprocess.Popen([*COMMAND, "bench", "rpc", "--sizes", "8,1K,4K", "--listen",
                                  "tcp://127.0.0.1:0"], stdout=subprocess.PIPE,
                                 stderr=terminal, text=True, env=ENV, cwd=ROOT)
        os.close(terminal)
        shown = b""
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        stdout, _ = child.communicate(timeout=120)
    finally:
        os.close(controller)
    assert child.returncode == 0
    assert stdout.startswith("# rpc over tcp://")
    text = shown.decode(errors="replace")
    # tqdm's bar: the label, sizes done of all, rate and time left.
    assert re.search(r"rpc tcp://127\.0\.0\.1:\d+: +\d+%.*\| *[123]/3 \[", text), text
    assert "size/s" in text or "s/size" in text, text
