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


def _serving_imports(path: Path) -> set[str]:
    """The `serving.<sub>` modules/packages a file imports (second path component), lazily or not."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.Import):
            mods = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "serving" else [])
        for mod in mods:
            parts = mod.split(".")
            if parts[0] == "serving" and len(parts) > 1:
                names.add(parts[1])
    return names


# Inside serving/: the HTTP edge -> the engine -> the executor -> the common modules, never back.
_LAYERS = {"server": {"executor"}, "engine": {"server"}, "executor": {"server", "engine"}}
_SUBPACKAGES = {"server", "engine", "executor"}


@pytest.mark.parametrize("layer, forbidden", sorted(_LAYERS.items()))
def test_serving_layers_point_one_way(layer: str, forbidden: set[str]) -> None:
    files = sorted((ROOT / "serving" / layer).rglob("*.py"))
    assert files, f"no python files under serving/{layer}/"
    offenders = {str(f.relative_to(ROOT)): sorted(_serving_imports(f) & forbidden) for f in files}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"serving/{layer} must not import serving.{sorted(forbidden)}: {offenders}"


def test_common_serving_modules_import_no_layer_but_the_entry_points() -> None:
    """Config, sampling params, outputs, tokenizer, model files: shared by every layer, so they
    import none of the layers (the offline `LLM` entry point may use the engine)."""
    entry_points = {"llm.py": {"engine"}, "__init__.py": {"engine"}}
    offenders = {}
    for f in sorted((ROOT / "serving").glob("*.py")):
        bad = (_serving_imports(f) & _SUBPACKAGES) - entry_points.get(f.name, set())
        if bad:
            offenders[f.name] = sorted(bad)
    assert not offenders, f"common modules must not import the layers: {offenders}"
