"""CUDA forward compatibility, chosen at start from the driver version (as the LMI image does).

The image's CUDA user space (torch's cu128 wheels, Triton's PTX) is newer than the drivers
SageMaker installs by default on most GPU instances (470 / 535 / 550). NVIDIA's `cuda-compat-12-8`
package puts a newer user-mode driver (`libcuda.so.<version>`) in `/usr/local/cuda/compat`; it works
on an older kernel module of a data-center GPU. It must be used only when the host driver is older
than it (a newer host driver is always better), so `container/serve` decides at start, before any
CUDA library is loaded, and prepends the directory to `LD_LIBRARY_PATH` of the server it execs.
Same rule as LMI's and SageMaker's documented entrypoint snippet: compat iff driver < compat.

`OPEN_LMI_CUDA_COMPAT=auto|true|false` overrides the choice (default auto).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

COMPAT_DIR = Path("/usr/local/cuda/compat")
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
ENV_SWITCH = "OPEN_LMI_CUDA_COMPAT"

# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.54.03  Tue Jun  6 22:20:39 UTC 2023"
# "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  ..."
_DRIVER_RE = re.compile(r"Kernel Module\b.*?\s(\d+(?:\.\d+)+)\s")
_LIBCUDA_RE = re.compile(r"^libcuda\.so\.(\d+(?:\.\d+)+)$")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def host_driver_version(version_file: Path = DRIVER_VERSION_FILE) -> tuple[int, ...] | None:
    """The loaded NVIDIA kernel module's version, or None without a driver (CPU, no GPU passed in)."""
    try:
        text = version_file.read_text(errors="replace")
    except OSError:
        return None
    match = _DRIVER_RE.search(text)
    return _version(match.group(1)) if match else None


def compat_driver_version(compat_dir: Path = COMPAT_DIR) -> tuple[int, ...] | None:
    """The driver version the compat libraries carry (`libcuda.so.1 -> libcuda.so.570.124.06`)."""
    link = compat_dir / "libcuda.so.1"
    candidates = []
    try:
        candidates.append(Path(os.readlink(link)).name)
    except OSError:
        pass
    try:
        candidates += sorted(p.name for p in compat_dir.glob("libcuda.so.*.*"))
    except OSError:
        pass
    for name in candidates:
        match = _LIBCUDA_RE.match(name)
        if match:
            return _version(match.group(1))
    return None


def _fmt(version: tuple[int, ...] | None) -> str:
    return ".".join(map(str, version)) if version else "none"


def cuda_compat_env(env: Mapping[str, str], compat_dir: Path = COMPAT_DIR,
                    version_file: Path = DRIVER_VERSION_FILE) -> tuple[dict[str, str], str]:
    """(`env` with the compat dir prepended to LD_LIBRARY_PATH when it should be used, why)."""
    out = dict(env)
    switch = env.get(ENV_SWITCH, "auto").strip().lower() or "auto"
    if switch not in ("auto", "true", "false"):
        raise ValueError(f"{ENV_SWITCH}={env[ENV_SWITCH]!r}: expected auto, true or false")
    compat = compat_driver_version(compat_dir)
    driver = host_driver_version(version_file)
    if switch == "false":
        return out, f"CUDA compat: off ({ENV_SWITCH}=false); host driver {_fmt(driver)}"
    if compat is None:
        return out, f"CUDA compat: no compat libraries in {compat_dir}; host driver {_fmt(driver)}"
    if switch == "auto" and driver is None:
        return out, f"CUDA compat: no NVIDIA driver loaded; compat libraries ({_fmt(compat)}) unused"
    if switch == "auto" and driver >= compat:
        return out, (f"CUDA compat: host driver {_fmt(driver)} >= compat libraries {_fmt(compat)}: "
                     "using the host driver")
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != str(compat_dir)]
    out["LD_LIBRARY_PATH"] = os.pathsep.join([str(compat_dir), *paths])
    why = "forced" if switch == "true" else f"host driver {_fmt(driver)} < {_fmt(compat)}"
    return out, f"CUDA compat: {why}: using the compat libraries in {compat_dir} ({_fmt(compat)})"
