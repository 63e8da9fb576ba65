"""What ``tensorwire info`` reports: versions, usable transports, UCX devices, GPUs.

Everything here is looked up when asked (optional libraries are imported
inside :func:`gather`), so importing the module costs nothing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ("format_text", "gather")

_DISTRIBUTIONS = {
    "tensorwire": "tensorwire",
    "numpy": "numpy",
    "msgpack": "msgpack",
    "uvloop": "uvloop",
    "ucxx": "ucxx-cu12",
    "cupy": "cupy-cuda12x",
    "torch": "torch",
    "ml_dtypes": "ml_dtypes",
}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ucx_info_binary() -> str | None:
    """The ``ucx_info`` of the system's UCX, else the one the libucx wheel ships."""
    found = shutil.which("ucx_info")
    if found:
        return found
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(next(iter(spec.submodule_search_locations))) / "bin" / "ucx_info"
    return str(candidate) if candidate.exists() else None


def _ucx_devices(binary: str) -> dict[str, list[str]]:
    """Transport -> devices, from ``ucx_info -d``."""
    # The wheel's ucx_info finds the wheel's libraries only when told where.
    lib = Path(binary).parent.parent / "lib"
    env = dict(os.environ)
    if (lib / "libucp.so.0").exists():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
    try:
        out = subprocess.run([binary, "-d"], capture_output=True, text=True, timeout=30,
                             env=env).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    devices: dict[str, list[str]] = {}
    transport = None
    for line in out.splitlines():
        text = line.strip().lstrip("#").strip()
        if text.startswith("Transport:"):
            transport = text.split(":", 1)[1].strip()
        elif text.startswith("Device:") and transport is not None:
            devices.setdefault(transport, []).append(text.split(":", 1)[1].strip())
    return devices


def _gpus() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return []
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if importlib.util.find_spec("cupy") is not None:
        try:
            cupy: Any = importlib.import_module("cupy")
            count = int(cupy.cuda.runtime.getDeviceCount())
            return [str(cupy.cuda.runtime.getDeviceProperties(i)["name"].decode())
                    for i in range(count)]
        except Exception:
            return []
    return []


def gather() -> dict[str, Any]:
    """The facts, as a JSON-ready dict."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name, distribution in _DISTRIBUTIONS.items():
        versions[name] = _version(distribution)
    transports: dict[str, dict[str, Any]] = {
        "tcp": {"usable": True, "note": "asyncio sockets; TLS with TransportConfig(ssl_*)"},
        "inproc": {"usable": True, "note": "same process and event loop (tests)"},
    }
    ucx: dict[str, Any] = {}
    if importlib.util.find_spec("ucxx") is None:
        transports["ucx"] = {"usable": False,
                             "note": "ucxx is not installed: pip install ucxx-cu12"}
    else:
        try:
            libucxx: Any = importlib.import_module("ucxx._lib.libucxx")
            ucx["version"] = ".".join(str(v) for v in libucxx.get_ucx_version())
            transports["ucx"] = {"usable": True, "note": f"UCX {ucx['version']}"}
        except Exception as exc:
            transports["ucx"] = {"usable": False, "note": f"ucxx does not load: {exc}"}
        binary = _ucx_info_binary()
        if binary is not None:
            ucx["ucx_info"] = binary
            ucx["devices"] = _ucx_devices(binary)
            rdma = sorted(t for t in ucx["devices"] if t in ("rc_verbs", "rc_mlx5", "dc_mlx5",
                                                             "ud_verbs", "ud_mlx5"))
            ucx["rdma"] = rdma
    return {
        "versions": versions,
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "executable": sys.executable,
        "transports": transports,
        "ucx": ucx,
        "gpus": _gpus(),
    }


def format_text(info: dict[str, Any]) -> str:
    """The facts for a person to read."""
    lines = ["versions:"]
    for name, version in info["versions"].items():
        lines.append(f"  {name:<11} {version or 'not installed'}")
    lines += [f"platform:   {info['platform']}", "transports:"]
    for scheme, state in info["transports"].items():
        mark = "yes" if state["usable"] else "no "
        lines.append(f"  {scheme + '://':<9} {mark}  {state['note']}")
    ucx = info["ucx"]
    if ucx.get("devices") is not None:
        lines.append(f"UCX devices ({ucx['ucx_info']}):")
        for transport, devices in sorted(ucx["devices"].items()):
            lines.append(f"  {transport:<11} {', '.join(devices)}")
        if not ucx.get("rdma"):
            lines.append("  no RDMA transport: this UCX has no InfiniBand/RoCE verbs "
                         "(see README, 'UCX on a cluster')")
    gpus = info["gpus"]
    lines.append("GPUs:       " + ("; ".join(gpus) if gpus else "none seen"))
    return "\n".join(lines)
