"""The package layout stays as data/__init__.py draws it: data/ and model/ import no circle (lazy
imports inside functions count too, sub-packages included), data/'s bands import only downward,
data/ never imports model/, no module imports another's private names, no test file imports
another, and checking a data config loads neither Grain nor JAX.
Run: pytest tests/test_imports.py"""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path, package: str):
    """(module imported, names imported from it) for every import in the file, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, [a.name for a in node.names]


def _graph(package: str) -> dict[str, set[str]]:
    """{module: modules of `package` it imports}, dotted below the package ("readers.sources"),
    over every file of the package and its sub-packages."""
    files = {".".join(p.relative_to(ROOT / package).with_suffix("").parts): p
             for p in (ROOT / package).rglob("*.py") if p.stem != "__init__"}
    graph = {}
    for m, path in files.items():
        deps = set()
        for mod, names in _imports(path, package):
            if mod != package and not mod.startswith(package + "."):
                continue
            below = mod.removeprefix(package).removeprefix(".")
            if below in files:
                deps.add(below)
            # `from data.readers import sources` / `from data import timing`
            deps.update(f"{below}.{n}" if below else n for n in names if (f"{below}.{n}" if below else n) in files)
        graph[m] = deps - {m}
    return graph


def _data_graph() -> dict[str, set[str]]:
    return _graph("data")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_data_imports_form_no_circle():
    graph = _data_graph()
    assert graph["host"] >= {"streams.mixture", "streams.shard"}          # the graph is really read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_model_imports_form_no_circle():
    graph = _graph("model")
    assert graph["runtime.resume"] >= {"runtime.checkpoint", "runtime.rollback"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


# data/'s bands: each imports only itself and the bands and leaves below it.
_BANDS = {"readers": {"readers", "timing"}, "streams": {"readers", "streams", "timing", "tokenizer"}}


def _band_breaches(graph: dict[str, set[str]]) -> list[str]:
    return [f"data/{m.replace('.', '/')}.py imports data.{d}" for m, deps in sorted(graph.items())
            if m.split(".")[0] in _BANDS for d in sorted(deps) if d.split(".")[0] not in _BANDS[m.split(".")[0]]]


def test_data_bands_import_only_downward():
    graph = _data_graph()
    assert graph["streams.shard"] >= {"readers.sources", "tokenizer"}
    assert not _band_breaches(graph), _band_breaches(graph)
    graph["readers.sources"] = graph["readers.sources"] | {"streams.shard"}   # a reader that packs
    assert _band_breaches(graph) == ["data/readers/sources.py imports data.streams.shard"]


def test_cycle_finder_finds_a_planted_circle():
    graph = _data_graph()
    graph["streams.mixture"] = graph["streams.mixture"] | {"host"}          # what data/ had before issue #20
    assert _cycle(graph) is not None


def test_data_never_imports_model_and_nobody_imports_private_names():
    files = [*ROOT.glob("data/**/*.py"), *ROOT.glob("model/**/*.py"), *ROOT.glob("scripts/**/*.py"), ROOT / "train.py"]
    bad = []
    for path in files:
        rel = path.relative_to(ROOT)
        for mod, names in _imports(path, ""):
            if rel.parts[0] == "data" and (mod == "model" or mod.startswith("model.")):
                bad.append(f"{rel}: imports {mod}")
            if mod.split(".")[0] in ("data", "model", "train"):
                bad += [f"{rel}: imports the private {mod}.{n}" for n in names if n.startswith("_")]
        # `import train` then `train._helper`: a private name of the entry file used elsewhere
        tree = ast.parse(path.read_text())
        bad += [f"{rel}: uses train.{n.attr}" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and n.value.id in ("train", "train_mod") and n.attr.startswith("_")]
    assert not bad, bad


def _test_files_imported(path: Path) -> list[str]:
    """The test_*.py modules a file imports (as test_x, tests.test_x or `from tests import test_x`)."""
    found = []
    for mod, names in _imports(path, ""):
        if mod == "tests":
            found += [f"tests.{n}" for n in names if n.startswith("test_")]
        elif mod.removeprefix("tests.").split(".")[0].startswith("test_"):
            found.append(mod)
    return found


def test_no_test_file_imports_another(tmp_path):
    """Helpers shared by test files live in conftest.py or a helper module (run_helpers.py,
    data_helpers.py, ...), never in one test_*.py imported by another."""
    planted = tmp_path / "test_planted.py"
    planted.write_text("import test_train\nfrom tests import test_data_formats\n"
                       "def f():\n    from tests.test_resume import run\n")
    assert _test_files_imported(planted) == ["test_train", "tests.test_data_formats", "tests.test_resume"]
    bad = [f"tests/{path.name}: imports {mod}" for path in sorted((ROOT / "tests").glob("test_*.py"))
           for mod in _test_files_imported(path)]
    assert not bad, bad


def test_checking_a_data_config_loads_neither_grain_nor_jax():
    code = (
        "import sys\n"
        "from data.config import DataConfig, validate_settings\n"
        "from data.heldout import eval_settings\n"
        f"cfg = DataConfig.from_mapping({{'paths': '{ROOT}/data/sample/*/en_head.json.gz', "
        "'tokenizer': 'x', 'seq_len': 64, 'global_batch_size': 8, 'num_shards': 4, 'num_workers': 'auto'})\n"
        "validate_settings(cfg, 2)\n"
        "eval_settings({'holdout_files': 1})\n"
        "print(sorted(m for m in ('grain', 'jax', 'jaxlib', 'flax', 'orbax') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.slow
def test_a_non_editable_install_holds_every_room(tmp_path):
    """`pip install .` (not -e) ships model/ and data/ with their sub-packages and the bundled
    sample: built from a copy of the tree, installed into a folder, imported from elsewhere."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "train.py", "model", "data"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree
                                         else {}))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(src)],
                   check=True, capture_output=True, text=True)
    rooms = sorted({".".join(p.relative_to(ROOT).parts[:-1]) for p in ROOT.glob("*/**/__init__.py")
                    if p.parts[len(ROOT.parts)] in ("model", "data")})
    assert {"data.readers", "data.streams", "model.runtime", "model.evals"} <= set(rooms), rooms
    code = (f"import importlib\nfor m in {rooms!r}:\n    print(importlib.import_module(m).__file__)\n"
            "import data.feed, model.runtime.saves, model.evals.tasks\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == len(rooms) and all(f.startswith(str(site)) for f in out), out
    assert (site / "data" / "sample" / "tokenizer.json").is_file()
