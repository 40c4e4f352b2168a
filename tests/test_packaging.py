"""The wheel installs `specctl.*` only: no bare top-level plugin/controller modules."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_only_the_specctl_namespace(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (whl,) = tmp_path.glob("specctl-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"specctl", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for pkg in ("policies", "controller", "training", "plugin"):
        assert f"specctl/{pkg}/__init__.py" in names
    assert "specctl/__init__.py" not in names  # an implicit namespace: nothing else claims `specctl`
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    # shipped simulator profiles and workloads travel as package data
    assert any(n.startswith("specctl/training/data/profiles/") and n.endswith(".json") for n in names)
    assert any(n.startswith("specctl/training/data/workloads/") and n.endswith(".json") for n in names)
    dist = next(t for t in tops if t.endswith(".dist-info"))
    eps = zipfile.ZipFile(whl).read(f"{dist}/entry_points.txt").decode()
    assert "[sglang.srt.plugins]" in eps and "specctl = specctl.plugin:register" in eps
    assert "specctl = specctl.controller.cli:main" in eps
    meta = zipfile.ZipFile(whl).read(f"{dist}/METADATA").decode()
    requires = [l for l in meta.splitlines() if l.startswith("Requires-Dist:") and "extra ==" not in l]
    assert not any(("sglang" in r or "torch" in r) for r in requires), requires


def test_policies_import_only_stdlib_and_numpy():
    import ast

    allowed = {"__future__", "bisect", "dataclasses", "typing", "math", "collections", "numpy",
               "itertools", "functools", "enum", "abc", "random", "statistics", "heapq", "json", "re"}
    for path in (ROOT / "policies").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module.split(".")[0]]
            else:
                continue
            for m in mods:
                assert m in allowed, f"{path.name} imports {m}"
