"""The import graph of the installed packages, read with `ast` (nothing is imported).

Layers, bottom up; a module may import its own layer and those below it, lazily or not:
  policies   stdlib and numpy only (the pure decision logic every other layer shares)
  protocol   controller.wire, controller.transport, controller.settings: the frames, sockets and
             settings both sides speak; leaf modules that import policies and each other only
  training   policies, protocol (the cost model, the table fit, the readers, the simulator)
  controller policies, protocol, training (the daemon: service, state, CLI)
  plugin     policies, protocol (never the rest of controller, never training)
  harness    anything (benchmarks, drills, the demo and the console script); nothing imports it
and no cycle among the modules' top-level imports.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("policies", "controller", "training", "plugin", "harness")
PROTOCOL = {"controller.wire", "controller.transport", "controller.settings"}
MAY_IMPORT = {
    "policies": {"policies"},
    "protocol": {"policies", "protocol"},
    "training": {"policies", "protocol", "training"},
    "controller": {"policies", "protocol", "training", "controller"},
    "plugin": {"policies", "protocol", "plugin"},
    "harness": {"policies", "protocol", "training", "controller", "plugin", "harness"},
}
POLICIES_THIRD_PARTY = {"numpy"}
# (importer, imported) edges that break the layers today, each with the reason it stands; the test
# below fails once an edge is gone, so the list only shrinks
EXCEPTIONS = {
    ("controller.cli_sglang", "plugin.launch_args"):
        "`specctl sglang-args` prints the plugin's launch arguments; launch_args imports policies only "
        "and belongs below controller (plugin/ is being restructured)",
}


def layer(module: str) -> str:
    return "protocol" if module in PROTOCOL else module.split(".")[0]


def module_names(root: Path) -> dict[str, Path]:
    """'controller.wire' -> its file, for every module of PACKAGES ('controller' for its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(root: Path) -> list[tuple[str, str, bool, int, str]]:
    """(importer, imported module of PACKAGES or a top-level third-party name, run at import time (not
    inside a function)?, line, file) for every import statement; `specctl.x.y` and relative imports
    resolve to 'x.y'."""
    modules = module_names(root)
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod.removeprefix('specctl.')}.{a.name}" in modules
                           else mod for a in node.names]
            for t in targets:
                t = t.removeprefix("specctl.")
                internal = t.split(".")[0] in PACKAGES
                if internal and t not in modules:
                    t = t.rpartition(".")[0] if t.rpartition(".")[0] in modules else t
                out.append((name, t if internal else t.split(".")[0], id(node) not in in_function, node.lineno,
                            str(path.relative_to(root))))
    return out


def layer_violations(root: Path) -> list[str]:
    bad = []
    for src, dst, _, line, file in imports(root):
        if src.split(".")[0] == "policies" and dst.split(".")[0] not in PACKAGES:
            if dst not in sys.stdlib_module_names and dst not in POLICIES_THIRD_PARTY:
                bad.append(f"{file}:{line}: {src} imports {dst} (policies: stdlib and numpy only)")
            continue
        if dst.split(".")[0] not in PACKAGES or (src, dst) in EXCEPTIONS:
            continue
        if layer(dst) not in MAY_IMPORT[layer(src)]:
            bad.append(f"{file}:{line}: {src} ({layer(src)}) imports {dst} ({layer(dst)})")
    return sorted(set(bad))


def module_cycles(root: Path) -> list[list[str]]:
    """Cycles among top-level imports (importing a.b runs a's __init__ too)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, at_top, _, _ in imports(root):
        if at_top and dst in modules:
            graph[src].add(dst)
            parent = dst.rpartition(".")[0]
            while parent:
                # a module inside `parent` runs only once parent's __init__ has begun: no edge back to it
                if parent in modules and parent != src and not src.startswith(parent + "."):
                    graph[src].add(parent)
                parent = parent.rpartition(".")[0]
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_every_import_respects_the_layers():
    assert layer_violations(ROOT) == []


def test_no_cycle_among_top_level_imports():
    assert module_cycles(ROOT) == []


def test_every_exception_is_still_needed():
    edges = {(src, dst) for src, dst, *_ in imports(ROOT)}
    assert set(EXCEPTIONS) <= edges, f"gone, drop from EXCEPTIONS: {set(EXCEPTIONS) - edges}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, needle", [
    ({"training/fit.py": "from ..controller import service\n", "controller/service.py": ""},
     "training.fit (training) imports controller.service (controller)"),
    ({"controller/wire.py": "from ..training import costmodel\n", "training/costmodel.py": ""},
     "controller.wire (protocol) imports training.costmodel (training)"),
    ({"plugin/engine.py": "def f():\n    from specctl.controller.service import X\n", "controller/service.py": ""},
     "plugin.engine (plugin) imports controller.service (controller)"),
    ({"controller/cli.py": "from specctl.harness import cli\n", "harness/cli.py": ""},
     "controller.cli (controller) imports harness.cli (harness)"),
    ({"policies/table.py": "import zmq\n"}, "policies.table imports zmq"),
])
def test_the_checker_catches_a_layer_violation(tmp_path, files, needle):
    bad = layer_violations(_tree(tmp_path, files))
    assert any(needle in b for b in bad), bad


def test_the_checker_catches_a_synthetic_cycle(tmp_path):
    root = _tree(tmp_path, {"training/a.py": "from . import b\n", "training/b.py": "from .c import x\n",
                            "training/c.py": "import specctl.training.a\n",
                            "training/d.py": "def lazy():\n    from . import a\n",
                            "training/e.py": "try:\n    from . import a\nexcept ImportError:\n    pass\n"})
    assert module_cycles(root) == [["training.a", "training.b", "training.c", "training.a"]]
    assert layer_violations(root) == []  # a cycle within one layer is still a cycle
