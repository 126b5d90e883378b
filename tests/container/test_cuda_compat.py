"""container/cuda_compat.py: the CUDA compat libraries are used iff the host driver is older."""

from pathlib import Path

import pytest

from container.cuda_compat import compat_driver_version, cuda_compat_env, host_driver_version

# Real /proc/driver/nvidia/version texts: the proprietary module, and the open one.
PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.54.03  Tue Jun  6 22:20:39 UTC 2023\n"
               "GCC version:  gcc version 7.3.1 20180712 (Red Hat 7.3.1-15) (GCC)\n")
OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Wed Feb 26 01:25:11 UTC 2025\n")


def _compat_dir(tmp_path: Path, version: str = "570.124.06") -> Path:
    d = tmp_path / "compat"
    d.mkdir()
    (d / f"libcuda.so.{version}").write_bytes(b"")
    (d / "libcuda.so.1").symlink_to(f"libcuda.so.{version}")
    return d


def _driver(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "version"
    f.write_text(text)
    return f


def test_versions_parsed(tmp_path):
    assert host_driver_version(_driver(tmp_path, PROPRIETARY)) == (535, 54, 3)
    assert host_driver_version(_driver(tmp_path, OPEN)) == (570, 124, 6)
    assert host_driver_version(tmp_path / "missing") is None
    assert compat_driver_version(_compat_dir(tmp_path)) == (570, 124, 6)
    assert compat_driver_version(tmp_path / "nothing") is None


@pytest.mark.parametrize("driver", ["470.256.02", "535.54.03", "550.127.05"])  # SageMaker's defaults
def test_older_driver_gets_compat_first_on_the_library_path(tmp_path, driver):
    compat = _compat_dir(tmp_path)
    text = PROPRIETARY.replace("535.54.03", driver)
    env, why = cuda_compat_env({"LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"}, compat,
                               _driver(tmp_path, text))
    assert env["LD_LIBRARY_PATH"] == f"{compat}:/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
    assert f"host driver {'.'.join(str(int(x)) for x in driver.split('.'))} < 570.124.6" in why


@pytest.mark.parametrize("driver", ["570.124.06", "575.51.03"])
def test_same_or_newer_driver_is_left_alone(tmp_path, driver):
    env, why = cuda_compat_env({"A": "1"}, _compat_dir(tmp_path), _driver(tmp_path, OPEN.replace("570.124.06", driver)))
    assert env == {"A": "1"} and "using the host driver" in why


def test_no_driver_or_no_compat_libraries(tmp_path):
    env, why = cuda_compat_env({}, _compat_dir(tmp_path), tmp_path / "no-driver")
    assert env == {} and "no NVIDIA driver" in why
    env, why = cuda_compat_env({}, tmp_path / "none", _driver(tmp_path, PROPRIETARY))
    assert env == {} and "no compat libraries" in why


def test_switch(tmp_path):
    compat = _compat_dir(tmp_path)
    new = _driver(tmp_path, OPEN.replace("570.124.06", "580.1.2"))
    env, _ = cuda_compat_env({"OPEN_LMI_CUDA_COMPAT": "true", "LD_LIBRARY_PATH": str(compat)}, compat, new)
    assert env["LD_LIBRARY_PATH"] == str(compat)  # forced, and never listed twice
    env, why = cuda_compat_env({"OPEN_LMI_CUDA_COMPAT": "false"}, compat, _driver(tmp_path, PROPRIETARY))
    assert "LD_LIBRARY_PATH" not in env and "off" in why
    with pytest.raises(ValueError, match="OPEN_LMI_CUDA_COMPAT"):
        cuda_compat_env({"OPEN_LMI_CUDA_COMPAT": "maybe"}, compat, new)
