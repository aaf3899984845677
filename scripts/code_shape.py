"""The shape of the code, as the layout issues measure it: files per room of model/ and data/, the
longest import chain (floors) of each package over its sub-packages, the lines of train.py's run and
of its loop, and the longest functions.

    python scripts/code_shape.py [ROOT]      # ROOT: a checkout (default: this one)
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, [a.name for a in node.names]


def graph(root: Path, pkg: str) -> dict[str, set[str]]:
    """{module below `pkg` ("readers.sources"): the modules of `pkg` it imports, at any depth}."""
    files = {".".join(p.relative_to(root / pkg).with_suffix("").parts): p
             for p in (root / pkg).rglob("*.py") if p.stem != "__init__"}
    g = {}
    for m, path in files.items():
        deps = set()
        for mod, names in _imports(path):
            if mod != pkg and not mod.startswith(pkg + "."):
                continue
            below = mod.removeprefix(pkg).removeprefix(".")
            deps.update(k for k in [below, *(f"{below}.{n}" if below else n for n in names)] if k in files)
        g[m] = deps - {m}
    return g


def floors(g: dict[str, set[str]]) -> int:
    memo: dict[str, int] = {}

    def floor(n: str) -> int:
        if n not in memo:
            memo[n] = 0     # a circle counts once (tests/test_imports.py forbids them anyway)
            memo[n] = 1 + max((floor(d) for d in g[n]), default=0)
        return memo[n]

    return max(floor(n) for n in g)


def main(root: Path) -> None:
    for pkg in ("model", "data"):
        g = graph(root, pkg)
        rooms: dict[str, int] = {}
        for m in g:
            room = f"{pkg}/{m.rsplit('.', 1)[0]}/" if "." in m else f"{pkg}/"
            rooms[room] = rooms.get(room, 0) + 1
        print(f"{pkg}: {floors(g)} import floors; files per room: "
              + ", ".join(f"{r} {n}" for r, n in sorted(rooms.items())))
    fns = []
    for p in [*root.glob("data/**/*.py"), *root.glob("model/**/*.py"), root / "train.py"]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fns.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(root)} {node.name}"))
                if p.name == "train.py" and node.name == "run":
                    loops = [n for n in ast.walk(node) if isinstance(n, ast.While)]
                    if loops:
                        print(f"train.py run: {fns[-1][0]} lines; its loop: "
                              f"{loops[0].end_lineno - loops[0].lineno + 1} lines")
    print("longest functions: " + "; ".join(f"{name} {n}" for n, name in sorted(fns, reverse=True)[:6]))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
