"""The wheel installs `specctl.*` only: no bare top-level plugin/controller modules."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fresh_tree(dst: Path) -> Path:
    """What a build of a fresh clone sees: no egg-info or build/ of an earlier build (setuptools
    takes the files a stale egg-info lists as package data, which would hide a missing one)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy2(ROOT / name, dst / name)
    for name in ("policies", "controller", "training", "plugin", "harness", "scripts"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def test_wheel_contains_only_the_specctl_namespace(tmp_path):
    src = fresh_tree(tmp_path / "src")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (whl,) = tmp_path.glob("sglang_specctl-*.whl")  # the distribution; the package stays `specctl`
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"specctl", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for pkg in ("policies", "controller", "training", "plugin", "harness"):
        assert f"specctl/{pkg}/__init__.py" in names
    assert "specctl/__init__.py" not in names  # an implicit namespace: nothing else claims `specctl`
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    # every shipped simulator profile and workload travels as package data
    data = ROOT / "training" / "data"
    shipped = {f"specctl/training/data/{f.relative_to(data).as_posix()}" for f in data.rglob("*")
               if f.is_file() and "__pycache__" not in f.parts}
    assert any("/profiles/" in n for n in shipped) and any("/workloads/" in n for n in shipped), shipped
    assert shipped - set(names) == set(), "data files missing from the wheel"
    dist = next(t for t in tops if t.endswith(".dist-info"))
    eps = zipfile.ZipFile(whl).read(f"{dist}/entry_points.txt").decode()
    assert "[sglang.srt.plugins]" in eps and "specctl = specctl.plugin:register" in eps
    assert "specctl = specctl.harness.cli:main" in eps  # the runtime commands plus bench and demo
    meta = zipfile.ZipFile(whl).read(f"{dist}/METADATA").decode()
    assert "Name: sglang-specctl" in meta.splitlines()  # `specctl` on PyPI is another project
    requires = [l for l in meta.splitlines() if l.startswith("Requires-Dist:") and "extra ==" not in l]
    assert not any(("sglang" in r or "torch" in r) for r in requires), requires


BUILD_WARNS = """
import sys, tempfile, warnings
sys.path[:0] = ["scripts"]  # pyproject.toml's backend-path
backend = __import__(sys.argv[1])
warnings.simplefilter("error", UserWarning)  # what pip shows of a build (setuptools' warnings are UserWarnings)
with tempfile.TemporaryDirectory() as out:
    backend.build_wheel(out)
    backend.build_editable(out)
"""


def test_wheel_and_editable_builds_emit_no_warning(tmp_path):
    import re

    backend = re.search(r'^build-backend = "([\w.]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    out = subprocess.run([sys.executable, "-c", BUILD_WARNS, backend], cwd=fresh_tree(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
