"""SGLang code the plugin tests run on CPU: named definitions compiled from the installed sglang's source files,
for modules that do not import without CUDA-only packages (tests/plugin/fi_harness.py, draft_harness.py)."""

from __future__ import annotations

import __future__
import ast
from pathlib import Path
from typing import Optional


def compile_from(path: Path, ns: dict, names: list, cls: Optional[str] = None) -> dict:
    """Compile the named top-level definitions (or methods of `cls`) of an SGLang source file into `ns`, with
    their own line numbers; function decorators (kernel-API logging) are dropped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    body = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names}
    missing = [n for n in names if n not in found]
    assert not missing, f"{path.name} has no {missing} (the SGLang version changed)"
    nodes = []
    for n in names:
        node = found[n]
        if isinstance(node, ast.FunctionDef):
            node.decorator_list = []
        nodes.append(node)
    code = compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    out: dict = {}
    exec(code, ns, out)
    ns.update(out)
    return out
