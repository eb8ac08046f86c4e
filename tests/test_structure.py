"""Structure: no import circles between the project's modules, one home for the helpers both packages use, importing
`dgap_hf` leaves the `"gaac"` attention unregistered, and `gaac-hf --help` needs no torch."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gaac_hf", "dgap_hf", "hf_common", "triton_ops")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_main_guard(node) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _imports(tree):
    """Every import statement, at any depth (function-level imports close circles too), except under
    `if __name__ == "__main__":`."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if _is_main_guard(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """`{module: {project modules it imports}}`; `from package import name` counts as importing `package.name`
    when that is a module, else `package`."""
    files = module_files(root)
    graph = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[:len(up) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # `import a.b.c` of a module imports its packages too
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Elementary cycles found by depth-first search (one per back edge)."""
    cycles, state = [], {}

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_cycle_finder_finds_a_function_level_circle(tmp_path):
    pkg = tmp_path / "gaac_hf"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("def f():\n    from .demo import g\n")
    (pkg / "demo.py").write_text("def g():\n    from .cli import f\n")
    for other in PACKAGES[1:]:
        (tmp_path / other).mkdir()
    assert find_cycles(import_graph(tmp_path)) == [["gaac_hf.cli", "gaac_hf.demo", "gaac_hf.cli"]]


def test_no_import_cycles():
    assert find_cycles(import_graph()) == []


def test_layering():
    """hf_common imports no other project package; triton_ops imports none; gaac_hf never imports dgap_hf."""
    for mod, targets in import_graph().items():
        top = {t.split(".")[0] for t in targets} - {mod.split(".")[0]}
        allowed = {"hf_common": set(), "triton_ops": set(), "gaac_hf": {"hf_common", "triton_ops"},
                   "dgap_hf": {"hf_common", "gaac_hf", "triton_ops"}}[mod.split(".")[0]]
        assert top <= allowed, f"{mod} imports {sorted(top - allowed)}"


@pytest.mark.parametrize("name", ["text_config", "layer_types_and_kwargs", "layer_types", "kv_geometry",
                                  "cache_kwarg", "shipped_calibration", "model_identity", "base_model_info"])
def test_shared_helpers_have_one_home(name):
    homes = []
    for mod, path in module_files().items():
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == name:
                homes.append(rel)
    assert len(homes) <= 1, f"{name} is defined in {homes}"
    # and the copies' tell-tale: reading get_text_config by hand
    readers = [str(p.relative_to(ROOT)) for p in module_files().values()
               if "get_text_config" in p.read_text()]
    assert readers == ["hf_common/model_config.py"]


ROW_SELECTION = ("reorder_cache", "batch_repeat_interleave", "batch_select_indices")


def test_dynamic_caches_share_the_layer_builder_and_row_selection():
    """GAACCache and LowBitCache build their layer lists with `hf_common.cache_layers` (the only module that builds a
    stock `DynamicCache` for its layers) and get the row-selection trio from its mixin."""
    from dgap_hf.cache import LowBitLayer
    from gaac_hf.cache import GAACLayer
    from hf_common.cache_layers import RowSelectionMixin

    for cls in (GAACLayer, LowBitLayer):
        assert issubclass(cls, RowSelectionMixin)
        assert not set(ROW_SELECTION) & set(vars(cls)), f"{cls.__name__} redefines the row selection"
        assert "_select_rows" in vars(cls)
    builders = [str(p.relative_to(ROOT)) for p in module_files().values() if "DynamicCache(config=config)" in
                re.sub(r'""".*?"""|#.*', "", p.read_text(), flags=re.S)]
    assert builders == ["hf_common/cache_layers.py"]


def test_hf_common_imports_no_torch():
    out = _python("import sys\nimport hf_common, hf_common.model_config, hf_common.artifacts, hf_common.console\n"
                  "print('torch imported:', 'torch' in sys.modules)\n")
    assert "torch imported: False" in out


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_importing_dgap_helpers_does_not_register_gaac():
    out = _python(
        "import sys\n"
        "import dgap_hf, dgap_hf.cli, dgap_hf.evaluation, dgap_hf.predict, dgap_hf.processor, dgap_hf.train\n"
        "from transformers import AttentionInterface\n"
        "print('gaac_hf loaded:', any(m.startswith('gaac_hf') for m in sys.modules))\n"
        "print('gaac registered:', 'gaac' in AttentionInterface._global_mapping)\n"
        "import gaac_hf\n"
        "print('after import gaac_hf:', 'gaac' in AttentionInterface._global_mapping)\n")
    assert "gaac_hf loaded: False" in out and "gaac registered: False" in out
    assert "after import gaac_hf: True" in out  # the documented way to register it still works


def test_gaac_hf_help_and_version_import_no_torch():
    out = _python(
        "import sys\n"
        "from hf_common.console import gaac_main\n"
        "for argv in (['--help'], ['calibrate', '--help'], ['report', '--help'], ['--version']):\n"
        "    try:\n"
        "        gaac_main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n")
    assert "torch imported: False" in out
    assert "gaac-hf 0.1.0" in out


def test_console_script_points_at_the_torch_free_parser():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^gaac-hf = "hf_common\.console:gaac_main"', text, re.M)


def test_dgap_hf_version_and_defaults_in_help(capsys):
    from dgap_hf.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == "dgap-hf 0.1.0"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["collect", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: K1V1,K2V2,K4V4,K8V8)" in text and "(default: 128)" in text


SHARED_TESTS = {"test_structure.py", "test_packaging.py", "test_model_identity.py", "test_artifact_paths.py"}


def test_tests_are_named_by_product_and_import_no_conftest():
    """`tests/test_gaac_*` / `tests/test_dgap_*` (plus the few shared ones); builders come from helper modules, never
    from conftest (fixtures only); no benchmark reaches into tests/ through sys.path."""
    tests = ROOT / "tests"
    unnamed = [p.name for p in tests.glob("test_*.py")
               if not p.name.startswith(("test_gaac_", "test_dgap_")) and p.name not in SHARED_TESTS]
    assert unnamed == []
    from_conftest = [p.name for p in tests.glob("*.py") for node in _imports(ast.parse(p.read_text()))
                     if isinstance(node, ast.ImportFrom) and node.module == "conftest"]
    assert from_conftest == []
    reach = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py")
             if re.search(r"sys\.path\.insert\([^)]*tests", p.read_text())]
    assert reach == []
