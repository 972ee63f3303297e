"""The wheel ships every package under quantdispatch/ (pyproject lists them by hand)."""

from __future__ import annotations

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
