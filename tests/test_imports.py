"""Imports point one way: sdk -> nothing of ours (and no torch); kernels -> nothing of serving."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    "package, forbidden",
    [("sdk", {"serving", "kernels", "container", "torch", "triton"}), ("kernels", {"serving", "container", "sdk"})],
)
def test_import_direction(package: str, forbidden: set[str]) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no python files under {package}/"
    offenders = {str(f.relative_to(ROOT)): sorted(_imported_modules(f) & forbidden) for f in files}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{package} must not import {sorted(forbidden)}: {offenders}"


def test_sdk_imports_without_torch() -> None:
    code = "import sys, sdk, sdk.iterators, sdk.client; assert 'torch' not in sys.modules, 'sdk pulled torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
