"""What ``tensorwire info`` reports, for a bug report as for a first look.

Versions, the OS, usable transports, the UCX library that was loaded and
its devices, GPUs and the CUDA driver (NVML) and runtimes, and the
environment variables that change what tensorwire or UCX do. Everything is
looked up when asked (optional libraries are imported inside
:func:`gather`), so importing the module costs nothing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import _compiled

__all__ = ("format_text", "gather")

#: Import name -> the distributions that may provide it (one per CUDA major).
_DISTRIBUTIONS = {
    "tensorwire": ("tensorwire",),
    "numpy": ("numpy",),
    "msgpack": ("msgpack",),
    "uvloop": ("uvloop",),
    "ucxx": ("ucxx-cu12", "ucxx-cu13"),
    "libucx": ("libucx-cu12", "libucx-cu13"),
    "cuda-bindings": ("cuda-bindings",),
    "cupy": ("cupy-cuda12x", "cupy-cuda13x"),
    "torch": ("torch",),
    "ml_dtypes": ("ml_dtypes",),
    "prometheus_client": ("prometheus-client",),
}
#: Environment variables that change what tensorwire, UCX or CUDA do.
_ENVIRONMENT = re.compile(r"^(UCX_|UCXPY_|TENSORWIRE_|RAPIDS_|CUDA_|NCCL_|NVIDIA_)|"
                          r"^(LD_LIBRARY_PATH|LD_PRELOAD|MASTER_ADDR|MASTER_PORT|RANK|"
                          r"WORLD_SIZE|LOCAL_RANK|SLURM_PROCID|SLURM_NTASKS|"
                          r"OMPI_COMM_WORLD_RANK|OMPI_COMM_WORLD_SIZE)$")
#: Variables whose values may be credentials: named, not shown.
_HIDDEN = re.compile(r"SECRET|TOKEN|PASSWORD|KEY", re.I)


def _version(distributions: tuple[str, ...]) -> str | None:
    for distribution in distributions:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if len(distributions) == 1 else f"{version} ({distribution})"
    return None


def _environment() -> dict[str, str]:
    return {name: ("(set, not shown)" if _HIDDEN.search(name) else value)
            for name, value in sorted(os.environ.items()) if _ENVIRONMENT.match(name)}


def _os() -> str:
    try:
        release = platform.freedesktop_os_release()
    except OSError:
        return platform.platform()
    return release.get("PRETTY_NAME") or release.get("NAME", platform.platform())


def _loaded_library(stem: str) -> Path | None:
    """The file of a shared library this process has mapped (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").partition("/")[2]
                if Path("/" + path).name.startswith(stem):
                    return Path("/" + path)
    except OSError:
        pass
    return None


def _ucx_info_version(binary: str, env: dict[str, str]) -> str | None:
    try:
        out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=30,
                             env=env).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"version:?\s*(\d+\.\d+\.\d+)", out)
    return found.group(1) if found else None


def _ucx_info_binary(library: Path, version: str) -> tuple[str | None, dict[str, str], str]:
    """A ``ucx_info`` that runs on the loaded UCX library, the environment to run
    it with, and why none was found.

    It looks beside the library first (the wheel's own ``bin/``, a system
    prefix's), then on PATH, and keeps one whose library version is the loaded
    one: a ``ucx_info`` of another UCX lists another UCX's devices.
    """
    env = dict(os.environ)
    # Each candidate runs on the loaded library's folder first.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(library.parent), env.get("LD_LIBRARY_PATH", "")) if p)
    candidates = [library.parent.parent / "bin" / "ucx_info",
                  library.parent.parent.parent / "bin" / "ucx_info"]
    on_path = shutil.which("ucx_info")
    if on_path:
        candidates.append(Path(on_path))
    seen = []
    for candidate in candidates:
        if not candidate.exists() or str(candidate) in seen:
            continue
        seen.append(str(candidate))
        found = _ucx_info_version(str(candidate), env)
        if found == version:
            return str(candidate), env, ""
        seen[-1] += f" (UCX {found})"
    why = (f"no ucx_info of UCX {version} found"
           + (f"; tried {', '.join(seen)}" if seen else ""))
    return None, env, why


def _ucx_devices(binary: str, env: dict[str, str]) -> dict[str, list[str]]:
    """Transport -> devices, from ``ucx_info -d``."""
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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda() -> dict[str, Any]:
    """GPUs and the CUDA driver from NVML, and the CUDA runtimes of the
    libraries installed (each library brings its own)."""
    cuda: dict[str, Any] = {"gpus": [], "driver": None, "driver_cuda": None, "runtimes": {}}
    try:
        import pynvml
    except ImportError:
        cuda["note"] = "nvidia-ml-py is not installed"
    else:
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # no driver: NVMLError_LibraryNotFound, ...
            cuda["note"] = f"NVML: {exc}"
        else:
            try:
                cuda["driver"] = _text(pynvml.nvmlSystemGetDriverVersion())
                version = int(pynvml.nvmlSystemGetCudaDriverVersion())
                cuda["driver_cuda"] = f"{version // 1000}.{version % 1000 // 10}"
                for index in range(int(pynvml.nvmlDeviceGetCount())):
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                    cuda["gpus"].append(
                        f"{index}: {_text(pynvml.nvmlDeviceGetName(handle))}, "
                        f"{int(memory.total) / (1 << 30):.0f} GiB, "
                        f"{_text(pynvml.nvmlDeviceGetUUID(handle))}")
            except Exception as exc:
                cuda["note"] = f"NVML: {exc}"
            finally:
                pynvml.nvmlShutdown()
    runtimes: dict[str, str] = cuda["runtimes"]
    torch = importlib.util.find_spec("torch")
    if torch is not None and torch.submodule_search_locations:
        # From torch/version.py's text: importing torch takes seconds.
        version_py = Path(next(iter(torch.submodule_search_locations))) / "version.py"
        try:
            found = re.search(r"^cuda\b.*?=\s*['\"]?([\w.]+)", version_py.read_text(), re.M)
        except OSError:
            found = None
        cuda_version = found.group(1) if found else "unknown"
        runtimes["torch"] = "none (a CPU build)" if cuda_version == "None" else cuda_version
    if importlib.util.find_spec("cupy") is not None:
        try:
            cupy: Any = importlib.import_module("cupy")
            version = int(cupy.cuda.runtime.runtimeGetVersion())
            runtimes["cupy"] = f"{version // 1000}.{version % 1000 // 10}"
        except Exception as exc:
            runtimes["cupy"] = f"unknown: {exc}"
    bindings = _version(("cuda-bindings",))
    if bindings is not None:
        runtimes["cuda-bindings (ucxx, rmm)"] = bindings
    return cuda


