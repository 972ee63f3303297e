"""The wheel ships every package under quantdispatch/ (pyproject lists them by hand), and a
plain install imports quietly."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "quantdispatch").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    missing = sorted(found - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"


def test_package_data_is_declared():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    for pkg, pattern in (("quantdispatch.kernels.common", "*.json"), ("quantdispatch", "py.typed")):
        assert pattern in data.get(pkg, []), f"{pkg} must ship {pattern}"
    for json_file in (ROOT / "quantdispatch").rglob("*.json"):
        assert json_file.parent == ROOT / "quantdispatch" / "kernels" / "common", json_file


def test_numpy_is_a_dependency_and_the_import_is_quiet():
    """torch warns "Failed to initialize NumPy" on import without numpy: a dependency."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps), deps
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import quantdispatch"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
