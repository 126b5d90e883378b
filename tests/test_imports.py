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


def _serving_imports(path: Path, depth: int = 1) -> set[str]:
    """The `serving.<sub>` modules/packages a file imports, lazily or not: the `depth` path
    components after `serving` (depth 2: `server.settings`, `server.app`, `checkpoint.quantization`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.Import):
            mods = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module.startswith("serving")]
        for mod in mods:
            parts = mod.split(".")
            if parts[0] == "serving" and len(parts) > depth:
                names.add(".".join(parts[1 : 1 + depth]))
    return names


# Inside serving/: the HTTP edge -> the engine -> the executor -> the public API types at the root
# -> the checkpoint on disk, never back. The edge's own ground floor is `server/settings/`.
_LAYERS = {
    "server": {"executor"},
    "engine": {"server"},
    "executor": {"server", "engine"},
    "checkpoint": {"server", "engine", "executor"},
}
_SUBPACKAGES = {"server", "engine", "executor"}  # the layers above the root modules
_BELOW_ROOT = {"checkpoint"}  # what the root modules may import besides themselves


@pytest.mark.parametrize("layer, forbidden", sorted(_LAYERS.items()))
def test_serving_layers_point_one_way(layer: str, forbidden: set[str]) -> None:
    files = sorted((ROOT / "serving" / layer).rglob("*.py"))
    assert files, f"no python files under serving/{layer}/"
    offenders = {str(f.relative_to(ROOT)): sorted(_serving_imports(f) & forbidden) for f in files}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"serving/{layer} must not import serving.{sorted(forbidden)}: {offenders}"


def test_checkpoint_imports_nothing_of_serving_outside_itself() -> None:
    """The checkpoint on disk is the ground floor: the root's API types and every layer read it."""
    offenders = {}
    for f in sorted((ROOT / "serving" / "checkpoint").rglob("*.py")):
        bad = {m for m in _serving_imports(f) if m != "checkpoint"}
        if bad:
            offenders[str(f.relative_to(ROOT))] = sorted(bad)
    assert not offenders, f"serving/checkpoint must import only itself of serving: {offenders}"


def test_edge_settings_import_no_other_part_of_the_edge() -> None:
    """`server/settings/` (configuration, model and adapter fetching) is read by the rest of the edge
    and by container/ scripts, so it imports none of the edge's other modules."""
    offenders = {}
    for f in sorted((ROOT / "serving" / "server" / "settings").rglob("*.py")):
        bad = {m for m in _serving_imports(f, depth=2) if m.startswith("server.") and m != "server.settings"}
        if bad:
            offenders[str(f.relative_to(ROOT))] = sorted(bad)
    assert not offenders, f"serving/server/settings must not import the rest of the edge: {offenders}"


def test_common_serving_modules_import_no_layer_but_the_entry_points() -> None:
    """The public API types at the root (sampling params, outputs, engine config, ...) are shared
    by every layer, so they import none of the layers, only `serving.checkpoint` (the offline `LLM`
    entry point may use the engine)."""
    entry_points = {"llm.py": {"engine"}, "__init__.py": {"engine"}}
    root_files = sorted((ROOT / "serving").glob("*.py"))
    allowed = _BELOW_ROOT | {f.stem for f in root_files}
    offenders = {}
    for f in root_files:
        bad = _serving_imports(f) - allowed - entry_points.get(f.name, set())
        if bad:
            offenders[f.name] = sorted(bad)
    assert not offenders, f"common modules must not import the layers: {offenders}"


def test_serving_reads_only_the_shared_model_type_facts_of_sdk() -> None:
    """The server may read `sdk/model_types.py` (the one torch-free table the sizing calculator reads
    too, so the two cannot drift) and nothing else of the client side."""
    offenders = {}
    for f in sorted((ROOT / "serving").rglob("*.py")):
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [f"{node.module}.{a.name}" if node.module == "sdk" else node.module for a in node.names]
            bad = [m for m in mods if m.split(".")[0] == "sdk" and m != "sdk.model_types"]
            if bad:
                offenders.setdefault(str(f.relative_to(ROOT)), []).extend(bad)
    assert not offenders, f"serving may import only sdk.model_types of sdk: {offenders}"