def gather() -> dict[str, Any]:
    """The facts, as a JSON-ready dict."""
    # Before ucxx is imported: it sets UCX_* variables of its own when imported.
    environment = _environment()
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name, distributions in _DISTRIBUTIONS.items():
        versions[name] = _version(distributions)
    transports: dict[str, dict[str, Any]] = {
        "tcp": {"usable": True, "note": "asyncio sockets; TLS with TransportConfig(ssl_*)"},
        "inproc": {"usable": True, "note": "same process and event loop (tests)"},
    }
    ucx: dict[str, Any] = {}
    if importlib.util.find_spec("ucxx") is None:
        transports["ucx"] = {"usable": False,
                             "note": "ucxx is not installed: pip install 'tensorwire[ucx-cu12]' "
                                     "(or ucx-cu13)"}
    else:
        try:
            libucxx: Any = importlib.import_module("ucxx._lib.libucxx")
            ucx["version"] = ".".join(str(v) for v in libucxx.get_ucx_version())
            transports["ucx"] = {"usable": True, "note": f"UCX {ucx['version']}"}
        except Exception as exc:
            transports["ucx"] = {"usable": False, "note": f"ucxx does not load: {exc}"}
        library = _loaded_library("libucp.so")
        if library is not None and "version" in ucx:
            ucx["library"] = str(library)
            binary, env, why = _ucx_info_binary(library, ucx["version"])
            if binary is None:
                ucx["devices_note"] = why
            else:
                ucx["ucx_info"] = binary
                ucx["devices"] = _ucx_devices(binary, env)
                ucx["rdma"] = sorted(t for t in ucx["devices"]
                                     if t in ("rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs",
                                              "ud_mlx5"))
    cuda = _cuda()
    return {
        "versions": versions,
        "os": _os(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "executable": sys.executable,
        "compiled_core": _compiled.status(),
        "transports": transports,
        "ucx": ucx,
        "gpus": cuda.pop("gpus"),
        "cuda": cuda,
        "environment": environment,
    }


def format_text(info: dict[str, Any]) -> str:
    """The facts for a person to read."""
    lines = ["versions:"]
    for name, version in info["versions"].items():
        lines.append(f"  {name:<17} {version or 'not installed'}")
    lines += [f"os:         {info['os']}", f"platform:   {info['platform']}",
              f"executable: {info['executable']}"]
    core = info["compiled_core"]
    lines.append("compiled core: " + ("loaded" if core["loaded"] else "NOT LOADED"))
    lines += [f"  {name:<40} {where}" for name, where in core["modules"].items()]
    lines.append("transports:")
    for scheme, state in info["transports"].items():
        mark = "yes" if state["usable"] else "no "
        lines.append(f"  {scheme + '://':<9} {mark}  {state['note']}")
    ucx = info["ucx"]
    if ucx.get("library"):
        lines.append(f"UCX library: {ucx['library']}")
    if ucx.get("devices") is not None:
        lines.append(f"UCX devices ({ucx['ucx_info']}):")
        for transport, devices in sorted(ucx["devices"].items()):
            lines.append(f"  {transport:<11} {', '.join(devices)}")
        if not ucx.get("rdma"):
            lines.append("  no RDMA transport: this UCX has no InfiniBand/RoCE verbs "
                         "(see README, 'UCX on a cluster')")
    elif ucx.get("devices_note"):
        lines.append(f"UCX devices: unknown, {ucx['devices_note']}")
    cuda = info["cuda"]
    driver = (f"{cuda['driver']} (CUDA {cuda['driver_cuda']})" if cuda["driver"]
              else f"none seen ({cuda.get('note', 'no NVML')})")
    lines.append(f"CUDA driver: {driver}")
    if cuda["runtimes"]:
        lines.append("CUDA runtimes: " + "; ".join(f"{name} {version}" for name, version
                                                   in cuda["runtimes"].items()))
    gpus = info["gpus"]
    lines.append("GPUs:" + ("".join(f"\n  {gpu}" for gpu in gpus) if gpus else "       none seen"))
    lines.append("environment:" + ("".join(f"\n  {name}={value}" for name, value
                                           in info["environment"].items()) or " nothing set"))
    return "\n".join(lines)
